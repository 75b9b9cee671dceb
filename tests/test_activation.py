"""Fused epilogues (ops/activation.py): references against float64, kernels against references."""

from __future__ import annotations

import pytest
import torch

from ninfer_core.ops import activation, dispatch


def _f64_silu_mul(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    g, u = x.double().chunk(2, dim=-1)
    silu = (g / (1 + torch.exp(-g))).to(dtype).double()  # the model rounds silu(gate) first
    return silu * u


def test_references_against_float64():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 2 * 24, generator=g)
    torch.testing.assert_close(activation.silu_mul_ref(x).double(), _f64_silu_mul(x, torch.float32), rtol=1e-6, atol=1e-7)
    y, gate, add = torch.randn(5, 3, 24, generator=g), torch.randn(5, 3, 24, generator=g), torch.randn(5, 3, 24, generator=g)
    sig = 1 / (1 + torch.exp(-gate.double()))
    torch.testing.assert_close(activation.sigmoid_mul_ref(y, gate).double(), y.double() * sig, rtol=1e-6, atol=1e-7)
    row_gate = gate[..., :1]
    expected = add.double() + (1 / (1 + torch.exp(-row_gate.double()))) * y.double()
    torch.testing.assert_close(activation.sigmoid_mul_ref(y, row_gate, add).double(), expected, rtol=1e-6, atol=1e-6)


def test_cpu_never_reaches_the_extension(monkeypatch):
    monkeypatch.setattr(dispatch, "extension", lambda: pytest.fail("extension used for CPU tensors"))
    x = torch.randn(2, 8)
    assert torch.equal(activation.silu_mul(x), activation.silu_mul_ref(x))
    assert torch.equal(activation.sigmoid_mul(x, x), activation.sigmoid_mul_ref(x, x))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows, cols", [(1, 512), (3, 7), (8, 2048), (40, 256)])
def test_kernels_match_references(dtype, rows, cols):
    if not dispatch.kernels_available():
        pytest.skip("ninfer_core._C not built")
    g = torch.Generator().manual_seed(rows * cols)
    x = (torch.randn(rows, 2 * cols, generator=g) * 3).to(dtype).cuda()
    tol = dict(rtol=0, atol=0) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-6)
    ours = activation.silu_mul(x)
    assert not ours.isnan().any()
    torch.testing.assert_close(ours, activation.silu_mul_ref(x), **(tol if dtype != torch.float32 else dict(rtol=1e-6, atol=1e-6)))
    y = torch.randn(rows, cols, generator=g).to(dtype).cuda()
    add = torch.randn(rows, cols, generator=g).to(dtype).cuda()
    # gates as the model has them: a strided per-head slice (attention), one column of a wider row (MoE)
    wide = torch.randn(rows, 2 * cols, generator=g).to(dtype).cuda()
    for gate, plus in ((wide[:, cols:], None), (wide[:, 5:6], add), (wide[:, :cols].contiguous(), add)):
        ours = activation.sigmoid_mul(y, gate, plus)
        ref = activation.sigmoid_mul_ref(y, gate, plus)
        torch.testing.assert_close(ours, ref, rtol=2 ** -7 if dtype != torch.float32 else 1e-6, atol=1e-5)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = activation.sigmoid_mul(y, wide[:, 5:6], add)
    graph.replay()
    torch.testing.assert_close(captured, activation.sigmoid_mul_ref(y, wide[:, 5:6], add), rtol=2 ** -7, atol=1e-5)

"""The grouped quantized MoE path (ops/moe_triton.py): the Triton kernels against float64 math over
the dequantized weights. On the CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1)
where Triton is installed; on a GPU, compiled."""

from __future__ import annotations

import os

import pytest
import torch

from ninfer_core.ops import dispatch
from ninfer_core.ops import moe as moe_ops
from ninfer_core.ops import moe_triton
from ninfer_core.ops.quant import QuantizedWeight, dequantize_ref, quantize

torch.set_num_threads(1)


def need_triton(device: str) -> None:
    """Skip unless the Triton kernels run on `device`: compiled on a GPU, in the interpreter on the CPU."""
    pytest.importorskip("triton")
    if device == "cpu":
        if torch.cuda.is_available():
            pytest.skip("a GPU is present: the compiled kernels are tested instead of the interpreter")
        assert os.environ.get("TRITON_INTERPRET") == "1", "conftest sets it before Triton is imported"
    elif not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    dispatch.triton_kernels.cache_clear()
    if not moe_triton.available():
        pytest.skip("triton cannot run here")


@pytest.fixture(autouse=True)
def _fresh_kernels():
    yield
    dispatch.triton_kernels.cache_clear()


def _reference(x, gate_up, down, weights, ids) -> torch.Tensor:
    """float64 over the dequantized weights: sum_j w_j * down_e @ (silu(gate_e x) * up_e x)."""
    gu, dn = (dequantize_ref(q, torch.float64) for q in (gate_up, down))
    inter = dn.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    xd = x.double().cpu()
    for n in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[n, j])
            h = gu[e].cpu() @ xd[n]
            h = torch.nn.functional.silu(h[:inter]) * h[inter:]
            out[n] += float(weights[n, j]) * (dn[e].cpu() @ h)
    return out


def quantized_weight(shape: tuple[int, ...], kind: str, group: int, gen: torch.Generator,
                     device: str = "cpu") -> QuantizedWeight:
    """Random weights of `kind` on `device`; int8 with groups (GGUF's Q8_0 kind) built from codes and
    fp16 scales."""
    if kind == "int8" and group:
        codes = torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)
        scales = (torch.rand(*shape[:-1], shape[-1] // group, generator=gen) * 1e-3).to(torch.float16)
        qw = QuantizedWeight("int8", codes, scales, group)
    else:
        qw = quantize(torch.randn(shape, generator=gen) * 0.1, kind, group or 128)
        assert qw.group_size == group
    return QuantizedWeight(qw.kind, qw.qweight.to(device), qw.scales.to(device), qw.group_size)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("kind,group", [("int4", 32), ("int4", 64), ("int8", 0), ("int8", 32)])
@pytest.mark.parametrize("tokens", [3, 37, 200])  # blocks of 16, 16 and 128 rows (block_m_for)
def test_grouped_quantized_experts_match_float64(device, kind, group, tokens):
    need_triton(device)
    gen = torch.Generator().manual_seed(tokens + group)
    experts, hidden, inter, top_k = 8, 128, 64, 3
    gate_up = quantized_weight((experts, 2 * inter, hidden), kind, group, gen, device)
    down = quantized_weight((experts, hidden, inter), kind, group, gen, device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float16  # the interpreter's dot mishandles bf16
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(device, torch.int32)
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), -1).to(device, dtype)
    out = torch.full_like(x, float("nan"))
    out.copy_(moe_triton.moe_experts_grouped_quantized(x, gate_up, down, weights, ids))
    ref = _reference(x, gate_up, down, weights, ids)
    err = (out.double().cpu() - ref).norm() / ref.norm()
    assert torch.isfinite(out).all() and err < 1e-2, err  # 16-bit activations, intermediate and outputs


@pytest.mark.cuda
def test_quantized_experts_are_sync_free_at_any_size_with_triton():
    """With 16-bit activations (the Triton kernels' only ones); fp32 activations stay on the decode
    kernels, as far as those go."""
    if not torch.cuda.is_available() or not moe_triton.available():
        pytest.skip("needs CUDA and Triton")
    gate_up = quantize(torch.randn(8, 128, 128, device="cuda") * 0.1, "int4", 32)
    down = quantize(torch.randn(8, 128, 64, device="cuda") * 0.1, "int4", 32)
    for dtype in (torch.bfloat16, torch.float16):
        assert moe_ops.sync_free_tokens(gate_up, down, dtype) == moe_ops.SYNC_FREE_UNLIMITED
    assert moe_ops.sync_free_tokens(gate_up, down, torch.float32) == moe_ops.QUANTIZED_DECODE_ALONE_TOKENS
    x = torch.randn(100, 128, device="cuda", dtype=torch.bfloat16)
    assert moe_ops.decode_kernel_tokens(x, gate_up, down) == moe_ops.QUANTIZED_DECODE_MAX_TOKENS
    assert moe_ops.decode_kernel_tokens(x.float(), gate_up, down) == moe_ops.QUANTIZED_DECODE_ALONE_TOKENS
    g128 = (quantize(torch.randn(8, 256, 128, device="cuda") * 0.1, "int4", 128),
            quantize(torch.randn(8, 128, 128, device="cuda") * 0.1, "int4", 128))
    assert moe_ops.decode_kernel_tokens(x, *g128) == moe_ops.MMA_DECODE_MAX_TOKENS
    weights, ids = moe_ops.moe_route(torch.randn(100, 8, device="cuda", dtype=torch.bfloat16), 2, True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    moe_ops.moe_experts(x, gate_up, down, weights, ids)  # compile first
    with torch.cuda.graph(graph):  # no host sync at 100 tokens: capturable
        out = moe_ops.moe_experts(x, gate_up, down, weights, ids)
    graph.replay()
    torch.testing.assert_close(out.float(), moe_ops.moe_experts_grouped(x, gate_up, down, weights, ids).float(),
                               rtol=2e-2, atol=2e-2)

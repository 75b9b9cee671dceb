"""The dense quantized GEMM (ops/quant_triton.py): the Triton kernel against float64 math over the
weights `dequantize` gives, and `quant_linear`'s choice of it. On the CPU the kernel runs in Triton's
interpreter (TRITON_INTERPRET=1, set by conftest) where Triton is installed; on a GPU, compiled."""

from __future__ import annotations

import pytest
import torch

from ninfer_core.ops import dispatch, quant, quant_triton
from ninfer_core.ops.quant import QuantizedWeight, dequantize_ref
from test_moe_triton import need_triton, quantized_weight

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fresh_kernels():
    dispatch.triton_kernels.cache_clear()
    yield
    dispatch.triton_kernels.cache_clear()


def _reference(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """float64 over the values the kernel multiplies by: `dequantize(qw, x.dtype)`, here its reference."""
    w = dequantize_ref(QuantizedWeight(qw.kind, qw.qweight.cpu(), qw.scales.cpu(), qw.group_size), x.dtype)
    out = x.double().cpu() @ w.double().T
    return out if bias is None else out + bias.double().cpu()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("kind,group", [("int4", 128), ("int4", 32), ("int8", 0), ("int8", 32)])
@pytest.mark.parametrize("rows", [17, 48, 130])  # a tile of 64 rows; 128 (two, the second 2 rows)
def test_dense_quantized_gemm_matches_float64(device, kind, group, rows):
    need_triton(device)
    gen = torch.Generator().manual_seed(rows + group)
    n, k = 80, 256  # a column tile past the weight's rows (masked), two or more K steps
    qw = quantized_weight((n, k), kind, group, gen, device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float16  # the interpreter's dot mishandles bf16
    x = torch.randn(rows, k, generator=gen).to(device, dtype)
    bias = torch.randn(n, generator=gen).to(device, dtype) if rows == 48 else None
    out = quant_triton.quant_gemm(x, qw, bias)
    assert out.shape == (rows, n) and out.dtype == dtype
    ref = _reference(x, qw, bias)
    err = (out.double().cpu() - ref).norm() / ref.norm()
    assert torch.isfinite(out).all() and err < 4e-3, err  # the 16-bit output's rounding


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("tiles", [quant_triton.TileConfig(16, 32, 2, 2), quant_triton.TileConfig(128, 128, 8, 3)])
def test_dense_quantized_gemm_any_tiling(device, tiles):
    """The benches' tilings: narrow and wide column tiles, a K step of a quarter group."""
    need_triton(device)
    gen = torch.Generator().manual_seed(7)
    qw = quantized_weight((160, 256), "int4", 128, gen, device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    x = torch.randn(40, 256, generator=gen).to(device, dtype)
    out = quant_triton.quant_gemm(x, qw, tiles=tiles)
    ref = _reference(x, qw, None)
    assert (out.double().cpu() - ref).norm() / ref.norm() < 4e-3


def test_what_the_dense_gemm_takes():
    gen = torch.Generator().manual_seed(3)
    qw = quantized_weight((64, 128), "int4", 32, gen, "cpu")
    x = torch.randn(40, 128, generator=gen, dtype=torch.float16)
    assert quant_triton.fits(x, qw) == quant_triton.available()  # the interpreter: any grid
    assert not quant_triton.fits(x.float(), qw)  # 16-bit rows only: tensor-core operands
    offsets = QuantizedWeight("int4", qw.qweight, qw.scales, 32, torch.zeros_like(qw.scales))
    assert not quant_triton.fits(x, offsets)  # GGUF's minimums: the dequantized copy's path
    experts = QuantizedWeight("int4", qw.qweight[None], qw.scales[None], 32)
    assert not quant_triton.fits(x, experts)  # a stack of experts: ops/moe_triton.py
    assert [quant_triton.block_m_for(r) for r in (1, 48, 64, 65, 128, 130)] == [64, 64, 64, 128, 128, 128]


def test_the_dense_gemm_takes_wide_weights_of_short_k():
    """On 132 SMs (H100 / H200): the 35B's GDN in_proj (12352 x 2048: 386 programs of 32 columns) and
    attention qkv (9216 x 2048: 288), not its o_proj (2048 x 4096: 64), the shared expert (512 x 2048)
    or the 27B's MLP down (5120 x 17408: its K loop); at 130 rows two row tiles double the grid."""
    assert quant_triton.fills_gpu(48, 12352, 2048, 132) and quant_triton.fills_gpu(128, 9216, 2048, 132)
    assert not quant_triton.fills_gpu(48, 2048, 4096, 132) and not quant_triton.fills_gpu(48, 512, 2048, 132)
    assert not quant_triton.fills_gpu(48, 5120, 17408, 132)
    assert not quant_triton.fills_gpu(128, 4096, 2048, 132) and quant_triton.fills_gpu(130, 4224, 2048, 132)


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [quant.TRITON_MIN_ROWS - 1, quant.TRITON_MIN_ROWS, quant.TRITON_MAX_ROWS,
                                  quant.TRITON_MAX_ROWS + 1])
def test_quant_linear_takes_the_dense_gemm_for_short_prompts_by_wide_weights(monkeypatch, rows):
    """From TRITON_MIN_ROWS to TRITON_MAX_ROWS `quant_linear` runs the Triton GEMM on a wide weight
    (no GEMV, no dequantized copy), a narrow one the GEMV or the copy; the same products either way."""
    need_triton("cuda")
    gen = torch.Generator().manual_seed(rows)
    wide, narrow = (quantized_weight((n, 512), "int8", 0, gen, "cuda") for n in (16384, 256))
    x = torch.randn(2, rows, 512, generator=gen).to("cuda", torch.bfloat16)[0]
    bias = torch.randn(16384, generator=gen).to("cuda", torch.bfloat16)
    calls = []
    gemm = quant_triton.quant_gemm
    monkeypatch.setattr(quant_triton, "quant_gemm", lambda *a, **kw: calls.append(a) or gemm(*a, **kw))
    out = quant.quant_linear(x, wide, bias)
    assert len(calls) == (quant.TRITON_MIN_ROWS <= rows <= quant.TRITON_MAX_ROWS)
    ref = _reference(x, wide, bias)
    assert (out.double().cpu() - ref).norm() / ref.norm() < 4e-3
    out = quant.quant_linear(x, narrow)
    assert len(calls) == (quant.TRITON_MIN_ROWS <= rows <= quant.TRITON_MAX_ROWS)  # not again
    ref = _reference(x, narrow, None)
    assert (out.double().cpu() - ref).norm() / ref.norm() < 4e-3

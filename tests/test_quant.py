"""ninfer_core.ops.quant: int8 / int4 weight formats, QuantLinear and the quant_gemv kernel.

CPU tests check quantize / dequantize / the references against independent float64 numpy code
(the byte and nibble layout included). `cuda` tests run csrc/quant_gemv.cu against the torch
reference and float64 math on fresh random inputs with NaN-poisoned outputs, inside a CUDA graph,
and check which rows take the dequantize + F.linear path; they need ninfer_core._C built
(scripts/gpu_check.sh).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ninfer_core.ops import dispatch, quant, quant_triton
from ninfer_core.ops.activation import sigmoid_mul, silu_mul
from ninfer_core.ops.quant import (
    QuantFormat,
    QuantizedWeight,
    QuantLinear,
    dequantize,
    dequantize_ref,
    quant_linear,
    quant_linear_ref,
    quantize,
)
from ninfer_core.ops.rmsnorm import add_rmsnorm
from kernel_stub import record_kernel_calls

torch.set_num_threads(2)


def _randn(*shape, seed: int, spread: float = 1.0, device="cpu", dtype=torch.float32) -> torch.Tensor:
    """Normal values times a log-normal factor per row (rows of different magnitudes, no zeros)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g, dtype=torch.float64)
    t = t * torch.exp(spread * torch.randn(*shape[:-1], 1, generator=g, dtype=torch.float64))
    return t.to(dtype).to(device)


def _codes64(qw: QuantizedWeight) -> np.ndarray:
    """Signed codes [..., N, K] decoded in numpy: int8 as is; int4 byte j = 2j (low) | 2j+1 (high)."""
    raw = qw.qweight.cpu().numpy()
    if qw.kind == "int8":
        return raw.astype(np.float64)
    codes = np.empty((*raw.shape[:-1], raw.shape[-1] * 2), dtype=np.float64)
    codes[..., 0::2] = raw & 0xF
    codes[..., 1::2] = raw >> 4
    return codes - 8


def _weights64(qw: QuantizedWeight) -> torch.Tensor:
    """The exact float64 weights the format stands for, decoded independently of `dequantize`."""
    codes = _codes64(qw)
    scales = qw.scales.cpu().double().numpy()
    if qw.kind == "int8":
        return torch.from_numpy(codes * scales[..., None])
    return torch.from_numpy(codes * np.repeat(scales, qw.group_size, axis=-1))


def _expected(x: torch.Tensor, w64: torch.Tensor, bias: torch.Tensor | None):
    """float64 x @ W^T (+ bias), and each output's magnitude sqrt(sum_k (w_k x_k)^2): the scale
    of its summation and weight-rounding errors, whatever the magnitude of its row."""
    xd, wd = x.double(), w64.to(x.device)
    exact = xd @ wd.T + (0 if bias is None else bias.double())
    return exact, (xd.square() @ wd.square().T).sqrt()


def _assert_close(actual: torch.Tensor, expected, rtol: float, atol: float) -> None:
    """|actual - exact| <= rtol |exact| + atol * magnitude, element by element."""
    exact, mag = expected
    assert actual.shape == exact.shape and torch.isfinite(actual).all()
    err = (actual.double() - exact).abs()
    bad = err > rtol * exact.abs() + atol * mag
    worst = (err / (rtol * exact.abs() + atol * mag)).max().item()
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} outputs off (worst {worst:.2f}x tolerance)"


# Output rounding to the dtype (an ulp, relative: twice the worst rounding error) and a margin for
# fp32 summation order.
OUT_RTOL = {torch.float32: 1e-6, torch.float16: 2**-10, torch.bfloat16: 2**-7}
OUT_ATOL = {torch.float32: 1e-4, torch.float16: 1e-3, torch.bfloat16: 4e-3}
# Weights rounded to the dtype (int4 kernel on fp16 / bf16, the dequantized prefill path): up to
# 2^-12 / 2^-9 relative per weight, ~1/sqrt(3) of that times the magnitude in rms.
ROUNDED_W_ATOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}


# ---------------------------------------------------------------- CPU: formats


def test_int8_format_and_round_trip():
    w = _randn(37, 80, seed=0)
    w[5] = 0  # a zero row gets scale 1 and codes 0
    qw = quantize(w, "int8")
    assert qw.qweight.dtype == torch.int8 and qw.qweight.shape == (37, 80)
    assert qw.scales.dtype == torch.float32 and qw.scales.shape == (37,)
    assert qw.group_size == 0
    w64 = w.double().numpy()
    amax = np.abs(w64).max(-1)
    scales = qw.scales.double().numpy()
    np.testing.assert_allclose(np.delete(scales, 5), np.delete(amax / 127, 5), rtol=1e-7)
    assert scales[5] == 1.0 and not qw.qweight[5].any()
    assert qw.qweight.abs().max() <= 127
    err = np.abs(_weights64(qw).numpy() - w64)
    assert (err <= scales[:, None] / 2 * (1 + 1e-6)).all()
    torch.testing.assert_close(dequantize_ref(qw, torch.float64), _weights64(qw), rtol=2**-24, atol=0)


def test_int8_scales_are_the_true_quotient():
    """scale = amax / 127 rounded once (the float64 quotient's fp32 rounding), not amax times a
    rounded 1 / 127, which differs in ~4% of rows: a load on any device writes the same scales."""
    w = _randn(4096, 64, seed=1)
    qw = quantize(w, "int8")
    assert torch.equal(qw.scales, (w.abs().amax(-1).double() / 127).float())
    assert not torch.equal(qw.scales, w.abs().amax(-1) * (1 / 127))  # the product would differ here


@pytest.mark.cuda
@pytest.mark.parametrize("kind,group_size", [("int8", 0), ("int4", 32), ("int4", 128)])
def test_quantizing_on_the_gpu_gives_the_cpus_bytes(kind, group_size):
    w = _randn(1024, 256, seed=2)
    cpu, gpu = quantize(w, kind, group_size), quantize(w.cuda(), kind, group_size)
    assert torch.equal(gpu.scales.cpu(), cpu.scales) and torch.equal(gpu.qweight.cpu(), cpu.qweight)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_format_and_round_trip(group_size):
    w = _randn(19, 256, seed=group_size)
    w[3, group_size : 2 * group_size] = 0  # a zero group
    qw = quantize(w, "int4", group_size)
    assert qw.qweight.dtype == torch.uint8 and qw.qweight.shape == (19, 128)
    assert qw.scales.dtype == torch.bfloat16 and qw.scales.shape == (19, 256 // group_size)
    assert qw.shape == (19, 256) and qw.in_features == 256 and qw.out_features == 19
    assert qw.nbytes == 19 * 128 + 19 * (256 // group_size) * 2
    groups = w.double().numpy().reshape(19, -1, group_size)
    want = np.abs(groups).max(-1) / 7
    scales = qw.scales.double().numpy()
    assert scales[3, 1] == 1.0 and (_codes64(qw)[3, group_size : 2 * group_size] == 0).all()
    want[3, 1] = 1.0
    np.testing.assert_allclose(scales, want, rtol=2**-8)  # the bf16 rounding of absmax / 7
    # Every weight is within half a step (|w / scale| <= 7 * (1 + 2^-8) < 7.5: no clamping loss).
    err = np.abs(_weights64(qw).numpy() - w.double().numpy())
    assert (err <= np.repeat(scales, group_size, axis=-1) / 2 * (1 + 1e-6)).all()
    assert torch.equal(dequantize_ref(qw, torch.float64), _weights64(qw))


def test_int4_nibble_layout_exact():
    """Codes chosen so that the scale is exactly 0.25: each byte must read (q[2j]+8) | (q[2j+1]+8) << 4."""
    g = torch.Generator().manual_seed(7)
    q = torch.randint(-7, 8, (6, 96), generator=g)
    q[:, ::32] = 7  # every group of 32 reaches absmax 7 * 0.25
    qw = quantize(q.float() * 0.25, "int4", 32)
    assert (qw.scales.float() == 0.25).all()
    n = (q + 8).numpy()
    want = (n[:, 0::2] | (n[:, 1::2] << 4)).astype(np.uint8)
    np.testing.assert_array_equal(qw.qweight.numpy(), want)


def test_int4_codes_match_float64_rounding():
    """Random weights: codes equal round(w / scale) computed in float64 (ties, where fp32 and
    float64 division may round apart, are skipped)."""
    w = _randn(64, 512, seed=3)
    qw = quantize(w, "int4", 64)
    ratio = w.double().numpy() / np.repeat(qw.scales.double().numpy(), 64, axis=-1)
    want = np.clip(np.rint(ratio), -8, 7)
    near_tie = np.abs(np.abs(ratio - np.floor(ratio)) - 0.5) < 1e-5
    assert near_tie.sum() < 10
    np.testing.assert_array_equal(_codes64(qw)[~near_tie], want[~near_tie])


@pytest.mark.parametrize("kind, group_size", [("int8", 0), ("int4", 64)])
def test_expert_stacks(kind, group_size):
    """[E, N, K] quantizes expert by expert; dequantize keeps the leading dims."""
    w = _randn(3, 40, 128, seed=11)
    qw = quantize(w, kind, group_size)
    for e in range(3):
        one = quantize(w[e], kind, group_size)
        assert torch.equal(qw.qweight[e], one.qweight) and torch.equal(qw.scales[e], one.scales)
    assert qw.shape == (3, 40, 128) and qw.out_features == 40 and qw.in_features == 128
    dq = dequantize_ref(qw, torch.float32)
    assert dq.shape == (3, 40, 128)
    torch.testing.assert_close(dq.double(), _weights64(qw), rtol=2**-24, atol=0)
    with pytest.raises(ValueError, match="2-D weight"):
        quant_linear(torch.randn(2, 128), qw)


def test_bad_formats_raise():
    w = torch.randn(8, 100)
    with pytest.raises(ValueError, match="in_features 100 is not a multiple of group_size 32"):
        quantize(w, "int4", 32)
    with pytest.raises(ValueError, match="group_size must be one of"):
        quantize(torch.randn(8, 96), "int4", 48)
    with pytest.raises(ValueError, match="unknown quantization kind"):
        quantize(w, "int3")
    with pytest.raises(ValueError, match="not a multiple of group_size"):
        QuantLinear.empty(100, 8, QuantFormat("int4", 64), bias=False, device="cpu", dtype=torch.float32)
    qw = quantize(torch.randn(8, 64), "int4", 32)
    with pytest.raises(ValueError, match="scales have shape"):
        QuantizedWeight("int4", qw.qweight, qw.scales[:, :1], 32)
    with pytest.raises(ValueError, match="codes / scales"):
        QuantizedWeight("int4", qw.qweight, qw.scales.to(torch.int16), 32)
    with pytest.raises(ValueError, match="offsets need the scales' shape and dtype"):
        QuantizedWeight("int4", qw.qweight, qw.scales, 32, qw.scales.float())
    with pytest.raises(ValueError, match="does not end in in_features"):
        quant_linear(torch.randn(2, 32), qw)


# ---------------------------------------------------------------- CPU: the linear


@pytest.mark.parametrize("kind, group_size", [("int8", 0), ("int4", 32), ("int4", 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_reference_matches_float64(kind, group_size, dtype, rows):
    qw = quantize(_randn(48, 256, seed=1), kind, group_size)
    x = _randn(rows, 256, seed=2, dtype=dtype)
    bias = _randn(48, seed=4, dtype=dtype)
    out = quant_linear_ref(x, qw, bias)
    assert out.dtype == dtype and out.shape == (rows, 48)
    _assert_close(out, _expected(x, _weights64(qw), bias), OUT_RTOL[dtype], OUT_ATOL[dtype])
    # CPU, <= 16 rows: the CPU kernel where built (tests/test_cpu_kernels.py), else the reference
    _assert_close(quant_linear(x, qw, bias), _expected(x, _weights64(qw), bias), OUT_RTOL[dtype], OUT_ATOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_rows_use_dequantized_linear(dtype, monkeypatch):
    """Past 16 rows (prefill): F.linear over the weights dequantized to x's dtype (the CPU kernels,
    where built, multiply fp32 tiles instead: tests/test_cpu_kernels.py)."""
    monkeypatch.setattr(dispatch, "cpu_extension", lambda: None)
    qw = quantize(_randn(48, 256, seed=5), "int4", 64)
    x = _randn(2, 9, 256, seed=6, dtype=dtype)
    bias = _randn(48, seed=7, dtype=dtype)
    out = quant_linear(x, qw, bias)
    assert out.shape == (2, 9, 48)
    assert torch.equal(out, F.linear(x, dequantize_ref(qw, dtype), bias))
    # Weights rounded to the dtype once, then the dtype's own matmul.
    expected = _expected(x.reshape(18, 256), _weights64(qw), bias)
    _assert_close(out.reshape(18, 48), expected, OUT_RTOL[dtype], ROUNDED_W_ATOL[dtype])


@pytest.mark.parametrize("kind, group_size", [("int8", 0), ("int4", 64)])
def test_from_linear_vs_float64_product(kind, group_size):
    """Against the unquantized float64 product, within the bound quantization allows:
    sum_k |x_k| * scale(n, k) / 2 per output."""
    linear = nn.Linear(192, 40, bias=True)
    with torch.no_grad():
        linear.weight.copy_(_randn(40, 192, seed=8))
    ql = QuantLinear.from_linear(linear, kind, group_size)
    assert (ql.kind, ql.group_size, ql.in_features, ql.out_features) == (kind, group_size, 192, 40)
    x = _randn(3, 192, seed=9)
    out = ql(x).double()
    exact = x.double() @ linear.weight.double().T + linear.bias.double()
    scales = ql.scales.double()
    step = scales[:, None].expand(40, 192) if kind == "int8" else scales.repeat_interleave(group_size, -1)
    bound = x.double().abs() @ (step / 2).T
    assert ((out - exact).abs() <= bound * (1 + 1e-4) + 1e-5).all()
    assert ((out - exact).abs() > 0).any()  # it is quantized


def test_state_dict_round_trip():
    """A model holding QuantLinears saves the quantized artifact and loads it into `empty` ones."""
    model = nn.Sequential(
        QuantLinear.from_linear(nn.Linear(128, 64), "int4", 32),
        QuantLinear.from_linear(nn.Linear(64, 16, bias=False), "int8"),
    )
    state = model.state_dict()
    assert set(state) == {"0.qweight", "0.scales", "0.bias", "1.qweight", "1.scales"}
    assert state["0.qweight"].dtype == torch.uint8 and state["1.qweight"].dtype == torch.int8
    fresh = nn.Sequential(
        QuantLinear.empty(128, 64, QuantFormat("int4", 32), bias=True, device="cpu", dtype=torch.float32),
        QuantLinear.empty(64, 16, QuantFormat("int8"), bias=False, device="cpu", dtype=torch.float32),
    )
    fresh.load_state_dict(state, strict=True)
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, state[key]) and value.dtype == state[key].dtype
    x = _randn(4, 128, seed=10)
    assert torch.equal(fresh(x), model(x))


def test_quantized_weight_is_made_once_and_again_when_a_buffer_is_replaced():
    """QuantLinear.quantized (it carries the CPU kernel's cached plan) is one object across calls, and
    a new one over the new buffers after `to` replaced one (the bf16 scales here)."""
    ql = QuantLinear(quantize(_randn(32, 64, seed=16), "int4", 32, torch.bfloat16))
    first = ql.quantized
    assert ql.quantized is first and first.qweight is ql.qweight
    ql.to(torch.float16)
    again = ql.quantized
    assert again is not first and again.scales is ql.scales and again.scales.dtype == torch.float16
    assert again.qweight is ql.qweight


def test_meta_from_linear_then_fill():
    """The loader's flow: quantize a meta Linear (shapes only), materialise, fill in place."""
    with torch.device("meta"):
        ql = QuantLinear.from_linear(nn.Linear(256, 96), "int4", 128)
    assert ql.qweight.is_meta and ql.qweight.shape == (96, 128) and ql.scales.shape == (96, 2)
    ql = ql.to_empty(device="cpu")
    w = _randn(96, 256, seed=12)
    qw = quantize(w, "int4", 128)
    ql.qweight.copy_(qw.qweight)
    ql.scales.copy_(qw.scales)
    with torch.no_grad():
        ql.bias.zero_()
    x = _randn(2, 256, seed=13)
    _assert_close(ql(x), _expected(x, _weights64(qw), None), OUT_RTOL[torch.float32], OUT_ATOL[torch.float32])


class _FakeExtension:
    """Stands in for ninfer_core._C; any kernel call is a test failure."""

    def __getattr__(self, name):
        raise AssertionError(f"kernel {name} called")


def test_cpu_tensors_never_call_the_cuda_extension(monkeypatch):
    monkeypatch.delenv(dispatch.DISABLE_ENV, raising=False)
    monkeypatch.setattr(dispatch, "extension", lambda: _FakeExtension())
    qw = quantize(_randn(32, 64, seed=14), "int8")
    x = _randn(2, 64, seed=15, dtype=torch.bfloat16)
    assert not quant._kernel_ok(x, qw, None)
    _assert_close(quant_linear(x, qw), _expected(x, _weights64(qw), None), OUT_RTOL[torch.bfloat16],
                  OUT_ATOL[torch.bfloat16])
    monkeypatch.setattr(dispatch, "cpu_extension", lambda: None)  # no CPU kernels: the reference itself
    assert torch.equal(quant_linear(x, qw), quant_linear_ref(x, qw))


# ---------------------------------------------------------------- GPU: the CUDA kernel

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
ROWS = [1, 2, 3, 8, 16, 17, 40, 64]  # past 16: blocks of 16 rows along the grid's y
# (N, K, int4 group): one row; 64-wide K (half a chunk per int4 row); odd N; rows of 5 / 2.5
# chunks; K split across 8 warps; N large enough for one warp per tile; the 27B MLP shapes; few
# row tiles with a long K (blocks of 16 warps, K split 16 ways: the 35B's GDN out_proj).
SHAPES = [
    (1, 4096, 128),
    (2048, 4096, 128),
    (64, 8192, 64),
    (33, 64, 32),
    (17, 1024, 64),
    (1000, 320, 32),
    (256, 2048, 128),
    (36000, 512, 64),
    (17408, 5120, 128),
    (5120, 17408, 128),
]


@pytest.fixture
def cuda_kernels(monkeypatch):
    monkeypatch.delenv(dispatch.DISABLE_ENV, raising=False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    assert dispatch.extension() is not None, (
        "CUDA is available but ninfer_core._C is not built: run scripts/gpu_check.sh"
    )


@functools.cache
def _cuda_weight(kind: str, n: int, k: int, group_size: int) -> tuple[QuantizedWeight, torch.Tensor]:
    """A quantized weight on the GPU and its exact float64 values (cached: shapes repeat)."""
    qw = quantize(_randn(n, k, seed=n + k, spread=0.5, device="cuda"), kind, group_size)
    return qw, _weights64(qw).cuda()


def _cuda_x(*shape, seed: int, dtype: torch.dtype) -> torch.Tensor:
    return _randn(*shape, seed=seed, spread=0.25, device="cuda", dtype=dtype)


def _poisoned(rows: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((rows, n), float("nan"), dtype=dtype, device="cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
def test_kernel_matches_reference(cuda_kernels, shape, kind, dtype, rows):
    n, k, group_size = shape
    qw, w64 = _cuda_weight(kind, n, k, group_size if kind == "int4" else 0)
    x = _cuda_x(rows, k, seed=rows * 7 + n, dtype=dtype)
    bias = _cuda_x(n, seed=k, dtype=dtype) if rows % 2 else None  # odd row counts add a bias
    assert quant._kernel_ok(x, qw, bias)
    out = _poisoned(rows, n, dtype)
    quant._gemv(out, x, qw, bias)
    assert not out.isnan().any(), "the kernel left outputs unwritten"
    exact = _expected(x, w64, bias)
    _assert_close(quant_linear_ref(x, qw, bias), exact, OUT_RTOL[dtype], OUT_ATOL[dtype])
    if kind == "int4" and dtype != torch.float32 and group_size != 128:
        # Exactly the weights of dequantize_ref(qw, dtype) with fp32 sums, up to output rounding.
        # (Groups of 128 are scaled after the MMAs in fp32: exact weights, the else branch.)
        rounded = _expected(x, dequantize_ref(qw, dtype).double(), bias)
        _assert_close(out, rounded, OUT_RTOL[dtype], OUT_ATOL[dtype])
        _assert_close(out, exact, OUT_RTOL[dtype], ROUNDED_W_ATOL[dtype])
    else:
        _assert_close(out, exact, OUT_RTOL[dtype], OUT_ATOL[dtype])
    triton = quant.TRITON_MIN_ROWS <= rows <= quant.TRITON_MAX_ROWS and quant_triton.fits(x.reshape(rows, k), qw)
    if rows <= quant.CUDA_MAX_GEMV_ROWS and not triton:
        assert torch.equal(quant_linear(x, qw, bias), out)  # the public op runs the same kernel
    else:  # past the crossover the public op runs a GEMM (a wide weight's Triton one, or dequantized)
        _assert_close(quant_linear(x, qw, bias), exact, OUT_RTOL[dtype], ROUNDED_W_ATOL[dtype])


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("rows", [65, 300, 1024])
def test_kernel_takes_up_to_1024_rows(cuda_kernels, kind, rows):
    """Past quant_linear's GEMV rows (it takes the dequantized GEMM there) the kernel itself still
    covers prefill-sized blocks: the bench compares the two there."""
    qw, w64 = _cuda_weight(kind, 1000, 320, 32 if kind == "int4" else 0)
    x = _cuda_x(rows, 320, seed=rows, dtype=torch.bfloat16)
    assert quant._kernel_ok(x, qw, None)
    out = _poisoned(rows, 1000, torch.bfloat16)
    quant._gemv(out, x, qw, None)
    assert not out.isnan().any(), "the kernel left outputs unwritten"
    _assert_close(out, _expected(x, w64, None), OUT_RTOL[torch.bfloat16], ROUNDED_W_ATOL[torch.bfloat16])


@pytest.mark.cuda
@pytest.mark.parametrize("kind, group_size", [("int8", 0), ("int4", 128)])
@pytest.mark.parametrize("rows", [1, 16])
def test_kernel_replays_in_cuda_graph(cuda_kernels, kind, group_size, rows):
    """The kernel runs on torch's current stream, so graph capture records it."""
    dtype = torch.bfloat16
    qw, w64 = _cuda_weight(kind, 2048, 4096, group_size)
    bias = _cuda_x(2048, seed=1, dtype=dtype)
    x = _cuda_x(rows, 4096, seed=2, dtype=dtype)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside capture
        quant_linear(x, qw, bias)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = quant_linear(x, qw, bias)
    tol = OUT_ATOL[dtype] if kind == "int8" else ROUNDED_W_ATOL[dtype]
    for seed in (3, 4):
        x.copy_(_cuda_x(rows, 4096, seed=seed, dtype=dtype))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _assert_close(out, _expected(x, w64, bias), OUT_RTOL[dtype], tol)


def test_epilogue_calls_pass_each_tensor_in_its_place(monkeypatch):
    """The CUDA branch of quant_swiglu / quant_linear_gated, run on the CPU against a stand-in
    extension that records the call: the SwiGLU's output width, the gate's view and row stride
    (a strided column of a merged output) and the added tensor reach their binding arguments."""
    calls = record_kernel_calls(monkeypatch, "quant_gemv")
    qw = quantize(_randn(64, 32, seed=1), "int8")
    x = _randn(3, 32, seed=2, dtype=torch.bfloat16)
    out = quant.quant_swiglu(x, qw)
    assert out.shape == (3, 32)
    merged = _randn(3, 257, seed=3, dtype=torch.bfloat16)
    add = _randn(3, 64, seed=4, dtype=torch.bfloat16)
    gated = quant.quant_linear_gated(x, qw, merged[:, 256:], add)
    assert gated.shape == (3, 64)
    swiglu, gate = calls
    for kw in calls:
        assert (kw["x"].data_ptr(), kw["x"].shape) == (x.data_ptr(), (3, 32))
        assert kw["qweight"] is qw.qweight and kw["scales"] is qw.scales
        assert kw["stream"] == 7 and kw["bias"] is None
    assert swiglu["gate_up"] and (swiglu["out"].data_ptr(), swiglu["out"].shape) == (out.data_ptr(), (3, 32))
    assert swiglu["gate"] is None and swiglu["add"] is None
    assert not gate["gate_up"] and (gate["out"].data_ptr(), gate["out"].shape) == (gated.data_ptr(), (3, 64))
    g = gate["gate"]
    assert (g.data_ptr(), g.shape, g.stride(0)) == (merged[:, 256:].data_ptr(), (3, 1), 257)
    assert (gate["add"].data_ptr(), gate["add"].shape) == (add.data_ptr(), (3, 64))


def _must_not_run(name: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"{name} ran: the epilogue was not folded into the GEMV")
    return refuse


@pytest.mark.cuda
@pytest.mark.parametrize("kind, group", [("int8", 0), ("int4", 32), ("int4", 128)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 5, 16, 32])
def test_swiglu_epilogue_equals_linear_then_silu_mul(cuda_kernels, monkeypatch, kind, group, dtype, rows):
    """quant_swiglu: one GEMV over [gate; up] with SiLU(gate) * up as its epilogue gives exactly
    quant_linear + the silu_mul kernel (same sums, same roundings), close to float64 math."""
    inter, k = 1024, 2048
    qw, w64 = _cuda_weight(kind, 2 * inter, k, group)
    x = _cuda_x(rows, k, seed=rows + 31, dtype=dtype) / 4  # SiLU(gate) * up stays within float16
    composed = silu_mul(quant_linear(x, qw))
    monkeypatch.setattr(quant, "silu_mul", _must_not_run("silu_mul"))
    fused = quant.quant_swiglu(x[None], qw)
    assert fused.shape == (1, rows, inter)
    assert torch.equal(fused[0], composed)
    gate, up = (x.double() @ w64.T.double()).split(inter, dim=-1)
    exact = F.silu(gate) * up
    assert ((fused[0].double() - exact).norm() / exact.norm()).item() < {torch.float32: 1e-5}.get(dtype, 2e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("kind, group", [("int8", 0), ("int4", 64)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 3, 16, 32])
@pytest.mark.parametrize("k", [512, 4096])  # 4096: blocks of 16 warps at 16 rows or fewer
def test_gated_epilogue_equals_linear_then_sigmoid_mul(cuda_kernels, monkeypatch, kind, group, dtype, rows, k):
    """quant_linear_gated: add + sigmoid(gate) * (x @ W^T) in the GEMV's epilogue, the gate a
    strided column of a merged projection's output (the MoE router's last column), gives exactly
    quant_linear + the sigmoid_mul kernel; and the bias goes in before the gate."""
    n = 2048
    qw, _ = _cuda_weight(kind, n, k, group)
    x = _cuda_x(rows, k, seed=rows + 41, dtype=dtype)
    merged = _cuda_x(rows, 257, seed=rows + 42, dtype=dtype)
    gate = merged[:, 256:]  # [rows, 1], rows 257 elements apart
    add = _cuda_x(rows, n, seed=rows + 43, dtype=dtype)
    bias = _cuda_x(n, seed=44, dtype=dtype)
    composed = [sigmoid_mul(quant_linear(x, qw, b), gate, add=add) for b in (None, bias)]
    monkeypatch.setattr(quant, "sigmoid_mul", _must_not_run("sigmoid_mul"))
    for b, want in zip((None, bias), composed):
        assert torch.equal(quant.quant_linear_gated(x, qw, gate, add, b), want)


@pytest.mark.cuda
def test_epilogues_past_the_gemv_limit_compose(cuda_kernels, monkeypatch):
    """Prefill-sized rows keep quant_linear's dequantized GEMM, then the elementwise kernel."""
    rows, dtype = quant.CUDA_MAX_GEMV_ROWS + 1, torch.bfloat16
    qw, _ = _cuda_weight("int4", 512, 256, 128)
    x = _cuda_x(rows, 256, seed=51, dtype=dtype)
    gate, add = _cuda_x(rows, 1, seed=52, dtype=dtype), _cuda_x(rows, 512, seed=53, dtype=dtype)
    want_swiglu = silu_mul(quant_linear(x, qw))
    want_gated = sigmoid_mul(quant_linear(x, qw), gate, add=add)
    monkeypatch.setattr(quant, "_gemv", _must_not_run("the GEMV kernel"))
    assert torch.equal(quant.quant_swiglu(x, qw), want_swiglu)
    assert torch.equal(quant.quant_linear_gated(x, qw, gate, add), want_gated)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_rows_past_the_gemv_limit_take_the_dequantized_linear(cuda_kernels, monkeypatch, dtype):
    rows = quant.CUDA_MAX_GEMV_ROWS + 1

    def no_kernel(*args):
        raise AssertionError(f"the GEMV kernel ran for {rows} rows")

    monkeypatch.setattr(quant, "_gemv", no_kernel)
    qw, _ = _cuda_weight("int4", 256, 2048, 128)
    bias = _cuda_x(256, seed=5, dtype=dtype)
    for shape in ((rows, 2048), (1, rows, 2048)):
        x = _cuda_x(*shape, seed=6, dtype=dtype)
        out = quant_linear(x, qw, bias)
        assert out.shape == (*shape[:-1], 256)
        assert torch.equal(out, F.linear(x, dequantize_ref(qw, dtype), bias))


@pytest.mark.cuda
def test_leading_dims_and_unsupported_calls(cuda_kernels, monkeypatch):
    """[B, T, K] inputs run the kernel; what it does not cover falls back to the reference."""
    dtype = torch.bfloat16
    qw, w64 = _cuda_weight("int8", 512, 2048, 0)
    x = _cuda_x(2, 3, 2048, seed=7, dtype=dtype)
    out = quant_linear(x, qw)
    assert out.shape == (2, 3, 512)
    _assert_close(out.view(6, 512), _expected(x.view(6, 2048), w64, None), OUT_RTOL[dtype], OUT_ATOL[dtype])

    def no_kernel(*args):
        raise AssertionError("the GEMV kernel ran on a call it does not cover")

    monkeypatch.setattr(quant, "_gemv", no_kernel)
    odd = quantize(_randn(64, 40, seed=8, device="cuda"), "int8")  # K % 16 != 0
    x = _cuda_x(2, 40, seed=9, dtype=dtype)
    assert torch.equal(quant_linear(x, odd), quant_linear_ref(x, odd))
    buf = _cuda_x(2 * 2048 + 1, seed=10, dtype=dtype)
    shifted = buf[1:].view(2, 2048)  # not 16-byte aligned
    assert torch.equal(quant_linear(shifted, qw), quant_linear_ref(shifted, qw))
    fp32_bias = _cuda_x(512, seed=11, dtype=torch.float32)  # bias dtype != x dtype
    x = shifted.contiguous()
    assert torch.equal(quant_linear(x, qw, fp32_bias), quant_linear_ref(x, qw, fp32_bias))


@pytest.mark.cuda
def test_kernel_rejects_what_it_cannot_run(cuda_kernels):
    qw, _ = _cuda_weight("int4", 256, 2048, 128)
    rows = quant.KERNEL_MAX_ROWS + 1
    x = _cuda_x(rows, 2048, seed=12, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=f"rows m={rows} must be in 1..{quant.KERNEL_MAX_ROWS}"):
        quant._gemv(_poisoned(rows, 256, torch.bfloat16), x, qw, None)


@pytest.mark.cuda
@pytest.mark.parametrize("kind, group", [("int8", 0), ("int4", 32), ("int4", 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequant_kernel_equals_reference(kind, group, dtype):
    """csrc/dequant.cu: bit-identical to dequantize_ref, every element written (NaN-filled pool)."""
    if not dispatch.kernels_available():
        pytest.skip("ninfer_core._C not built")
    g = torch.Generator().manual_seed(7)
    w = torch.randn(3, 40, 256, generator=g).cuda()
    qw = quantize(w, kind, group or 128)
    junk = torch.full((3 * 40 * 256,), float("nan"), dtype=dtype, device="cuda")
    del junk  # the caching allocator hands this NaN-filled block to the kernel's output
    out = dequantize(qw, dtype)
    assert torch.equal(out, dequantize_ref(qw, dtype))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = dequantize(qw, dtype)
    graph.replay()
    assert torch.equal(captured, out)


# ---------------------------------------------------------------- the add + RMSNorm folded in front


def _norm_inputs(rows: int, k: int, zero_centered: bool, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    """x (a residual stream's delta), the residual (4x larger) and an RMSNorm weight around its identity."""
    x = _randn(rows, k, seed=seed, spread=0.25, device=device, dtype=dtype)
    residual = _randn(rows, k, seed=seed + 1, spread=0.25, device=device, dtype=dtype) * 4
    g = torch.Generator().manual_seed(seed + 2)
    weight = torch.randn(k, generator=g) * 0.2 + (0.0 if zero_centered else 1.0)
    return x, residual, weight.to(dtype).to(device)


def test_add_norm_call_passes_each_tensor_in_its_place(monkeypatch):
    """quant_linear_add_norm's kernel call (recording stand-in): x, the residual, the norm's weight,
    eps and centring, fresh outputs, the bias; leading dims kept."""
    calls = record_kernel_calls(monkeypatch, "quant_gemv")
    qw = quantize(_randn(32, 64, seed=1), "int8")
    x, residual, weight = _norm_inputs(3, 64, True, torch.bfloat16)
    bias = _randn(32, seed=2, dtype=torch.bfloat16)
    y, summed = quant.quant_linear_add_norm(x[None], residual[None], weight, 1e-5, True, qw, bias)
    assert y.shape == (1, 3, 32) and summed.shape == (1, 3, 64)
    (kw,) = calls
    assert tuple(kw[name].data_ptr() for name in ("out", "x", "residual", "residual_out")) == tuple(
        t.data_ptr() for t in (y, x, residual, summed))
    assert kw["out"].shape == (3, 32) and kw["x"].shape == kw["residual"].shape == kw["residual_out"].shape == (3, 64)
    assert kw["norm_weight"] is weight and kw["bias"] is bias and kw["qweight"] is qw.qweight
    assert (kw["eps"], kw["zero_centered"]) == (1e-5, True)
    assert not kw["gate_up"] and kw["gate"] is None and kw["add"] is None
    assert len({y.data_ptr(), summed.data_ptr(), x.data_ptr(), residual.data_ptr()}) == 4


def test_add_norm_composes_where_the_fold_does_not_fit(monkeypatch):
    """Rows, widths and dtypes past the fold's limits run add_rmsnorm + quant_linear (stand-ins);
    4 rows of 8192 (the largest stage) still fold."""
    calls = record_kernel_calls(monkeypatch, "quant_gemv", "rmsnorm")
    monkeypatch.setattr(dispatch, "cpu_kernels_available", lambda: False)  # quant_linear: the stand-in too
    x, residual, weight = _norm_inputs(5, 2048, False, torch.bfloat16)
    misaligned = _randn(2 * 2048 + 1, seed=5, dtype=torch.bfloat16)[1:].view(2, 2048)
    cases = {  # name: (x, residual, norm weight, folds)
        "5 rows": (x, residual, weight, False),
        "4 rows": (x[:4], residual[:4], weight, True),
        "4 rows of 8192": (*_norm_inputs(4, 8192, False, torch.bfloat16), True),
        "8208 wide": (*_norm_inputs(1, 8208, False, torch.bfloat16), False),
        "fp32": (x[:2].float(), residual[:2].float(), weight.float(), False),
        "fp32 norm weight": (x[:2], residual[:2], weight.float(), False),
        "misaligned residual": (x[:2], misaligned, weight, False),
    }
    for name, (x_, residual_, weight_, folds) in cases.items():
        calls.clear()
        qw = quantize(_randn(32, x_.shape[-1], seed=x_.shape[-1]), "int8")
        quant.quant_linear_add_norm(x_, residual_, weight_, 1e-6, False, qw)
        folded = [kw for kw in calls if "qweight" in kw and kw["residual"] is not None]
        norms = [kw for kw in calls if "qweight" not in kw]
        assert (len(folded), len(norms)) == ((1, 0) if folds else (0, 1)), name


def test_add_norm_on_the_cpu_is_the_composition():
    """CPU tensors: add_rmsnorm + quant_linear, close to the float reference."""
    qw = quantize(_randn(48, 256, seed=7), "int4", 64)
    for dtype in (torch.float32, torch.bfloat16):
        x, residual, weight = _norm_inputs(3, 256, True, dtype, seed=8)
        y, summed = quant.quant_linear_add_norm(x, residual, weight, 1e-6, True, qw)
        normed, want_summed = add_rmsnorm(x, residual, weight, 1e-6, zero_centered=True)
        assert torch.equal(y, quant_linear(normed, qw)) and torch.equal(summed, want_summed)
        ref_y, ref_summed = quant.quant_linear_add_norm_ref(x, residual, weight, 1e-6, True, qw)
        assert torch.equal(summed, ref_summed)
        torch.testing.assert_close(y, ref_y, rtol=OUT_RTOL[dtype], atol=OUT_ATOL[dtype] * ref_y.abs().max().item())


@functools.cache
def _cuda_norm_weight(kind: str, n: int, k: int, group_size: int) -> QuantizedWeight:
    return quantize(_randn(n, k, seed=n + k + 1, spread=0.5, device="cuda"), kind, group_size)


def _poison_allocations(monkeypatch) -> None:
    """torch.empty / empty_like hand out NaN: outputs the kernel leaves unwritten show."""
    empty, empty_like = torch.empty, torch.empty_like
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: empty_like(*a, **kw).fill_(float("nan")))


def _fold_check(monkeypatch, qw: QuantizedWeight, rows: int, k: int, zero_centered: bool, dtype: torch.dtype,
                bias: torch.Tensor | None) -> tuple[int, int]:
    """quant_linear_add_norm against add_rmsnorm then quant_linear (both kernels): the new residual to
    the bit, and the output too where the fold splits K as the plain GEMV does; where it splits K
    fewer ways (split_for_norm, csrc/quant_gemv.cu) its sums add in another order: the output is then
    the fold kernel's and within the GEMV's rounding of the composition's. The fold runs wherever its
    stage takes the rows. Returns (the fold's split, the plain GEMV's); (0, 0) where it composes."""
    x, residual, weight = _norm_inputs(rows, k, zero_centered, dtype, device="cuda", seed=rows + k)
    normed, want_summed = add_rmsnorm(x, residual, weight, 1e-6, zero_centered=zero_centered)
    want = quant_linear(normed, qw, bias)
    splits = (0, 0)
    if rows <= quant.NORM_MAX_ROWS:
        plain, folded = torch.empty_like(want), torch.empty_like(want)
        plain_split = quant._gemv(plain, normed, qw, bias)
        fold_split = quant._gemv(folded, x, qw, bias,
                                 norm=quant._FoldedNorm(residual, weight, torch.empty_like(x), 1e-6, zero_centered))
        assert torch.equal(plain, want)  # the public op ran that plain GEMV
        splits = (fold_split, plain_split)
    with monkeypatch.context() as fold:
        if rows <= quant.NORM_MAX_ROWS:
            fold.setattr(quant, "add_rmsnorm", _must_not_run("add_rmsnorm"))
        _poison_allocations(fold)
        y, summed = quant.quant_linear_add_norm(x, residual, weight, 1e-6, zero_centered, qw, bias)
    assert torch.equal(summed, want_summed), f"new residual differs at {rows} rows"
    if splits[0] == splits[1]:
        assert torch.equal(y, want), f"output differs at {rows} rows"
    else:
        assert splits[0] < splits[1], f"the fold splits K {splits[0]} ways, the plain GEMV {splits[1]}"
        assert torch.equal(y, folded)
        torch.testing.assert_close(y, want, rtol=OUT_RTOL[dtype], atol=OUT_ATOL[dtype] * want.abs().max().item())
    return splits


@pytest.mark.cuda
@pytest.mark.parametrize("kind, group", [("int8", 0), ("int4", 32), ("int4", 64), ("int4", 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("k", [2048, 5120])
@pytest.mark.parametrize("zero_centered", [True, False])
@pytest.mark.parametrize("n", [256, 4608])  # K split 16 ways (int8 at 5120: blocks of 16 warps) / 8 ways or fewer
def test_add_norm_fold_equals_add_rmsnorm_then_linear(cuda_kernels, monkeypatch, kind, group, dtype, k,
                                                      zero_centered, n):
    """Rows 1..6 (up to 4 fold, the rest compose): the normed GEMV and the new residual are
    add_rmsnorm's + quant_linear's (_fold_check: to the bit where both split K alike, as all of these
    grids fit one wave on the H200); odd row counts add a bias."""
    qw = _cuda_norm_weight(kind, n, k, group)
    bias = _cuda_x(n, seed=k + n, dtype=dtype)
    for rows in range(1, quant.NORM_MAX_ROWS + 3):
        _fold_check(monkeypatch, qw, rows, k, zero_centered, dtype, bias if rows % 2 else None)


@pytest.mark.cuda
@pytest.mark.parametrize("k, rows", [(64, [1, 3, 4]), (320, [1, 2, 4]), (8192, [1, 3, 4])])
def test_add_norm_fold_at_other_widths(cuda_kernels, monkeypatch, k, rows):
    """64 wide (rmsnorm's rows of one warp), 320 (a partial 32-vector group), 8192 (32 groups, one
    vector each of rmsnorm's 1,024 threads)."""
    qw = _cuda_norm_weight("int8", 1000, k, 0)
    for r in rows:
        for zero_centered in (True, False):
            _fold_check(monkeypatch, qw, r, k, zero_centered, torch.bfloat16, None)


@pytest.mark.cuda
@pytest.mark.parametrize("kind, group", [("int8", 0), ("int4", 128)])
def test_add_norm_fold_at_the_27b_shape(cuda_kernels, monkeypatch, kind, group):
    """The 27B's GDN in_proj (16,480 x 5,120): a plain GEMV of 1,030 tiles takes 2-3 waves at split 8,
    the fold fewer splits (split_for_norm), whose output stays within the GEMV's rounding."""
    qw = _cuda_norm_weight(kind, 16480, 5120, group)
    for rows in (1, 4):
        fold_split, plain_split = _fold_check(monkeypatch, qw, rows, 5120, True, torch.bfloat16, None)
        assert 1 <= fold_split <= plain_split


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 4])
def test_add_norm_fold_replays_in_cuda_graph(cuda_kernels, rows):
    """Captured (its stage past 48 KB at 4 rows of 8192), replayed on new inputs: still the composition."""
    dtype, k = torch.bfloat16, 8192
    qw = _cuda_norm_weight("int8", 4608, k, 0)
    x, residual, weight = _norm_inputs(rows, k, True, dtype, device="cuda", seed=20)
    quant.quant_linear_add_norm(x, residual, weight, 1e-6, True, qw)  # warm-up outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, summed = quant.quant_linear_add_norm(x, residual, weight, 1e-6, True, qw)
    for seed in (21, 22):
        new_x, new_residual, _ = _norm_inputs(rows, k, True, dtype, device="cuda", seed=seed)
        x.copy_(new_x)
        residual.copy_(new_residual)
        y.fill_(float("nan"))
        graph.replay()
        eager_y, eager_summed = quant.quant_linear_add_norm(new_x, new_residual, weight, 1e-6, True, qw)
        _, want_summed = add_rmsnorm(new_x, new_residual, weight, 1e-6, zero_centered=True)
        assert torch.equal(summed, want_summed) and torch.equal(eager_summed, want_summed)
        assert torch.equal(y, eager_y)  # the eager fold (its split; _fold_check compares it with the composition)


@pytest.mark.cuda
def test_add_norm_kernel_rejects_what_it_cannot_run(cuda_kernels):
    qw = _cuda_norm_weight("int8", 256, 2048, 0)
    x, residual, weight = _norm_inputs(17, 2048, True, torch.bfloat16, device="cuda")
    out, summed = _poisoned(17, 256, torch.bfloat16), torch.empty_like(x)

    def gemv(x_, residual_, weight_, summed_, out_=None):
        rows = x_.shape[0]
        quant._gemv(out[:rows] if out_ is None else out_, x_, qw, None,
                    norm=quant._FoldedNorm(residual_, weight_, summed_, 1e-6, True))

    with pytest.raises(ValueError, match="the folded norm takes m <= 4 rows .*, got m=17"):
        gemv(x, residual, weight, summed)  # 17 rows
    with pytest.raises(ValueError, match="residual_out overlaps x"):
        gemv(x[:2], residual[:2], weight, x[:2])  # the new residual over x
    over_residual = residual[:2].view(-1)[:512].view(2, 256)  # contiguous, inside the residual's rows
    with pytest.raises(ValueError, match="out overlaps residual"):
        gemv(x[:2], residual[:2], weight, summed[:2], out_=over_residual)
    shifted = torch.empty(2049, dtype=torch.bfloat16, device="cuda")[1:]
    with pytest.raises(ValueError, match="16-byte aligned"):
        gemv(x[:2], residual[:2], shifted, summed[:2])
    with pytest.raises(ValueError, match="the folded norm needs fp16 / bf16 x"):
        quant._gemv(out[:2].float(), x[:2].float(), qw, None,
                    norm=quant._FoldedNorm(residual[:2].float(), weight.float(), summed[:2].float(), 1e-6, True))


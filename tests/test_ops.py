"""ninfer_core.ops: the kernel-or-reference dispatch and the RMSNorm op.

CPU tests check the dispatch rule and the torch reference (against a float64 formula and,
bit for bit, against the transformers norms). `cuda` tests check the compiled kernel against
the float64 formula on fresh random inputs with poisoned outputs, so every element must be
written; they need ninfer_core._C built (scripts/gpu_check.sh).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ninfer_core import ops
from ninfer_core.ops import dispatch

EPS = 1e-6
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Output tolerance against float64: up to two roundings to the dtype (plain mode rounds twice).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _expected(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    zero_centered: bool,
) -> tuple[np.ndarray, torch.Tensor | None]:
    """float64 RMSNorm; the summed residual is rounded to x's dtype, as the op defines it."""
    summed = None
    if residual is not None:
        summed = (x.double() + residual.double()).to(x.dtype)
        x = summed
    v = x.double().cpu().numpy()
    w = weight.double().cpu().numpy() + (1.0 if zero_centered else 0.0)
    normed = v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + EPS) * w
    return normed, summed


def _inputs(shape, dtype, device, *, residual: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 2 + 0.5).to(dtype).to(device)
    r = (torch.randn(shape, generator=g) * 3).to(dtype).to(device) if residual else None
    w = (torch.randn(shape[-1], generator=g) * 0.5).to(dtype).to(device)
    return x, r, w


def _assert_close_f64(actual: torch.Tensor, expected: np.ndarray, dtype: torch.dtype) -> None:
    torch.testing.assert_close(
        actual.double().cpu(), torch.from_numpy(expected), rtol=TOL[dtype], atol=TOL[dtype]
    )


# ---------------------------------------------------------------- CPU: reference and dispatch


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
def test_reference_matches_float64(dtype, zero_centered, with_residual):
    x, r, w = _inputs((5, 3, 67), dtype, "cpu", residual=with_residual)
    if with_residual:
        out, summed = ops.add_rmsnorm(x, r, w, EPS, zero_centered=zero_centered)
        assert torch.equal(summed, _expected(x, r, w, zero_centered)[1])
    else:
        out = ops.rmsnorm(x, w, EPS, zero_centered=zero_centered)
    assert out.dtype == dtype and out.shape == x.shape
    _assert_close_f64(out, _expected(x, r, w, zero_centered)[0], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_equals_transformers_norms(dtype):
    """Bit-exact with Qwen3.5's zero-centred norm and Llama's plain norm (their roundings)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    x, _, w = _inputs((4, 96), dtype, "cpu", residual=False, seed=1)
    qwen = Qwen3_5RMSNorm(96, eps=EPS).to(dtype)
    llama = LlamaRMSNorm(96, eps=EPS).to(dtype)
    with torch.no_grad():
        qwen.weight.copy_(w)
        llama.weight.copy_(w)
        assert torch.equal(ops.rmsnorm(x, w, EPS, zero_centered=True), qwen(x))
        assert torch.equal(ops.rmsnorm(x, w, EPS, zero_centered=False), llama(x))


def test_in_place_outputs_on_cpu():
    x, r, w = _inputs((3, 40), torch.bfloat16, "cpu", residual=True)
    want_out, want_sum = ops.add_rmsnorm_ref(x, r, w, EPS, zero_centered=True)
    out, summed = ops.add_rmsnorm(x, r, w, EPS, zero_centered=True, out=x, residual_out=r)
    assert out is x and summed is r
    assert torch.equal(x, want_out) and torch.equal(r, want_sum)


def test_bad_arguments_raise():
    x, r, w = _inputs((2, 8), torch.float32, "cpu", residual=True)
    with pytest.raises(ValueError, match="weight shape"):
        ops.rmsnorm(x, w[:4], EPS)
    with pytest.raises(ValueError, match="residual"):
        ops.add_rmsnorm(x, r.half(), w, EPS)
    with pytest.raises(ValueError, match="weight is torch.float16"):
        ops.rmsnorm(x.bfloat16(), w.half(), EPS)
    with pytest.raises(ValueError, match="out must be contiguous"):
        ops.rmsnorm(x, w, EPS, out=torch.empty(8, 2).t())


class _FakeExtension:
    """Stands in for ninfer_core._C; any kernel call is a test failure."""

    def __getattr__(self, name):
        raise AssertionError(f"kernel {name} called")


@pytest.fixture
def fake_extension(monkeypatch):
    monkeypatch.delenv(dispatch.DISABLE_ENV, raising=False)
    monkeypatch.setattr(dispatch, "extension", lambda: _FakeExtension())


def _fake_cuda(dtype=torch.bfloat16):
    return SimpleNamespace(device=torch.device("cuda", 0), dtype=dtype)


def test_dispatch_rule(fake_extension, monkeypatch):
    assert dispatch.use_kernel(_fake_cuda(), _fake_cuda(torch.float32))
    assert not dispatch.use_kernel(_fake_cuda(), torch.ones(2))  # one CPU tensor => reference
    assert not dispatch.use_kernel(_fake_cuda(torch.float64))  # no kernel for float64
    monkeypatch.setenv(dispatch.DISABLE_ENV, "1")
    assert not dispatch.use_kernel(_fake_cuda())
    monkeypatch.setenv(dispatch.DISABLE_ENV, "0")
    assert dispatch.use_kernel(_fake_cuda())
    monkeypatch.setattr(dispatch, "extension", lambda: None)
    assert not dispatch.use_kernel(_fake_cuda())


def test_cpu_tensors_take_the_reference_even_with_the_extension(fake_extension):
    x, r, w = _inputs((2, 16), torch.bfloat16, "cpu", residual=True)
    out, summed = ops.add_rmsnorm(x, r, w, EPS)  # _FakeExtension would raise if reached
    want_out, want_sum = ops.add_rmsnorm_ref(x, r, w, EPS)
    assert torch.equal(out, want_out) and torch.equal(summed, want_sum)


def test_missing_extension_degrades_quietly(monkeypatch, caplog):
    def no_module(name):
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(dispatch.importlib, "import_module", no_module)
    dispatch.extension.cache_clear()
    try:
        with caplog.at_level(logging.DEBUG, logger=dispatch.__name__):
            assert dispatch.extension() is None
            assert dispatch.extension() is None
            assert not ops.kernels_available()
        records = [rec for rec in caplog.records if rec.name == dispatch.__name__]
        assert len(records) == 1 and records[0].levelno == logging.DEBUG
    finally:
        dispatch.extension.cache_clear()


# ---------------------------------------------------------------- GPU: the CUDA kernel

SHAPES = [
    (1, 2048),
    (3, 4096),
    (2, 5120),
    (37, 256),  # one warp per row, rows not a multiple of the 4 rows per block
    (5, 128),
    (4, 1000),  # 16-byte path for bf16/fp16, hidden % 8 == 0 but not a power of two
    (3, 1023),  # odd: element-wise path
    (2, 8191),  # odd and longer than one pass of 1024 threads
    (1, 17),
    (2, 12288),  # more vectors than threads
    (6, 7, 96),
]


@pytest.fixture
def cuda_kernels(monkeypatch):
    monkeypatch.delenv(dispatch.DISABLE_ENV, raising=False)
    assert dispatch.extension() is not None, (
        "CUDA is available but ninfer_core._C is not built: run scripts/gpu_check.sh"
    )


def _poisoned(like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, float("nan"))


@pytest.mark.cuda
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("zero_centered", [False, True], ids=["plain", "zc"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "add_norm"])
def test_kernel_matches_float64(cuda_kernels, shape, dtype, zero_centered, with_residual):
    x, r, w = _inputs(shape, dtype, "cuda", residual=with_residual, seed=sum(shape))
    x_before = x.clone()
    assert dispatch.use_kernel(x, w)
    out = _poisoned(x)
    if with_residual:
        r_before = r.clone()
        summed = _poisoned(x)
        ops.add_rmsnorm(x, r, w, EPS, zero_centered=zero_centered, out=out, residual_out=summed)
        assert torch.equal(summed, x + r)  # torch's own add in the dtype: exact
        assert torch.equal(r, r_before)
        ref_out, _ = ops.add_rmsnorm_ref(x, r, w, EPS, zero_centered=zero_centered)
    else:
        ops.rmsnorm(x, w, EPS, zero_centered=zero_centered, out=out)
        ref_out = ops.rmsnorm_ref(x, w, EPS, zero_centered=zero_centered)
    assert torch.equal(x, x_before)
    assert not out.isnan().any()
    _assert_close_f64(out, _expected(x, r, w, zero_centered)[0], dtype)
    # Against the torch reference only the fp32 sum order differs: at most an ulp or two.
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(out, ref_out, rtol=2 * ulp, atol=2 * ulp)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "misaligned"])
def test_kernel_fp32_weight(cuda_kernels, dtype, offset):
    """fp32 weights on the 16-byte path, and with an input one element off 16 bytes."""
    rows, hidden = 9, 1024
    buf = torch.randn(rows * hidden + offset, device="cuda").to(dtype)
    x = buf[offset:].view(rows, hidden)
    assert (x.data_ptr() % 16 == 0) == (offset == 0)
    w = torch.randn(hidden, device="cuda") * 0.3
    for zero_centered in (False, True):
        out = _poisoned(x)
        ops.rmsnorm(x, w, EPS, zero_centered=zero_centered, out=out)
        _assert_close_f64(out, _expected(x, None, w, zero_centered)[0], dtype)


@pytest.mark.cuda
def test_kernel_in_place(cuda_kernels):
    x, r, w = _inputs((8, 2048), torch.bfloat16, "cuda", residual=True)
    want_out, want_sum = ops.add_rmsnorm_ref(x, r, w, EPS, zero_centered=True)
    out, summed = ops.add_rmsnorm(x, r, w, EPS, zero_centered=True, out=x, residual_out=r)
    assert out is x and summed is r
    assert torch.equal(r, want_sum)
    torch.testing.assert_close(x, want_out, rtol=0.016, atol=0.016)


@pytest.mark.cuda
def test_kernel_replays_in_cuda_graph(cuda_kernels):
    """The kernel runs on torch's current stream, so graph capture records it."""
    x, r, w = _inputs((4, 2048), torch.bfloat16, "cuda", residual=True)
    out, summed = torch.empty_like(x), torch.empty_like(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside capture
        ops.add_rmsnorm(x, r, w, EPS, zero_centered=True, out=out, residual_out=summed)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.add_rmsnorm(x, r, w, EPS, zero_centered=True, out=out, residual_out=summed)
    for seed in (1, 2):
        nx, nr, _ = _inputs((4, 2048), torch.bfloat16, "cuda", residual=True, seed=seed)
        x.copy_(nx)
        r.copy_(nr)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(summed, nx + nr)
        _assert_close_f64(out, _expected(nx, nr, w, True)[0], torch.bfloat16)

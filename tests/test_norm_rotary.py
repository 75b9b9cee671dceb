"""ops/rope.py `norm_rotary`: the attention layer's q / k path (head RMSNorm, then rotate-half RoPE).

CPU: the op is the composition of `rmsnorm` and `apply_rotary`, and that composition matches a
float64 formulation written from the definitions. `cuda`: the kernel (csrc/rope.cu) against the
composition and float64, on head vectors read in place from strided views (the [query | gate]
split and the merged q|k|v projection), with and without the norm, full and partial rotary.
"""

from __future__ import annotations

import pytest
import torch

from ninfer_core.layers.rope import RotaryEmbedding
from ninfer_core.ops import dispatch
from ninfer_core.ops.rope import norm_rotary, norm_rotary_ref


def _tables(batch: int, tokens: int, rotary: int, dtype, device):
    positions = (torch.arange(tokens)[None] + 1000 * torch.arange(batch)[:, None]).to(device)
    return RotaryEmbedding(rotary, 10_000_000.0)(positions, dtype)


def _f64(x, cos, sin, weight, eps, zero_centered):
    """float64 from the definitions (the norm's output rounded to x's dtype, as the layer does)."""
    xd = x.double()
    if weight is not None:
        normed = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
        scale = weight.double() + 1 if zero_centered else weight.double()
        xd = (normed * scale).to(x.dtype).double()
    rotary = cos.shape[-1]
    c, s = cos.double()[:, :, None], sin.double()[:, :, None]
    first, second = xd[..., : rotary // 2], xd[..., rotary // 2 : rotary]
    rotated = torch.cat((first * c[..., : rotary // 2] - second * s[..., : rotary // 2],
                         second * c[..., rotary // 2 :] + first * s[..., rotary // 2 :]), dim=-1)
    return torch.cat((rotated, xd[..., rotary:]), dim=-1)


def _case(dim: int, rotary: int, dtype, device, strided: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    batch, tokens, heads = 2, 5, 3
    wide = torch.randn(batch, tokens, heads, 2 * dim if strided else dim, generator=g).to(dtype).to(device)
    x = wide[..., :dim]  # the [query | gate] split: head stride 2 D
    weight = (0.3 * torch.randn(dim, generator=g)).to(dtype).to(device)
    cos, sin = _tables(batch, tokens, rotary, dtype, device)
    return x, cos, sin, weight


@pytest.mark.parametrize("zero_centered", [True, False, None], ids=["zero-centred", "plain", "no-norm"])
@pytest.mark.parametrize("dim,rotary", [(64, 64), (256, 64), (128, 32)])
def test_composition_matches_float64(dim, rotary, zero_centered):
    x, cos, sin, weight = _case(dim, rotary, torch.float32, "cpu", True, dim + rotary)
    weight = None if zero_centered is None else weight
    got = norm_rotary(x, cos, sin, weight, 1e-6, bool(zero_centered))
    assert got.shape == x.shape and got.is_contiguous()
    torch.testing.assert_close(got.double(), _f64(x, cos, sin, weight, 1e-6, bool(zero_centered)),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("zero_centered", [True, False, None], ids=["zero-centred", "plain", "no-norm"])
@pytest.mark.parametrize("dim,rotary", [(256, 64), (256, 256), (128, 128), (128, 32), (64, 64), (64, 16)])
@pytest.mark.parametrize("strided", [True, False])
def test_kernel_matches_composition_and_float64(monkeypatch, dtype, zero_centered, dim, rotary, strided):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    monkeypatch.delenv(dispatch.DISABLE_ENV, raising=False)
    monkeypatch.setenv(dispatch.REQUIRE_ENV, "1")  # a silent fallback to the composition would pass
    assert dispatch.extension() is not None, "CUDA is available but ninfer_core._C is not built"
    x, cos, sin, weight = _case(dim, rotary, dtype, "cuda", strided, dim + rotary + strided)
    weight = None if zero_centered is None else weight
    got = norm_rotary(x, cos, sin, weight, 1e-6, bool(zero_centered))
    want = norm_rotary_ref(x, cos, sin, weight, 1e-6, bool(zero_centered))
    assert got.dtype == dtype and got.shape == x.shape and got.is_contiguous() and not got.isnan().any()
    ulp = torch.finfo(dtype).eps * (8 if dtype == torch.float32 else 2)  # rstd's fp32 sum order
    torch.testing.assert_close(got, want, rtol=ulp, atol=ulp)
    torch.testing.assert_close(got.double(), _f64(x, cos, sin, weight, 1e-6, bool(zero_centered)),
                               rtol=4 * ulp, atol=4 * ulp)


@pytest.mark.cuda
def test_kernel_reads_merged_projection_in_place(monkeypatch):
    """k as the attention layer slices it: a view into [q | k | v] rows (token stride = row width)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    monkeypatch.delenv(dispatch.DISABLE_ENV, raising=False)
    monkeypatch.setenv(dispatch.REQUIRE_ENV, "1")
    g = torch.Generator().manual_seed(5)
    batch, tokens, q_out, kv_heads, dim = 2, 4, 1024, 2, 256
    merged = torch.randn(batch, tokens, q_out + 2 * kv_heads * dim, generator=g).bfloat16().cuda()
    k = merged[..., q_out : q_out + kv_heads * dim].view(batch, tokens, kv_heads, dim)
    weight = (0.3 * torch.randn(dim, generator=g)).bfloat16().cuda()
    cos, sin = _tables(batch, tokens, 64, torch.bfloat16, "cuda")
    got = norm_rotary(k, cos, sin, weight, 1e-6, True)
    torch.testing.assert_close(got, norm_rotary_ref(k, cos, sin, weight, 1e-6, True), rtol=0.016, atol=0.016)


def test_rotary_frequencies_are_computed_once_per_device():
    """The inverse frequencies are kept per device after the first call (no kernels for them in a
    decode step), equal to theta^(-2i/d) in float64, and the tables are those of a fresh module."""
    rope = RotaryEmbedding(64, 10_000_000.0)
    first = rope.inv_freq(torch.device("cpu"))
    assert rope.inv_freq(torch.device("cpu")) is first
    want = 1.0 / 10_000_000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    torch.testing.assert_close(first.double(), want, rtol=1e-6, atol=0)
    positions = torch.arange(40).view(2, 20)
    for a, b in zip(rope(positions, torch.bfloat16), RotaryEmbedding(64, 10_000_000.0)(positions, torch.bfloat16)):
        assert torch.equal(a, b)

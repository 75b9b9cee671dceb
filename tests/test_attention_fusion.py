"""The decode step's fused attention ops against the unfused composition they replace, bit for bit.

`norm_rotary_write_kv` is `norm_rotary` of q and of k, then `write_kv` (one kernel, csrc/rope.cu);
`decode_attention(..., gate=)` is `decode_attention` then `sigmoid_mul` (in the attention kernels'
final write); `Attention.forward` uses both in a decode step (T <= 16).

CPU: each op is that composition, so results are as before the fusion; every tensor reaches its
binding argument as the view it is (recorded by kernel_stub: the binding reads their sizes and
strides; tests/test_binding_checks_attention_gdn.py checks it). `cuda`: the fused kernels against the
composition of the unfused kernels with torch.equal, on outputs and on every cache byte and scale
(caches start out as random data, so a stray write shows), with the unfused ops made to raise
while the fused path runs: bf16 / fp16, native / fp8 / int8 caches, batch 1..8, 1..4 new
tokens crossing page boundaries, inputs read in place from the merged q|k|v projection, Qwen3.6's
attention head (256 dims, rotary 64, zero-centred norm, output gate) and Llama-like ones (full
rotary, plain norm or none), both output paths of the attention (one split written directly,
several combined by the reduce kernel), and a CUDA graph replayed as the context grows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

import ninfer_core.layers.attention as attention_layer
import ninfer_core.ops.attention as attention_ops
from ninfer_core.cache.kv_pool import KVLayer, KVPool
from ninfer_core.config import ModelConfig
from ninfer_core.engine.graph_capture import capture
from ninfer_core.layers.attention import Attention, AttentionMetadata
from ninfer_core.layers.rope import RotaryEmbedding
from ninfer_core.ops import dispatch
from ninfer_core.ops.activation import sigmoid_mul
from ninfer_core.ops.attention import decode_attention, norm_rotary_write_kv, write_kv, write_kv_ref
from ninfer_core.ops.rope import norm_rotary
from kernel_stub import record_kernel_calls
from test_decode_attention import LENS, Case

PAGE = 16
KINDS = [None, "fp8", "int8"]
DTYPES = [torch.bfloat16, torch.float16]
# Tokens cached before the step, per sequence: 1..4 new tokens cross a page boundary in most rows.
CACHED = [PAGE - 1, 2 * PAGE - 2, 0, 5 * PAGE - 1, 37, 3 * PAGE, PAGE - 3, 100]
cuda = pytest.mark.cuda


@dataclass(frozen=True)
class Layout:
    """An attention layer's heads, as ModelConfig fields."""

    arch: str
    heads: int
    kv_heads: int
    dim: int
    rotary: int
    qk_norm: bool
    zero_centered: bool
    gated: bool

    def config(self) -> ModelConfig:
        return ModelConfig(arch=self.arch, vocab_size=8, hidden_size=256, num_layers=1, layer_types=["full_attention"],
                           num_heads=self.heads, num_kv_heads=self.kv_heads, head_dim=self.dim,
                           partial_rotary_factor=self.rotary / self.dim, rope_theta=1e7, qk_norm=self.qk_norm,
                           norm_zero_centered=self.zero_centered, attn_output_gate=self.gated)


LAYOUTS = {
    "qwen3.6": Layout("qwen3_5_moe", 16, 2, 256, 64, True, True, True),  # Qwen3.6-35B-A3B's full attention
    "qwen3": Layout("qwen3", 8, 2, 128, 128, True, False, False),  # plain head norm, full rotary
    "llama": Layout("llama", 8, 2, 64, 64, False, False, False),  # no head norm
}
SHAPES = [(1, 1), (2, 4), (8, 1), (8, 4)]  # (batch, new tokens)


# ------------------------------------------------------------------------------------ helpers


def _randn(shape, generator: torch.Generator, dtype: torch.dtype, device: str, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=generator) * scale).to(dtype).to(device)


@dataclass
class Paged:
    """A cache whose every row holds random data, its shuffled block table and the lengths cached."""

    kv: KVLayer
    table: torch.Tensor
    cache_lens: torch.Tensor

    def meta(self, tokens: int) -> AttentionMetadata:
        return AttentionMetadata.build(self.table, self.cache_lens, tokens, PAGE, self.kv.k.shape[0])


def _paged(batch: int, tokens: int, kv_heads: int, dim: int, kind: str | None, dtype: torch.dtype, device: str,
           g: torch.Generator, extra_pages: int = 2) -> Paged:
    cached = CACHED[:batch]
    width = max(math.ceil((n + tokens) / PAGE) for n in cached) + extra_pages
    num_pages = batch * width + 3
    kv = KVPool([0], num_pages, PAGE, kv_heads, dim, dtype, device, kv_dtype=kind).layer(0)
    rows = torch.arange(num_pages * PAGE, device=device)[None]
    write_kv_ref(kv, _randn((1, rows.shape[1], kv_heads, dim), g, dtype, device, 2.0),
                 _randn((1, rows.shape[1], kv_heads, dim), g, dtype, device), rows)
    table = torch.randperm(num_pages, generator=g)[: batch * width].view(batch, width).to(torch.int32).to(device)
    return Paged(kv, table, torch.tensor(cached, dtype=torch.int64, device=device))


def _clone(kv: KVLayer) -> KVLayer:
    copy = lambda t: None if t is None else t.clone()  # noqa: E731
    return KVLayer(copy(kv.k), copy(kv.v), copy(kv.k_scale), copy(kv.v_scale))


def _assert_same_cache(ours: KVLayer, ref: KVLayer) -> None:
    for a, b in ((ours.k, ref.k), (ours.v, ref.v)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    if ref.k_scale is not None:
        assert torch.equal(ours.k_scale, ref.k_scale) and torch.equal(ours.v_scale, ref.v_scale)


def _tables(rotary: int, cache_lens: torch.Tensor, tokens: int, dtype: torch.dtype):
    positions = cache_lens[:, None] + torch.arange(tokens, device=cache_lens.device)
    return RotaryEmbedding(rotary, 1e7)(positions, dtype)


def _projection(layout: Layout, batch: int, tokens: int, dtype: torch.dtype, device: str, g: torch.Generator):
    """q, gate (None without), k, v [B, T, H(kv), D] as the layer has them: views of one merged
    q|k|v output (per head [query | gate] when gated)."""
    q_width = layout.heads * layout.dim * (2 if layout.gated else 1)
    kv_width = layout.kv_heads * layout.dim
    merged = _randn((batch, tokens, q_width + 2 * kv_width), g, dtype, device, 2.0)
    q, k, v = merged.split([q_width, kv_width, kv_width], dim=-1)
    q = q.view(batch, tokens, layout.heads, -1)
    gate = None
    if layout.gated:
        q, gate = q.split(layout.dim, dim=-1)
    shape = (batch, tokens, layout.kv_heads, layout.dim)
    return q, gate, k.view(shape), v.view(shape)


def _weights(layout: Layout, dtype: torch.dtype, device: str, g: torch.Generator):
    if not layout.qk_norm:
        return None, None
    return _randn(layout.dim, g, dtype, device, 0.3), _randn(layout.dim, g, dtype, device, 0.3)


def _unfused_forward(attn: Attention, x, cos, sin, kv: KVLayer, meta: AttentionMetadata) -> torch.Tensor:
    """Attention.forward's decode step before the fusion: norm_rotary of q, of k, write_kv,
    decode_attention, sigmoid_mul."""
    batch, tokens, _ = x.shape
    q, k, v = attn.qkv_proj(x)
    q = q.view(batch, tokens, attn.num_heads, -1)
    if attn.output_gate:
        q, gate = q.split(attn.head_dim, dim=-1)
    k = k.view(batch, tokens, attn.num_kv_heads, attn.head_dim)
    v = v.view(batch, tokens, attn.num_kv_heads, attn.head_dim)
    if attn.q_norm is not None:
        q = norm_rotary(q, cos, sin, attn.q_norm.weight, attn.q_norm.eps, attn.q_norm.zero_centered)
        k = norm_rotary(k, cos, sin, attn.k_norm.weight, attn.k_norm.eps, attn.k_norm.zero_centered)
    else:
        q, k = norm_rotary(q, cos, sin), norm_rotary(k, cos, sin)
    write_kv(kv, k, v, meta.slot_mapping)
    out = decode_attention(q, kv, meta.block_table, meta.cache_lens, attn.scale)
    if attn.output_gate:
        out = sigmoid_mul(out, gate)
    return attn.o_proj(out.reshape(batch, tokens, -1))


def _layer(layout: Layout, dtype: torch.dtype, device: str, seed: int) -> Attention:
    """The layer with random weights (head norms far from identity)."""
    torch.manual_seed(seed)
    attn = Attention(layout.config())
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.normal_(0.0, 0.3 if "norm" in name else p.shape[-1] ** -0.5)
    return attn.to(device=device, dtype=dtype).eval()


def _require_kernels(monkeypatch) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    monkeypatch.delenv(dispatch.DISABLE_ENV, raising=False)
    monkeypatch.setenv(dispatch.REQUIRE_ENV, "1")  # a silent fallback to a torch reference would pass
    assert dispatch.kernels_available(), "CUDA is available but ninfer_core._C is not built"


def _forbid_composition(monkeypatch) -> None:
    """From here on the unfused ops raise where the fused path would fall back to them (the ops'
    own fallbacks and the layer's prefill path), so a passing test ran the fused kernels."""
    def forbidden(name: str):
        def call(*args, **kwargs):
            raise AssertionError(f"{name} ran: the fused kernel path was not taken")
        return call
    for module in (attention_ops, attention_layer):
        for name in ("norm_rotary", "write_kv", "sigmoid_mul"):
            monkeypatch.setattr(module, name, forbidden(name))


# ------------------------------------------------------------------------------ CPU: plumbing


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_cpu_prologue_is_the_composition(monkeypatch, layout, kind):
    """On the CPU norm_rotary_write_kv runs the unfused ops (never the CUDA extension)."""
    monkeypatch.setattr(dispatch, "extension", lambda: pytest.fail("CUDA extension used for CPU tensors"))
    g = torch.Generator().manual_seed(1)
    q, _, k, v = _projection(layout, 3, 4, torch.float32, "cpu", g)
    q_weight, k_weight = _weights(layout, torch.float32, "cpu", g)
    paged = _paged(3, 4, layout.kv_heads, layout.dim, kind, torch.float32, "cpu", g)
    ref_kv = _clone(paged.kv)
    cos, sin = _tables(layout.rotary, paged.cache_lens, 4, torch.float32)
    meta = paged.meta(4)
    got = norm_rotary_write_kv(q, k, v, cos, sin, paged.kv, meta.slot_mapping, q_weight, k_weight, 1e-6,
                               layout.zero_centered)
    want = norm_rotary(q, cos, sin, q_weight, 1e-6, layout.zero_centered)
    write_kv(ref_kv, norm_rotary(k, cos, sin, k_weight, 1e-6, layout.zero_centered), v, meta.slot_mapping)
    assert torch.equal(got, want)
    _assert_same_cache(paged.kv, ref_kv)


@pytest.mark.parametrize("kind", KINDS)
def test_cpu_gated_decode_attention_is_sigmoid_mul(kind):
    case = Case([0, 9, 40], 3, 8, 2, 32, kind, torch.float32, "cpu", seed=4)
    gate = torch.randn(case.q.shape, generator=case.generator)
    want = sigmoid_mul(decode_attention(case.q, case.kv, case.table, case.cache_lens, case.scale), gate)
    out = torch.full_like(case.q, float("nan"))
    got = decode_attention(case.q, case.kv, case.table, case.cache_lens, case.scale, out=out, gate=gate)
    assert got is out and torch.equal(got, want)


@pytest.mark.parametrize("kind", [None, "int8"])
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_cpu_layer_decode_equals_unfused_forward(layout, kind):
    g = torch.Generator().manual_seed(2)
    attn = _layer(layout, torch.float32, "cpu", seed=2)
    paged = _paged(3, 2, layout.kv_heads, layout.dim, kind, torch.float32, "cpu", g)
    ref_kv = _clone(paged.kv)
    x = _randn((3, 2, 256), g, torch.float32, "cpu")
    cos, sin = _tables(layout.rotary, paged.cache_lens, 2, torch.float32)
    meta = paged.meta(2)
    with torch.no_grad():
        want = _unfused_forward(attn, x, cos, sin, ref_kv, meta)
        got = attn(x, cos, sin, paged.kv, meta)
    assert torch.equal(got, want)
    _assert_same_cache(paged.kv, ref_kv)


def _record(monkeypatch, binding: str) -> list[dict]:
    """kernel_stub's recorder for `binding`, with the cache kinds and split count the attention
    wrappers ask the extension for."""
    calls = record_kernel_calls(monkeypatch, binding)
    dispatch.extension().decode_attention_max_splits = lambda **kw: 3
    monkeypatch.setattr(dispatch, "num_sms", lambda device: 132)
    return calls


@pytest.mark.parametrize("kind", KINDS)
def test_prologue_binding_arguments(monkeypatch, kind):
    """q / k / v read in place from the merged projection (the views themselves), the norm weights,
    tables, cache, scales and slots each reach their argument."""
    calls = _record(monkeypatch, "norm_rotary_write_kv")
    layout = LAYOUTS["qwen3.6"]
    g = torch.Generator().manual_seed(3)
    q, _, k, v = _projection(layout, 2, 3, torch.bfloat16, "cpu", g)
    q_weight, k_weight = _weights(layout, torch.bfloat16, "cpu", g)
    paged = _paged(2, 3, layout.kv_heads, layout.dim, kind, torch.bfloat16, "cpu", g)
    cos, sin = _tables(layout.rotary, paged.cache_lens, 3, torch.bfloat16)
    slots = paged.meta(3).slot_mapping
    out = norm_rotary_write_kv(q, k, v, cos, sin, paged.kv, slots, q_weight, k_weight, 1e-5, True)
    (kw,) = calls
    assert kw["q_out"] is out and out.shape == q.shape and out.is_contiguous()
    kv = paged.kv
    tensors = {"q": q, "k": k, "v": v, "q_weight": q_weight, "k_weight": k_weight, "cos": cos, "sin": sin,
               "k_cache": kv.k, "v_cache": kv.v, "k_scale": kv.k_scale, "v_scale": kv.v_scale, "slot_mapping": slots}
    for name, t in tensors.items():  # the views themselves: the binding reads their strides
        assert kw[name] is t, name
    assert (kw["k_scale"] is None) == (kind is None)
    assert kw["eps"] == 1e-5 and kw["zero_centered"] and kw["stream"] == 7


def test_gated_decode_attention_binding_arguments(monkeypatch):
    """The gate, a [query | gate] view, reaches the kernel in place; no gate passes None. The
    workspace is sized for the splits the extension asked for."""
    calls = _record(monkeypatch, "decode_attention")
    case = Case([0, 9, 40], 3, 8, 2, 64, None, torch.bfloat16, "cpu", seed=5)
    q, gate = torch.cat([case.q, case.q], dim=-1).split(64, dim=-1)
    out = decode_attention(q, case.kv, case.table, case.cache_lens, case.scale, gate=gate)
    decode_attention(q, case.kv, case.table, case.cache_lens, case.scale)
    gated, plain = calls
    assert gated["out"] is out and gated["gate"] is gate and plain["gate"] is None
    for kw in calls:
        assert torch.equal(kw["q"], q) and kw["q"].is_contiguous()
        assert kw["k_cache"] is case.kv.k and kw["v_cache"] is case.kv.v and kw["k_scale"] is None
        assert kw["block_table"] is case.table and kw["cache_lens"] is case.cache_lens
        # split-K partials of 3 splits: [B, Hkv, splits, T x H / Hkv] rows of D values, then (max, sum) each
        assert kw["max_splits"] == 3 and kw["workspace"].numel() == 3 * 2 * 3 * 3 * 4 * (64 + 2)


# ------------------------------------------------------------------------------ CUDA kernels


@cuda
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
@pytest.mark.parametrize("batch,tokens", SHAPES)
def test_prologue_kernel_matches_composition(monkeypatch, batch, tokens, layout, dtype, kind):
    """q out and every cache byte as norm_rotary (q), norm_rotary (k) + write_kv leave them, with
    q / k / v read in place from the merged projection; a token whose slot is -1 (outside the
    cache) still gets its q and writes no row."""
    _require_kernels(monkeypatch)
    g = torch.Generator().manual_seed(batch * 10 + tokens)
    q, _, k, v = _projection(layout, batch, tokens, dtype, "cuda", g)
    q_weight, k_weight = _weights(layout, dtype, "cuda", g)
    paged = _paged(batch, tokens, layout.kv_heads, layout.dim, kind, dtype, "cuda", g)
    ref_kv = _clone(paged.kv)
    cos, sin = _tables(layout.rotary, paged.cache_lens, tokens, dtype)
    slots = paged.meta(tokens).slot_mapping.clone()
    if batch > 1:
        slots[-1, -1] = -1
    want = norm_rotary(q, cos, sin, q_weight, 1e-6, layout.zero_centered)
    write_kv(ref_kv, norm_rotary(k, cos, sin, k_weight, 1e-6, layout.zero_centered), v, slots)
    _forbid_composition(monkeypatch)
    got = norm_rotary_write_kv(q, k, v, cos, sin, paged.kv, slots, q_weight, k_weight, 1e-6, layout.zero_centered)
    torch.cuda.synchronize()
    assert got.shape == q.shape and got.is_contiguous() and torch.equal(got, want)
    _assert_same_cache(paged.kv, ref_kv)


@cuda
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads,kv_heads,dim", [(16, 2, 256), (8, 2, 128), (4, 4, 64)])
@pytest.mark.parametrize("num_new", [1, 4, 16])
@pytest.mark.parametrize("lens", LENS.values(), ids=LENS.keys())
def test_gated_decode_attention_matches_sigmoid_mul(monkeypatch, lens, num_new, heads, kv_heads, dim, dtype, kind):
    """Both output writes (sequences of one split, written by the attention kernel; of several, by
    the reduce kernel; 16 tokens x GQA 8 at 256 dims: two row chunks), the gate read in place from
    [query | gate] heads."""
    _require_kernels(monkeypatch)
    case = Case(lens, num_new, heads, kv_heads, dim, kind, dtype, "cuda", seed=len(lens) + num_new + dim)
    query_gate = torch.cat([case.q, _randn(case.q.shape, case.generator, dtype, "cuda", 3.0)], dim=-1)
    q, gate = query_gate.split(dim, dim=-1)
    want = sigmoid_mul(decode_attention(q, case.kv, case.table, case.cache_lens, case.scale), gate)
    _forbid_composition(monkeypatch)
    out = torch.full_like(case.q, float("nan"))
    got = decode_attention(q, case.kv, case.table, case.cache_lens, case.scale, out=out, gate=gate)
    torch.cuda.synchronize()
    assert got is out and torch.equal(got, want)


@cuda
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
@pytest.mark.parametrize("batch,tokens", SHAPES)
def test_layer_decode_matches_unfused_forward(monkeypatch, batch, tokens, layout, dtype, kind):
    """Attention.forward in a decode step: output and cache equal to the six-launch composition."""
    _require_kernels(monkeypatch)
    g = torch.Generator().manual_seed(batch * 10 + tokens + 1)
    attn = _layer(layout, dtype, "cuda", seed=batch + tokens)
    paged = _paged(batch, tokens, layout.kv_heads, layout.dim, kind, dtype, "cuda", g)
    ref_kv = _clone(paged.kv)
    x = _randn((batch, tokens, 256), g, dtype, "cuda")
    cos, sin = _tables(layout.rotary, paged.cache_lens, tokens, dtype)
    meta = paged.meta(tokens)
    with torch.inference_mode():
        want = _unfused_forward(attn, x, cos, sin, ref_kv, meta)
        _forbid_composition(monkeypatch)
        got = attn(x, cos, sin, paged.kv, meta)
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    _assert_same_cache(paged.kv, ref_kv)


@cuda
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tokens", [1, 4])
def test_layer_decode_in_cuda_graph_as_context_grows(monkeypatch, kind, tokens):
    """The Qwen3.6 layer's decode step captured once at a fixed table width, replayed after the
    contexts grew across split counts: equal to the eager unfused composition each time."""
    _require_kernels(monkeypatch)
    layout = LAYOUTS["qwen3.6"]
    g = torch.Generator().manual_seed(tokens)
    attn = _layer(layout, torch.bfloat16, "cuda", seed=7)
    paged = _paged(3, tokens, layout.kv_heads, layout.dim, kind, torch.bfloat16, "cuda", g, extra_pages=400)
    x = _randn((3, tokens, 256), g, torch.bfloat16, "cuda")
    cos, sin = _tables(layout.rotary, paged.cache_lens, tokens, torch.bfloat16)
    meta = paged.meta(tokens)
    with torch.inference_mode():
        graph, out = capture(lambda: attn(x, cos, sin, paged.kv, meta))
        for grown in ([CACHED[0], CACHED[1], CACHED[2]], [1500, 2000, 6000], [6001, 15, 3000]):
            paged.cache_lens.copy_(torch.tensor(grown))
            step = paged.meta(tokens)
            meta.slot_mapping.copy_(step.slot_mapping)
            x.copy_(_randn(x.shape, g, torch.bfloat16, "cuda"))
            new_cos, new_sin = _tables(layout.rotary, paged.cache_lens, tokens, torch.bfloat16)
            cos.copy_(new_cos)
            sin.copy_(new_sin)
            ref_kv = _clone(paged.kv)
            want = _unfused_forward(attn, x, cos, sin, ref_kv, meta)
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want)
            _assert_same_cache(paged.kv, ref_kv)

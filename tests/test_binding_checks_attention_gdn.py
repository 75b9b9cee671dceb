"""The attention, GDN and sampling bindings (csrc/bind_attention.cpp, bind_gdn.cpp, bind_sampling.cpp)
check shapes, strides and dtypes in C++ (csrc/tensor_arg.h) before anything launches, as
test_binding_checks.py does for rmsnorm and the activations. Runs wherever ninfer_core._C is built,
GPU or not: with CPU tensors a binding goes through every check and its last one, the device check,
raises DeviceError instead of launching. So each op's wrapper, routed to its kernel path on CPU
tensors (`kernels_on_cpu`) with the call shapes of the GPU tests and the model (decode batch 1 and 8,
verify and commit, a forked prefill's tail, views sliced out of merged projections, the gated
attention output, fp8 / int8 caches, sampling with each filter), must reach DeviceError: the
arguments it builds pass the binding's checks. And each wrong argument handed to a binding must be
a ValueError that names it.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from ninfer_core.cache.kv_pool import KVPool
from ninfer_core.engine.sampling import SamplingParams, row_params
from ninfer_core.ops import attention as attention_ops
from ninfer_core.ops import dispatch
from ninfer_core.ops import gdn as gdn_ops
from ninfer_core.ops import sampling as sampling_ops
from ninfer_core.ops.rope import norm_rotary

from kernel_stub import kernels_on_cpu, reaches_launch, rejects  # noqa: F401 - kernels_on_cpu is a fixture
from test_attention_fusion import LAYOUTS, _paged, _projection, _tables, _weights
from test_decode_attention import Case
from test_gdn_decode import SHAPE_35B, _tail_case, make_case, without_z

ext = dispatch.extension()
# The extension is built only where CUDA is: `cuda` too, so the device's `pytest -m cuda` runs them.
pytestmark = [pytest.mark.skipif(ext is None, reason="ninfer_core._C is not built"), pytest.mark.cuda]

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
KINDS = [None, "fp8", "int8"]

Changes = Callable[[dict], dict]


def rejects_change(binding: str, kwargs: dict, change: Changes, match: str) -> None:
    """binding(**kwargs) with `change(kwargs)` applied fails a check (`kwargs` reach the device check)."""
    rejects(lambda: getattr(ext, binding)(**{**kwargs, **change(kwargs)}), match)


def _bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(BF16)


def _meta(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    """A tensor of any size without memory: for the checks of sizes past the kernels' ranges."""
    return torch.empty(*shape, dtype=dtype, device="meta")


def _offset(t: torch.Tensor, elements: int = 1) -> torch.Tensor:
    """A copy of t starting `elements` elements past an aligned address."""
    flat = torch.empty(t.numel() + elements, dtype=t.dtype)[elements:]
    return flat.view(t.shape).copy_(t)


# ------------------------------------------------------------------------ GDN: the fused steps


@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=str)
@pytest.mark.parametrize("batch", [1, 8])
def test_gdn_decode_reaches_launch(kernels_on_cpu, batch, dtype):
    case = make_case(SHAPE_35B, batch, dtype)
    reaches_launch(lambda: gdn_ops.gdn_decode_step(**case))
    reaches_launch(lambda: gdn_ops.gdn_decode_step(**case, out=torch.empty_like(case["z"])))


@pytest.mark.parametrize("tokens", [None, 1, 4, 16])
def test_gdn_steps_on_merged_projection_slices_reach_launch(kernels_on_cpu, tokens):
    """qkv | z | b | a as column slices of one [B, (T,) W] projection, read in place: decode, verify, commit."""
    case = make_case(SHAPE_35B, 3, BF16, tokens=tokens)
    names = ("qkv", "z", "b", "a")
    merged = torch.cat([case[n] for n in names], dim=-1)
    sliced = {**case, **dict(zip(names, merged.split([case[n].shape[-1] for n in names], dim=-1)))}
    if tokens is None:
        reaches_launch(lambda: gdn_ops.gdn_decode_step(**sliced))
        return
    reaches_launch(lambda: gdn_ops.gdn_verify(**sliced))
    reaches_launch(lambda: gdn_ops.gdn_commit(**without_z(sliced), counts=torch.tensor([1, tokens, 0])))


def test_gdn_verify_commit_and_tail_reach_launch(kernels_on_cpu):
    case = make_case(SHAPE_35B, 4, BF16, tokens=4)
    reaches_launch(lambda: gdn_ops.gdn_verify(**case))
    reaches_launch(lambda: gdn_ops.gdn_commit(**without_z(case), counts=torch.tensor([0, 1, 3, 4])))
    # a forked prefill chunk's tail: 40 rows a sequence, 16 tokens from device offsets, fork slots
    case, tail = _tail_case("cpu", BF16)
    reaches_launch(lambda: gdn_ops.gdn_prefill_tail(**case, **tail))


def _gdn_kwargs(batch: int = 2, tokens: int = 3) -> dict:
    """Valid gdn_steps arguments (Hk 2, Hv 4, dk 32, dv 64, 4 taps): a verify with outputs."""
    hk, hv, dk, dv, taps = 2, 4, 32, 64, 4
    channels, slots = 2 * hk * dk + hv * dv, 2 * batch + 1
    return dict(
        qkv=_bf16(batch, tokens, channels), a=_bf16(batch, tokens, hv), b=_bf16(batch, tokens, hv),
        z=_bf16(batch, tokens, hv * dv), conv_pool=_bf16(slots, channels, taps - 1),
        state_pool=torch.randn(slots, hv, dk, dv), slots=torch.arange(batch), counts=None, offsets=None,
        fork_slots=None, width=None, out=torch.empty(batch, tokens, hv * dv, dtype=BF16),
        scratch=torch.empty(batch * (tokens * channels + hv)), conv_weight=_bf16(channels, taps), A_log=_bf16(hv),
        dt_bias=_bf16(hv), norm_weight=_bf16(dv), write_state=False, q_scale=dk**-0.5, eps=1e-6, stream=0,
    )


def test_gdn_steps_binding_takes_valid_arguments():
    kw = _gdn_kwargs()
    reaches_launch(lambda: ext.gdn_steps(**kw))
    tail = {"offsets": torch.tensor([1, 0]), "counts": torch.tensor([2, 1]), "fork_slots": torch.tensor([3, 4])}
    reaches_launch(lambda: ext.gdn_steps(**{**kw, **tail, "width": 2, "write_state": True}))
    reaches_launch(lambda: ext.gdn_steps(**{**kw, "z": None, "out": None, "write_state": True}))  # a commit
    with pytest.raises(TypeError):  # the raw-pointer interface is gone: an address is not a tensor
        ext.gdn_steps(**{**kw, "qkv": kw["qkv"].data_ptr()})


GDN_REJECTS: list[tuple[str, Changes]] = [
    ("state_pool is bfloat16, expected float32", lambda kw: {"state_pool": kw["state_pool"].to(BF16)}),
    ("state_pool must be contiguous", lambda kw: {"state_pool": kw["state_pool"].transpose(2, 3)}),
    ("state_pool must start at a 16-byte aligned address", lambda kw: {"state_pool": _offset(kw["state_pool"])}),
    ("state_pool's head dims 48 / 64 must be multiples of 32", lambda kw: {"state_pool": torch.randn(5, 4, 48, 64)}),
    (r"qkv width 480 is not 2 Hk 32 \+ 4 \* 64", lambda kw: {"qkv": _bf16(2, 3, 480)}),
    ("4 value heads are not a multiple of 3 key heads", lambda kw: {"qkv": _bf16(2, 3, 448)}),
    ("qkv needs a contiguous last axis", lambda kw: {"qkv": kw["qkv"].transpose(1, 2).contiguous().transpose(1, 2)}),
    ("qkv is int64, expected a float dtype", lambda kw: {"qkv": kw["qkv"].long()}),
    ("qkv needs its tokens one stride apart", lambda kw: {"qkv": kw["qkv"].transpose(0, 1).contiguous()
                                                          .transpose(0, 1)}),
    ("qkv has 65536 x 1 rows, too many", lambda kw: {"qkv": kw["qkv"][:1, :1].expand(65536, 1, -1)}),
    ("17 tokens a row, expected 1..16", lambda kw: {"qkv": _bf16(2, 17, 384)}),
    ("offsets and width go together", lambda kw: {"width": 2}),
    ("4 tokens a row, expected 1..3", lambda kw: {"offsets": torch.tensor([0, 0]), "width": 4}),
    (r"a has shape \(2, 3, 3\), expected \(2, 3, 4\)", lambda kw: {"a": kw["a"][..., :3]}),
    ("b is float16, expected bfloat16", lambda kw: {"b": kw["b"].half()}),
    ("a and b need one token stride", lambda kw: {"a": torch.cat([kw["a"], kw["a"]], -1)[..., :4]}),
    ("z and out go together", lambda kw: {"out": None}),
    ("nothing to do: no out and no state write", lambda kw: {"out": None, "z": None}),
    (r"z has shape \(2, 3, 255\)", lambda kw: {"z": kw["z"][..., :255]}),
    ("out must be contiguous", lambda kw: {"out": torch.empty(2, 3, 512, dtype=BF16)[..., :256]}),
    ("conv_weight has 9 taps, expected 2..8", lambda kw: {"conv_weight": _bf16(384, 9)}),
    (r"conv_weight has shape \(383, 4\), expected \(384, \*\)", lambda kw: {"conv_weight": _bf16(383, 4)}),
    (r"conv_pool has shape \(5, 384, 2\), expected \(5, 384, 3\)", lambda kw: {"conv_pool": _bf16(5, 384, 2)}),
    (r"conv_pool has shape \(4, 384, 3\), expected \(5, 384, 3\)", lambda kw: {"conv_pool": _bf16(4, 384, 3)}),
    ("slots is int32, expected int64", lambda kw: {"slots": kw["slots"].int()}),
    ("slots must be contiguous", lambda kw: {"slots": torch.arange(4)[::2]}),
    (r"counts has shape \(3,\), expected \(2,\)", lambda kw: {"counts": torch.zeros(3, dtype=torch.long)}),
    ("offsets is int32, expected int64", lambda kw: {"offsets": torch.zeros(2, dtype=torch.int), "width": 1}),
    (r"fork_slots has shape \(1,\)", lambda kw: {"fork_slots": torch.zeros(1, dtype=torch.long)}),
    (r"A_log has shape \(3,\), expected \(4,\)", lambda kw: {"A_log": kw["A_log"][:3]}),
    ("dt_bias is float32, expected bfloat16", lambda kw: {"dt_bias": kw["dt_bias"].float()}),
    (r"norm_weight has shape \(32,\), expected \(64,\)", lambda kw: {"norm_weight": kw["norm_weight"][:32]}),
    ("scratch has 2311 elements, needs at least 2312", lambda kw: {"scratch": kw["scratch"][:-1]}),
    ("scratch is bfloat16, expected float32", lambda kw: {"scratch": kw["scratch"].to(BF16)}),
]


@pytest.mark.parametrize("match,change", GDN_REJECTS, ids=[m for m, _ in GDN_REJECTS])
def test_gdn_steps_rejects_what_the_kernel_cannot_take(match, change):
    rejects_change("gdn_steps", _gdn_kwargs(), change, "gdn_steps: " + match)


# ------------------------------------------------------------------------ GDN: the prefill conv


def _conv_kwargs(tokens: int = 65, taps: int = 4, valid: bool = True, dtype: torch.dtype = BF16) -> dict:
    """Valid gdn_conv_prefill arguments: 3 rows of 200 channels (q / k / v parts of 48, 48, 104), qkv a
    slice of a wider projection, 5 pooled slots."""
    batch, channels = 3, 200
    x = lambda *shape: torch.randn(*shape).to(dtype)  # noqa: E731
    return dict(out=torch.empty(batch * tokens * channels, dtype=dtype),
                qkv=x(batch, tokens, channels + 40)[..., 8:-32], conv_pool=x(5, channels, taps - 1),
                slots=torch.tensor([3, 0, 4]),
                valid=torch.tensor([tokens, 0, 2]) if valid else None, weight=x(channels, taps), split=48, stream=0)


@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=str)
@pytest.mark.parametrize("tokens,taps,padded", [(1, 4, False), (3, 4, True), (65, 2, True), (200, 8, True),
                                                (517, 4, False)])
def test_conv_prefill_reaches_launch(kernels_on_cpu, dtype, tokens, taps, padded):
    kw = _conv_kwargs(tokens, taps, padded, dtype)
    reaches_launch(lambda: gdn_ops.conv_prefill(kw["qkv"], kw["conv_pool"], kw["slots"], kw["weight"], kw["split"],
                                                kw["valid"]))
    reaches_launch(lambda: ext.gdn_conv_prefill(**kw))


CONV_REJECTS: list[tuple[str, Changes]] = [
    ("qkv needs a contiguous last axis", lambda kw: {"qkv": kw["qkv"].transpose(1, 2).contiguous().transpose(1, 2)}),
    ("qkv is int32, expected a float dtype", lambda kw: {"qkv": kw["qkv"].int()}),
    (r"qkv has shape \(0, 65, 200\), out of the kernel's range", lambda kw: {"qkv": kw["qkv"][:0]}),
    (r"weight has shape \(201, 4\), expected \(200, \*\)", lambda kw: {"weight": _bf16(201, 4)}),
    ("weight has 1 taps, expected 2..8", lambda kw: {"weight": _bf16(200, 1)}),
    ("weight is float16, expected bfloat16", lambda kw: {"weight": kw["weight"].half()}),
    ("out must be contiguous", lambda kw: {"out": torch.empty(2 * kw["out"].numel(), dtype=kw["out"].dtype)[::2]}),
    (r"out has shape \(38400,\), expected \(39000,\)", lambda kw: {"out": kw["out"][:38400]}),
    ("split 100 leaves no v part of 200 channels", lambda kw: {"split": 100}),
    ("split 0 leaves no v part of 200 channels", lambda kw: {"split": 0}),
    (r"conv_pool has shape \(5, 200, 2\), expected \(\*, 200, 3\)", lambda kw: {"conv_pool": _bf16(5, 200, 2)}),
    ("conv_pool has no slots", lambda kw: {"conv_pool": kw["conv_pool"][:0]}),
    ("slots is int32, expected int64", lambda kw: {"slots": kw["slots"].int()}),
    (r"valid has shape \(2,\), expected \(3,\)", lambda kw: {"valid": kw["valid"][:2]}),
]


@pytest.mark.parametrize("match,change", CONV_REJECTS, ids=[m for m, _ in CONV_REJECTS])
def test_conv_prefill_rejects_what_the_kernel_cannot_take(match, change):
    rejects_change("gdn_conv_prefill", _conv_kwargs(), change, "gdn_conv_prefill: " + match)


# ------------------------------------------------------------------------ attention: KV write


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [BF16, F16], ids=str)
@pytest.mark.parametrize("dim", [64, 128, 256])
def test_write_kv_reaches_launch(kernels_on_cpu, kind, dtype, dim):
    kv = KVPool([0], 40, 16, 2, dim, dtype, "cpu", kv_dtype=kind).layer(0)
    k, v = torch.randn(3, 7, 2, dim).to(dtype), torch.randn(3, 7, 2, dim).to(dtype)
    slots = torch.randperm(40 * 16)[:21].view(3, 7)
    reaches_launch(lambda: attention_ops.write_kv(kv, k, v, slots))


def _cache(kind: str | None, dtype=BF16, pages: int = 6, page: int = 16, kv_heads: int = 2, dim: int = 64) -> dict:
    kv = KVPool([0], pages, page, kv_heads, dim, dtype, "cpu", kv_dtype=kind).layer(0)
    return dict(k_cache=kv.k, v_cache=kv.v, k_scale=kv.k_scale, v_scale=kv.v_scale)


def _write_kv_kwargs(kind: str | None = "fp8") -> dict:
    return dict(**_cache(kind), k=_bf16(5, 2, 64), v=_bf16(5, 2, 64), slot_mapping=torch.arange(5), stream=0)


WRITE_KV_REJECTS: list[tuple[str, Changes]] = [
    ("k is float32, expected float16 or bfloat16", lambda kw: {"k": kw["k"].float(), "v": kw["v"].float()}),
    ("head_dim 96 must be 64, 128 or 256", lambda kw: {"k": _bf16(5, 2, 96)}),
    ("k must be contiguous", lambda kw: {"k": kw["k"].transpose(0, 1).contiguous().transpose(0, 1)}),
    ("k must start at a 4-byte aligned address", lambda kw: {"k": _offset(kw["k"])}),
    (r"v has shape \(4, 2, 64\), k \(5, 2, 64\): they must match", lambda kw: {"v": kw["v"][:4]}),
    ("k has no kv heads", lambda kw: {"k": kw["k"][:, :0], "v": kw["v"][:, :0]} |
     {name: kw[name][:, :, :0] for name in ("k_cache", "v_cache", "k_scale", "v_scale")}),
    (r"k_cache has shape \(6, 16, 3, 64\), expected \(\*, \*, 2, 64\)", lambda kw: _cache("fp8", kv_heads=3)),
    ("k_cache is float16, expected bfloat16 or float8_e4m3fn or int8", lambda kw: _cache(None, dtype=F16)),
    ("k_cache must be contiguous", lambda kw: {"k_cache": kw["k_cache"].transpose(0, 1).contiguous()
                                              .transpose(0, 1)}),
    ("v_cache is int8, k_cache float8_e4m3fn: they must match", lambda kw: {"v_cache": _cache("int8")["v_cache"]}),
    ("fp8 / int8 caches need k_scale and v_scale", lambda kw: {"k_scale": None}),
    ("a native cache has no k_scale / v_scale", lambda kw: {**_cache(None), "v_scale": kw["v_scale"]}),
    ("k_scale is bfloat16, expected float32", lambda kw: {"k_scale": kw["k_scale"].to(BF16)}),
    (r"v_scale has shape \(6, 16\)", lambda kw: {"v_scale": kw["v_scale"][..., 0]}),
    ("slot_mapping is int32, expected int64", lambda kw: {"slot_mapping": kw["slot_mapping"].int()}),
    (r"slot_mapping has shape \(1, 5\), expected \(5,\)", lambda kw: {"slot_mapping": kw["slot_mapping"][None]}),
]


@pytest.mark.parametrize("match,change", WRITE_KV_REJECTS, ids=[m for m, _ in WRITE_KV_REJECTS])
def test_write_kv_rejects_what_the_kernel_cannot_take(match, change):
    kw = _write_kv_kwargs()
    reaches_launch(lambda: ext.write_kv(**kw))
    rejects_change("write_kv", kw, change, "write_kv: " + match)


# ------------------------------------------------------------------------ attention: decode


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("lens", [[5000], [0, 17, 1000], [1, 15, 16, 17, 1000, 700, 0, 63]], ids=len)
@pytest.mark.parametrize("num_new", [1, 4, 16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(16, 2, 256), (4, 4, 64), (32, 2, 128)])
def test_decode_attention_reaches_launch(kernels_on_cpu, kind, lens, num_new, heads, kv_heads, dim):
    case = Case(lens, num_new, heads, kv_heads, dim, kind, BF16, "cpu", seed=1, extra_width=1)
    reaches_launch(lambda: attention_ops.decode_attention(case.q, case.kv, case.table, case.cache_lens, case.scale))
    # the output gate read in place from [query | gate] heads, into a given out
    q, gate = torch.cat([case.q, case.q], dim=-1).split(dim, dim=-1)
    out = torch.empty_like(case.q)
    reaches_launch(lambda: attention_ops.decode_attention(q, case.kv, case.table, case.cache_lens, case.scale,
                                                          out=out, gate=gate))


def test_chunk_rows_reach_the_decode_binding(kernels_on_cpu, monkeypatch):
    """A prompt chunk without Triton: rows of 16 tokens on the decode kernel."""
    monkeypatch.setattr(dispatch, "triton_kernels", lambda name: None)
    case = Case([0, 40], 32, 8, 2, 128, "int8", F16, "cpu", seed=2)
    reaches_launch(lambda: attention_ops.chunk_attention(case.q, case.kv, case.table, case.cache_lens, case.scale))


def _decode_kwargs(kind: str | None = "int8", batch: int = 2, tokens: int = 3, heads: int = 4, splits: int = 3) -> dict:
    """Valid decode_attention arguments: 2 kv heads, head_dim 64, pages of 16, a table 3 wide."""
    q = _bf16(batch, tokens, heads, 64)
    partials = batch * 2 * splits * tokens * (heads // 2)
    return dict(out=torch.empty_like(q), q=q, gate=None, **_cache(kind), block_table=torch.randperm(6)[:batch * 3]
                .view(batch, 3).int(), cache_lens=torch.tensor([5, 30][:batch]), workspace=torch.empty(partials * 66),
                max_splits=splits, scale=0.125, stream=0)


DECODE_REJECTS: list[tuple[str, Changes]] = [
    ("q has 17 new tokens, expected 1..16", lambda kw: _decode_kwargs(tokens=17)),
    ("q is float32, expected float16 or bfloat16", lambda kw: {"q": kw["q"].float()}),
    ("q must be contiguous", lambda kw: {"q": kw["q"].transpose(1, 2).contiguous().transpose(1, 2)}),
    ("q must start at a 16-byte aligned address", lambda kw: {"q": _offset(kw["q"], 4)}),
    ("head_dim 96 must be 64, 128 or 256", lambda kw: {"q": _bf16(2, 3, 4, 96)}),
    ("batch 65536 is over 65535", lambda kw: {"q": kw["q"][:1, :1].expand(65536, 1, 4, 64).contiguous()}),
    (r"out has shape \(2, 3, 2, 64\), q \(2, 3, 4, 64\): they must match", lambda kw: {"out": kw["out"][:, :, :2]}),
    ("out must start at a 8-byte aligned address", lambda kw: {"out": _offset(kw["out"], 2)}),
    ("gate needs a contiguous last axis", lambda kw: {"gate": kw["q"].transpose(2, 3).contiguous().transpose(2, 3)}),
    ("gate is float16, q bfloat16", lambda kw: {"gate": kw["q"].half()}),
    ("out overlaps gate", lambda kw: {"gate": kw["out"]}),
    ("3 heads are not a multiple of 2 kv heads", lambda kw: {"q": _bf16(2, 3, 3, 64), "out": _bf16(2, 3, 3, 64)}),
    ("the cache's page size 12 must be a power of two", lambda kw: _cache("int8", page=12)),
    (r"the cache has 2147483648 pages, past the kernel's 2\^31 - 1",
     lambda kw: {name: _meta(2**31, 16, 2, 64, dtype=torch.int8) for name in ("k_cache", "v_cache")} |
     {name: _meta(2**31, 16, 2, dtype=F32) for name in ("k_scale", "v_scale")}),
    (r"k_cache has shape \(6, 16, 2, 128\), expected \(\*, \*, \*, 64\)", lambda kw: _cache("int8", dim=128)),
    ("k_scale is float16, expected float32", lambda kw: {"k_scale": kw["k_scale"].half()}),
    ("block_table is int64, expected int32", lambda kw: {"block_table": kw["block_table"].long()}),
    (r"block_table has shape \(1, 3\), expected \(2, \*\)", lambda kw: {"block_table": kw["block_table"][:1]}),
    ("block_table must be contiguous", lambda kw: {"block_table": kw["block_table"].t().contiguous().t()}),
    ("cache_lens is int32, expected int64", lambda kw: {"cache_lens": kw["cache_lens"].int()}),
    ("max_splits 0 out of range 1..1024", lambda kw: {"max_splits": 0}),
    ("workspace has 4752 elements, needs at least 6336", lambda kw: {"max_splits": 4}),  # sized for 3
    ("workspace is float16, expected float32", lambda kw: {"workspace": kw["workspace"].half()}),
    ("workspace must start at a 16-byte aligned address", lambda kw: {"workspace": _offset(kw["workspace"])}),
]


@pytest.mark.parametrize("match,change", DECODE_REJECTS, ids=[m for m, _ in DECODE_REJECTS])
def test_decode_attention_rejects_what_the_kernel_cannot_take(match, change):
    kw = _decode_kwargs()
    reaches_launch(lambda: ext.decode_attention(**kw))
    reaches_launch(lambda: ext.decode_attention(**{**kw, "gate": torch.empty_like(kw["q"])}))
    rejects_change("decode_attention", kw, change, "decode_attention: " + match)


# ------------------------------------------------------------------------ attention: norm + rotary


@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=str)
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "no-norm"])
@pytest.mark.parametrize("dim,rotary", [(256, 64), (256, 256), (128, 128), (128, 32), (64, 64), (64, 16)])
@pytest.mark.parametrize("strided", [True, False])
def test_norm_rotary_reaches_launch(kernels_on_cpu, dtype, norm, dim, rotary, strided):
    batch, tokens, heads = 2, 5, 3
    x = torch.randn(batch, tokens, heads, 2 * dim if strided else dim).to(dtype)[..., :dim]  # [query | gate] split
    weight = torch.randn(dim).to(dtype) if norm else None
    cos, sin = torch.randn(batch, tokens, rotary).to(dtype), torch.randn(batch, tokens, rotary).to(dtype)
    reaches_launch(lambda: norm_rotary(x, cos, sin, weight, 1e-6, True))


def test_norm_rotary_reads_merged_projection_in_place(kernels_on_cpu):
    """k as the attention layer slices it, the tables as the rotary embedding makes them."""
    merged = _bf16(2, 4, 1024 + 2 * 2 * 256)
    k = merged[..., 1024:1024 + 512].view(2, 4, 2, 256)
    cos, sin = _tables(64, torch.tensor([3, 900]), 4, BF16)
    reaches_launch(lambda: norm_rotary(k, cos, sin, _bf16(256), 1e-6, True))


def _rotary_kwargs(dim: int = 128, rotary: int = 32) -> dict:
    x = _bf16(2, 5, 3, 2 * dim)[..., :dim]
    return dict(out=torch.empty(x.shape, dtype=BF16), x=x, weight=_bf16(dim), cos=_bf16(2, 5, rotary),
                sin=_bf16(2, 5, rotary), eps=1e-6, zero_centered=True, stream=0)


ROTARY_REJECTS: list[tuple[str, Changes]] = [
    ("x needs a contiguous last axis", lambda kw: {"x": kw["x"].transpose(2, 3).contiguous().transpose(2, 3)}),
    ("x is int64, expected a float dtype", lambda kw: {"x": kw["x"].long()}),
    ("head_dim 96 must be 64, 128 or 256", lambda kw: {"x": _bf16(2, 5, 3, 96)}),
    (r"x has shape \(2, 0, 3, 128\): no head vectors", lambda kw: {"x": kw["x"][:, :0]}),
    (r"x has 1073741825 tokens, past the kernel's 2\^30",
     lambda kw: dict(x=_meta(1, 2**30 + 1, 3, 128), out=_meta(1, 2**30 + 1, 3, 128), cos=_meta(1, 2**30 + 1, 32),
                     sin=_meta(1, 2**30 + 1, 32))),
    (r"x has 1048577 heads, past the kernel's 2\^20",
     lambda kw: dict(x=_meta(2, 5, 2**20 + 1, 128), out=_meta(2, 5, 2**20 + 1, 128))),
    (r"cos has shape \(1, 5, 32\), expected \(2, 5, \*\)", lambda kw: {"cos": kw["cos"][:1]}),
    ("cos is float16, expected bfloat16", lambda kw: {"cos": kw["cos"].half()}),
    (r"sin has shape \(2, 5, 16\), cos \(2, 5, 32\)", lambda kw: {"sin": kw["sin"][..., :16]}),
    ("sin and cos need the same strides", lambda kw: {"sin": _bf16(2, 5, 64)[..., :32]}),
    ("rotary_dim 20 must be even, at most 128, its half a multiple of 4", lambda kw: {"cos": _bf16(2, 5, 20),
                                                                                        "sin": _bf16(2, 5, 20)}),
    ("rotary_dim 256 must be even, at most 128", lambda kw: {"cos": _bf16(2, 5, 256), "sin": _bf16(2, 5, 256)}),
    ("out must be contiguous", lambda kw: {"out": _bf16(2, 5, 3, 256)[..., :128]}),
    (r"out has shape \(2, 5, 2, 128\)", lambda kw: {"out": kw["out"][:, :, :2]}),
    (r"weight has shape \(64,\), expected \(128,\)", lambda kw: {"weight": kw["weight"][:64]}),
    ("weight is float32, expected bfloat16", lambda kw: {"weight": kw["weight"].float()}),
]


@pytest.mark.parametrize("match,change", ROTARY_REJECTS, ids=[m for m, _ in ROTARY_REJECTS])
def test_norm_rotary_rejects_what_the_kernel_cannot_take(match, change):
    kw = _rotary_kwargs()
    reaches_launch(lambda: ext.norm_rotary(**kw))
    reaches_launch(lambda: ext.norm_rotary(**{**kw, "weight": None}))
    rejects_change("norm_rotary", kw, change, "norm_rotary: " + match)


# ------------------------------------------------------------------------ attention: decode prologue


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [BF16, F16], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
@pytest.mark.parametrize("batch,tokens", [(1, 1), (2, 4), (8, 1), (8, 4)])
def test_prologue_reaches_launch(kernels_on_cpu, batch, tokens, layout, dtype, kind):
    """q / k / v read in place from the merged projection, as the layer's decode step has them."""
    g = torch.Generator().manual_seed(batch * 10 + tokens)
    q, _, k, v = _projection(layout, batch, tokens, dtype, "cpu", g)
    q_weight, k_weight = _weights(layout, dtype, "cpu", g)
    paged = _paged(batch, tokens, layout.kv_heads, layout.dim, kind, dtype, "cpu", g)
    cos, sin = _tables(layout.rotary, paged.cache_lens, tokens, dtype)
    slots = paged.meta(tokens).slot_mapping
    reaches_launch(lambda: attention_ops.norm_rotary_write_kv(q, k, v, cos, sin, paged.kv, slots, q_weight, k_weight,
                                                              1e-6, layout.zero_centered))


def _prologue_kwargs(kind: str | None = "fp8") -> dict:
    """Valid norm_rotary_write_kv arguments: q [2, 3, 4, 64] and k, v [2, 3, 2, 64] slices of one projection."""
    q, k, v = _bf16(2, 3, 8 * 64).split([4 * 64, 2 * 64, 2 * 64], dim=-1)
    return dict(q_out=_bf16(2, 3, 4, 64), q=q.view(2, 3, 4, 64), k=k.view(2, 3, 2, 64), v=v.view(2, 3, 2, 64),
                q_weight=_bf16(64), k_weight=None, cos=_bf16(2, 3, 32), sin=_bf16(2, 3, 32), **_cache(kind),
                slot_mapping=torch.arange(6).view(2, 3), eps=1e-6, zero_centered=False, stream=0)


PROLOGUE_REJECTS: list[tuple[str, Changes]] = [
    ("q is float32, expected float16 or bfloat16", lambda kw: {"q": kw["q"].float()}),
    ("q needs a contiguous last axis", lambda kw: {"q": kw["q"].transpose(2, 3).contiguous().transpose(2, 3)}),
    (r"k has shape \(2, 3, 2, 32\), expected \(2, 3, \*, 64\)", lambda kw: {"k": kw["k"][..., :32]}),
    ("k is float16, expected bfloat16", lambda kw: {"k": kw["k"].half(), "v": kw["v"].half()}),
    ("k needs a contiguous last axis", lambda kw: {"k": kw["k"].transpose(2, 3).contiguous().transpose(2, 3)}),
    (r"v has shape \(2, 3, 1, 64\), k \(2, 3, 2, 64\)", lambda kw: {"v": kw["v"][:, :, :1]}),
    ("k has no kv heads", lambda kw: {"k": kw["k"][:, :, :0], "v": kw["v"][:, :, :0]}),
    (r"q and k have 1048576 \+ 2 heads, past the kernel's 2\^20",
     lambda kw: dict(q=_meta(2, 3, 2**20, 64), q_out=_meta(2, 3, 2**20, 64))),
    (r"q has 1073741825 tokens, past the kernel's 2\^30",
     lambda kw: dict(q=_meta(1, 2**30 + 1, 4, 64), q_out=_meta(1, 2**30 + 1, 4, 64), k=_meta(1, 2**30 + 1, 2, 64),
                     v=_meta(1, 2**30 + 1, 2, 64), cos=_meta(1, 2**30 + 1, 32), sin=_meta(1, 2**30 + 1, 32),
                     slot_mapping=_meta(1, 2**30 + 1, dtype=torch.long))),
    ("rotary_dim 14 must be even", lambda kw: {"cos": _bf16(2, 3, 14), "sin": _bf16(2, 3, 14)}),
    ("q_out must be contiguous", lambda kw: {"q_out": _bf16(2, 3, 4, 128)[..., :64]}),
    ("k_weight is float16, expected bfloat16", lambda kw: {"k_weight": kw["q_weight"].half()}),
    (r"q_weight has shape \(1, 64\)", lambda kw: {"q_weight": kw["q_weight"][None]}),
    (r"k_cache has shape \(6, 16, 4, 64\), expected \(\*, \*, 2, 64\)", lambda kw: _cache("fp8", kv_heads=4)),
    ("fp8 / int8 caches need k_scale and v_scale", lambda kw: {"v_scale": None}),
    (r"slot_mapping has shape \(6,\), expected \(2, 3\)", lambda kw: {"slot_mapping": kw["slot_mapping"].view(6)}),
    ("slot_mapping must be contiguous", lambda kw: {"slot_mapping": torch.arange(6).view(3, 2).t()}),
]


@pytest.mark.parametrize("match,change", PROLOGUE_REJECTS, ids=[m for m, _ in PROLOGUE_REJECTS])
def test_prologue_rejects_what_the_kernel_cannot_take(match, change):
    kw = _prologue_kwargs()
    reaches_launch(lambda: ext.norm_rotary_write_kv(**kw))
    reaches_launch(lambda: ext.norm_rotary_write_kv(**{**kw, **_cache(None), "k_weight": kw["q_weight"]}))
    rejects_change("norm_rotary_write_kv", kw, change, "norm_rotary_write_kv: " + match)


# ------------------------------------------------------------------------ sampling


FILTERS = {"greedy": SamplingParams(temperature=0), "plain": SamplingParams(), "top_k": SamplingParams(top_k=5),
           "top_p": SamplingParams(top_p=0.7), "min_p": SamplingParams(min_p=0.1),
           "all": SamplingParams(temperature=0.6, top_k=20, top_p=0.95, min_p=0.05)}


@pytest.mark.parametrize("candidates", [sampling_ops.CANDIDATES, 0])
@pytest.mark.parametrize("vocab", [1, 50, 4099, 151936])
@pytest.mark.parametrize("rows", [list(FILTERS), ["greedy"], ["top_p"], ["top_k", "min_p"]], ids="+".join)
def test_sampling_reaches_launch(kernels_on_cpu, monkeypatch, rows, vocab, candidates):
    monkeypatch.setattr(sampling_ops, "CANDIDATES", candidates)
    logits = torch.randn(len(rows), vocab)
    params = row_params([FILTERS[name] for name in rows])
    u = torch.rand(len(rows), dtype=torch.float64)
    reaches_launch(lambda: sampling_ops.sample(logits, *params, u))
    reaches_launch(lambda: sampling_ops.sample(logits, *params, u, out=torch.empty(len(rows), dtype=torch.long)))
    reaches_launch(lambda: sampling_ops.filtered_probs(logits, *params))
    reaches_launch(lambda: sampling_ops.kept_threshold(logits, *params))


def _sampling_kwargs(rows: int = 4, vocab: int = 100) -> dict:
    return dict(tokens=torch.empty(rows, dtype=torch.long), probs=torch.empty(rows, vocab),
                threshold=torch.empty(rows), logits=torch.randn(rows, vocab),
                columns=torch.tensor([[1.0] * rows, [0.0] * rows, [1.0] * rows, [0.0] * rows], dtype=torch.float64),
                uniform=torch.rand(rows, dtype=torch.float64), segments=torch.empty(rows * 1024, dtype=torch.long),
                max_candidates=4096, stream=0)


SAMPLING_REJECTS: list[tuple[str, Changes]] = [
    ("logits is bfloat16, expected float32", lambda kw: {"logits": kw["logits"].to(BF16)}),
    ("logits must be contiguous", lambda kw: {"logits": torch.randn(100, 4).t()}),
    (r"logits has shape \(4, 0\), out of the kernel's range", lambda kw: {"logits": kw["logits"][:, :0]}),
    (r"logits has shape \(400,\), expected \(\*, \*\)", lambda kw: {"logits": kw["logits"].view(-1)}),
    ("columns is float32, expected float64", lambda kw: {"columns": kw["columns"].float()}),
    (r"columns has shape \(4, 3\), expected \(4, 4\)", lambda kw: {"columns": kw["columns"][:, :3]}),
    (r"columns has shape \(3, 4\), expected \(4, 4\)", lambda kw: {"columns": kw["columns"][:3]}),
    ("columns must be contiguous", lambda kw: {"columns": kw["columns"].t().contiguous().t()}),
    ("uniform is float32, expected float64", lambda kw: {"uniform": kw["uniform"].float()}),
    (r"uniform has shape \(5,\), expected \(4,\)", lambda kw: {"uniform": torch.rand(5, dtype=torch.float64)}),
    ("tokens needs uniform", lambda kw: {"uniform": None}),
    ("tokens is int32, expected int64", lambda kw: {"tokens": kw["tokens"].int()}),
    (r"probs has shape \(4, 99\), expected \(4, 100\)", lambda kw: {"probs": kw["probs"][:, :99]}),
    ("probs must be contiguous", lambda kw: {"probs": torch.empty(100, 4).t()}),
    ("threshold is float16, expected float32", lambda kw: {"threshold": kw["threshold"].half()}),
    ("max_candidates 4097 out of range 0..4096", lambda kw: {"max_candidates": 4097}),
    ("probs overlaps logits", lambda kw: {"probs": kw["logits"]}),
    ("segments has 4095 elements, needs at least 4096", lambda kw: {"segments": kw["segments"][1:]}),
    ("segments is int32, expected int64", lambda kw: {"segments": kw["segments"].int()}),
    (r"segments has shape \(4, 1024\), expected \(\*,\)", lambda kw: {"segments": kw["segments"].view(4, -1)}),
    ("segments overlaps logits", lambda kw: {"logits": kw["segments"][-200:].view(torch.float32).view(4, 100)}),
    ("segments overlaps probs", lambda kw: {"probs": kw["segments"][:200].view(torch.float32).view(4, 100)}),
    ("segments overlaps tokens", lambda kw: {"tokens": kw["segments"][:4]}),
]


@pytest.mark.parametrize("match,change", SAMPLING_REJECTS, ids=[m for m, _ in SAMPLING_REJECTS])
def test_sample_rows_rejects_what_the_kernel_cannot_take(match, change):
    kw = _sampling_kwargs()
    reaches_launch(lambda: ext.sample_rows(**kw))
    reaches_launch(lambda: ext.sample_rows(**{**kw, "tokens": None, "uniform": None, "threshold": None}))
    rejects_change("sample_rows", kw, change, "sample_rows: " + match)


def _penalise_kwargs(rows: int = 3, vocab: int = 100, slots: int = 5) -> dict:
    return dict(out=torch.empty(rows, vocab), logits=torch.randn(rows, vocab),
                seen=torch.zeros(slots, vocab, dtype=torch.bool), counts=torch.zeros(slots, vocab, dtype=torch.int),
                rows=torch.tensor([4, 0, 2]), repetition=torch.ones(rows), presence=torch.zeros(rows),
                frequency=torch.zeros(rows), stream=0)


PENALISE_REJECTS: list[tuple[str, Changes]] = [
    ("logits is bfloat16, expected float32", lambda kw: {"logits": kw["logits"].to(BF16)}),
    (r"logits has shape \(0, 100\), out of the kernel's range", lambda kw: {"logits": kw["logits"][:0]}),
    (r"out has shape \(3, 99\), logits \(3, 100\): they must match",
     lambda kw: {"out": kw["out"][:, :99].contiguous()}),
    ("seen is uint8, expected bool", lambda kw: {"seen": kw["seen"].to(torch.uint8)}),
    (r"counts has shape \(4, 100\), expected \(5, 100\)", lambda kw: {"counts": kw["counts"][:4]}),
    ("counts is int64, expected int32", lambda kw: {"counts": kw["counts"].long()}),
    ("without rows, seen / counts need 3 rows, got 5", lambda kw: {"rows": None}),
    ("rows is int32, expected int64", lambda kw: {"rows": kw["rows"].int()}),
    (r"presence has shape \(2,\), expected \(3,\)", lambda kw: {"presence": kw["presence"][:2]}),
    ("frequency is float64, expected float32", lambda kw: {"frequency": kw["frequency"].double()}),
]


@pytest.mark.parametrize("match,change", PENALISE_REJECTS, ids=[m for m, _ in PENALISE_REJECTS])
def test_penalise_rejects_what_the_kernel_cannot_take(match, change):
    kw = _penalise_kwargs()
    reaches_launch(lambda: ext.penalise(**kw))
    reaches_launch(lambda: ext.penalise(**{**kw, "rows": None, "seen": kw["seen"][:3], "counts": kw["counts"][:3]}))
    rejects_change("penalise", kw, change, "penalise: " + match)


def _record_kwargs(slots: int = 5, vocab: int = 100) -> dict:
    return dict(seen=torch.zeros(slots, vocab, dtype=torch.bool), counts=torch.zeros(slots, vocab, dtype=torch.int),
                rows=torch.tensor([4, 0, 2]), ids=torch.tensor([7, -1, 99]), stream=0)


RECORD_REJECTS: list[tuple[str, Changes]] = [
    ("seen is uint8, expected bool", lambda kw: {"seen": kw["seen"].to(torch.uint8)}),
    (r"seen has shape \(500,\), expected \(\*, \*\)", lambda kw: {"seen": kw["seen"].view(-1)}),
    (r"counts has shape \(5, 99\), expected \(5, 100\)", lambda kw: {"counts": kw["counts"][:, :99].contiguous()}),
    ("counts is int64, expected int32", lambda kw: {"counts": kw["counts"].long()}),
    ("counts must be contiguous", lambda kw: {"counts": torch.zeros(100, 5, dtype=torch.int).t()}),
    ("counts overlaps seen", lambda kw: {"seen": kw["counts"].view(-1).view(torch.bool)[:500].view(5, 100)}),
    ("rows is int32, expected int64", lambda kw: {"rows": kw["rows"].int()}),
    (r"ids has shape \(2,\), expected \(3,\)", lambda kw: {"ids": kw["ids"][:2]}),
    ("ids must be contiguous", lambda kw: {"ids": torch.tensor([7, 0, -1, 0, 99, 0])[::2]}),
]


@pytest.mark.parametrize("match,change", RECORD_REJECTS, ids=[m for m, _ in RECORD_REJECTS])
def test_record_tokens_rejects_what_the_kernel_cannot_take(match, change):
    kw = _record_kwargs()
    reaches_launch(lambda: ext.record_tokens(**kw))
    reaches_launch(lambda: ext.record_tokens(**{**kw, "rows": kw["rows"][:0], "ids": kw["ids"][:0]}))
    rejects_change("record_tokens", kw, change, "record_tokens: " + match)


def _judge_kwargs(batch: int = 2, width: int = 3, vocab: int = 50) -> dict:
    return dict(out=torch.empty(2 * batch, dtype=torch.long), p=torch.rand(8, vocab), q=torch.rand(5, vocab),
                drafts=torch.zeros(batch, width, dtype=torch.long), u=torch.rand(batch, width + 1, dtype=torch.float64),
                meta=torch.tensor([[3, 0, 0], [2, 4, -1]]), finite=torch.ones(8, dtype=torch.bool),
                sums=torch.empty(2 * batch * 1024, dtype=torch.long), stream=0)


JUDGE_REJECTS: list[tuple[str, Changes]] = [
    ("p is bfloat16, expected float32", lambda kw: {"p": kw["p"].to(BF16)}),
    (r"q has shape \(5, 49\), expected \(\*, 50\)", lambda kw: {"q": kw["q"][:, :49].contiguous()}),
    ("drafts is int32, expected int64", lambda kw: {"drafts": kw["drafts"].int()}),
    ("drafts has 33 columns, at most 32", lambda kw: {"drafts": torch.zeros(2, 33, dtype=torch.long),
                                                      "u": torch.rand(2, 34, dtype=torch.float64)}),
    (r"u has shape \(2, 3\), expected \(2, 4\)", lambda kw: {"u": kw["u"][:, :3].contiguous()}),
    ("u is float32, expected float64", lambda kw: {"u": kw["u"].float()}),
    (r"meta has shape \(2, 2\), expected \(2, 3\)", lambda kw: {"meta": kw["meta"][:, :2].contiguous()}),
    (r"finite has shape \(7,\), expected \(8,\)", lambda kw: {"finite": kw["finite"][:7]}),
    (r"out has shape \(3,\), expected \(4,\)", lambda kw: {"out": kw["out"][:3]}),
    ("sums has 4095 elements, needs at least 4096", lambda kw: {"sums": kw["sums"][1:]}),
    ("sums overlaps out", lambda kw: {"out": kw["sums"][:4]}),
]


@pytest.mark.parametrize("match,change", JUDGE_REJECTS, ids=[m for m, _ in JUDGE_REJECTS])
def test_judge_rows_rejects_what_the_kernel_cannot_take(match, change):
    kw = _judge_kwargs()
    reaches_launch(lambda: ext.judge_rows(**kw))
    reaches_launch(lambda: ext.judge_rows(**{**kw, "q": None, "finite": None}))
    rejects_change("judge_rows", kw, change, "judge_rows: " + match)

"""KV cache dtypes (native / fp8 / int8), the KV write, decode and prefill attention.

CPU tests check the torch references against an independent float64 formulation (einsum
softmax per sequence) on caches with shuffled pages, the quantization error bounds, and the
layer's decode / prefill paths against each other. `cuda` tests check the kernels (write_kv,
split-K decode_attention) against the references and float64 on fresh random inputs with
poisoned outputs and workspaces, mixed context lengths in one batch, and CUDA graph replay as
the context grows; they need ninfer_core._C built. The Triton chunk kernel (chunk_attention) is
checked against float64 compiled on a GPU and in Triton's interpreter on the CPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from ninfer_core.cache import CacheManager, KVPool
from ninfer_core.cache.kv_pool import KVLayer, kv_bytes_per_token, resolve_kv_dtype
from ninfer_core.config import ModelConfig
from ninfer_core.engine.graph_capture import capture
from ninfer_core.errors import NinferError
from ninfer_core.layers.attention import Attention, AttentionMetadata
from ninfer_core.ops import dispatch
from ninfer_core.ops.attention import (
    attention_ref,
    chunk_attention,
    chunk_tiles,
    decode_attention,
    dequantize_kv,
    prefill_attention,
    quantize_kv,
    write_kv,
    write_kv_ref,
)

KINDS = [None, "fp8", "int8"]  # None: the model dtype
PAGE = 16


# ------------------------------------------------------------------------------------ helpers


def _randn(shape, generator, dtype, device, scale=1.0):
    return (torch.randn(shape, generator=generator) * scale).to(dtype).to(device)


class Case:
    """A paged cache with shuffled pages holding `lens[b] + num_new` tokens of each sequence (the
    new tokens' k/v already written, as the layer does before attending). Each sequence owns
    `extra_width` spare pages past its last one; every cache row starts out as unrelated data,
    so a kernel reading past a sequence's length gets a wrong answer."""

    def __init__(self, lens, num_new, heads, kv_heads, dim, kind, dtype, device, seed=0, extra_width=3):
        g = torch.Generator().manual_seed(seed)
        self.lens = lens
        self.num_new = num_new
        width = max(math.ceil((n + num_new) / PAGE) for n in lens) + extra_width
        num_pages = len(lens) * width + 5
        self.pool = KVPool([0], num_pages, PAGE, kv_heads, dim, dtype, device, kv_dtype=kind)
        self.kv = self.pool.layer(0)
        rows = num_pages * PAGE
        everywhere = torch.arange(rows, device=device)[None]
        write_kv_ref(self.kv, _randn((1, rows, kv_heads, dim), g, dtype, device),
                     _randn((1, rows, kv_heads, dim), g, dtype, device), everywhere)
        perm = torch.randperm(num_pages, generator=g)[: len(lens) * width]
        self.table = perm.view(len(lens), width).to(torch.int32).to(device)
        self.cache_lens = torch.tensor(lens, dtype=torch.int64, device=device)
        self.q = _randn((len(lens), num_new, heads, dim), g, dtype, device)
        self.scale = dim**-0.5
        self.generator = g
        for b, n in enumerate(lens):  # history 0 .. lens[b] - 1 and the new tokens
            self.write_tokens(b, n + num_new)

    def write_tokens(self, b: int, count: int) -> None:
        """Fresh k (std 2) and v (std 1) for cache indices 0 .. count - 1 of sequence b."""
        kv_heads, dim = self.kv.k.shape[2:]
        device, dtype = self.q.device, self.q.dtype
        index = torch.arange(count, device=device)
        slots = (self.table[b].long()[index // PAGE] * PAGE + index % PAGE)[None]
        write_kv_ref(self.kv, _randn((1, count, kv_heads, dim), self.generator, dtype, device, 2.0),
                     _randn((1, count, kv_heads, dim), self.generator, dtype, device), slots)

    def expected(self) -> torch.Tensor:
        return attention_f64(self.q, self.kv, self.table, self.cache_lens, self.scale)


def _pages(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8)[pages].view(cache.dtype) if cache.element_size() == 1 else cache[pages]


def attention_f64(q, kv: KVLayer, table, cache_lens, scale) -> torch.Tensor:
    """float64 attention, one sequence at a time, over the cache as the ops read it (dequantized
    to q's dtype): einsum + masked softmax, independent of the SDPA the references use."""
    batch, num_new, heads, _ = q.shape
    group = heads // kv.k.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for b in range(batch):
        length = int(cache_lens[b]) + num_new
        pages = table[b, : math.ceil(length / kv.page_size)].long()
        k, v = (
            (_pages(c, pages) if s is None else dequantize_kv(_pages(c, pages), s[pages], q.dtype)).to(q.dtype)
            .flatten(0, 1)[:length].double().repeat_interleave(group, dim=1)
            for c, s in ((kv.k, kv.k_scale), (kv.v, kv.v_scale))
        )
        scores = torch.einsum("thd,lhd->htl", q[b].double(), k) * scale
        query_pos = int(cache_lens[b]) + torch.arange(num_new, device=q.device)
        visible = torch.arange(length, device=q.device)[None, :] <= query_pos[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[b] = torch.einsum("htl,lhd->thd", probs, v)
    return out


def _close(actual, expected, tol):
    torch.testing.assert_close(actual.double(), expected.double(), rtol=tol, atol=tol)


def _rel_l2(actual, expected) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


# -------------------------------------------------------------------------- CPU: storage


def test_kv_dtype_names_and_bytes():
    assert resolve_kv_dtype(None, torch.bfloat16) == torch.bfloat16
    assert resolve_kv_dtype("auto", torch.float16) == torch.float16
    assert resolve_kv_dtype("bf16", torch.float32) == torch.bfloat16
    assert resolve_kv_dtype("fp8", torch.bfloat16) == "fp8"
    with pytest.raises(NinferError, match="unknown KV dtype"):
        resolve_kv_dtype("fp4", torch.bfloat16)
    layers, heads, dim = [3, 7], 2, 8
    for kind, name, per_token in [
        (None, "bf16", 2 * 2 * heads * dim * 2),
        ("fp8", "fp8", 2 * 2 * heads * (dim + 4)),
        ("int8", "int8", 2 * 2 * heads * (dim + 4)),
    ]:
        pool = KVPool(layers, 5, 4, heads, dim, torch.bfloat16, "cpu", kv_dtype=kind)
        assert pool.dtype_name == name and pool.bytes_per_token == per_token
        assert pool.nbytes == per_token * 5 * 4
        layer = pool.layer(7)
        assert layer.k.shape == (5, 4, heads, dim) and layer.quantized == (kind is not None)
        if kind is not None:
            assert layer.k.dtype == {"fp8": torch.float8_e4m3fn, "int8": torch.int8}[kind]
            assert layer.k_scale.shape == (5, 4, heads) and layer.k_scale.dtype == torch.float32
    config = ModelConfig(arch="qwen3", vocab_size=8, hidden_size=8, num_layers=3,
                         layer_types=["full_attention"] * 3, num_heads=4, num_kv_heads=2, head_dim=8)
    assert kv_bytes_per_token(config, "int8", torch.bfloat16) == 3 * 2 * 2 * (8 + 4)
    manager = CacheManager(config, max_tokens=32, max_seqs=1, page_size=4, dtype=torch.float32, kv_dtype="fp8")
    assert manager.cache.kv.dtype_name == "fp8" and manager.kv_bytes == 32 * 3 * 2 * 2 * (8 + 4)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
def test_quantize_error_bounds(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 3, 128, generator=g) * torch.logspace(-3, 2, 64)[:, None, None]
    x[5, 1] = 0.0  # an all-zero vector: scale 1, zeros back
    values, scale = quantize_kv(x, dtype)
    assert values.dtype == dtype and scale.shape == (64, 3) and scale[5, 1] == 1.0
    back = dequantize_kv(values, scale, torch.float64)
    amax = x.abs().amax(-1, keepdim=True).double()
    err = (back - x.double()).abs()
    if dtype == torch.int8:  # uniform grid of step amax / 127: half a step
        assert (err <= amax / 127 * 0.5 * (1 + 1e-5)).all()
    else:  # 3 mantissa bits: 2^-4 relative, half the smallest subnormal (2^-10 * scale) absolute
        bound = x.double().abs() * 2**-4 + amax / 448 * 2**-10
        assert (err <= bound * (1 + 1e-5)).all()
    assert torch.equal(back[5, 1], torch.zeros(128, dtype=torch.float64))
    assert (back.abs().amax(-1) - amax[..., 0]).abs().max() <= 1e-6 * amax.max()  # absmax kept exactly


@pytest.mark.parametrize("kind", KINDS)
def test_write_kv_ref_round_trip_through_shuffled_pages(kind):
    g = torch.Generator().manual_seed(2)
    pool = KVPool([0], 12, 4, 2, 16, torch.float32, "cpu", kv_dtype=kind)
    kv = pool.layer(0)
    k, v = torch.randn(2, 5, 2, 16, generator=g), torch.randn(2, 5, 2, 16, generator=g)
    table = torch.tensor([[7, 2], [0, 11]])
    lens = torch.tensor([1, 3])
    meta = AttentionMetadata.build(table, lens, 5, 4, 12)
    write_kv(kv, k, v, meta.slot_mapping)  # CPU: the reference
    for b in range(2):
        index = lens[b] + torch.arange(5)
        pages, rows = table[b][index // 4], index % 4
        for cache, scales, x in ((kv.k, kv.k_scale, k), (kv.v, kv.v_scale, v)):
            stored = cache[pages, rows]
            if kind is None:
                assert torch.equal(stored, x[b])
            else:
                back = dequantize_kv(stored, scales[pages, rows], torch.float32)
                torch.testing.assert_close(back, x[b], rtol=0.07, atol=0.02)
                expected_values, expected_scale = quantize_kv(x[b], cache.dtype)
                assert torch.equal(stored.view(torch.uint8), expected_values.view(torch.uint8))
                assert torch.equal(scales[pages, rows], expected_scale)
    untouched = torch.ones(12, 4, dtype=torch.bool)
    for b in range(2):
        index = lens[b] + torch.arange(5)
        untouched[table[b][index // 4], index % 4] = False
    assert (kv.k[untouched].float() == 0).all()


# ------------------------------------------------------------------------ CPU: references


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_new", [1, 5])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (3, 3)])
def test_attention_ref_matches_float64(kind, num_new, heads, kv_heads):
    case = Case([0, 9, 40], num_new, heads, kv_heads, 32, kind, torch.float32, "cpu")
    out = attention_ref(case.q, case.kv, case.table, case.cache_lens, case.scale)
    _close(out, case.expected(), 1e-5)
    # On the CPU decode_attention is the CPU kernel where it applies (fp32 cache), else the reference.
    _close(decode_attention(case.q, case.kv, case.table, case.cache_lens, case.scale), case.expected(), 1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_attention_matches_float64(kind):
    case = Case([0, 7, 50], 40, 8, 2, 32, kind, torch.float32, "cpu", seed=3)
    expected = case.expected()
    _close(prefill_attention(case.q, case.kv, case.table, case.cache_lens, case.scale), expected, 1e-5)
    _close(attention_ref(case.q, case.kv, case.table, case.cache_lens, case.scale), expected, 1e-5)


@pytest.mark.parametrize("kind,tol", [("fp8", 0.08), ("int8", 0.02)])
def test_quantized_attention_stays_close_to_exact_kv(kind, tol):
    """Relative L2 error of attention over a quantized cache vs the unquantized tokens (measured:
    ~4.5% fp8 e4m3, ~1.1% int8 at scores of std 2)."""
    exact = Case([30, 200], 4, 8, 2, 64, None, torch.float32, "cpu", seed=4)
    quant = Case([30, 200], 4, 8, 2, 64, kind, torch.float32, "cpu", seed=4)  # same tokens, quantized
    reference = attention_f64(exact.q, exact.kv, exact.table, exact.cache_lens, exact.scale)
    out = attention_ref(quant.q, quant.kv, quant.table, quant.cache_lens, quant.scale).double()
    assert (out - reference).norm() / reference.norm() < tol


def test_layer_prefill_and_decode_paths_agree():
    """One 40-token prefill chunk (prefill_attention) == 40 single-token decode steps
    (decode_attention): same cache contents and same outputs."""
    torch.manual_seed(5)
    config = ModelConfig(arch="qwen3", vocab_size=8, hidden_size=64, num_layers=1, layer_types=["full_attention"],
                         num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True)
    attn = Attention(config).eval()
    x = torch.randn(1, 40, 64)
    cos, sin = torch.ones(1, 40, 16), torch.zeros(1, 40, 16)  # identity rotary: positions do not matter here
    table = torch.tensor([[3, 0, 5]])
    outs = []
    for steps in ([40], [1] * 40):
        pool = KVPool([0], 6, PAGE, 2, 16, torch.float32, "cpu")
        chunks, start = [], 0
        with torch.no_grad():
            for n in steps:
                meta = AttentionMetadata.build(table, torch.tensor([start]), n, PAGE, 6)
                chunks.append(attn(x[:, start:start + n], cos[:, start:start + n], sin[:, start:start + n],
                                   pool.layer(0), meta))
                start += n
        outs.append((torch.cat(chunks, 1), pool.k[0].clone()))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[0][1], outs[1][1])


# ------------------------------------------------------------------------------ CUDA kernels

cuda = pytest.mark.cuda
LENS = {"one_long": [5000], "three": [0, 17, 1000], "eight": [1, 15, 16, 17, 1000, 5000, 0, 63]}
TOL = 2e-2  # bf16 / fp16 output, probabilities rounded to 16 bits for the tensor cores
REF_L2 = 1e-2  # relative L2 error bound of 16-bit SDPA (the reference)


def _need_kernels():
    if not dispatch.kernels_available():
        pytest.skip("ninfer_core._C not built")


def _poison_workspace(case: Case) -> None:
    """Leave a NaN block of exactly the workspace's size in the caching allocator, so a
    workspace entry the kernels read without writing shows up as NaN in the output."""
    batch, num_new, heads, dim = case.q.shape
    kv_heads = case.kv.k.shape[2]
    splits = dispatch.extension().decode_attention_max_splits(
        batch=batch, num_new=num_new, num_heads=heads, kv_heads=kv_heads, head_dim=dim, page_size=PAGE,
        table_width=case.table.shape[1], num_sms=torch.cuda.get_device_properties(case.q.device).multi_processor_count,
    )
    numel = batch * kv_heads * splits * num_new * (heads // kv_heads) * (dim + 2)
    poison = torch.full((numel,), float("nan"), device=case.q.device)
    del poison


def _run_decode(case: Case) -> torch.Tensor:
    out = torch.full_like(case.q, float("nan"))
    _poison_workspace(case)
    result = decode_attention(case.q, case.kv, case.table, case.cache_lens, case.scale, out=out)
    assert result is out
    torch.cuda.synchronize()
    assert not out.isnan().any(), "some outputs were not written"
    return out


@cuda
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dim", [128, 256])
@pytest.mark.parametrize("heads,kv_heads", [(16, 2), (4, 4)])
@pytest.mark.parametrize("num_new", [1, 4, 16])
@pytest.mark.parametrize("lens", LENS.values(), ids=LENS.keys())
def test_decode_kernel_matches_reference(lens, num_new, heads, kv_heads, dim, kind):
    _need_kernels()
    case = Case(lens, num_new, heads, kv_heads, dim, kind, torch.bfloat16, "cuda", seed=len(lens) + num_new)
    out = _run_decode(case)
    expected = case.expected()
    _close(out, expected, TOL)
    # The reference's SDPA rounds the scores to bf16 (the kernel keeps them in fp32): compared in norm.
    ref = attention_ref(case.q, case.kv, case.table, case.cache_lens, case.scale)
    assert _rel_l2(ref, expected) < REF_L2 and _rel_l2(out, ref) < REF_L2


@cuda
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_new", [1, 2])
def test_decode_kernel_past_what_a_reduce_thread_holds(kind, num_new):
    """One kv head of one sequence over 10K keys: up to 264 splits (2 a SM), so the reduce kernel
    reads (m, l) past one a thread and O vectors past the 128 splits it holds in registers."""
    _need_kernels()
    case = Case([10000], num_new, 4, 1, 128, kind, torch.bfloat16, "cuda", seed=num_new)
    out = _run_decode(case)
    _close(out, case.expected(), TOL)


@cuda
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dim,heads,kv_heads,num_new", [(64, 6, 2, 4), (256, 32, 2, 16), (128, 32, 2, 16)])
def test_decode_kernel_fp16_other_shapes(dim, heads, kv_heads, num_new, kind):
    """fp16, head_dim 64, and GQA 16 x 16 tokens (256 query rows: several row chunks per kv head)."""
    _need_kernels()
    case = Case([3, 700, 2100], num_new, heads, kv_heads, dim, kind, torch.float16, "cuda", seed=dim)
    _close(_run_decode(case), case.expected(), TOL)


@cuda
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_new", [1, 4])
def test_decode_kernel_in_cuda_graph_as_context_grows(kind, num_new):
    """One capture at a fixed table width; replays after the contexts grew across split counts."""
    _need_kernels()
    case = Case([100, 5, 300], num_new, 16, 2, 256, kind, torch.bfloat16, "cuda", seed=7, extra_width=400)
    out = torch.full_like(case.q, float("nan"))
    call = lambda: decode_attention(case.q, case.kv, case.table, case.cache_lens, case.scale, out=out)
    graph, _ = capture(call)
    for grown in ([100, 5, 300], [101, 6, 301], [1500, 2000, 6000]):
        for b, n in enumerate(grown):
            case.write_tokens(b, n + num_new)
        case.cache_lens.copy_(torch.tensor(grown))
        case.q.copy_(_randn(case.q.shape, case.generator, torch.bfloat16, "cuda"))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not out.isnan().any()
        _close(out, case.expected(), TOL)


@cuda
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [64, 128, 256])
def test_write_kv_kernel_matches_reference(kind, dtype, dim):
    """Bit for bit: the same values (and scales) in the same rows, nothing else touched."""
    _need_kernels()
    g = torch.Generator().manual_seed(dim)
    pools = [KVPool([0], 40, PAGE, 2, dim, dtype, "cuda", kv_dtype=kind) for _ in range(2)]
    k = _randn((3, 7, 2, dim), g, dtype, "cuda", 3.0)
    v = _randn((3, 7, 2, dim), g, dtype, "cuda")
    k[1, 2, 0] = 0  # a zero vector: scale 1
    slots = torch.randperm(40 * PAGE, generator=g)[:21].view(3, 7).to("cuda")
    write_kv(pools[0].layer(0), k, v, slots)
    write_kv_ref(pools[1].layer(0), k, v, slots)
    torch.cuda.synchronize()
    ours, ref = pools[0].layer(0), pools[1].layer(0)
    for a, b in ((ours.k, ref.k), (ours.v, ref.v)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    if kind is not None:
        assert torch.equal(ours.k_scale, ref.k_scale) and torch.equal(ours.v_scale, ref.v_scale)
        flat = ours.k_scale.view(-1, 2)
        assert flat[slots[1, 2], 0] == 1.0


@cuda
@pytest.mark.parametrize("kind", KINDS)
def test_prefill_attention_matches_reference_on_gpu(kind):
    case = Case([0, 37, 700], 300, 16, 2, 256, kind, torch.bfloat16, "cuda", seed=9)
    out = prefill_attention(case.q, case.kv, case.table, case.cache_lens, case.scale)
    expected = case.expected()
    _close(out, expected, TOL)
    ref = attention_ref(case.q, case.kv, case.table, case.cache_lens, case.scale)
    assert _rel_l2(ref, expected) < REF_L2 and _rel_l2(out, ref) < REF_L2


# ------------------------------------------------------------- Triton chunk attention kernel


@pytest.fixture
def chunk_device():
    """cuda where a GPU is present (compiled kernels), else the CPU under Triton's interpreter."""
    dispatch.triton_kernels.cache_clear()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if dispatch.triton_kernels("chunk_attention_kernels") is None:
        pytest.skip("triton cannot run here")
    yield device
    dispatch.triton_kernels.cache_clear()


@pytest.mark.parametrize("lens,num_new,heads,kv_heads,dim", [
    ([0, 37, 700], 48, 16, 2, 256),  # the 35B's heads, mixed prefixes, one split per tile
    ([300], 20, 6, 1, 128),  # a group of 6 padded to 8, a partial last tile
    ([700], 8, 8, 1, 64),  # one program: the keys split across programs, then combined
    ([5, 90], 33, 4, 4, 64),  # no grouping
])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_chunk_kernel_matches_float64(chunk_device, lens, num_new, heads, kv_heads, dim, dtype):
    if dtype == torch.bfloat16 and chunk_device == "cpu":
        pytest.skip("Triton's interpreter misreads bf16 (numpy has none); compiled on a GPU it is tested")
    case = Case(lens, num_new, heads, kv_heads, dim, None, dtype, chunk_device, seed=num_new + dim)
    out = chunk_attention(case.q, case.kv, case.table, case.cache_lens, case.scale)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    _close(out, case.expected(), TOL)


@pytest.mark.parametrize("num_new", [24, 64])  # on the CPU: keys split, then one pass per tile
def test_chunk_kernel_takes_a_strided_query(chunk_device, num_new):
    """q as the gated layer has it before rotary, a view of [query | gate] per head: the output
    is still written where each query's row is."""
    case = Case([40], num_new, 8, 2, 64, None, torch.float16, chunk_device, seed=11)
    query_gate = torch.cat([case.q, torch.full_like(case.q, float("nan"))], dim=-1)
    view = query_gate[..., :64]
    assert not view.is_contiguous()
    _close(chunk_attention(view, case.kv, case.table, case.cache_lens, case.scale), case.expected(), TOL)


def test_chunk_kernel_splits_when_programs_are_few(chunk_device):
    """The split-and-combine path is taken (and right) for one tile of one kv head over a long
    prefix, and the single-pass path for many tiles: both against float64."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count if chunk_device == "cuda" else 4
    tiles = chunk_tiles(8, 64)
    for num_new in (tiles.block_t, tiles.block_t * 4 * sms):
        case = Case([1000], num_new, 8, 1, 64, None, torch.float16, chunk_device, seed=num_new)
        _close(chunk_attention(case.q, case.kv, case.table, case.cache_lens, case.scale), case.expected(), TOL)


def test_chunk_attention_without_triton_runs_rows_of_the_decode_path(monkeypatch):
    """Where no Triton kernel applies, the chunk runs as rows of 16 tokens (fp32 on the CPU here)."""
    monkeypatch.setattr(dispatch, "triton_kernels", lambda module: None)
    case = Case([3, 40], 32, 4, 2, 16, None, torch.float32, "cpu", seed=3)
    _close(chunk_attention(case.q, case.kv, case.table, case.cache_lens, case.scale), case.expected(), 1e-5)

"""Attention over the paged KV cache: the KV write, decode attention and prefill attention.

Cache layout (cache/kv_pool.py): k, v [num_pages, page_size, Hkv, D]; the token at cache index
i of sequence b lives in page block_table[b, i // page_size], row i % page_size. fp8 / int8
caches keep one fp32 scale per (token, kv head): stored = x / scale, scale = absmax(x) / qmax
(448 for e4m3, 127 for int8; 1 when x is all zeros), so a token is quantized once, on write.

Query t of sequence b (cache index cache_lens[b] + t, its own k/v already written) sees cache
indices 0 .. cache_lens[b] + t. `attention_ref` is the reference of both attention ops: masked
SDPA over the whole gathered (dequantized) block table.

  kv_slots           a forward's KV rows of its new tokens and the clamped int32 block table: one
                     CUDA kernel (csrc/step_tables.cu) for the torch expression's 11 launches
  write_kv           CUDA kernel: one warp per (token, kv head), quantizing with the warp's absmax;
                     on the CPU (csrc/cpu/decode_ops.h) row copies into a cache of k's dtype
  norm_rotary_write_kv  a decode step's prologue: `norm_rotary` of q and k, then `write_kv`, in
                     one CUDA kernel (csrc/rope.cu, write_kv's store) instead of three launches
  decode_attention   T <= 16 (decode, speculative verify): split-K CUDA kernel
                     (csrc/decode_attention.cu), reading 8-bit pages directly, with the layer's
                     output gate (`sigmoid_mul`) in its final write; on the CPU an fp32
                     online-softmax pass per (sequence, token, head) (csrc/cpu/decode_ops.h)
  chunk_attention    a prompt chunk with its lengths on the device (CUDA graphs): a Triton
                     tensor-core kernel, else rows of 16 tokens on decode_attention
  prefill_attention  longer chunks: per sequence, contiguous K/V + SDPA with a lower-right
                     causal bias (fused flash / memory-efficient backends on the GPU)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..cache.kv_pool import KVLayer
from . import dispatch
from .activation import sigmoid_mul
from .rope import norm_rotary, rotary_kernel_fits

DECODE_MAX_TOKENS = 16  # new tokens per sequence the decode kernel takes (speculative K + 1 <= 16)
QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}
# The CPU kernels' numbers for a KV cache's element type (csrc/cpu/decode_ops.h CacheType)
CACHE_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_HEAD_DIMS = (64, 128, 256)  # what the kernels are compiled for
_CHUNK_HEAD_DIMS = (32, 64, 128, 256)  # tl.dot needs >= 16; powers of two for the tiles
_LOG2E = 1.4426950408889634  # the chunk kernel's softmax runs in base 2


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (x / scale stored as `dtype`, scale [...] fp32), one scale per vector."""
    qmax = QMAX[dtype]
    xf = x.float()
    # times the fp32 reciprocal, as the kernel computes it (torch's GPU division by a Python scalar
    # multiplies by the reciprocal too; spelled out so every device agrees bit for bit)
    scale = xf.abs().amax(-1) * (1.0 / qmax)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    y = (xf / scale[..., None]).clamp(-qmax, qmax)
    return (y.round() if dtype == torch.int8 else y).to(dtype), scale


def dequantize_kv(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """round_dtype(stored * scale): what the decode kernel computes too, bit for bit."""
    return (values.float() * scale[..., None]).to(dtype)


def kv_slots_ref(block_table: torch.Tensor, cache_lens: torch.Tensor, num_new_tokens: int, page_size: int,
                 num_pages: int, valid_tokens: torch.Tensor | None = None, pad_row: int = 0,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot_mapping [B, T] int64: the cache row of each of a row's T new tokens, block_table [B, P]
    int32 clamped to real pages); with valid_tokens, the tokens past them write row pad_row."""
    table = block_table.long().clamp(0, num_pages - 1)
    offsets = torch.arange(num_new_tokens, device=cache_lens.device)
    index = cache_lens[:, None] + offsets  # [B, T] cache index of each new token
    pages = table.gather(1, (index // page_size).clamp(0, table.shape[1] - 1))
    slots = pages * page_size + index % page_size
    if valid_tokens is not None:  # padding writes one row nobody reads
        slots = torch.where(offsets[None, :] < valid_tokens[:, None], slots, pad_row)
    return slots, table.to(torch.int32)


def kv_slots(block_table: torch.Tensor, cache_lens: torch.Tensor, num_new_tokens: int, page_size: int,
             num_pages: int, valid_tokens: torch.Tensor | None = None, pad_row: int = 0,
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """`kv_slots_ref`, in one kernel on CUDA."""
    tensors = (block_table, cache_lens) if valid_tokens is None else (block_table, cache_lens, valid_tokens)
    if not (block_table.device.type == "cuda" and dispatch.kernels_available()
            and all(t.device == block_table.device for t in tensors) and block_table.dim() == 2
            and block_table.dtype in (torch.int32, torch.int64) and block_table.shape[1] >= 1
            and 1 <= block_table.shape[0] <= 65535 and num_new_tokens >= 1
            and all(t.dtype == torch.int64 for t in tensors[1:])):
        return kv_slots_ref(block_table, cache_lens, num_new_tokens, page_size, num_pages, valid_tokens, pad_row)
    batch, width = block_table.shape
    slots = torch.empty(batch, num_new_tokens, dtype=torch.int64, device=block_table.device)
    table = torch.empty(batch, width, dtype=torch.int32, device=block_table.device)
    dispatch.extension().kv_slots(
        slots=slots, table_out=table, block_table=block_table if block_table.stride(-1) == 1 else block_table.contiguous(),
        cache_lens=cache_lens.contiguous(), valid_tokens=None if valid_tokens is None else valid_tokens.contiguous(),
        page_size=page_size, num_pages=num_pages, pad_row=pad_row, stream=dispatch.stream_handle(slots))
    return slots, table


def write_kv_ref(kv: KVLayer, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Torch reference of `write_kv`."""
    rows = slot_mapping.reshape(-1)
    for cache, scales, x in ((kv.k, kv.k_scale, k), (kv.v, kv.v_scale, v)):
        flat = cache.view(-1, *cache.shape[2:])
        x = x.reshape(-1, *x.shape[2:])
        if scales is None:
            flat[rows] = x.to(cache.dtype)
        else:
            values, scale = quantize_kv(x, cache.dtype)
            flat.view(torch.uint8)[rows] = values.view(torch.uint8)  # index_put has no 8-bit float kernels
            scales.view(-1, scales.shape[-1])[rows] = scale


def write_kv(kv: KVLayer, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store k, v [B, T, Hkv, D] at the flat cache rows (page * page_size + row) `slot_mapping` [B, T]."""
    if _cpu_fits(kv, k, v) and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous():
        # row copies (csrc/cpu/decode_ops.h): the cache holds k's dtype, or bf16 / fp16 rounded from fp32
        ext, row = dispatch.cpu_extension(), k.shape[-1] * k.shape[-2]
        if _narrow_beside_fp32(kv, k):
            ext.write_kv_narrow(kv.k.data_ptr(), kv.v.data_ptr(), k.data_ptr(), v.data_ptr(), slot_mapping.data_ptr(),
                                slot_mapping.numel(), row, CACHE_TYPES[kv.k.dtype])
        else:
            ext.write_kv(kv.k.data_ptr(), kv.v.data_ptr(), k.data_ptr(), v.data_ptr(), slot_mapping.data_ptr(),
                         slot_mapping.numel(), row * k.element_size())
        return
    if not (_kernel_fits(k, kv) and v.dtype == k.dtype and slot_mapping.device == k.device):
        dispatch.fallback("write_kv", k, kv.k)
        return write_kv_ref(kv, k, v, slot_mapping)
    kv_heads, dim = k.shape[-2:]
    dispatch.extension().write_kv(
        k_cache=kv.k, v_cache=kv.v, k_scale=kv.k_scale, v_scale=kv.v_scale,
        k=k.reshape(-1, kv_heads, dim).contiguous(), v=v.reshape(-1, kv_heads, dim).contiguous(),
        slot_mapping=slot_mapping.reshape(-1).to(torch.int64).contiguous(), stream=dispatch.stream_handle(k),
    )


def norm_rotary_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv: KVLayer,
    slot_mapping: torch.Tensor,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    zero_centered: bool = False,
) -> torch.Tensor:
    """An attention layer's decode prologue: `norm_rotary` of q [B, T, H, D] and of k [B, T, Hkv, D]
    (each with its own head-norm weight, or none; eps and zero_centered shared), then `write_kv` of
    that k and v at `slot_mapping` [B, T]. Returns q's result (contiguous). q, k, v are read in place
    (slices of the merged q|k|v projection). On CUDA one kernel (csrc/rope.cu) instead of those
    three launches, bit-equal to them; elsewhere that composition."""
    if not _prologue_kernel_fits(q, k, v, cos, sin, kv, slot_mapping, q_weight, k_weight):
        q = norm_rotary(q, cos, sin, q_weight, eps, zero_centered)
        write_kv(kv, norm_rotary(k, cos, sin, k_weight, eps, zero_centered), v, slot_mapping)
        return q
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dispatch.extension().norm_rotary_write_kv(  # q, k, v read in place, with their own strides
        q_out=out, q=q, k=k, v=v, q_weight=q_weight, k_weight=k_weight, cos=cos, sin=sin,
        k_cache=kv.k, v_cache=kv.v, k_scale=kv.k_scale, v_scale=kv.v_scale,
        slot_mapping=slot_mapping.to(torch.int64).contiguous(), eps=float(eps), zero_centered=zero_centered,
        stream=dispatch.stream_handle(q),
    )
    return out


def _prologue_kernel_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          kv: KVLayer, slot_mapping: torch.Tensor, q_weight: torch.Tensor | None,
                          k_weight: torch.Tensor | None) -> bool:
    """Whether `norm_rotary_write_kv`'s kernel takes this call: q and k each as `norm_rotary`'s
    kernel would (same tables, so the same B, T and dtype), k and v as `write_kv`'s would."""
    return (rotary_kernel_fits(q, cos, sin, q_weight) and rotary_kernel_fits(k, cos, sin, k_weight)
            and _kernel_fits(k, kv) and q.shape[-1] == k.shape[-1] and kv.k.shape[2] == k.shape[2]
            and v.shape == k.shape and v.dtype == k.dtype and v.device == k.device and v.stride(-1) == 1
            and slot_mapping.shape == q.shape[:2] and slot_mapping.device == q.device)


def _pages(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """cache[pages] for any index shape: index_select on the flat ids (a quarter of advanced
    indexing's time on the CPU, where the decode step is bound by such small ops)."""
    return cache.index_select(0, pages.reshape(-1)).view(*pages.shape, *cache.shape[1:])


def _gather(cache: torch.Tensor, scale: torch.Tensor | None, pages: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The pages `pages` (any index shape) of one cache, as `dtype`."""
    if scale is None:
        return _pages(cache, pages).to(dtype)
    values = _pages(cache.view(torch.uint8), pages).view(cache.dtype)  # no 8-bit float index kernels everywhere
    return dequantize_kv(values, _pages(scale, pages), dtype)


def attention_ref(
    q: torch.Tensor, kv: KVLayer, block_table: torch.Tensor, cache_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Torch reference of `decode_attention` and `prefill_attention`: q [B, T, H, D] -> [B, T, H, D]."""
    num_new = q.shape[1]
    table = block_table.long()
    # The sequences' pages as contiguous [B, P * page_size, Hkv, D].
    k = _gather(kv.k, kv.k_scale, table, q.dtype).flatten(1, 2)
    v = _gather(kv.v, kv.v_scale, table, q.dtype).flatten(1, 2)
    key_pos = torch.arange(k.shape[1], device=q.device)
    query_pos = cache_lens[:, None] + torch.arange(num_new, device=q.device)  # [B, T]
    mask = key_pos[None, None, :] <= query_pos[:, :, None]  # [B, T, L]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None], scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2)


def decode_attention(
    q: torch.Tensor,
    kv: KVLayer,
    block_table: torch.Tensor,
    cache_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of T <= 16 new tokens per sequence over the paged cache (see the module doc).

    q [B, T, H, D]; block_table [B, P] int32 / int64; cache_lens [B] int64 (tokens cached before
    the step). `out` (contiguous, q's shape and dtype) receives the result. Capture-safe: the
    split workspace is sized by the table width P, not by the lengths. With `gate` (q's shape and
    dtype, last axis contiguous: the output gate, read in place; not overlapping `out`) the result
    is `sigmoid_mul(attention, gate)`: on CUDA in the kernels' final write, bit-equal to that
    composition, which runs elsewhere.
    """
    batch, num_new, heads, dim = q.shape
    kv_heads, page_size = kv.k.shape[2], kv.page_size
    kernel = _decode_kernel_fits(q, kv, block_table, cache_lens)
    if gate is not None and not (kernel and _gate_fits(gate, q)):
        return _into(out, sigmoid_mul(decode_attention(q, kv, block_table, cache_lens, scale), gate))
    if (num_new <= DECODE_MAX_TOKENS and q.dtype == torch.float32 and _cpu_fits(kv, q) and heads % kv_heads == 0
            and block_table.dtype == torch.int32 and cache_lens.dtype == torch.int64
            and block_table.is_contiguous() and cache_lens.is_contiguous()):
        return _cpu_decode_attention(q, kv, block_table, cache_lens, scale, out)
    if not kernel:
        dispatch.fallback("decode_attention", q, kv.k)
        return _into(out, attention_ref(q, kv, block_table, cache_lens, scale))
    ext = dispatch.extension()
    q = q.contiguous()
    table = block_table.to(torch.int32).contiguous()
    lens = cache_lens.to(torch.int64).contiguous()
    splits = ext.decode_attention_max_splits(
        batch=batch, num_new=num_new, num_heads=heads, kv_heads=kv_heads, head_dim=dim, page_size=page_size,
        table_width=table.shape[1], num_sms=dispatch.num_sms(q.device),
    )
    partials = batch * kv_heads * splits * num_new * (heads // kv_heads)
    workspace = torch.empty(partials * (dim + 2), dtype=torch.float32, device=q.device)  # O, then (max, sum)
    out = torch.empty_like(q) if out is None else _checked_out(out, q)
    ext.decode_attention(
        out=out, q=q, gate=gate, k_cache=kv.k, v_cache=kv.v, k_scale=kv.k_scale, v_scale=kv.v_scale,
        block_table=table, cache_lens=lens, workspace=workspace, max_splits=splits, scale=float(scale),
        stream=dispatch.stream_handle(q),
    )
    return out


def _decode_kernel_fits(q: torch.Tensor, kv: KVLayer, block_table: torch.Tensor, cache_lens: torch.Tensor) -> bool:
    """Whether `decode_attention`'s split-K CUDA kernel takes this call."""
    num_new, heads = q.shape[1], q.shape[2]
    page_size = kv.page_size
    return (num_new <= DECODE_MAX_TOKENS and _kernel_fits(q, kv) and heads % kv.k.shape[2] == 0
            and page_size & (page_size - 1) == 0 and block_table.device == q.device and cache_lens.device == q.device)


def _gate_fits(gate: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether the decode kernel reads this output gate in place (any strides but the last)."""
    return gate.shape == q.shape and gate.dtype == q.dtype and gate.device == q.device and gate.stride(-1) == 1


def _cpu_decode_attention(q: torch.Tensor, kv: KVLayer, block_table: torch.Tensor, cache_lens: torch.Tensor,
                          scale: float, out: torch.Tensor | None) -> torch.Tensor:
    """csrc/cpu/decode_ops.h: chunks of 256 keys per (sequence, token, kv head) on the pool's threads
    (attention_kernels.h, per instruction set), their softmax sums merged; fp32."""
    batch, num_new, heads, dim = q.shape
    out = torch.empty_like(q) if out is None else _checked_out(out, q)
    dispatch.cpu_extension().decode_attention(
        out.data_ptr(), q.data_ptr(), kv.k.data_ptr(), kv.v.data_ptr(), block_table.data_ptr(), cache_lens.data_ptr(),
        batch, num_new, heads, kv.k.shape[2], dim, kv.page_size, block_table.shape[1], float(scale),
        dispatch.cpu_threads(), CACHE_TYPES[kv.k.dtype],
    )
    return out


def chunk_attention(
    q: torch.Tensor, kv: KVLayer, block_table: torch.Tensor, cache_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """`prefill_attention`'s result with the lengths on the device, so a CUDA graph captures it
    (prefill graphs: a prompt chunk, possibly after a cached prefix of any length).

    On the GPU a Triton kernel (ops/chunk_attention_kernels.py) runs the chunk on tensor cores:
    each program takes a tile of tokens x the query heads of one kv head against one split of the
    keys, so a 384-token chunk over a 30K-token cached prefix is a few GEMM-shaped passes, where
    the decode kernel (CUDA cores, 16 tokens a row, every row re-reading the prefix) took ~6 ms
    a layer. Elsewhere (8-bit caches, other head sizes, no Triton) the chunk runs as rows of 16
    tokens on `decode_attention` (`_rows_attention`). The splits depend on shapes only."""
    kernels = dispatch.triton_kernels("chunk_attention_kernels")
    batch, num_new, heads, dim = q.shape
    kv_heads = kv.k.shape[2]
    if not (kernels is not None and q.dtype in (torch.bfloat16, torch.float16) and kv.k.dtype == q.dtype
            and dim in _CHUNK_HEAD_DIMS and heads % kv_heads == 0
            and kv.k.is_contiguous() and kv.v.is_contiguous() and kv.k.device == q.device):
        return _rows_attention(q, kv, block_table, cache_lens, scale)
    q = q.contiguous()  # the kernel stores the output with q's strides
    group = heads // kv_heads
    tiles = chunk_tiles(group, dim)
    grid_tokens = -(-num_new // tiles.block_t)
    programs = grid_tokens * batch * kv_heads
    sms = dispatch.num_sms(q.device) if q.is_cuda else 4  # the interpreter: any count
    splits = min(16, 1 << max(0, math.ceil(math.log2(max(1, 2 * sms / programs)))))
    table = block_table.to(torch.int32).contiguous()
    lens = cache_lens.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    rows = batch * num_new * heads
    part_o = torch.empty((splits * rows, dim) if splits > 1 else (1,), dtype=torch.float32, device=q.device)
    part_ml = torch.empty((splits * rows, 2) if splits > 1 else (1,), dtype=torch.float32, device=q.device)
    kernels.chunk_attention[(grid_tokens, batch * kv_heads, splits)](
        q, kv.k, kv.v, table, lens, out, part_o, part_ml, num_new, table.shape[1], scale * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2), kv.k.stride(0), kv.k.stride(1), kv.k.stride(2),
        KV_HEADS=kv_heads, GROUP=group, GROUP_PAD=tiles.group_pad, HEAD_DIM=dim, PAGE=kv.page_size,
        BLOCK_T=tiles.block_t, BLOCK_N=tiles.block_n, SPLITS=splits, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    if splits > 1:
        kernels.combine_splits[(rows,)](part_o, part_ml, out, rows, heads, num_new, out.stride(0), out.stride(1),
                                        out.stride(2), HEAD_DIM=dim, SPLITS=splits)
    return out


@dataclass(frozen=True)
class ChunkTiles:
    """`chunk_attention`'s tiling: block_t tokens x group_pad heads = 64 query rows a program."""

    group_pad: int
    block_t: int
    block_n: int
    num_warps: int
    num_stages: int


def chunk_tiles(group: int, dim: int) -> ChunkTiles:
    """H200, head_dim 256 (scripts/bench_chunk_attention.py, 2026-12-01): 4 warps and 3 stages ran
    fastest, 0.91 ms for 384 tokens over a 29.7K prefix (207 TFLOP/s; 8 warps 1.66 ms, 64-key
    tiles 1.15 ms, 16-token tiles 2.35 ms)."""
    group_pad = 1 << max(0, (group - 1).bit_length())
    return ChunkTiles(group_pad, max(1, 64 // group_pad), block_n=32 if dim > 128 else 64, num_warps=4,
                      num_stages=3)


def _rows_attention(
    q: torch.Tensor, kv: KVLayer, block_table: torch.Tensor, cache_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """A chunk of T = 16 * R tokens as R rows of 16 tokens of the same sequence on the decode
    kernel, row i starting at cache index cache_lens + 16 i (its keys are all in the cache
    already: the KV of the whole chunk is written first)."""
    batch, num_new, heads, dim = q.shape
    if num_new % DECODE_MAX_TOKENS:
        raise ValueError(f"chunk attention by rows: {num_new} tokens is not a multiple of {DECODE_MAX_TOKENS}")
    rows = num_new // DECODE_MAX_TOKENS
    starts = torch.arange(0, num_new, DECODE_MAX_TOKENS, device=cache_lens.device)
    out = decode_attention(q.reshape(batch * rows, DECODE_MAX_TOKENS, heads, dim), kv,
                           block_table.repeat_interleave(rows, dim=0),
                           (cache_lens[:, None] + starts).reshape(-1), scale)
    return out.reshape(batch, num_new, heads, dim)


def prefill_attention(
    q: torch.Tensor, kv: KVLayer, block_table: torch.Tensor, cache_lens: torch.Tensor, scale: float,
    host_cache_lens: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Causal attention of a longer chunk (T > 16): same contract as `decode_attention`.

    Each sequence's L = cache_lens[b] + T cached tokens are gathered into contiguous K/V
    (dequantized to q's dtype) and go through SDPA with `causal_lower_right(T, L)` (query t sees
    keys 0 .. L - T + t). Why not the reference's boolean [T, L] mask: an explicit mask rules out
    SDPA's flash and memory-efficient backends, so the math backend would materialise [H, T, L]
    scores (gigabytes for a 4K-token chunk at 32K context); the bias names the same mask as a
    shape, which the fused kernels apply themselves. One call per sequence, since the bias has
    one (T, L). Needs the lengths on the host (`host_cache_lens`, else read from cache_lens: a
    device sync): not for CUDA graphs (decode steps are T <= 16).
    """
    num_new = q.shape[1]
    page_size = kv.page_size
    out = torch.empty_like(q)
    with sdpa_kernel(_PREFILL_BACKENDS):
        lengths = host_cache_lens if host_cache_lens is not None else cache_lens.tolist()
        for b, cached in enumerate(lengths):
            _prefill_one(q, kv, block_table, b, cached, num_new, page_size, scale, out)
    return out


# cuDNN's attention builds a plan per new (T, L) shape (~6 ms per layer call on the H200), which a
# server sees on almost every prompt: the fused backends without per-shape setup come first
_PREFILL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _prefill_one(q: torch.Tensor, kv: KVLayer, block_table: torch.Tensor, b: int, cached: int, num_new: int,
                 page_size: int, scale: float, out: torch.Tensor) -> None:
    """Row b of `prefill_attention` into out[b]."""
    length = cached + num_new
    pages = block_table[b, : -(-length // page_size)].long()
    k = _gather(kv.k, kv.k_scale, pages, q.dtype).flatten(0, 1)[:length]
    v = _gather(kv.v, kv.v_scale, pages, q.dtype).flatten(0, 1)[:length]
    o = F.scaled_dot_product_attention(
        q[b].transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        **_causal(num_new, length, q.device),
        scale=scale,
        enable_gqa=True,
    )
    out[b] = o[0].transpose(0, 1)


def _causal(num_new: int, length: int, device: torch.device) -> dict:
    """SDPA's causal arguments: query t sees keys 0 .. length - num_new + t. On CUDA as
    `causal_lower_right` (see prefill_attention). On the CPU a prompt's first chunk (no cached keys)
    as `is_causal`, with which torch's flash kernel skips the blocks above the diagonal (-27% for a
    670-token prompt; the same bits), later chunks as a boolean [T, L] mask, which the CPU flash
    kernel takes; without importing torch.nn.attention.bias, which pulls in torch._dynamo: 2.4 s of
    every CPU start."""
    if device.type == "cuda":
        from torch.nn.attention.bias import causal_lower_right

        return {"attn_mask": causal_lower_right(num_new, length)}
    if length == num_new:
        return {"is_causal": True}
    return {"attn_mask": torch.ones(num_new, length, dtype=torch.bool, device=device).tril(length - num_new)}


def _cache_readable(kv: KVLayer, dtype: torch.dtype) -> bool:
    """Whether the kernels read this cache with activations of `dtype`: fp8 / int8 pages with their
    scales, or pages of that dtype (the bindings tell which from the pages' dtype)."""
    return kv.k.dtype in QMAX if kv.quantized else kv.k.dtype == dtype


def _narrow_beside_fp32(kv: KVLayer, x: torch.Tensor) -> bool:
    """A bf16 / fp16 cache beside fp32 activations (`--kv-dtype bf16 / fp16` on the CPU): the kernels
    round into it and widen out of it."""
    return kv.k.dtype in (torch.bfloat16, torch.float16) and x.dtype == torch.float32


def _cpu_fits(kv: KVLayer, *xs: torch.Tensor) -> bool:
    """Whether the CPU kernels take these activations with this cache: contiguous, on the CPU, the
    cache in the activations' dtype or bf16 / fp16 beside fp32 activations (no fp8 / int8 scales)."""
    return (
        not kv.quantized
        and all(x.device.type == "cpu" and x.is_contiguous() and (x.dtype == kv.k.dtype or _narrow_beside_fp32(kv, x))
                for x in xs)
        and kv.k.device.type == "cpu" and kv.v.dtype == kv.k.dtype and kv.k.is_contiguous() and kv.v.is_contiguous()
        and xs[0].shape[-1] == kv.k.shape[-1]
        and dispatch.cpu_kernels_available()
    )


def _kernel_fits(x: torch.Tensor, kv: KVLayer) -> bool:
    """Whether the kernels take activations `x` (q or k) with this cache."""
    if not (dispatch.use_kernel(x) and x.dtype in (torch.float16, torch.bfloat16) and x.shape[-1] in _HEAD_DIMS):
        return False
    tensors = [kv.k, kv.v] + ([kv.k_scale, kv.v_scale] if kv.quantized else [])
    if not all(t.device == x.device and t.is_contiguous() for t in tensors):
        return False
    return kv.k.dtype == kv.v.dtype and kv.k.shape[-1] == x.shape[-1] and _cache_readable(kv, x.dtype)


def _checked_out(out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or not out.is_contiguous():
        raise ValueError(
            f"decode_attention: out is {tuple(out.shape)} {out.dtype} on {out.device}, needs a contiguous "
            f"{tuple(q.shape)} {q.dtype} on {q.device}"
        )
    return out


def _into(dst: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    return value if dst is None else dst.copy_(value)

"""Mixture-of-experts ops: softmax top-k routing and the routed experts' SwiGLU FFN.

Routing: `moe_route` over router logits (one warp per token, any count); for a decode step
`moe_router` also computes the logits, the router GEMV and the top-k in one launch, and
`moe_add_norm_router` also the residual add + RMSNorm before them.

Expert weights keep the checkpoint's fused layout, `gate_up` [E, 2I, H] (gate rows first) and
`down` [E, H, I], as bf16/fp16/fp32 tensors or as int8/int4 `QuantizedWeight`s (ops/quant.py).

`moe_experts` takes one of five paths:
  decode    CUDA, N <= 16 tokens (QUANTIZED_DECODE_MAX_TOKENS with int8 / int4 experts): our two
            GEMV kernels (csrc/moe.cu), each (token, expert) pair's weights read once. Expert ids
            stay on the device, so a decode step never syncs with the host and is captured by
            CUDA graphs. `moe_experts_with_shared` adds a quantized shared expert to the same two
            launches (its gate, and the sum with the routed experts, in the down epilogue).
  grouped gemv   CUDA, int8 / int4 experts, up to GROUPED_GEMV_MAX_TOKENS: the slots grouped by
            expert on the device (ops/moe_align.py), then the quant GEMV kernel per slot block
            (csrc/quant_gemv.cu, tensor cores, SwiGLU in the gate_up epilogue): each hit expert
            is read once per block of its slots. Verify rounds, batched decode, short prompts.
  grouped quantized   CUDA + Triton, int8 / int4 experts, larger N: grouped GEMMs that dequantize
            in registers (ops/moe_triton.py), tensor-core tiles for many rows per expert; no
            host sync at any N.
  grouped   CUDA, larger N otherwise (prefill): the (token, slot) pairs sorted by expert and one
            grouped GEMM per projection (`moe_experts_grouped`).
  cpu       CPU, int8 / int4 experts: the reference's loop over hit experts, each projection on the
            CPU quant kernels (a GEMM over dequantized tiles for a prompt's many rows: ops/quant.py)
            where the reference dequantizes every hit expert whole, every step; a decode step's rows
            (up to CPU_GEMV_ROWS) in one call with the shared expert (csrc/cpu/moe_step.h: the same
            GEMVs in the same order, one call where the loop took ~10 torch ops an expert). Outside
            the exact CPU math, `cpu_moe_layer` also runs the add + norm, the router GEMV and the
            top-k of a decode step in that call.
  reference CPU otherwise, or NINFER_DISABLE_KERNELS=1: the loop over hit experts (`moe_experts_ref`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import dispatch, moe_triton
from .cpu_layer import cpu_fp32, linear_plan
from .activation import row_view, silu_mul
from .moe_align import Aligned, align_by_expert, combine_slots
from .kquant import KQuantExperts, KQuantWeight, kquant_linear
from .kquant import dequantize_ref as kquant_dequantize_ref
from .quant import CPU_GEMV_ROWS, QuantizedWeight, dequantize, quant_linear

log = logging.getLogger(__name__)

ExpertTensor = torch.Tensor | QuantizedWeight | KQuantExperts  # K-quant experts: a GGUF's on the CPU

# Token counts up to which the decode kernels run: they read each (token, expert) pair's weights
# once, the grouped paths each hit expert once per block of its slots. bf16 experts turn to the
# grouped GEMM at 16 tokens. Quantized experts (H200, 35B shape, one layer as graph replays,
# scripts/bench_moe_triton.py): decode kernels 14.5 / 24 / 44 / 63 / 82 us at 1 / 2 / 4 / 6 / 8
# tokens against the grouped GEMV's 36 / 28 / 43 / 54 / 70 us (its grouping and combine are two
# more launches); past 4 tokens the grouped GEMV wins (37 tokens: 174 vs 345 us, 128: 238 vs
# 1,169), and past 512 the Triton tiles (1,024 tokens: 748 vs 815 us).
# int4 experts in groups of 128 take the decode kernels on tensor cores (csrc/moe_decode_mma.cu)
# to 8 tokens: batch-8 graph replays 5.35 -> 4.55 ms against the grouped GEMV (H200, 35B, 512
# context, issue 15, eleventh session).
DECODE_MAX_TOKENS = 16
QUANTIZED_DECODE_MAX_TOKENS = 4
MMA_DECODE_MAX_TOKENS = 8
GROUPED_GEMV_MAX_TOKENS = 512
# Quantized experts the grouped GEMV does not take (fp32 activations): the decode kernels go on to
# the engine's largest decode graph bucket, sync-free.
QUANTIZED_DECODE_ALONE_TOKENS = 64
SYNC_FREE_UNLIMITED = 1 << 30
# A prompt's rows per hit expert up to which the CPU takes the GEMV kernel, past it the tiled GEMM: the
# 35B's expert shapes tie at 6 rows (gate_up 1,024 x 2,048 int4, one thread: 8 rows 0.72 vs 0.56 ms, 16
# rows 1.53 vs 0.68; down 2,048 x 512: 6 rows 0.26 vs 0.27, 16 rows 0.93 vs 0.38), where the general
# CPU_GEMV_ROWS keeps decode and verify rows (the same math as a decode step's) on the GEMV. A 512-token
# prompt through 4 of the 35B's layers: -12% (twenty-ninth session, docs/performance.md).
CPU_PREFILL_EXPERT_GEMV_ROWS = 6
_MAX_TOP_K = 64  # csrc/moe.cu's limits
_MAX_ROUTE_EXPERTS = 512  # a token's probabilities in one warp's registers
_MAX_SHARED_BYTES = 48 * 1024
_DEQUANT_CHUNK_BYTES = 256 << 20  # grouped path: experts dequantized per chunk of this size
_grouped_mm_works: bool | None = None  # torch._grouped_mm, tried at first use


# ---------------------------------------------------------------- routing


def moe_route_ref(
    logits: torch.Tensor, top_k: int, renormalize: bool, rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `moe_route` (any device)."""
    if rows is not None:
        logits = logits.index_select(0, rows)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids.to(torch.int32)


def moe_route(
    logits: torch.Tensor, top_k: int, renormalize: bool, rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] -> (weights [N, k] in the logits' dtype, expert ids [N, k] int32).

    Softmax over all experts in fp32, the top k in descending order, optionally rescaled to sum
    to 1, rounded to the logits' dtype. One warp per token, at every token count (torch's
    softmax + topk + renormalization cost a 512-token prompt 14 us a layer in topk alone).
    `rows` [N] int64 (values < N): token n is routed by logits row rows[n] instead of its own
    (`padding_route_rows`: a padded chunk's padding tokens take real tokens' experts).
    """
    tokens, experts = logits.shape
    if not (dispatch.use_kernel(logits) and 1 <= top_k <= min(experts, _MAX_TOP_K) and experts <= _MAX_ROUTE_EXPERTS):
        dispatch.fallback("moe_route", logits)
        return moe_route_ref(logits, top_k, renormalize, rows)
    logits = logits.contiguous()
    weights = torch.empty(tokens, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=logits.device)
    dispatch.extension().moe_route(
        weights=weights, ids=ids, logits=logits, rows=rows, renormalize=renormalize,
        stream=dispatch.stream_handle(logits),
    )
    return weights, ids


def padding_route_rows(valid_tokens: torch.Tensor, tokens: int) -> torch.Tensor:
    """`moe_route`'s rows for a padded prompt chunk of B rows of `tokens` (valid_tokens [B] real ones,
    on the device): [B * tokens] int64, row b's token t routed as its token t % valid_tokens[b] (itself
    if real). Padding rows routed like real ones hit experts of their own (a 37-token prompt in the
    48-token graph: ~200 experts a layer read instead of ~176); as copies of real tokens they hit none
    more, spread over all real tokens rather than one token's experts, whose grouped blocks they would
    overflow. A few kernels once a forward, no host sync (prefill CUDA graphs)."""
    t = torch.arange(tokens, device=valid_tokens.device)
    first = torch.arange(valid_tokens.shape[0], device=valid_tokens.device) * tokens
    return (first[:, None] + t[None, :] % valid_tokens.clamp(min=1)[:, None]).reshape(-1)


# Tokens and widths up to which `moe_router` runs the router as one kernel (csrc/moe.cu:
# kRouterMaxTokens, moe.h: kMoeRouterMaxHidden)
ROUTER_KERNEL_MAX_TOKENS = 8
ROUTER_KERNEL_MAX_HIDDEN = 4096
_router_done: dict[tuple[torch.device, int], torch.Tensor] = {}


def moe_router(
    x: torch.Tensor, weight: torch.Tensor, experts: int, top_k: int, renormalize: bool,
    live: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A decode step's router in one launch instead of a GEMM and `moe_route`: (logits [N, R] =
    x @ weight^T, where rows past `experts` are extra outputs such as the shared expert's gate;
    weights, ids of `moe_route` over the first `experts` columns). None where the kernel does not
    apply (the caller runs the GEMM and `moe_route`): past ROUTER_KERNEL_MAX_TOKENS tokens, fp32,
    shapes it does not take. `live` [1] int32 (a decode graph's real tokens, `ForwardBatch.live_tokens`):
    the tokens from live[0] on are routed dead, ids -1 and weights 0, so that the experts' kernels read
    no weights for a graph's spare rows (their outputs, discarded, are zeros or left unwritten)."""
    if not _router_fits(x, weight, experts, top_k):
        return None
    return _launch_router(x, weight, experts, top_k, renormalize, live)


@dataclass(frozen=True)
class RouterNorm:
    """The residual add + RMSNorm before the MoE (ops.add_rmsnorm's arguments but x)."""

    residual: torch.Tensor
    weight: torch.Tensor
    eps: float
    zero_centered: bool


def moe_add_norm_router(
    x: torch.Tensor, norm: RouterNorm, weight: torch.Tensor, experts: int, top_k: int, renormalize: bool,
    live: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """`ops.add_rmsnorm(x, norm.residual, ...)` then `moe_router` on its normed rows, in the router's
    one launch (bit-equal to the two): (normed, summed, logits, weights, ids), `live` as there. None
    where the kernel does not take it (also: hidden not a multiple of 256 or past 2,048)."""
    hidden = x.shape[-1]
    fits = (
        _router_fits(x, weight, experts, top_k)
        and hidden % 256 == 0 and hidden <= 2048
        and all(t.dtype == x.dtype and t.is_contiguous() and t.data_ptr() % 16 == 0
                and t.device == x.device for t in (norm.residual, norm.weight))
        and norm.residual.shape == x.shape and norm.weight.shape == (hidden,)
    )
    if not fits:
        return None
    normed, summed = torch.empty_like(x), torch.empty_like(x)
    logits, weights, ids = _launch_router(x, weight, experts, top_k, renormalize, live,
                                          residual=norm.residual, norm_weight=norm.weight, normed=normed,
                                          residual_out=summed, eps=float(norm.eps), zero_centered=norm.zero_centered)
    return normed, summed, logits, weights, ids


def _router_fits(x: torch.Tensor, weight: torch.Tensor, experts: int, top_k: int) -> bool:
    tokens, hidden = x.shape
    return (
        1 <= tokens <= ROUTER_KERNEL_MAX_TOKENS
        and hidden <= ROUTER_KERNEL_MAX_HIDDEN
        and dispatch.use_kernel(x, weight)
        and x.dtype in (torch.float16, torch.bfloat16)
        and weight.dtype == x.dtype
        and weight.shape[1] == hidden
        and hidden % 8 == 0
        and 1 <= top_k <= min(experts, _MAX_TOP_K)
        and experts <= min(weight.shape[0], _MAX_ROUTE_EXPERTS)
        and x.is_contiguous() and weight.is_contiguous()
        and x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0
    )


def _launch_router(
    x: torch.Tensor, weight: torch.Tensor, experts: int, top_k: int, renormalize: bool,
    live: torch.Tensor | None = None, **norm: torch.Tensor | float | bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens, rows = x.shape[0], weight.shape[0]
    # The kernel's completion counter: one per router weight, so engines never share one; it is
    # 0 between launches (the last block resets it), and its address stays fixed for CUDA graphs.
    key = (x.device, weight.data_ptr())
    done = _router_done.get(key)
    if done is None:
        done = _router_done[key] = torch.zeros(1, dtype=torch.int32, device=x.device)
    logits = torch.empty(tokens, rows, dtype=x.dtype, device=x.device)
    weights = torch.empty(tokens, top_k, dtype=x.dtype, device=x.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=x.device)
    dispatch.extension().moe_router(
        logits=logits, weights=weights, ids=ids, done=done, x=x, w=weight, experts=experts,
        renormalize=renormalize, stream=dispatch.stream_handle(x), live=live, **norm,
    )
    return logits, weights, ids


# ---------------------------------------------------------------- experts


def _hit_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 ffn: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """out[n] = sum_j weights[n, j] * ffn(ids[n, j], x[n]): the experts that were hit in turn, each
    over the rows of its tokens, in id order."""
    out = torch.zeros_like(x)
    for expert in torch.unique(ids).tolist():
        token, slot = torch.where(ids == expert)
        out.index_add_(0, token, (ffn(expert, x[token]) * weights[token, slot, None]).to(out.dtype))
    return out


def moe_experts_ref(
    x: torch.Tensor,
    gate_up: ExpertTensor,
    down: ExpertTensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """Torch reference of `moe_experts` (any device): a loop over the experts that were hit,
    each dequantized to x's dtype; every step rounds to x's dtype like transformers' loop."""
    _check(x, gate_up, down, weights, ids)
    inter = down.shape[2]

    def ffn(expert: int, rows: torch.Tensor) -> torch.Tensor:
        gu = F.linear(rows, _dense(gate_up, expert, expert + 1, x.dtype)[0])
        return F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], _dense(down, expert, expert + 1, x.dtype)[0])

    return _hit_experts(x, weights, ids, ffn)


CpuExperts = QuantizedWeight | KQuantExperts


def _kquant(gate_up: ExpertTensor, down: ExpertTensor) -> bool:
    """Either part as K-quant blocks (the CPU kernels alone take them)."""
    return isinstance(gate_up, KQuantExperts) or isinstance(down, KQuantExperts)


def _cpu_experts_fit(gate_up: ExpertTensor, down: ExpertTensor) -> bool:
    return (all(isinstance(w, CpuExperts) and w.experts[0].cpu_plan is not None for w in (gate_up, down))
            and dispatch.cpu_kernels_available())


def _cpu_experts(
    x: torch.Tensor, gate_up: CpuExperts, down: CpuExperts, weights: torch.Tensor, ids: torch.Tensor,
) -> torch.Tensor:
    """`moe_experts_ref`'s loop with each hit expert's projections on the CPU quant kernels: a decode
    step's few rows in one call (`_cpu_experts_call`), a prompt's from Python (its GEMMs dominate)."""
    out = _cpu_experts_call(x, gate_up, down, weights, ids, None)
    if out is not None:
        return out
    return _hit_experts(x, weights, ids, lambda expert, rows: _expert_linear(
        silu_mul(_expert_linear(rows, gate_up, expert)), down, expert))


def _expert_linear(rows: torch.Tensor, w: CpuExperts, expert: int) -> torch.Tensor:
    if isinstance(w, KQuantExperts):
        return kquant_linear(rows, w.experts[expert])
    return quant_linear(rows, w.experts[expert], cpu_gemv_rows=CPU_PREFILL_EXPERT_GEMV_ROWS)


def _cpu_experts_call(
    x: torch.Tensor, gate_up: CpuExperts, down: CpuExperts, weights: torch.Tensor, ids: torch.Tensor,
    shared: SharedExpert | None,
) -> torch.Tensor | None:
    """The routed experts (and the shared one, gated, where given) of fp32 rows in one call
    (csrc/cpu/moe_step.h: the loop's GEMVs in its order, ~10 torch ops an expert saved); None where
    it does not apply. int8 / int4 experts up to CPU_GEMV_ROWS rows (a prompt's hit experts then
    multiply dequantized tiles, faster past a few rows each); K-quant ones at every size, since their
    kernels' int8 products beat the tiles at a prompt's rows an expert too (35B shapes, 64 / 512 /
    2048-token prompts: 1.23x / 1.35x / 1.2x on one core), unless the CPU math is exact."""
    rows_fit = dispatch.cpu_math() != "exact" if _kquant(gate_up, down) else x.shape[0] <= CPU_GEMV_ROWS
    shared_plan = None if shared is None else _cpu_shared_plan(shared, x.shape[0])
    if not (rows_fit and x.dtype == weights.dtype == torch.float32 and ids.dtype == torch.int32
            and (shared is None or shared_plan is not None)):
        return None
    x, weights, ids = x.contiguous(), weights.contiguous(), ids.contiguous()
    out = torch.empty_like(x)
    dispatch.cpu_extension().moe_experts(
        out.data_ptr(), x.data_ptr(), weights.data_ptr(), ids.data_ptr(), x.shape[0], ids.shape[1], gate_up.shape[0],
        _cpu_expert_plan(gate_up), _cpu_expert_plan(down), shared_plan, dispatch.cpu_threads(),
        dispatch.cpu_math() == "int8")
    return out


def cpu_moe_layer(
    x: torch.Tensor, norm: RouterNorm, router: torch.Tensor, top_k: int, renormalize: bool,
    gate_up: ExpertTensor, down: ExpertTensor, shared: tuple[QuantizedWeight | KQuantWeight, ...] | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A decode step's MoE layer on the CPU in one call (csrc/cpu/moe_step.h `moe_layer`): (out, s) for
    s = x + norm.residual, out = the experts (and the shared expert (gate_up, down), gated by router row
    E) of h = norm(s), routed by the softmax top-k of h @ router[:E]^T (E = experts). The composition it
    replaces: add_rmsnorm, the router GEMM, `moe_route`, `moe_experts_with_shared`. None where it does
    not apply: the exact CPU math (its router's dot products add in another order than torch's GEMM),
    not fp32, more rows than the experts' call takes."""
    experts = gate_up.shape[0]
    tokens, hidden = x.shape
    shared_plan = None if shared is None else tuple(linear_plan(w) for w in shared)
    if not (x.device.type == "cpu" and dispatch.cpu_kernels_available() and dispatch.cpu_math() != "exact"
            and _cpu_experts_fit(gate_up, down) and (_kquant(gate_up, down) or tokens <= CPU_GEMV_ROWS)
            and all(cpu_fp32(t) for t in (x, norm.residual, norm.weight, router))
            and norm.residual.shape == x.shape and norm.weight.shape == (hidden,)
            and router.shape == (experts + (shared is not None), hidden) and 1 <= top_k <= experts
            and (shared_plan is None or None not in (shared[0].cpu_plan, shared[1].cpu_plan))):
        return None
    out, summed, normed = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)
    logits = torch.empty(tokens, router.shape[0])
    weights, ids = torch.empty(tokens, top_k), torch.empty(tokens, top_k, dtype=torch.int32)
    tensors = (out, x, norm.residual, norm.weight, summed, router, normed, logits, weights, ids)
    dispatch.cpu_extension().moe_layer(
        tuple(t.data_ptr() for t in tensors), float(norm.eps), norm.zero_centered, router.shape[0], renormalize,
        tokens, top_k, experts, _cpu_expert_plan(gate_up), _cpu_expert_plan(down), shared_plan,
        dispatch.cpu_threads(), dispatch.cpu_math() == "int8")
    return out, summed


def _cpu_expert_plan(w: CpuExperts) -> tuple:
    """moe_experts' view of stacked experts: the first's linear, the byte strides between experts
    (codes, scales, offsets; K-quant blocks move by the first). Made once per weight (kept in its
    __dict__ beside its cached `experts`): every decode step's MoE call asks for it."""
    plan = w.__dict__.get("_cpu_expert_plan")
    if plan is None:
        if isinstance(w, KQuantExperts):
            strides = (w.blocks.stride(0), 0, 0)
        else:
            strides = tuple(0 if t is None else t.stride(0) * t.element_size()
                            for t in (w.qweight, w.scales, w.offsets))
        plan = w.__dict__["_cpu_expert_plan"] = (linear_plan(w.experts[0]), strides)
    return plan


def _cpu_shared_plan(shared: SharedExpert, tokens: int) -> tuple | None:
    """moe_experts' shared expert (linears, the gate logits' pointer and row stride), or None."""
    gate = row_view(shared.gate, 1) if shared.gate.shape == (tokens, 1) else None
    if gate is None or gate.dtype != torch.float32 or None in (shared.gate_up.cpu_plan, shared.down.cpu_plan):
        return None
    return linear_plan(shared.gate_up), linear_plan(shared.down), gate.data_ptr(), gate.stride(0)


def moe_experts(
    x: torch.Tensor,
    gate_up: ExpertTensor,
    down: ExpertTensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """x [N, H] -> [N, H]: out[n] = sum_j weights[n, j] * down[e] @ (silu(g) * u) with
    [g | u] = gate_up[e] @ x[n], e = ids[n, j]. See the module docstring for the paths."""
    _check(x, gate_up, down, weights, ids)
    if x.device.type == "cpu" and _cpu_experts_fit(gate_up, down):
        return _cpu_experts(x, gate_up, down, weights, ids)
    if x.device.type != "cuda" or dispatch.kernels_disabled() or _kquant(gate_up, down):
        dispatch.fallback("moe_experts", x)
        return moe_experts_ref(x, gate_up, down, weights, ids)
    plan = _decode_plan(x, gate_up, down, weights, ids)
    if plan is not None:
        return _decode(x, plan, weights, ids)
    if ids.shape[0] <= GROUPED_GEMV_MAX_TOKENS and grouped_gemv_fits(x, gate_up, down):
        return moe_experts_grouped_gemv(x, gate_up, down, weights, ids)
    if _grouped_quantized(x, gate_up, down):
        return moe_triton.moe_experts_grouped_quantized(x, gate_up, down, weights, ids)
    return moe_experts_grouped(x, gate_up, down, weights, ids)


@dataclass(frozen=True)
class SharedExpert:
    """A shared expert beside the routed ones, adding sigmoid(gate) * down @ swiglu(gate_up @ x)."""

    gate_up: QuantizedWeight | KQuantWeight  # [2 I, H], gate rows first (K-quant: the CPU kernels only)
    down: QuantizedWeight | KQuantWeight  # [H, I]
    gate: torch.Tensor  # [N, 1] logits (any row stride: a column of the router's output)


def moe_experts_with_shared(
    x: torch.Tensor, gate_up: ExpertTensor, down: ExpertTensor, weights: torch.Tensor, ids: torch.Tensor,
    shared: SharedExpert,
) -> torch.Tensor | None:
    """`moe_experts` plus the shared expert in the decode kernels' two launches (its rows ride
    along with the routed experts' instead of four launches of their own; on the CPU in the experts'
    one call), with the roundings of the composition; None where the kernels do not take them (fp16 /
    bf16 x, quantized experts, a decode-sized batch): the caller then composes `moe_experts` and the
    shared expert."""
    _check(x, gate_up, down, weights, ids)
    out = _cpu_experts_call(x, gate_up, down, weights, ids, shared) if x.device.type == "cpu" and _cpu_experts_fit(
        gate_up, down) else None
    if out is not None:
        return out
    if not dispatch.use_kernel(x) or x.dtype not in (torch.float16, torch.bfloat16) or not all(
            isinstance(w, QuantizedWeight) for w in (gate_up, down, shared.gate_up, shared.down)):
        return None
    plan = _decode_plan(x, gate_up, down, weights, ids)
    hidden, inter = x.shape[1], shared.down.in_features
    gate = row_view(shared.gate, 1) if shared.gate.shape == (x.shape[0], 1) else None
    fits = (
        plan is not None
        and shared.gate_up.shape == (2 * inter, hidden)
        and shared.down.shape == (hidden, inter)
        and gate is not None
        and gate.dtype == x.dtype
        and 4 * (ids.shape[1] * (down.shape[2] + 2) + inter) <= _MAX_SHARED_BYTES
    )
    shared_plan = (_kernel_weights(shared.gate_up, x, hidden), _kernel_weights(shared.down, x, inter)) if fits else None
    if shared_plan is None or None in shared_plan:
        return None
    return _decode(x, plan, weights, ids, (shared_plan[0], shared_plan[1], inter, gate))


def _grouped_quantized(x: torch.Tensor, gate_up: ExpertTensor, down: ExpertTensor) -> bool:
    """Whether the Triton grouped kernels take these experts (int8 / int4 of one kind, fp16 / bf16 x)."""
    return (
        isinstance(gate_up, QuantizedWeight)
        and isinstance(down, QuantizedWeight)
        and gate_up.kind == down.kind
        and x.dtype in (torch.float16, torch.bfloat16)
        and all(t.is_contiguous() for t in (gate_up.qweight, gate_up.scales, down.qweight, down.scales))
        and moe_triton.available()
    )


def sync_free_tokens(gate_up: ExpertTensor, down: ExpertTensor, dtype: torch.dtype | None) -> int:
    """The most tokens of `dtype` activations `moe_experts` takes without a host sync, so that CUDA
    graphs can capture calls up to this size (the dequantizing grouped path reads group sizes on the
    host). The Triton and grouped GEMV kernels take fp16 / bf16 activations only: fp32 ones (or an
    unknown dtype) keep quantized experts on the decode kernels."""
    if not (isinstance(gate_up, QuantizedWeight) and isinstance(down, QuantizedWeight)):
        return DECODE_MAX_TOKENS
    if dtype not in (torch.float16, torch.bfloat16):
        return QUANTIZED_DECODE_ALONE_TOKENS
    return SYNC_FREE_UNLIMITED if moe_triton.available() else max(QUANTIZED_DECODE_ALONE_TOKENS,
                                                                   GROUPED_GEMV_MAX_TOKENS)


def decode_kernel_tokens(x: torch.Tensor, gate_up: ExpertTensor, down: ExpertTensor) -> int:
    """The most tokens the decode kernels take; past it a grouped path reads each hit expert once
    per block of its slots (the crossovers are measured above DECODE_MAX_TOKENS)."""
    if not (isinstance(gate_up, QuantizedWeight) and isinstance(down, QuantizedWeight)):
        return DECODE_MAX_TOKENS
    if not grouped_gemv_fits(x, gate_up, down):
        return QUANTIZED_DECODE_ALONE_TOKENS
    # csrc/moe_decode_mma.cu checks the shapes too; those it does not take run moe.cu's kernels
    int4_128 = all(w.kind == "int4" and w.group_size == 128 for w in (gate_up, down))
    return MMA_DECODE_MAX_TOKENS if int4_128 else QUANTIZED_DECODE_MAX_TOKENS


def moe_experts_grouped(
    x: torch.Tensor,
    gate_up: ExpertTensor,
    down: ExpertTensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """The prefill path (any device): the N * k (token, slot) pairs sorted by expert, so that
    each expert's rows are one contiguous block, then one grouped GEMM per projection.

    The grouped GEMM is `torch._grouped_mm` (PyTorch's CUTLASS grouped GEMM; bf16, sm90+):
    prefill is compute-bound, where a tuned tensor-core GEMM over jagged groups, maintained
    upstream for every new GPU, beats anything we would write and keep up ourselves; our own
    kernels cover the bandwidth-bound decode GEMVs instead. bf16 experts take one call per
    projection with the group ends on the device: no host sync at all (CUDA-graph safe).
    Quantized experts are dequantized to bf16 a chunk of experts at a time (bounded scratch), and
    without `_grouped_mm` (fp16 / fp32, older GPUs, CPU) each hit expert is one F.linear; both read
    the group bounds to the host once per call (one sync per layer, none per expert). Each
    token's k expert outputs are weighted and summed by one bmm (fp32 accumulation, no atomics).
    """
    _check(x, gate_up, down, weights, ids)
    top_k = ids.shape[1]
    sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
    experts = torch.arange(gate_up.shape[0], dtype=sorted_ids.dtype, device=ids.device)
    ends = torch.searchsorted(sorted_ids, experts, right=True, out_int32=True)
    bounds = functools.cache(lambda: [0, *ends.tolist()])
    gu = _expert_matmul(x[order // top_k], gate_up, ends, bounds)
    inter = gu.shape[1] // 2
    y = _expert_matmul(F.silu(gu[:, :inter]) * gu[:, inter:], down, ends, bounds)
    return combine_slots(weights, torch.empty_like(y).index_copy_(0, order, y))  # back in (token, slot) order


# ---------------------------------------------------------------- decode kernels

_KernelWeights = tuple[torch.Tensor, torch.Tensor | None, int]  # weight, scales (None: dense), int4 group


def _decode_plan(
    x: torch.Tensor,
    gate_up: ExpertTensor,
    down: ExpertTensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    max_tokens: int | None = None,
) -> tuple[_KernelWeights, _KernelWeights] | None:
    """The kernels' view of both expert tensors; None when csrc/moe.cu does not cover the call
    (or it has more than `max_tokens` tokens, default `decode_kernel_tokens`)."""
    tokens, top_k = ids.shape
    hidden, inter = x.shape[1], down.shape[2]
    fits = (
        tokens <= (decode_kernel_tokens(x, gate_up, down) if max_tokens is None else max_tokens)
        and 1 <= top_k <= _MAX_TOP_K
        and 4 * hidden <= _MAX_SHARED_BYTES
        and 8 * top_k + 4 * top_k * inter <= _MAX_SHARED_BYTES
        and ids.device == x.device
        and dispatch.use_kernel(x, weights)
    )
    if not fits:
        return None
    gu, dn = _kernel_weights(gate_up, x, hidden), _kernel_weights(down, x, inter)
    return None if gu is None or dn is None else (gu, dn)


def _kernel_weights(w: ExpertTensor, x: torch.Tensor, cols: int) -> _KernelWeights | None:
    if isinstance(w, QuantizedWeight):
        q, scales, group = w.qweight, w.scales, w.group_size
        if w.offsets is not None:  # a GGUF's affine blocks: the CPU kernels' format
            return None
        if w.kind == "int8" and q.dtype == torch.int8 and scales.dtype == torch.float32 and group == 0:
            plan, vec = (q, scales, 0), 16
        elif w.kind == "int4" and q.dtype == torch.uint8 and scales.dtype == torch.bfloat16:
            if group < 32 or group & (group - 1) or cols % group:
                return None
            plan, vec = (q, scales, group), 32
        else:
            return None
        ok = q.device == x.device and scales.is_contiguous() and dispatch.use_kernel(scales)
    else:
        q, plan, vec = w, (w, None, 0), 16 // w.element_size()
        ok = w.dtype == x.dtype and dispatch.use_kernel(w)
    ok = ok and q.is_contiguous() and q.data_ptr() % 16 == 0 and cols % vec == 0
    return plan if ok else None


def _decode(
    x: torch.Tensor,
    plan: tuple[_KernelWeights, _KernelWeights],
    weights: torch.Tensor,
    ids: torch.Tensor,
    shared: tuple[_KernelWeights, _KernelWeights, int, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`shared`: the shared expert's gate_up / down, its intermediate size and gate logit rows.
    The binding reads the formats, group sizes and sizes off the tensors."""
    (gu, gu_scales, _), (dn, dn_scales, _) = plan
    tokens, top_k = ids.shape
    inter = gu.shape[1] // 2
    x, weights = _aligned(x), weights.contiguous()
    ids = ids.to(torch.int32).contiguous()
    out = torch.empty_like(x)
    shared_inter = 0 if shared is None else shared[2]
    h = torch.empty(tokens, top_k * inter + shared_inter, dtype=x.dtype, device=x.device)  # kernel 1 -> kernel 2
    extra = {}
    if shared is not None:
        (sgu, sgu_scales, _), (sdn, sdn_scales, _), _, gate = shared
        extra = dict(shared_gate_up=sgu, shared_gate_up_scales=sgu_scales, shared_down=sdn,
                     shared_down_scales=sdn_scales, shared_gate=gate)
    dispatch.extension().moe_decode(
        out=out, h=h, x=x, weights=weights, ids=ids, gate_up=gu, gate_up_scales=gu_scales, down=dn,
        down_scales=dn_scales, stream=dispatch.stream_handle(x), **extra,
    )
    return out


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """x contiguous and 16-byte aligned, as the GEMV kernels load it (a copy only for an odd view)."""
    x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


# ---------------------------------------------------------------- grouped GEMV


def grouped_gemv_fits(x: torch.Tensor, gate_up: ExpertTensor, down: ExpertTensor) -> bool:
    """Whether the grouped GEMV kernel takes these experts: int8 / int4 in the CUDA formats
    (int4 groups of 32-128), fp16 / bf16 activations on the device."""
    hidden, inter = x.shape[1], down.shape[2]
    if not (isinstance(gate_up, QuantizedWeight) and isinstance(down, QuantizedWeight)):
        return False
    if x.dtype not in (torch.float16, torch.bfloat16) or not dispatch.use_kernel(x):
        return False
    plans = _kernel_weights(gate_up, x, hidden), _kernel_weights(down, x, inter)
    return all(p is not None and p[2] <= 128 for p in plans)


def grouped_gemv_block_m(slots: int, num_experts: int) -> int:
    """Slots per block (8, 16 or 32) for the slots an expert gets on average: smaller blocks pad
    less, larger ones read an expert fewer times. (H200, 35B shape, scripts/bench_moe_triton.py,
    twenty-second session: 8 was fastest to 8 slots an expert, 16 at 12 and 16; 16 and 32 tied at
    16. H100, fifty-first session, with bf16 16-slot blocks computing two row tiles a warp (csrc/
    quant_gemv.cu kSets): at 8 slots an expert (256 tokens) 16-slot blocks 0.224 against 8-slot ones'
    0.249; at 4 (128 tokens) 8-slot ones stay ahead, 0.186 against 0.210. fp16 keeps a tile a warp, so
    its 16-slot blocks at 8 slots an expert are likely ~3% slower than 8-slot ones would be (bf16 with a
    tile a warp: 0.255 / 0.249).)"""
    per_expert = slots / num_experts
    return 8 if per_expert < 8 else 16 if per_expert <= 24 else 32


def moe_experts_grouped_gemv(x: torch.Tensor, gate_up: QuantizedWeight, down: QuantizedWeight, weights: torch.Tensor,
                             ids: torch.Tensor, block_m: int | None = None) -> torch.Tensor:
    """The grouped GEMV path of `moe_experts` (see the module docstring): x [N, H] -> [N, H]."""
    tokens, top_k = ids.shape
    experts, slots = gate_up.shape[0], tokens * top_k
    block_m = block_m or grouped_gemv_block_m(slots, experts)
    aligned = align_by_expert(ids, experts, block_m)
    x = _aligned(x)
    h = torch.empty(slots, down.shape[2], dtype=x.dtype, device=x.device)
    _grouped_gemv(h, x, gate_up, aligned, block_m, gate_up=True)  # a token's top_k slots read its x row
    y = torch.empty(slots, x.shape[1], dtype=x.dtype, device=x.device)
    # right after gate_up: the down kernel reads `aligned` before its PDL wait (two launches back)
    _grouped_gemv(y, h, down, aligned, block_m, gate_up=False)
    return combine_slots(weights, y)


def _grouped_gemv(out: torch.Tensor, x: torch.Tensor, w: QuantizedWeight, aligned: Aligned,
                  block_m: int, gate_up: bool) -> None:
    sorted_slots, block_experts, used = aligned
    dispatch.extension().moe_grouped_gemv(
        out=out, x=x, qweight=w.qweight, scales=w.scales, sorted_slots=sorted_slots, block_experts=block_experts,
        used=used, block_m=block_m, gate_up=gate_up, stream=dispatch.stream_handle(x),
    )


# ---------------------------------------------------------------- grouped GEMM


def _expert_matmul(
    a: torch.Tensor, w: ExpertTensor, ends: torch.Tensor, bounds: Callable[[], list[int]]
) -> torch.Tensor:
    """a [M, K], rows grouped by expert (group e ends at row ends[e]) -> [M, N], each row times
    its expert's w[e].T. `bounds()` is the host copy of [0, *ends], fetched only when needed."""
    grouped = _grouped_usable(a, w)
    if grouped and isinstance(w, torch.Tensor):
        out = _grouped_mm(a, w.transpose(1, 2), ends)
        if out is not None:
            return out
        grouped = False
    experts, rows, cols = w.shape
    chunk = max(1, _DEQUANT_CHUNK_BYTES // (2 * rows * cols)) if grouped else 1
    b = bounds()
    out = a.new_empty(a.shape[0], rows)
    for e0 in range(0, experts, chunk):
        e1 = min(e0 + chunk, experts)
        if b[e0] == b[e1]:
            continue
        dense = _dense(w, e0, e1, a.dtype)
        part = (
            _grouped_mm(a[b[e0] : b[e1]], dense.transpose(1, 2), ends[e0:e1] - b[e0])
            if grouped
            else None
        )
        if part is None:
            part = torch.cat([F.linear(a[b[e] : b[e + 1]], dense[e - e0]) for e in range(e0, e1)])
        out[b[e0] : b[e1]] = part
    return out


def _grouped_usable(a: torch.Tensor, w: ExpertTensor) -> bool:
    """bf16 on CUDA with 16-byte-aligned rows: what torch._grouped_mm takes."""
    _, rows, cols = w.shape
    dense_ok = isinstance(w, QuantizedWeight) or (w.dtype == torch.bfloat16 and w.is_contiguous())
    return (
        hasattr(torch, "_grouped_mm")
        and _grouped_mm_works is not False
        and a.device.type == "cuda"
        and a.dtype == torch.bfloat16
        and dense_ok
        and rows % 8 == 0
        and cols % 8 == 0
    )


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor | None:
    """torch._grouped_mm, or None when this torch / GPU lacks it (found out once at first use)."""
    global _grouped_mm_works
    if _grouped_mm_works is False:
        return None
    try:
        out = torch._grouped_mm(a, b, offs=offs)
    except RuntimeError as exc:
        if _grouped_mm_works:
            raise
        log.info("torch._grouped_mm unavailable (%s); MoE prefill loops over the experts", exc)
        _grouped_mm_works = False
        return None
    _grouped_mm_works = True
    return out


# ---------------------------------------------------------------- expert tensors


def _dense(w: ExpertTensor, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Experts start..stop-1 of w as a [stop - start, N, K] tensor in dtype."""
    if isinstance(w, QuantizedWeight):
        part = QuantizedWeight(w.kind, w.qweight[start:stop], w.scales[start:stop], w.group_size,
                               None if w.offsets is None else w.offsets[start:stop])
        return dequantize(part, dtype)
    if isinstance(w, KQuantExperts):
        return torch.stack([kquant_dequantize_ref(w.experts[e], dtype) for e in range(start, stop)])
    return w[start:stop].to(dtype)


def _check(
    x: torch.Tensor,
    gate_up: ExpertTensor,
    down: ExpertTensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> None:
    experts, two_inter, hidden = gate_up.shape
    if (
        x.dim() != 2
        or x.shape[1] != hidden
        or two_inter % 2
        or tuple(down.shape) != (experts, hidden, two_inter // 2)
    ):
        raise ValueError(
            f"moe_experts: x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)} and down "
            f"{tuple(down.shape)} do not fit [N, H], [E, 2I, H], [E, H, I]"
        )
    if ids.dim() != 2 or ids.shape[0] != x.shape[0] or weights.shape != ids.shape:
        raise ValueError(
            f"moe_experts: weights {tuple(weights.shape)} and ids {tuple(ids.shape)} must both "
            f"be [N, k] with N = {x.shape[0]}"
        )

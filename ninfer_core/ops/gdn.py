"""Gated DeltaNet hot ops: the fused steps (decode, speculative verify / commit, a forked chunk's
tail), chunked prefill.

The fused steps are the whole layer between the input projections and out_proj for T <= 16 new
tokens per sequence: conv + SiLU, q / k l2-norm, gates, the delta rule on the fp32 state token
by token, gated RMSNorm. Four uses, one kernel pair (csrc/gdn_decode.cu) and one reference
(`gdn_steps_ref`, composing the functions of layers/gdn.py and layers/norm.py exactly as
`GatedDeltaNet` does), selected in `_steps`:
  gdn_decode_step   T = 1: output, pools advanced;
  gdn_verify        T = K + 1: every token's output, pools untouched;
  gdn_commit        pools advanced through the first counts[b] tokens (a device tensor, so the
                    commit replays in a CUDA graph), no output;
  gdn_prefill_tail  a forked prompt chunk's last counts[b] <= 16 tokens, read and written in place
                    at device row offsets, the state they start from copied to a fork slot.
A decode step whose input norm is pending and whose in_proj is quantized runs the conv in in_proj's
GEMV epilogue instead (`gdn_decode_step_folded`, ops/quant.py `quant_linear_add_norm_conv`): the
GEMV, then the recurrent kernel alone (`conv_done`), which l2-normalises q / k itself; one launch
fewer a GDN layer, bit for bit the same results.
Verify + commit is the speculative rollback (engine/speculative/rollback.py): the state is read
by the verify and read + written once by the commit; per-token math is the decode step's, so a
committed state equals the state of that many decode steps bit for bit, given the same inputs.
The kernel reads and writes every state element at most once per launch; the state is the
decode traffic (35B: 30 layers x 32 heads x 64 KB, read and written, per token and sequence).
It applies when the call is on CUDA, every tensor but the state, slots and counts has the model
dtype (fp32 / fp16 / bf16), the state is fp32, both pools are contiguous, dk and dv are
multiples of 32 up to 256 and the conv has 2..8 taps. On the CPU, fp32 models' decode, verify
and commit steps run csrc/cpu/gdn_step.h (the conv by channel blocks, then one work item per
sequence and value head on the pool's threads; 35B shape, one token: 1.34 -> 0.21 ms a layer);
outside the exact CPU math a decode step's whole mixer (input norm, in_proj, the steps, out_proj) is
one call (`cpu_gdn_mixer`). Anything else runs the reference.

`gated_delta_rule_prefill` is `gated_delta_rule_chunked`'s contract on flash-linear-attention's
Triton kernel (`fla.ops.gated_delta_rule.chunk_gated_delta_rule`, package flash-linear-attention
or just its kernels, fla-core, which needs only torch, triton and einops) where it is importable.
Why fla rather than our own chunked kernel now: it is the maintained, per-architecture tuned
kernel that transformers and the serving engines run for Qwen3-Next / Qwen3.5 on GPU, so prefill
matches what the checkpoints are validated with; it takes our layout as is ([B, T, H, D], fp32
state [B, Hv, dk, dv] in and out, value head j reading key head j // (Hv / Hk) without expanding
q, k (checked on 0.6.0, the oldest version accepted), log-space g, post-sigmoid beta, `scale`).
A chunked kernel of our own (intra-chunk triangular solve, inter-chunk state scan, tensor-core
tiling per GPU) is a large project for prefill alone, while decode, a plain memory-bound
recurrence, is where owning the kernel pays (fused norm, CUDA graphs). Only bf16 / fp16 models
take it: q, k go in at the model dtype (as transformers feeds them) and fla's fp32 matmuls would
run in TF32 (~1e-3), so fp32 models (the parity tests) keep the exact reference. The layer's prefill
(`gated_delta_rule_from_conv`) hands fla the conv output's heads and the gates' raw inputs, with q /
k's l2norm, the gates and beta's sigmoid done inside fla's kernels: a short prompt's GDN layer is
launch-bound, and those steps in torch were about 25 small kernels a layer.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace

import torch

from ..layers import gdn as gdn_layer
from ..layers.norm import PendingNorm, gated_rms_norm
from . import dispatch, quant
from .cpu_layer import cpu_fp32, linear_plan
from .kquant import KQuantWeight

log = logging.getLogger(__name__)

_MAX_HEAD_DIM = 256
MAX_STEP_TOKENS = 16  # tokens per sequence the fused steps take (speculative K + 1 <= 16)
_MAX_CONV_KERNEL = 8
_FLA_DTYPES = (torch.bfloat16, torch.float16)
_FLA_MIN_VERSION = (0, 6)  # native grouped value heads (Hv > Hk) in the chunked kernels


@dataclass(frozen=True)
class GDNWeights:
    """One GDN layer's parameters the fused steps read, and its head layout."""

    conv_weight: torch.Tensor  # [C, K]
    A_log: torch.Tensor  # [Hv]
    dt_bias: torch.Tensor  # [Hv]
    norm_weight: torch.Tensor  # [dv]
    eps: float
    num_k_heads: int
    head_k_dim: int
    head_v_dim: int


@dataclass(frozen=True)
class GDNStepInputs:
    """The tensors of one fused-step call (shapes checked in `_check`): T new tokens of B sequences."""

    qkv: torch.Tensor  # [B, T, C] pre-conv projections
    a: torch.Tensor  # [B, T, Hv] (in_proj_a)
    b: torch.Tensor  # [B, T, Hv] (in_proj_b)
    z: torch.Tensor | None  # [B, T, Hv*dv] the norm's gate; None: no output (commit)
    conv_pool: torch.Tensor  # [S, C, K-1]
    state_pool: torch.Tensor  # [S, Hv, dk, dv] fp32
    slots: torch.Tensor  # [B] distinct
    counts: torch.Tensor | None = None  # [B] tokens row b advances through (a device tensor); None: all T
    # A forked prefill chunk's tail: row b's tokens are rows offsets[b] .. offsets[b] + width - 1 of
    # qkv / a / b / z (and out), and its state before them is also copied to fork_slots[b].
    offsets: torch.Tensor | None = None  # [B] int64 on the device
    fork_slots: torch.Tensor | None = None  # [B] int64
    width: int | None = None  # tokens per row with offsets (<= MAX_STEP_TOKENS)
    # qkv holds the conv's outputs already and the conv states have advanced (in_proj's GEMV ran the
    # conv: `gdn_decode_step_folded`); a decode step's (T = 1, z, no counts / offsets / fork slots).
    conv_done: bool = False

    @property
    def num_tokens(self) -> int:
        return self.qkv.shape[1] if self.width is None else self.width


def gdn_steps_ref(step: GDNStepInputs, write_state: bool, w: GDNWeights) -> torch.Tensor | None:
    """Torch reference of the fused steps (any device, any float dtype); `_steps` has the contract.
    Composes the functions of layers/gdn.py and layers/norm.py exactly as `GatedDeltaNet` does.
    Partial advances (counts) keep the state after every token and pick each row's: one pass and
    no host sync (CUDA graphs capture it too)."""
    qkv, conv_pool, state_pool, slots, counts = step.qkv, step.conv_pool, step.state_pool, step.slots, step.counts
    batch, num_tokens, _ = qkv.shape
    conv_state, state = conv_pool[slots], state_pool[slots]
    if step.fork_slots is not None:
        conv_pool[step.fork_slots], state_pool[step.fork_slots] = conv_state, state
    final_conv: torch.Tensor | None = None  # conv_done: the conv states have advanced already
    if step.conv_done:
        parts = gdn_layer.qkv_parts(qkv, w.num_k_heads * w.head_k_dim)
        q, k, v = gdn_layer.qkv_heads(parts, w.num_k_heads, w.head_k_dim, w.head_v_dim, state_pool.dtype)
    else:
        q, k, v, final_conv = gdn_layer.conv_qkv_heads(
            qkv, conv_state, w.conv_weight, w.num_k_heads, w.head_k_dim, w.head_v_dim, state_pool.dtype
        )
    g, beta = gdn_layer.gdn_gates(step.a, step.b, w.A_log, w.dt_bias)
    partial = write_state and counts is not None
    o, states = gdn_layer.gated_delta_rule_recurrent(q, k, v, g, beta, state, every_state=partial)
    out = None
    if step.z is not None:
        out = gated_rms_norm(o.to(qkv.dtype), step.z.reshape(batch, num_tokens, -1, w.head_v_dim), w.norm_weight,
                             w.eps)
        out = out.reshape(batch, num_tokens, -1)
    if not write_state:
        return out
    if counts is None:
        if final_conv is not None:
            conv_pool[slots] = final_conv
        state_pool[slots] = states
        return out
    n = counts.clamp(0, num_tokens)
    state_pool[slots] = states[torch.arange(batch, device=n.device), n]
    conv_pool[slots] = gdn_layer.conv_state_after(conv_state, qkv, n)
    return out


def gdn_decode_step_ref(
    qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, z: torch.Tensor, conv_pool: torch.Tensor,
    state_pool: torch.Tensor, slots: torch.Tensor, w: GDNWeights,
) -> torch.Tensor:
    """Torch reference of `gdn_decode_step`."""
    step = GDNStepInputs(qkv[:, None], a[:, None], b[:, None], z[:, None], conv_pool, state_pool, slots)
    out = gdn_steps_ref(step, True, w)
    assert out is not None
    return out[:, 0]


def gdn_decode_step(
    qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, z: torch.Tensor, conv_pool: torch.Tensor,
    state_pool: torch.Tensor, slots: torch.Tensor, w: GDNWeights, *, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One GDN layer's step for one new token of each of B sequences, before out_proj.

    qkv [B, C] pre-conv projections, a / b [B, Hv] (in_proj_a / in_proj_b), z [B, Hv*dv] (the
    norm's gate); conv_pool [S, C, K-1] and state_pool [S, Hv, dk, dv] advance in place at the
    (distinct) `slots` [B]. Returns gated_rms_norm(o, z) as [B, Hv*dv] in qkv's dtype (into `out`).
    """
    if out is not None:
        _check_out(out, z, "gdn_decode_step")
    step = GDNStepInputs(qkv[:, None], a[:, None], b[:, None], z[:, None], conv_pool, state_pool, slots)
    value = _steps("gdn_decode_step", step, True, w, None if out is None else out[:, None])
    assert value is not None
    return value[:, 0] if out is None else out


def quant_linear_add_norm_conv_ref(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, zero_centered: bool,
    qw: quant.QuantizedWeight, bias: torch.Tensor | None, conv: quant.GemvConv,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of ops/quant.py `quant_linear_add_norm_conv`: the normed projection
    (`quant_linear_add_norm_ref`), then one conv step (`causal_conv1d_silu`) on the first C outputs of
    each row, the conv states of `conv.slots` advanced."""
    y, summed = quant.quant_linear_add_norm_ref(x, residual, norm_weight, eps, zero_centered, qw, bias)
    channels = conv.weight.shape[0]
    rows = y.reshape(-1, 1, y.shape[-1])  # [M, 1, N]: one new input a sequence
    mixed, conv.pool[conv.slots] = gdn_layer.causal_conv1d_silu(rows[..., :channels], conv.pool[conv.slots],
                                                                conv.weight)
    zeroed = torch.zeros(conv.zeroed, dtype=torch.int32, device=x.device)
    return torch.cat((mixed, rows[..., channels:]), dim=-1).view(y.shape), summed, zeroed


def gdn_decode_step_folded_ref(
    pending: PendingNorm, in_proj: quant.QuantizedWeight, bias: torch.Tensor | None, conv_pool: torch.Tensor,
    state_pool: torch.Tensor, slots: torch.Tensor, w: GDNWeights,
) -> torch.Tensor:
    """Torch reference of `gdn_decode_step_folded`: the projection with its conv step, then the steps
    without the conv."""
    norm, conv = pending.norm, quant.GemvConv(conv_pool, w.conv_weight, slots, 0)
    y, pending.summed, _ = quant_linear_add_norm_conv_ref(pending.x, pending.residual, norm.weight, norm.eps,
                                                          norm.zero_centered, in_proj, bias, conv)
    out = gdn_steps_ref(_folded_step(y, conv_pool, state_pool, slots, w), True, w)
    assert out is not None
    return out[:, 0]


def gdn_decode_step_folded(
    pending: PendingNorm, in_proj: quant.QuantizedWeight, bias: torch.Tensor | None, conv_pool: torch.Tensor,
    state_pool: torch.Tensor, slots: torch.Tensor, w: GDNWeights,
) -> torch.Tensor | None:
    """`gdn_decode_step` on in_proj's projections of the pending norm's rows [B, 1, hidden] (in_proj's
    rows: the GDN layer's merged [qkv | z | b | a]), with the conv in in_proj's GEMV epilogue
    (`quant.quant_linear_add_norm_conv`) and the fused steps after it without their conv: two launches
    where `quant_linear_add_norm` + `gdn_decode_step` take three. Returns [B, Hv*dv] and sets
    pending.summed; None where the GEMV does not take the conv (nothing ran: the caller projects and
    steps as before), e.g. for slots that are not contiguous int64."""
    num_v_heads, channels = w.A_log.shape[0], w.conv_weight.shape[0]
    if in_proj.out_features != channels + num_v_heads * (w.head_v_dim + 2):
        raise ValueError(f"gdn_decode_step_folded: in_proj has {in_proj.out_features} rows, not qkv {channels} + "
                         f"z {num_v_heads * w.head_v_dim} + b, a {num_v_heads} each")
    norm, batch = pending.norm, pending.x.shape[0]
    conv = quant.GemvConv(conv_pool, w.conv_weight, slots, batch * num_v_heads)
    projected = quant.quant_linear_add_norm_conv(pending.x, pending.residual, norm.weight, norm.eps,
                                                 norm.zero_centered, in_proj, bias, conv)
    if projected is None:
        return None
    y, pending.summed, counters = projected
    out = _steps("gdn_decode_step_folded", _folded_step(y, conv_pool, state_pool, slots, w), True, w, None,
                 counters)
    assert out is not None
    return out[:, 0]


def _folded_step(y: torch.Tensor, conv_pool: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor,
                 w: GDNWeights) -> GDNStepInputs:
    """The steps' inputs from in_proj's output y [B, 1, qkv | z | b | a] whose qkv the conv has run on."""
    num_v_heads = w.A_log.shape[0]
    qkv, z, b, a = y.split([w.conv_weight.shape[0], num_v_heads * w.head_v_dim, num_v_heads, num_v_heads], dim=-1)
    return GDNStepInputs(qkv, a, b, z, conv_pool, state_pool, slots, conv_done=True)


def gdn_verify_ref(
    qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, z: torch.Tensor, conv_pool: torch.Tensor,
    state_pool: torch.Tensor, slots: torch.Tensor, w: GDNWeights,
) -> torch.Tensor:
    """Torch reference of `gdn_verify`."""
    out = gdn_steps_ref(GDNStepInputs(qkv, a, b, z, conv_pool, state_pool, slots), False, w)
    assert out is not None
    return out


def gdn_verify(
    qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, z: torch.Tensor, conv_pool: torch.Tensor,
    state_pool: torch.Tensor, slots: torch.Tensor, w: GDNWeights,
) -> torch.Tensor:
    """Speculative verification: qkv [B, T, C], a / b [B, T, Hv], z [B, T, Hv*dv] of T <= 16 tokens
    -> gated_rms_norm(o, z) [B, T, Hv*dv], token t seeing the state advanced through tokens
    0..t; the pools stay as they are (`gdn_commit` keeps the accepted prefix later)."""
    return gdn_verify_recorded(qkv, a, b, z, conv_pool, state_pool, slots, w)[0]


def gdn_verify_recorded(
    qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, z: torch.Tensor, conv_pool: torch.Tensor,
    state_pool: torch.Tensor, slots: torch.Tensor, w: GDNWeights,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`gdn_verify`, and on the CUDA kernel its activations (the conv's outputs, fp32 [B (T C + Hv)]),
    which `gdn_commit(act=...)` reads instead of running the conv again: a commit of one launch a layer
    instead of two. None where the kernel does not run (the commit then recomputes them)."""
    step = GDNStepInputs(qkv, a, b, z, conv_pool, state_pool, slots)
    act = None
    if _kernel_applies(step, w) and not _cpu_kernel_applies(step, w):
        act = _scratch(step)
    out = _steps("gdn_verify", step, False, w, None, scratch=act)
    assert out is not None
    return out, act


def gdn_commit_ref(
    qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_pool: torch.Tensor, state_pool: torch.Tensor,
    slots: torch.Tensor, counts: torch.Tensor, w: GDNWeights,
) -> None:
    """Torch reference of `gdn_commit`."""
    gdn_steps_ref(GDNStepInputs(qkv, a, b, None, conv_pool, state_pool, slots, counts), True, w)


def gdn_commit(
    qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_pool: torch.Tensor, state_pool: torch.Tensor,
    slots: torch.Tensor, counts: torch.Tensor, w: GDNWeights, act: torch.Tensor | None = None,
) -> None:
    """After a verify: advance row b's pools through its first counts[b] tokens (a device int64
    tensor [B], read on the device: no host sync, so a CUDA graph can replay it). act: that verify's
    activations (`gdn_verify_recorded`), read instead of running the conv again (the same values)."""
    step = GDNStepInputs(qkv, a, b, None, conv_pool, state_pool, slots, counts)
    _steps("gdn_commit", step, True, w, None, scratch=act)


def gdn_prefill_tail(
    qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, z: torch.Tensor, conv_pool: torch.Tensor,
    state_pool: torch.Tensor, slots: torch.Tensor, w: GDNWeights, *, offsets: torch.Tensor, counts: torch.Tensor,
    fork_slots: torch.Tensor, width: int, out: torch.Tensor,
) -> None:
    """The tail of a forked prefill chunk (layers/gdn.py `_forked`): qkv [B, T, C], a / b [B, T, Hv],
    z / out [B, T, Hv*dv] of the whole chunk; slots[b]'s state is copied to fork_slots[b], then
    advances through row b's tokens offsets[b] .. offsets[b] + counts[b] - 1 (counts[b] <= width
    <= 16), whose outputs overwrite those rows of out; other rows of out stay. Device tensors, no
    host sync: a prompt-chunk CUDA graph replays it."""
    _check_out(out, z, "gdn_prefill_tail")
    step = GDNStepInputs(qkv, a, b, z, conv_pool, state_pool, slots, counts, offsets, fork_slots, width)
    _steps("gdn_prefill_tail", step, True, w, out)


def gdn_prefill_stepped(
    qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, z: torch.Tensor, conv_pool: torch.Tensor,
    state_pool: torch.Tensor, slots: torch.Tensor, w: GDNWeights, cuts: Sequence[tuple[int, torch.Tensor]] = (),
) -> torch.Tensor:
    """A prefill chunk [B, T, ...] as fused steps of up to MAX_STEP_TOKENS tokens: the pools of `slots`
    advance through all T tokens; after `at` tokens of each (at, fork_slots) in `cuts` (0 < at <= T)
    both pools are also copied to fork_slots (a checkpoint). Returns the normed outputs [B, T, Hv*dv].
    Where the CPU kernel takes them (`cpu_steps_apply`) the chunked rule's ~100 torch ops cost more:
    one 35B-shape layer, one thread, 4 / 16 / 64 / 256 tokens: 11.4 / 11.2 / 16.5 / 67 ms chunked,
    0.5 / 1.9 / ~7.6 / ~30 ms stepped."""
    batch, total = qkv.shape[:2]
    out = torch.empty(z.shape, dtype=z.dtype, device=z.device)
    edges = sorted({*range(0, total, MAX_STEP_TOKENS), *(at for at, _ in cuts), total})
    for start, stop in zip(edges, edges[1:]):
        inputs = (t[:, start:stop] for t in (qkv, a, b, z))
        rows = out[:, start:stop]  # contiguous for one sequence; several: written through a copy
        written = rows if rows.is_contiguous() else torch.empty_like(rows)
        _steps("gdn_prefill_stepped", GDNStepInputs(*inputs, conv_pool, state_pool, slots), True, w, written)
        if written is not rows:
            rows.copy_(written)
        for at, fork_slots in cuts:
            if at == stop:
                conv_pool[fork_slots], state_pool[fork_slots] = conv_pool[slots], state_pool[slots]
    return out


def _tail_ref(step: GDNStepInputs, w: GDNWeights, out: torch.Tensor) -> None:
    """`gdn_prefill_tail` composed of the reference steps: gather the rows, step, scatter the kept ones."""
    assert step.offsets is not None and step.counts is not None and step.z is not None
    batch, rows = step.qkv.shape[:2]
    taken = torch.arange(step.num_tokens, device=step.qkv.device)
    index = (step.offsets[:, None] + taken).clamp(max=rows - 1)  # [B, W]
    take = lambda t: t.gather(1, index[..., None].expand(-1, -1, t.shape[-1]))  # noqa: E731
    inner = GDNStepInputs(take(step.qkv), take(step.a), take(step.b), take(step.z), step.conv_pool,
                          step.state_pool, step.slots, step.counts, fork_slots=step.fork_slots)
    tail = gdn_steps_ref(inner, True, w)
    assert tail is not None
    kept = torch.where(taken < step.counts[:, None], index, rows)  # rows past the counts go to a spare row
    spare = torch.cat((out, out.new_zeros(batch, 1, out.shape[-1])), dim=1)
    out.copy_(spare.scatter(1, kept[..., None].expand(-1, -1, out.shape[-1]), tail)[:, :rows])


def _scratch(step: GDNStepInputs) -> torch.Tensor:
    """The fused steps' scratch: fp32 activations [B, T, C], then one counter per (row, value head)."""
    batch, _, channels = step.qkv.shape
    return torch.empty(batch * (step.num_tokens * channels + step.a.shape[2]), dtype=torch.float32,
                       device=step.qkv.device)


def _steps(name: str, step: GDNStepInputs, write_state: bool, w: GDNWeights,
           out: torch.Tensor | None, counters: torch.Tensor | None = None,
           scratch: torch.Tensor | None = None) -> torch.Tensor | None:
    """The one dispatch place of the fused steps: the kernel where it applies, else the reference.
    Rows advance through counts[b] tokens (all T when None) if write_state; with z the outputs of
    all T tokens are returned (into `out` [B, T, Hv*dv] when given). counters: with step.conv_done,
    the recurrent kernel's [B * Hv] int32 counters, which the GEMV that ran the conv zeroed.
    scratch (`_scratch`'s): a verify's, kept (`gdn_verify_recorded`); a commit's (write_state): that
    verify's, whose activations the kernel reads instead of running the conv (unused by the references)."""
    _check(name, step, w)
    if step.conv_done and (counters is None or counters.shape != (step.qkv.shape[0] * step.a.shape[2],)):
        raise ValueError(f"{name}: a step after the conv needs the GEMV's zeroed counters [B * Hv]")
    if _cpu_kernel_applies(step, w):
        return _cpu_steps(step, write_state, w, out)
    if not _kernel_applies(step, w):
        dispatch.fallback(name, step.qkv, step.state_pool)
        if step.offsets is not None:
            assert out is not None
            _tail_ref(step, w, out)
            return out
        value = gdn_steps_ref(step, write_state, w)
        return value if out is None or value is None else out.copy_(value)
    kernel_step = _kernel_layout(step)
    if step.z is not None and out is None:
        out = torch.empty(step.z.shape, dtype=step.z.dtype, device=step.z.device)
    act_ready = write_state and scratch is not None
    if step.conv_done:
        scratch = counters  # [B * Hv] int32, zeroed by the GEMV that ran the conv
    elif scratch is None:
        scratch = _scratch(step)
    # The binding takes GDNStepInputs' fields by name (conv_done among them) and reads every size and
    # stride from them.
    dispatch.extension().gdn_steps(
        **{f.name: getattr(kernel_step, f.name) for f in fields(kernel_step)},
        out=out,
        scratch=scratch,
        conv_weight=w.conv_weight.contiguous(),
        A_log=w.A_log.contiguous(),
        dt_bias=w.dt_bias.contiguous(),
        norm_weight=w.norm_weight.contiguous(),
        write_state=write_state,
        q_scale=w.head_k_dim**-0.5,
        eps=float(w.eps),
        stream=dispatch.stream_handle(step.qkv),
        act_ready=act_ready,
    )
    return out


def _cpu_steps(step: GDNStepInputs, write_state: bool, w: GDNWeights, out: torch.Tensor | None) -> torch.Tensor | None:
    """`_steps` on the CPU kernel (csrc/cpu/gdn_step.h): the inputs read in place where their tokens are
    one stride apart (slices of in_proj's output), the pools advanced in place."""
    step = _kernel_layout(step)
    if step.z is not None and out is None:
        out = torch.empty(step.z.shape, dtype=step.z.dtype)
    batch, tokens, _ = step.qkv.shape
    params = [t.contiguous() for t in (w.conv_weight, w.A_log, w.dt_bias, w.norm_weight)]
    pointer = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    dispatch.cpu_extension().gdn_steps(
        *(pointer(t) for t in (out, step.qkv, step.a, step.b, step.z, step.conv_pool, step.state_pool, step.slots,
                               step.counts, *params)),
        batch, tokens, w.num_k_heads, step.a.shape[2], w.head_k_dim, w.head_v_dim, w.conv_weight.shape[1],
        _token_stride(step.qkv), _token_stride(step.a), 0 if step.z is None else _token_stride(step.z),
        w.head_k_dim**-0.5, float(w.eps), write_state, dispatch.cpu_threads(),
    )
    return out


def cpu_gdn_mixer(
    pending: PendingNorm, in_proj: quant.QuantizedWeight | KQuantWeight, out_proj: quant.QuantizedWeight | KQuantWeight,
    out_order: torch.Tensor | None, conv_pool: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor,
    w: GDNWeights,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A decode step's GDN mixer on the CPU in one call (csrc/cpu/gdn_step.h `gdn_mixer`): (out_proj's
    output [B, 1, H], x + residual) for the pending input norm's rows, in_proj's rows [qkv | z | b | a]
    (layers/gdn.py), out_proj's inputs taken in `out_order` where given; the pools advance at `slots`.
    The same kernels in the same order as the layer's calls one by one (add_rmsnorm, the projections,
    `_cpu_steps`), so the same bits. None where it does not apply: the exact CPU math (its projections
    multiply differently), not fp32, not one new token a sequence."""
    x, residual, norm = pending.x, pending.residual, pending.norm
    batch, tokens, hidden = x.shape
    plans = tuple(linear_plan(p) for p in (in_proj, out_proj))
    if not (tokens == 1 and dispatch.cpu_math() != "exact" and cpu_steps_apply(conv_pool, state_pool, w)
            and all(cpu_fp32(t) for t in (x, residual, norm.weight))
            and residual.shape == x.shape and None not in (in_proj.cpu_plan, out_proj.cpu_plan)
            and slots.dtype == torch.int64 and slots.is_contiguous()
            and (out_order is None or (out_order.dtype == torch.int64 and out_order.is_contiguous()))):
        return None
    out, summed = torch.empty_like(x), torch.empty_like(x)
    tensors = (x, residual, summed, out, conv_pool, state_pool, slots, w.conv_weight.contiguous(), w.A_log, w.dt_bias,
               w.norm_weight, norm.weight)
    pointers = (*(t.data_ptr() for t in tensors), 0 if out_order is None else out_order.data_ptr())
    dispatch.cpu_extension().gdn_mixer(
        pointers, batch, tokens, w.num_k_heads, w.A_log.shape[0], w.head_k_dim, w.head_v_dim, w.conv_weight.shape[1],
        w.head_k_dim**-0.5, float(w.eps), float(norm.eps), norm.zero_centered, *plans, dispatch.cpu_threads(),
        dispatch.cpu_math() == "int8")
    return out, summed


def cpu_steps_apply(conv_pool: torch.Tensor, state_pool: torch.Tensor, w: GDNWeights) -> bool:
    """Whether the CPU kernel takes a layer's fused steps: an fp32 model on the CPU, contiguous pools."""
    tensors = (conv_pool, state_pool, w.conv_weight, w.A_log, w.dt_bias, w.norm_weight)
    return (dispatch.use_cpu_kernel(*tensors) and all(t.dtype == torch.float32 for t in tensors)
            and state_pool.is_contiguous() and conv_pool.is_contiguous()
            and 2 <= w.conv_weight.shape[1] <= _MAX_CONV_KERNEL)


def _cpu_kernel_applies(step: GDNStepInputs, w: GDNWeights) -> bool:
    """`cpu_steps_apply`, and the call's own tensors fp32 on the CPU: a decode, verify, commit or
    stepped prefill (a forked prefill's tail and steps after a GEMV's conv are CUDA's)."""
    tensors = [t for t in (step.qkv, step.a, step.b, step.z) if t is not None]
    return (
        cpu_steps_apply(step.conv_pool, step.state_pool, w)
        and dispatch.use_cpu_kernel(*tensors, step.slots, *([] if step.counts is None else [step.counts]))
        and all(t.dtype == torch.float32 for t in tensors)
        and step.offsets is None
        and step.fork_slots is None
        and not step.conv_done
        and step.num_tokens <= MAX_STEP_TOKENS
    )


def conv_prefill(qkv: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor,
                 key_dim: int, valid: torch.Tensor | None = None) -> gdn_layer.QKV:
    """A prefill chunk's causal conv + SiLU, qkv [B, T, C] -> its q, k, v parts [B, T, key_dim],
    [B, T, key_dim], [B, T, C - 2 key_dim]; the conv states of `slots` advance in the pool through
    each row's first valid[b] tokens (all T without `valid`). One kernel on CUDA (csrc/gdn_conv.cu),
    which writes each part dense (fla's prefill copied each column slice of a [B, T, C] output:
    three copies a GDN layer), else `conv_prefill_ref`'s views."""
    taps, (batch, tokens, channels) = weight.shape[-1], qkv.shape
    if not (dispatch.use_kernel(qkv, conv_pool, weight) and qkv.dtype == conv_pool.dtype == weight.dtype
            and 2 <= taps <= _MAX_CONV_KERNEL and conv_pool.is_contiguous() and slots.dtype == torch.int64
            and (valid is None or valid.dtype == torch.int64)):
        dispatch.fallback("gdn conv_prefill", qkv, conv_pool, weight)
        return gdn_layer.qkv_parts(conv_prefill_ref(qkv, conv_pool, slots, weight, valid), key_dim)
    out = torch.empty(batch * tokens * channels, dtype=qkv.dtype, device=qkv.device)
    dispatch.extension().gdn_conv_prefill(  # qkv read in place with its own strides
        out=out, qkv=qkv if qkv.stride(-1) == 1 else qkv.contiguous(), conv_pool=conv_pool, slots=slots.contiguous(),
        valid=None if valid is None else valid.contiguous(), weight=weight.contiguous(), split=key_dim,
        stream=dispatch.stream_handle(qkv),
    )
    widths = (key_dim, key_dim, channels - 2 * key_dim)
    q, k, v = (part.view(batch, tokens, width)
               for part, width in zip(out.split([batch * tokens * w for w in widths]), widths))
    return q, k, v


def conv_prefill_ref(qkv: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor,
                     valid: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of `conv_prefill` (any device)."""
    conv_state = conv_pool[slots]
    mixed, final = gdn_layer.causal_conv1d_silu(qkv, conv_state, weight)
    conv_pool[slots] = final if valid is None else gdn_layer.conv_state_after(conv_state, qkv, valid)
    return mixed


def gated_delta_rule_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gated_delta_rule_chunked`, on fla's kernel where it applies (then o comes in v's dtype)."""
    if _fla_applies(q, v, state):
        return gated_delta_rule_fla(q, k, v, g, beta, state)
    dispatch.fallback("gated_delta_rule_prefill (fla)", v, state)
    return gdn_layer.gated_delta_rule_chunked(q, k, v, g, beta, state)


def gated_delta_rule_from_conv(
    parts: gdn_layer.QKV, a: torch.Tensor, b: torch.Tensor, w: GDNWeights, valid_tokens: torch.Tensor | None,
    state: torch.Tensor, delta_rule: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked rule from the conv output's q, k, v parts and the gates' raw inputs a, b [B, T, Hv]:
    (o, final state); padding (past valid_tokens) leaves the state as it is. On fla, q / k's l2norm,
    the gates and beta's sigmoid run inside its kernels (`gated_delta_rule_fla_raw`): about 25 small
    torch kernels fewer a layer, each a launch-bound ~2 us of a short prompt's graph (2,479 kernels
    for a 37-token prompt of the 35B, 12.4 ms of GPU time on the H100). Else, or with `delta_rule`
    (a test's recurrent form): `heads_and_gates`, then that rule or `gated_delta_rule_prefill`."""
    q, k, v = gdn_layer.split_heads(parts, w.num_k_heads, w.head_k_dim, w.head_v_dim)
    if delta_rule is None and _fla_applies(q, v, state):
        return gated_delta_rule_fla_raw(q, k, v, a, b, w, valid_tokens, state)
    q, k, v, g, beta = gdn_layer.heads_and_gates(parts, a, b, w, valid_tokens, state.dtype)
    return (delta_rule or gated_delta_rule_prefill)(q, k, v, g, beta, state)


# a padding token's raw gate inputs: softplus(a + dt_bias) and sigmoid(b) come out exactly 0 in fp32
# (g = beta = 0: the state as it was), a finite value, in range of fp16 and bf16
_PADDING_GATE = -1e4


def gated_delta_rule_fla_raw(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, w: GDNWeights,
    valid_tokens: torch.Tensor | None, state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gated_delta_rule_from_conv` on fla's kernel (q, k, v: the conv output's heads, `split_heads`)
    with q / k's l2norm (q's dk^-1/2 as its scale), g = -exp(A_log) softplus(a + dt_bias) and beta =
    sigmoid(b) inside it (fla >= 0.6: `use_qk_l2norm_in_kernel`, `use_gate_in_kernel`,
    `use_beta_sigmoid_in_kernel`). q, k are normalised from the model dtype to it (the torch path
    normalises in fp32 before rounding)."""
    chunk = _fla_chunk()
    if chunk is None:
        raise RuntimeError("flash-linear-attention (fla >= 0.6 with triton) is not importable")
    if valid_tokens is not None:
        real = gdn_layer.real_tokens(valid_tokens, q.shape[1])
        a, b = torch.where(real, a, _PADDING_GATE), torch.where(real, b, _PADDING_GATE)
    return chunk(q, k, v, a, b, scale=w.head_k_dim**-0.5, initial_state=state.float(), output_final_state=True,
                 use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=w.A_log, dt_bias=w.dt_bias,
                 use_beta_sigmoid_in_kernel=True)


def gated_delta_rule_fla(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's chunked kernel under `gated_delta_rule_chunked`'s contract (CUDA, fla importable).

    q, k are cast to v's dtype (fla takes one dtype; q arrives normalised and scaled, hence
    scale=1), g / beta go in fp32, the fp32 state in and out. o comes in v's dtype, not the
    state's: the layer rounds it to the model dtype next anyway.
    """
    chunk = _fla_chunk()
    if chunk is None:
        raise RuntimeError("flash-linear-attention (fla >= 0.6 with triton) is not importable")
    q, k = q.to(v.dtype), k.to(v.dtype)
    return chunk(q, k, v, g.float(), beta.float(), scale=1.0, initial_state=state.float(), output_final_state=True)


def _kernel_layout(step: GDNStepInputs) -> GDNStepInputs:
    """step as the kernel reads it: qkv / a / b / z with their tokens one stride apart (a and b the
    same stride), slots / counts / offsets / fork_slots contiguous int64; views kept where they qualify."""
    a, b = _rows(step.a), _rows(step.b)
    if _token_stride(a) != _token_stride(b):
        a, b = a.contiguous(), b.contiguous()
    index = lambda t: None if t is None else t.long().contiguous()  # noqa: E731
    return replace(step, qkv=_rows(step.qkv), a=a, b=b, z=None if step.z is None else _rows(step.z),
                   slots=index(step.slots), counts=index(step.counts), offsets=index(step.offsets),
                   fork_slots=index(step.fork_slots))


def _token_stride(t: torch.Tensor) -> int | None:
    """t [B, T, X] with a contiguous last axis: the stride between tokens when token t of sequence b
    is row b * T + t of one stride (the kernel's layout), else None. Slices of a merged
    projection's output qualify, so the kernel reads them in place."""
    batch, tokens = t.shape[:2]
    if t.stride(-1) != 1:
        return None
    if tokens == 1:
        return t.stride(0)
    return t.stride(1) if batch == 1 or t.stride(0) == tokens * t.stride(1) else None


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as is when the kernel reads its tokens in place (`_token_stride`), else a contiguous copy."""
    return t if _token_stride(t) is not None else t.contiguous()


def _kernel_applies(step: GDNStepInputs, w: GDNWeights) -> bool:
    qkv, state_pool, conv_pool, slots, counts = step.qkv, step.state_pool, step.conv_pool, step.slots, step.counts
    model_dtype = [t for t in (qkv, step.a, step.b, step.z, conv_pool, w.conv_weight, w.A_log, w.dt_bias,
                               w.norm_weight) if t is not None]
    return (
        dispatch.use_kernel(*model_dtype, state_pool)
        and all(t.dtype == qkv.dtype and t.device == qkv.device for t in model_dtype)
        and state_pool.dtype == torch.float32
        and state_pool.device == slots.device == qkv.device
        and all(t is None or t.device == qkv.device for t in (counts, step.offsets, step.fork_slots))
        and state_pool.is_contiguous()
        and state_pool.data_ptr() % 16 == 0
        and conv_pool.is_contiguous()
        and all(d % 32 == 0 and 32 <= d <= _MAX_HEAD_DIM for d in (w.head_k_dim, w.head_v_dim))
        and 2 <= w.conv_weight.shape[1] <= _MAX_CONV_KERNEL
        and step.num_tokens <= MAX_STEP_TOKENS
        and (not step.conv_done or qkv.dtype in (torch.float16, torch.bfloat16))  # after a 16-bit GEMV
        and qkv.shape[0] <= 65535
        and qkv.shape[0] * qkv.shape[1] < 2**31
    )


def _fla_applies(q: torch.Tensor, v: torch.Tensor, state: torch.Tensor) -> bool:
    return (
        v.is_cuda
        and v.dtype in _FLA_DTYPES
        and state.dtype == torch.float32
        and q.shape[-1] <= _MAX_HEAD_DIM
        and not dispatch.kernels_disabled()
        and _fla_chunk() is not None
    )


@functools.cache
def _fla_chunk() -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """fla's chunk_gated_delta_rule, or None (logged once at debug level) when fla is missing,
    broken or older than 0.6. Only CUDA calls ask, so CPU runs never import it."""
    try:
        import fla
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        version = tuple(int(part) for part in fla.__version__.split(".")[:2])
    except Exception as exc:  # noqa: BLE001 - an optional package: any import failure means "absent"
        log.debug("flash-linear-attention unavailable, GDN prefill uses the torch reference: %s", exc)
        return None
    if version < _FLA_MIN_VERSION:
        log.debug("flash-linear-attention %s is older than 0.6: GDN prefill uses the torch reference", fla.__version__)
        return None
    return chunk_gated_delta_rule


def _check_out(out: torch.Tensor, like: torch.Tensor, name: str) -> None:
    if out.shape != like.shape or out.dtype != like.dtype or out.device != like.device or not out.is_contiguous():
        raise ValueError(f"{name}: out must be a contiguous {like.dtype} tensor of shape {tuple(like.shape)} "
                         f"on {like.device}")


def _check(name: str, step: GDNStepInputs, w: GDNWeights) -> None:
    """Shapes must agree on every path: a kernel given wrong ones would write out of bounds."""
    qkv, a, b, z, conv_pool = step.qkv, step.a, step.b, step.z, step.conv_pool
    if qkv.dim() != 3 or a.dim() != 3 or conv_pool.dim() != 3 or w.conv_weight.dim() != 2:
        raise ValueError(f"{name}: qkv, a need a token axis ([B, T, C], [B, T, Hv]), conv_pool 3 dims, "
                         "conv_weight 2")
    (batch, num_tokens, channels), num_v_heads, num_slots = qkv.shape, a.shape[2], conv_pool.shape[0]
    hk, dk, dv = w.num_k_heads, w.head_k_dim, w.head_v_dim
    if hk <= 0 or num_v_heads % hk:
        raise ValueError(f"{name}: {num_v_heads} value heads are not a multiple of {hk} key heads")
    if channels != 2 * hk * dk + num_v_heads * dv:
        raise ValueError(f"{name}: qkv width {channels} != 2 * {hk} * {dk} + {num_v_heads} * {dv}")
    taps = w.conv_weight.shape[1]
    expected = {
        "a": (a, (batch, num_tokens, num_v_heads)),
        "b": (b, (batch, num_tokens, num_v_heads)),
        "conv_pool": (conv_pool, (num_slots, channels, taps - 1)),
        "state_pool": (step.state_pool, (num_slots, num_v_heads, dk, dv)),
        "slots": (step.slots, (batch,)),
        "conv_weight": (w.conv_weight, (channels, taps)),
        "A_log": (w.A_log, (num_v_heads,)),
        "dt_bias": (w.dt_bias, (num_v_heads,)),
        "norm_weight": (w.norm_weight, (dv,)),
    }
    if z is not None:
        expected["z"] = (z, (batch, num_tokens, num_v_heads * dv))
    for key in ("counts", "offsets", "fork_slots"):
        if getattr(step, key) is not None:
            expected[key] = (getattr(step, key), (batch,))
    if step.conv_done and (num_tokens != 1 or z is None or any(
            t is not None for t in (step.counts, step.offsets, step.fork_slots))):
        raise ValueError(f"{name}: steps after the conv are a decode step's (1 token, z, no counts / offsets)")
    if step.width is not None and not (1 <= step.width <= min(num_tokens, MAX_STEP_TOKENS)):
        raise ValueError(f"{name}: width {step.width} out of range [1, {min(num_tokens, MAX_STEP_TOKENS)}]")
    for key, (t, shape) in expected.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: {key} has shape {tuple(t.shape)}, expected {shape}")

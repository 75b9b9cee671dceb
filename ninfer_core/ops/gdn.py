"""Gated DeltaNet hot ops: the fused decode step and the chunked prefill.

`gdn_decode_step` (one new token per sequence) is the whole layer between the input projections
and out_proj: conv + SiLU, q / k l2-norm, gates, one delta-rule step on the fp32 state, gated
RMSNorm. Its reference `gdn_decode_step_ref` composes the functions of layers/gdn.py and
layers/norm.py exactly as `GatedDeltaNet` does for T = 1. The CUDA kernel (csrc/gdn_decode.cu)
fuses it into two launches that read and write every state element once; the state is the
decode traffic (35B: 30 layers x 32 heads x 64 KB, read and written, per token and sequence).
It applies when the call is on CUDA, every tensor but the state and the slots has the model dtype
(fp32 / fp16 / bf16), the state is fp32, both pools are contiguous, dk and dv are multiples of 32
up to 256 and the conv has 2..8 taps; anything else runs the reference.

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
run in TF32 (~1e-3), so fp32 models (the parity tests) keep the exact reference. Speculative
verification always keeps the reference (layers/gdn.py).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from ..layers import gdn as gdn_layer
from ..layers.norm import gated_rms_norm
from . import dispatch

log = logging.getLogger(__name__)

_MAX_HEAD_DIM = 256
_MAX_CONV_KERNEL = 8
_FLA_DTYPES = (torch.bfloat16, torch.float16)
_FLA_MIN_VERSION = (0, 6)  # native grouped value heads (Hv > Hk) in the chunked kernels


def gdn_decode_step_ref(
    qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    z: torch.Tensor,
    conv_pool: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
) -> torch.Tensor:
    """Torch reference of `gdn_decode_step` (any device, any float dtype)."""
    batch = qkv.shape[0]
    q, k, v, conv_state = gdn_layer.conv_qkv_heads(
        qkv[:, None], conv_pool[slots], conv_weight, num_k_heads, head_k_dim, head_v_dim, state_pool.dtype
    )
    g, beta = gdn_layer.gdn_gates(a[:, None], b[:, None], A_log, dt_bias)
    out, state = gdn_layer.gated_delta_rule_recurrent(q, k, v, g, beta, state_pool[slots])
    conv_pool[slots] = conv_state
    state_pool[slots] = state
    out = gated_rms_norm(out.to(qkv.dtype), z.reshape(batch, 1, -1, head_v_dim), norm_weight, eps)
    return out.reshape(batch, -1)


def gdn_decode_step(
    qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    z: torch.Tensor,
    conv_pool: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One GDN layer's step for one new token of each of B sequences, before out_proj.

    qkv [B, C] pre-conv projections, a / b [B, Hv] (in_proj_a / in_proj_b), z [B, Hv*dv] (the
    norm's gate); conv_pool [S, C, K-1] and state_pool [S, Hv, dk, dv] advance in place at the
    (distinct) `slots` [B]; conv_weight [C, K], A_log / dt_bias [Hv], norm_weight [dv].
    Returns gated_rms_norm(o, z) as [B, Hv*dv] in qkv's dtype (into `out` when given).
    """
    args = (qkv, a, b, z, conv_pool, state_pool, slots, conv_weight, A_log, dt_bias, norm_weight)
    _check(*args, num_k_heads, head_k_dim, head_v_dim, out)
    if not _kernel_applies(*args, head_k_dim, head_v_dim):
        value = gdn_decode_step_ref(*args, eps, num_k_heads, head_k_dim, head_v_dim)
        return value if out is None else out.copy_(value)
    qkv, a, b, z, conv_weight, A_log, dt_bias, norm_weight = (
        t.contiguous() for t in (qkv, a, b, z, conv_weight, A_log, dt_bias, norm_weight)
    )
    slots = slots.long().contiguous()
    batch, channels = qkv.shape
    num_v_heads = a.shape[1]
    out = torch.empty_like(z) if out is None else out
    scratch = torch.empty(batch * (channels + num_v_heads), dtype=torch.float32, device=qkv.device)
    dispatch.extension().gdn_decode_step(
        out=out.data_ptr(),
        scratch=scratch.data_ptr(),
        qkv=qkv.data_ptr(),
        a=a.data_ptr(),
        b=b.data_ptr(),
        z=z.data_ptr(),
        conv_pool=conv_pool.data_ptr(),
        state_pool=state_pool.data_ptr(),
        slots=slots.data_ptr(),
        conv_weight=conv_weight.data_ptr(),
        A_log=A_log.data_ptr(),
        dt_bias=dt_bias.data_ptr(),
        norm_weight=norm_weight.data_ptr(),
        batch=batch,
        num_k_heads=num_k_heads,
        num_v_heads=num_v_heads,
        head_k_dim=head_k_dim,
        head_v_dim=head_v_dim,
        conv_kernel=conv_weight.shape[1],
        q_scale=head_k_dim**-0.5,
        eps=float(eps),
        dtype=dispatch.kernel_dtype(qkv),
        device=qkv.device.index,
        stream=dispatch.stream_handle(qkv),
    )
    return out


def gated_delta_rule_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gated_delta_rule_chunked`, on fla's kernel where it applies (then o comes in v's dtype)."""
    if _fla_applies(q, v, state):
        return gated_delta_rule_fla(q, k, v, g, beta, state)
    return gdn_layer.gated_delta_rule_chunked(q, k, v, g, beta, state)


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


def _kernel_applies(
    qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    z: torch.Tensor,
    conv_pool: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    head_k_dim: int,
    head_v_dim: int,
) -> bool:
    model_dtype = (qkv, a, b, z, conv_pool, conv_weight, A_log, dt_bias, norm_weight)
    return (
        dispatch.use_kernel(*model_dtype, state_pool)
        and all(t.dtype == qkv.dtype and t.device == qkv.device for t in model_dtype)
        and state_pool.dtype == torch.float32
        and state_pool.device == slots.device == qkv.device
        and state_pool.is_contiguous()
        and state_pool.data_ptr() % 16 == 0
        and conv_pool.is_contiguous()
        and all(d % 32 == 0 and 32 <= d <= _MAX_HEAD_DIM for d in (head_k_dim, head_v_dim))
        and 2 <= conv_weight.shape[1] <= _MAX_CONV_KERNEL
        and qkv.shape[0] <= 65535
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


def _check(
    qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    z: torch.Tensor,
    conv_pool: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    out: torch.Tensor | None,
) -> None:
    """Shapes must agree on every path: a kernel given wrong ones would write out of bounds."""
    if qkv.dim() != 2 or a.dim() != 2 or conv_pool.dim() != 3 or conv_weight.dim() != 2:
        raise ValueError("gdn_decode_step: qkv, a need 2 dims ([B, C], [B, Hv]), conv_pool 3, conv_weight 2")
    (batch, channels), num_v_heads, num_slots = qkv.shape, a.shape[1], conv_pool.shape[0]
    if num_k_heads <= 0 or num_v_heads % num_k_heads:
        raise ValueError(f"gdn_decode_step: {num_v_heads} value heads are not a multiple of {num_k_heads} key heads")
    if channels != 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim:
        raise ValueError(
            f"gdn_decode_step: qkv width {channels} != 2 * {num_k_heads} * {head_k_dim} + {num_v_heads} * {head_v_dim}"
        )
    taps = conv_weight.shape[1]
    expected = {
        "a": (a, (batch, num_v_heads)),
        "b": (b, (batch, num_v_heads)),
        "z": (z, (batch, num_v_heads * head_v_dim)),
        "conv_pool": (conv_pool, (num_slots, channels, taps - 1)),
        "state_pool": (state_pool, (num_slots, num_v_heads, head_k_dim, head_v_dim)),
        "slots": (slots, (batch,)),
        "conv_weight": (conv_weight, (channels, taps)),
        "A_log": (A_log, (num_v_heads,)),
        "dt_bias": (dt_bias, (num_v_heads,)),
        "norm_weight": (norm_weight, (head_v_dim,)),
    }
    if out is not None:
        expected["out"] = (out, (batch, num_v_heads * head_v_dim))
        if out.dtype != qkv.dtype or out.device != qkv.device or not out.is_contiguous():
            raise ValueError(f"gdn_decode_step: out must be a contiguous {qkv.dtype} tensor on {qkv.device}")
    for name, (t, shape) in expected.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"gdn_decode_step: {name} has shape {tuple(t.shape)}, expected {shape}")

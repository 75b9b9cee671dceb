"""Rotate-half rotary embedding applied to q / k heads (the tables come from layers/rope.py).

`apply_rotary_ref` is the torch expression; on the CPU a contiguous fp32 call runs
csrc/cpu/decode_ops.h instead (the ~10 torch ops of the expression cost more than the math in a
decode step). `norm_rotary` is the attention layer's whole q / k path, the head RMSNorm then the
rotary: one kernel on CUDA (csrc/rope.cu), ~7 torch ops per tensor otherwise. A decode step runs
q and k through `ops.attention.norm_rotary_write_kv` instead: the same kernel code for both, with
the KV append, in one launch. `rotary_tables` makes the cos / sin tables of a forward's positions:
one kernel on CUDA (csrc/step_tables.cu) where the torch expression is 7 launches at the head of
every decode step.
"""

from __future__ import annotations

import torch

from . import dispatch
from .rmsnorm import rmsnorm


def rotary_tables_ref(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [...] -> cos, sin [..., R] in dtype: the fp32 angles positions * inv_freq [R/2],
    repeated for both halves of a rotate-half table, rounded once."""
    return angle_tables(positions[..., None].float() * inv_freq, dtype)


def angle_tables(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 angles [..., R/2] -> cos, sin [..., R] in dtype (each angle for both halves)."""
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotary_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_tables_ref`, in one kernel on CUDA (int64 positions, fp32 inv_freq on its device)."""
    if not (positions.device.type == "cuda" and dispatch.kernels_available() and positions.dtype == torch.int64
            and positions.numel() > 0 and inv_freq.dtype == torch.float32 and inv_freq.device == positions.device
            and dtype in (torch.float32, torch.float16, torch.bfloat16)):
        return rotary_tables_ref(positions, inv_freq, dtype)
    shape = (*positions.shape, 2 * inv_freq.shape[0])
    cos = torch.empty(shape, dtype=dtype, device=positions.device)
    sin = torch.empty_like(cos)
    dispatch.extension().rotary_tables(cos=cos.view(-1, shape[-1]), sin=sin.view(-1, shape[-1]),
                                       positions=positions.contiguous(), inv_freq=inv_freq.contiguous(),
                                       stream=dispatch.stream_handle(cos))
    return cos, sin


def apply_rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D], cos/sin [B, T, R] with R <= D: rotate-half RoPE on the first R dims."""
    rotary_dim = cos.shape[-1]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated = x_rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((rotated, x_pass), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rotary_ref`, by the CPU kernel where it applies (on a contiguous copy of a slice)."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        x = x.contiguous()
    if not (x.device.type == "cpu" and all(t.dtype == torch.float32 and t.is_contiguous() for t in (x, cos, sin))
            and x.dim() == 4 and cos.shape[:2] == x.shape[:2] and dispatch.cpu_kernels_available()):
        return apply_rotary_ref(x, cos, sin)
    out = torch.empty_like(x)
    dispatch.cpu_extension().rotary(out.data_ptr(), x.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                    x.shape[0] * x.shape[1], x.shape[2], x.shape[3], cos.shape[-1])
    return out


def norm_rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor | None = None,
                    eps: float = 1e-6, zero_centered: bool = False) -> torch.Tensor:
    """`apply_rotary(rmsnorm(x, weight))`, or the rotary alone without a weight (any device)."""
    normed = x if weight is None else rmsnorm(x, weight, eps, zero_centered=zero_centered)
    return apply_rotary(normed, cos, sin)


def norm_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor | None = None,
                eps: float = 1e-6, zero_centered: bool = False) -> torch.Tensor:
    """x [B, T, H, D] (last axis contiguous: slices of a merged projection are read in place) ->
    a contiguous [B, T, H, D]: `norm_rotary_ref`, in one kernel on CUDA where it applies."""
    if not rotary_kernel_fits(x, cos, sin, weight):
        dispatch.fallback("norm_rotary", x, cos, sin)
        return norm_rotary_ref(x, cos, sin, weight, eps, zero_centered)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dispatch.extension().norm_rotary(out=out, x=x, weight=weight, cos=cos, sin=sin, eps=float(eps),
                                     zero_centered=zero_centered, stream=dispatch.stream_handle(x))
    return out


def rotary_kernel_fits(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Whether csrc/rope.cu takes x [B, T, H, D] with these tables and norm weight (`norm_rotary`,
    and q / k of `ops.attention.norm_rotary_write_kv`)."""
    batch, tokens, _, dim = x.shape
    rotary = cos.shape[-1]
    tensors = (x, cos, sin) if weight is None else (x, cos, sin, weight)
    return (dispatch.use_kernel(*tensors) and all(t.dtype == x.dtype for t in tensors)
            and dim in (64, 128, 256) and 0 < rotary <= dim and rotary % 2 == 0 and (rotary // 2) % (dim // 32) == 0
            and cos.shape == sin.shape == (batch, tokens, rotary) and cos.stride() == sin.stride()
            and x.stride(-1) == cos.stride(-1) == 1 and (weight is None or weight.is_contiguous()))

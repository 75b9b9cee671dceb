"""Rotate-half rotary embedding applied to q / k heads (the tables come from layers/rope.py).

`apply_rotary_ref` is the torch expression; on the CPU a contiguous fp32 call runs
csrc/cpu/decode_ops.h instead (the ~10 torch ops of the expression cost more than the math in a
decode step). On the GPU the expression runs inside the CUDA graph.
"""

from __future__ import annotations

import torch

from . import dispatch


def apply_rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D], cos/sin [B, T, R] with R <= D: rotate-half RoPE on the first R dims."""
    rotary_dim = cos.shape[-1]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated = x_rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((rotated, x_pass), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rotary_ref`, by the CPU kernel where it applies."""
    if not (x.device.type == "cpu" and all(t.dtype == torch.float32 and t.is_contiguous() for t in (x, cos, sin))
            and x.dim() == 4 and cos.shape[:2] == x.shape[:2] and dispatch.cpu_kernels_available()):
        return apply_rotary_ref(x, cos, sin)
    out = torch.empty_like(x)
    dispatch.cpu_extension().rotary(out.data_ptr(), x.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                    x.shape[0] * x.shape[1], x.shape[2], x.shape[3], cos.shape[-1])
    return out

"""RMSNorm modules: block norm (zero-centred or plain) and the gated norm of the GDN output.

The block norm is `ops.rmsnorm` (kernel or torch reference): zero-centred (Qwen3.5) scales by
`1 + w`, plain (Llama) by `w`. Both normalise in fp32. A decoder layer hands its mixer the input
norm still to run (`PendingNorm`), so that the mixer's first projection can fold it into its GEMV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`w * rmsnorm(x) * silu(z)` over the last dim (the GDN output norm, one value head per row)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return ((weight * normed.to(x.dtype)) * F.silu(z.float())).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, zero_centered: bool):
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        # Zero-centred checkpoints store w with 1 + w the effective scale, so identity is 0.
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rmsnorm(x, self.weight, self.eps, zero_centered=self.zero_centered)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) in one kernel."""
        return ops.add_rmsnorm(x, residual, self.weight, self.eps, zero_centered=self.zero_centered)


@dataclass
class PendingNorm:
    """A mixer's input h = norm.add_norm(x, residual) not yet computed: the mixer's first projection
    makes it (`MergedLinear`, which folds the add + norm into a quantized GEMV where it can) and
    sets `summed`, x + residual, the residual stream the decoder layer continues with."""

    x: torch.Tensor
    residual: torch.Tensor
    norm: RMSNorm
    summed: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        """h's shape (a mixer reads its input's shape before projecting it)."""
        return self.x.shape

    def normed(self) -> torch.Tensor:
        """h by the add_norm kernel; sets `summed`."""
        h, self.summed = self.norm.add_norm(self.x, self.residual)
        return h


class GatedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, z, self.weight, self.eps)

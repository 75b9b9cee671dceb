"""Rotary position embedding: partial rotary (first `rotary_dim` dims of a head) and mRoPE.

Rotate-half convention: dim i pairs with dim i + rotary_dim/2 inside the rotated part; the dims
after `rotary_dim` pass through untouched.

Interleaved mRoPE (Qwen3-VL / Qwen3.5): frequency slot j takes its position from axis H when
j % 3 == 1 and j < 3 * section[1], from axis W when j % 3 == 2 and j < 3 * section[2], else from
axis T. transformers applies this layout for Qwen3.5 whatever `mrope_interleaved` says. For
text all three axes are equal, which reduces to plain RoPE.

Nothing is stored in buffers: the frequencies are computed from (theta, rotary_dim) on the
positions' device at its first call there and kept per device outside the module's state, so a
model built on the meta device needs no buffer fix-up (and a decode step launches no kernels for
them). The tables of plain positions come from `ops.rope.rotary_tables`, one kernel on a GPU.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.rope import apply_rotary  # noqa: F401  (the op: CPU kernel or torch reference)
from ..ops.rope import angle_tables, rotary_tables


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, theta: float, mrope_section: list[int] | None = None):
        super().__init__()
        if rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
        if mrope_section is not None and (len(mrope_section) != 3 or sum(mrope_section) != rotary_dim // 2):
            raise ValueError(
                f"mrope_section {mrope_section} must have 3 entries summing to rotary_dim/2 = {rotary_dim // 2}"
            )
        self.rotary_dim = rotary_dim
        self.theta = theta
        self.mrope_section = list(mrope_section) if mrope_section is not None else None
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        cached = self._inv_freq.get(device)
        if cached is None:
            exponent = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device=device) / self.rotary_dim
            cached = 1.0 / (self.theta**exponent)
            # not from inside a CUDA graph capture: its memory is the graph's, freed with it
            if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
                self._inv_freq[device] = cached
        return cached

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] or [3, B, T] (t, h, w) -> cos, sin [B, T, rotary_dim] in `dtype`."""
        inv_freq = self.inv_freq(positions.device)
        if positions.dim() != 3:
            return rotary_tables(positions, inv_freq, dtype)
        if self.mrope_section is None:
            raise ValueError("3-axis (mRoPE) positions given to a model without mrope_section")
        return angle_tables(self._interleave_axes(positions[..., None].float() * inv_freq), dtype)

    def _interleave_axes(self, freqs: torch.Tensor) -> torch.Tensor:
        """[3, B, T, R/2] per-axis angles -> [B, T, R/2] with each slot read from its axis."""
        _, sec_h, sec_w = self.mrope_section
        j = torch.arange(freqs.shape[-1], device=freqs.device)
        from_h = (j % 3 == 1) & (j < 3 * sec_h)
        from_w = (j % 3 == 2) & (j < 3 * sec_w)
        return torch.where(from_h, freqs[1], torch.where(from_w, freqs[2], freqs[0]))

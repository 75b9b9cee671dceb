"""An image or video ready for the vision tower: patch rows, grid, and (video) frame timestamps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True)
class PreparedMedia:
    kind: Literal["image", "video"]
    pixel_values: torch.Tensor  # [t*h*w, C*T*P*P] float32 patch rows, each 2x2 merge window contiguous
    grid_thw: tuple[int, int, int]  # patches along time (frame pairs), height, width
    merge_size: int = 2
    timestamps: tuple[float, ...] = ()  # video: seconds of each frame pair (the `<t.t seconds>` text)

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w

    @property
    def tokens_per_frame(self) -> int:
        """Language-model tokens of one frame pair (one image): merged patches."""
        _, h, w = self.grid_thw
        return h * w // self.merge_size**2

    @property
    def num_tokens(self) -> int:
        """Placeholder tokens this item takes in the prompt."""
        return self.grid_thw[0] * self.tokens_per_frame

    @property
    def nbytes(self) -> int:
        return self.pixel_values.numel() * self.pixel_values.element_size()

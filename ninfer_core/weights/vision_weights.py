"""The vision tower's weights under the tower's own names (`model.visual.` stripped).

Qwen3.5 / Qwen3.6 checkpoints keep the tower unquantized (FP8 releases list `model.visual` in
`modules_to_not_convert`), so this is a plain renaming view over the checkpoint.
"""

from __future__ import annotations

import torch

from ..errors import ModelLoadError
from .checkpoint import Checkpoint

VISION_PREFIXES = ("model.visual.", "visual.")


class VisionWeights:
    """`names()` / `get(name, dtype)` over the tower's tensor names (the `load_weights` contract)."""

    def __init__(self, checkpoint: Checkpoint):
        self._checkpoint = checkpoint
        prefix = next((p for p in VISION_PREFIXES if any(n.startswith(p) for n in checkpoint.names())), None)
        if prefix is None:
            raise ModelLoadError(f"{checkpoint.directory}: the checkpoint has no vision tower tensors (model.visual.*)")
        self._sources = {n.removeprefix(prefix): n for n in checkpoint.names() if n.startswith(prefix)}

    def names(self) -> set[str]:
        return set(self._sources)

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        if name not in self._sources:
            raise ModelLoadError(f"{self._checkpoint.directory}: vision tensor '{name}' not found in the checkpoint")
        return self._checkpoint.get(self._sources[name], dtype)

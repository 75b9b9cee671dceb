"""What a loaded multimodal checkpoint needs to read images and videos: its preprocessing settings,
its vision token ids, and its vision tower (built on first use, or at start with `--vision`).

`prompt` turns a rendered prompt (one pad per medium) and the media sources into the request's
expanded token ids plus the `MultimodalPrompt` the engine consumes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..errors import ModelLoadError
from ..media import MediaLimits, MediaProcessor, MediaSource
from .multimodal import MultimodalPrompt, VisionTokenIds, expand_placeholders
from .vision import VisionConfig, VisionTower, load_vision_tower


class VisionSupport:
    def __init__(
        self, model_dir: str | Path, device: torch.device, dtype: torch.dtype, limits: MediaLimits | None = None
    ):
        self.model_dir = Path(model_dir)
        self.device = device
        self.dtype = dtype
        self.config = VisionConfig.from_model_dir(self.model_dir)
        self.tokens = VisionTokenIds.from_model_dir(self.model_dir)
        self.processor = MediaProcessor.from_model_dir(self.model_dir, limits)
        tower = self.config
        for kind, settings in (("image", self.processor.config.image), ("video", self.processor.config.video)):
            if settings.patch_values != tower.patch_values or settings.merge_size != tower.spatial_merge_size:
                raise ModelLoadError(
                    f"{self.model_dir}: the {kind} preprocessing (patch {settings.patch_size}, merge "
                    f"{settings.merge_size}) does not match the vision tower (patch {tower.patch_size}, merge "
                    f"{tower.spatial_merge_size})"
                )
        self._tower: VisionTower | None = None
        self._lock = threading.Lock()

    def tower(self) -> VisionTower:
        with self._lock:
            if self._tower is None:
                self._tower = load_vision_tower(self.model_dir, self.device, self.dtype)
            return self._tower

    def prompt(
        self, prompt_ids: Sequence[int], sources: Sequence[MediaSource], encode: Callable[[str], list[int]]
    ) -> tuple[list[int], MultimodalPrompt]:
        media = self.processor.prepare_all(sources)
        ids = expand_placeholders(prompt_ids, media, self.tokens, encode)
        return ids, MultimodalPrompt.build(ids, media, self.tokens)

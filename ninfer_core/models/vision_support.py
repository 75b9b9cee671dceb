"""What a loaded multimodal model needs to read images and videos: its preprocessing settings,
its vision token ids, and its vision tower (built on first use, or at start with `--vision`).

Two sources: a checkpoint directory (config.json's `vision_config` and token ids, the
preprocessor configs, `model.visual.*` tensors), or a GGUF model with llama.cpp's vision
projector file (weights/gguf_mmproj.py; token ids looked up by their text in the model's
vocabulary).

`prompt` turns a rendered prompt (one pad per medium) and the media sources into the request's
expanded token ids plus the `MultimodalPrompt` the engine consumes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..errors import ModelLoadError
from ..media import MediaLimits, MediaProcessor, MediaSource
from ..media.config import MediaConfig
from .multimodal import MultimodalPrompt, VisionTokenIds, expand_placeholders
from .vision import TowerWeights, VisionConfig, VisionTower, load_vision_tower

if TYPE_CHECKING:
    from ..tokenizer import Tokenizer
    from ..weights.gguf_mmproj import MmprojFile
    from .loader import LoadedModel


class VisionSupport:
    def __init__(
        self, config: VisionConfig, tokens: VisionTokenIds, media: MediaConfig, weights: Callable[[], TowerWeights],
        device: torch.device, dtype: torch.dtype, where: str, limits: MediaLimits | None = None,
    ):
        self.config = config
        self.tokens = tokens
        self.processor = MediaProcessor(media, limits)
        self.device = device
        self.dtype = dtype
        self._weights = weights
        for kind, settings in (("image", media.image), ("video", media.video)):
            if settings.patch_values != config.patch_values or settings.merge_size != config.spatial_merge_size:
                raise ModelLoadError(
                    f"{where}: the {kind} preprocessing (patch {settings.patch_size}, merge "
                    f"{settings.merge_size}) does not match the vision tower (patch {config.patch_size}, merge "
                    f"{config.spatial_merge_size})"
                )
        self._tower: VisionTower | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_model_dir(
        cls, model_dir: str | Path, device: torch.device, dtype: torch.dtype, limits: MediaLimits | None = None
    ) -> VisionSupport:
        from ..weights.checkpoint import open_checkpoint
        from ..weights.vision_weights import VisionWeights

        return cls(VisionConfig.from_model_dir(model_dir), VisionTokenIds.from_model_dir(model_dir),
                   MediaConfig.from_model_dir(model_dir), lambda: VisionWeights(open_checkpoint(model_dir)),
                   device, dtype, str(model_dir), limits)

    @classmethod
    def from_mmproj(
        cls, mmproj: MmprojFile, tokenizer: Tokenizer, device: torch.device, dtype: torch.dtype,
        limits: MediaLimits | None = None,
    ) -> VisionSupport:
        return cls(mmproj.config, VisionTokenIds.from_tokenizer(tokenizer, str(mmproj.path)), mmproj.media_config(),
                   lambda: mmproj, device, dtype, str(mmproj.path), limits)

    @classmethod
    def of(cls, loaded: LoadedModel) -> VisionSupport | None:
        """A loaded model's vision support; None for a text-only model."""
        if loaded.mmproj is not None:
            return cls.from_mmproj(loaded.mmproj, loaded.tokenizer, loaded.device, loaded.dtype)
        if loaded.config.has_vision and loaded.source.is_dir():
            return cls.from_model_dir(loaded.source, loaded.device, loaded.dtype)
        return None

    def tower_bytes(self) -> int:
        """Memory the tower's weights will take (0 once built): the cache sizing keeps it free."""
        if self._tower is not None:
            return 0
        with torch.device("meta"):
            tower = VisionTower(self.config)
        return sum(p.numel() for p in tower.parameters()) * self.dtype.itemsize

    def tower(self) -> VisionTower:
        with self._lock:
            if self._tower is None:
                self._tower = load_vision_tower(self.config, self._weights(), self.device, self.dtype)
            return self._tower

    def prompt(
        self, prompt_ids: Sequence[int], sources: Sequence[MediaSource], encode: Callable[[str], list[int]]
    ) -> tuple[list[int], MultimodalPrompt]:
        media = self.processor.prepare_all(sources)
        ids = expand_placeholders(prompt_ids, media, self.tokens, encode)
        return ids, MultimodalPrompt.build(ids, media, self.tokens)

"""Preprocessing settings of a checkpoint: `preprocessor_config.json` (images),
`video_preprocessor_config.json` (videos), or both nested in `processor_config.json`.

The defaults are the values Qwen3.5 / Qwen3.6 checkpoints ship (patch 16, merge 2, temporal
patch 2, mean = std = 0.5; images 256x256 .. 4096x4096 pixels; videos 4096 .. 24Mi pixels over
all frames, 2 fps, 4..768 frames), so a directory without these files still behaves like one
that has them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..config import read_json_object
from ..errors import ModelLoadError

IMAGE_FILE = "preprocessor_config.json"
VIDEO_FILE = "video_preprocessor_config.json"
COMBINED_FILE = "processor_config.json"


@dataclass(frozen=True)
class PreprocessConfig:
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 256 * 256
    max_pixels: int = 4096 * 4096
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    fps: float = 2.0  # videos: frames sampled per second
    min_frames: int = 4
    max_frames: int = 768

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this: one merge window of patches."""
        return self.patch_size * self.merge_size

    @property
    def patch_values(self) -> int:
        """Values in one patch row: channels x temporal patch x patch x patch (3 x 2 x 16 x 16 = 1536)."""
        return len(self.image_mean) * self.temporal_patch_size * self.patch_size**2


IMAGE_DEFAULTS = PreprocessConfig()
VIDEO_DEFAULTS = PreprocessConfig(min_pixels=4096, max_pixels=24 * 1024 * 1024)


@dataclass(frozen=True)
class MediaConfig:
    image: PreprocessConfig = IMAGE_DEFAULTS
    video: PreprocessConfig = VIDEO_DEFAULTS

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "MediaConfig":
        directory = Path(model_dir)
        combined = read_json_object(directory / COMBINED_FILE)
        image = read_json_object(directory / IMAGE_FILE) or combined.get("image_processor") or {}
        video = read_json_object(directory / VIDEO_FILE) or combined.get("video_processor") or {}
        return cls.from_dicts(image, video, str(directory))

    @classmethod
    def from_dicts(cls, image: dict[str, Any], video: dict[str, Any], where: str) -> "MediaConfig":
        """From preprocessor-config style dicts (what they leave out keeps Qwen3.5's value)."""
        return cls(image=_settings(IMAGE_DEFAULTS, image, where), video=_settings(VIDEO_DEFAULTS, video, where))


def _settings(defaults: PreprocessConfig, raw: dict[str, Any], where: str) -> PreprocessConfig:
    size = raw.get("size") or {}
    values: dict[str, Any] = {
        "min_pixels": size.get("shortest_edge", raw.get("min_pixels")),
        "max_pixels": size.get("longest_edge", raw.get("max_pixels")),
        "image_mean": raw.get("image_mean"),
        "image_std": raw.get("image_std"),
    }
    for key in ("patch_size", "temporal_patch_size", "merge_size", "rescale_factor", "fps", "min_frames", "max_frames"):
        values[key] = raw.get(key)
    try:
        given = {k: _typed(defaults, k, v) for k, v in values.items() if v is not None}
        config = replace(defaults, **given)
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{where}: bad preprocessing setting ({e})") from None
    if len(config.image_mean) != len(config.image_std) or min(config.image_std) <= 0:
        raise ModelLoadError(f"{where}: image_mean / image_std must be per-channel lists with std > 0")
    if min(config.patch_size, config.temporal_patch_size, config.merge_size, config.min_frames) < 1:
        raise ModelLoadError(f"{where}: patch, merge and frame settings must be >= 1")
    if not 0 < config.min_pixels <= config.max_pixels:
        raise ModelLoadError(f"{where}: need 0 < size.shortest_edge <= size.longest_edge")
    return config


def _typed(defaults: PreprocessConfig, key: str, value: Any) -> Any:
    current = getattr(defaults, key)
    if isinstance(current, tuple):
        return tuple(float(v) for v in value)
    return type(current)(value)

"""The front door for media: sources -> prepared media, with the per-request limits and the cache."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .cache import PreparedMediaCache
from .config import MediaConfig
from .image import image_size, image_tokens, prepare_image
from .limits import MediaError, MediaLimits
from .prepared import PreparedMedia
from .sources import MediaSource


class MediaProcessor:
    def __init__(
        self,
        config: MediaConfig | None = None,
        limits: MediaLimits | None = None,
        cache: PreparedMediaCache | None = None,
    ):
        self.config = config or MediaConfig()
        self.limits = limits or MediaLimits()
        self.cache = cache if cache is not None else PreparedMediaCache()

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, limits: MediaLimits | None = None) -> "MediaProcessor":
        return cls(MediaConfig.from_model_dir(model_dir), limits)

    def prepare(self, source: MediaSource) -> PreparedMedia:
        settings = self.config.image if source.kind == "image" else self.config.video
        if source.path is not None:
            self.limits.check_bytes(source.kind, source.size(), source.name)
        key = (source.digest(), source.kind, settings)
        if source.kind == "image":
            return self.cache.get_or_prepare(
                key, lambda: prepare_image(source.read(), settings, self.limits, source.name)
            )
        from .video import prepare_video  # PyAV loads FFmpeg: only when a video arrives

        video = source.data if source.data is not None else source.path
        return self.cache.get_or_prepare(key, lambda: prepare_video(video, settings, self.limits, source.name))

    def image_tokens(self, sources: Sequence[MediaSource]) -> int:
        """Vision tokens of the request's images, from their headers alone, refusing a request whose
        images together are over the token or the pixel limit before any of them is decoded
        (videos are counted as they are prepared)."""
        limits, settings = self.limits, self.config.image
        tokens = pixels = 0
        for source in sources:
            if source.kind != "image":
                continue
            width, height = image_size(source.data if source.data is not None else source.path, limits, source.name)
            pixels += width * height
            if pixels > limits.max_request_pixels:
                raise MediaError(f"{source.name}: the request's images have {pixels / 1e6:.0f}+ megapixels, over the "
                                 f"limit of {limits.max_request_pixels / 1e6:.0f} (send smaller or fewer images)")
            tokens += image_tokens(width, height, settings, source.name)
            if tokens > limits.max_vision_tokens:
                raise _too_many_tokens(source, tokens, limits)
        return tokens

    def prepare_all(self, sources: Sequence[MediaSource]) -> list[PreparedMedia]:
        """Every source of one request, in order; the request's vision tokens are bounded."""
        if len(sources) > self.limits.max_media_items:
            raise MediaError(
                f"the request has {len(sources)} images / videos, over the limit of {self.limits.max_media_items}"
            )
        self.image_tokens(sources)
        prepared, tokens = [], 0
        for source in sources:
            item = self.prepare(source)
            tokens += item.num_tokens
            if tokens > self.limits.max_vision_tokens:
                raise _too_many_tokens(source, tokens, self.limits)
            prepared.append(item)
        return prepared


def _too_many_tokens(source: MediaSource, tokens: int, limits: MediaLimits) -> MediaError:
    return MediaError(
        f"{source.name}: the request's images / videos need {tokens}+ vision tokens, over the limit "
        f"of {limits.max_vision_tokens} (use smaller or fewer images, or shorter videos)"
    )

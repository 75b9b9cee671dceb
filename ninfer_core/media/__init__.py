"""Image and video input: sources -> preprocessing (exact to transformers' Qwen3-VL processors) -> patch rows."""

from .cache import PreparedMediaCache
from .config import MediaConfig, PreprocessConfig
from .limits import MediaError, MediaLimits
from .prepared import PreparedMedia
from .processor import MediaProcessor
from .sources import MediaSource, source_from_url, split_media

__all__ = [
    "MediaConfig",
    "MediaError",
    "MediaLimits",
    "MediaProcessor",
    "MediaSource",
    "PreparedMedia",
    "PreparedMediaCache",
    "PreprocessConfig",
    "source_from_url",
    "split_media",
]

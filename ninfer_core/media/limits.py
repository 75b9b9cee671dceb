"""Limits on user media, and the error every media failure raises.

Media come from users (and, through the server, from the network), so every size that drives
memory or compute is bounded before the expensive step: file bytes before decoding, source
pixels before a decoder allocates them (per image and per request, read from the headers), the
images' vision tokens before any of them is decoded, frames before a video is decoded, vision
tokens before the tower runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import NinferError

MIB = 1 << 20


class MediaError(NinferError):
    """An image or video that cannot be used: unreadable, unsupported, or over a limit (named)."""


@dataclass(frozen=True)
class MediaLimits:
    max_image_bytes: int = 64 * MIB
    max_video_bytes: int = 1024 * MIB
    max_image_pixels: int = 100_000_000  # decoded source pixels (decompression-bomb guard)
    max_request_pixels: int = 200_000_000  # the same, summed over a request's images
    max_video_frame_pixels: int = 8192 * 8192  # source frame size
    max_video_seconds: float = 3 * 3600.0  # every frame up to the last sampled one is decoded
    max_vision_tokens: int = 32768  # language-model tokens of all media of one request
    max_media_items: int = 64  # images + videos in one request

    def check_bytes(self, kind: str, size: int, name: str) -> None:
        limit = self.max_image_bytes if kind == "image" else self.max_video_bytes
        if size == 0:
            raise MediaError(f"{name}: the {kind} file is empty")
        if size > limit:
            raise MediaError(f"{name}: {kind} is {size / MIB:.1f} MiB, over the limit of {limit / MIB:.0f} MiB")

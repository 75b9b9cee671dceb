"""A chat as the TUI holds it (messages with reasoning, media and stats) and its OpenAI-style form.

Media are kept as local paths; `api_messages` turns them into the message parts the engine reads
({"type": "image_url", "image_url": {"url": path}}, or video_url for video files).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ninfer_core.errors import NinferError

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff"})
VIDEO_SUFFIXES = frozenset({".mp4", ".mov", ".webm", ".mkv", ".avi", ".m4v"})
TITLE_CHARS = 48


@dataclass(eq=False)  # identity: two equal texts are still two messages
class Message:
    role: str  # "user" | "assistant"
    content: str
    reasoning: str = ""
    media: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)  # finish_reason, tokens, rates, error
    id: int | None = None  # row id in the history store


@dataclass
class Chat:
    id: int | None = None
    title: str = "New chat"
    model: str = ""
    messages: list[Message] = field(default_factory=list)
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)

    def last(self, role: str) -> Message | None:
        return next((m for m in reversed(self.messages) if m.role == role), None)


def media_kind(path: str | Path) -> str:
    """"image" or "video" from the file name; NinferError naming the file otherwise."""
    suffix = Path(path).suffix.lower()
    if suffix in IMAGE_SUFFIXES:
        return "image"
    if suffix in VIDEO_SUFFIXES:
        return "video"
    raise NinferError(
        f"{path}: not an image or video file (images: {', '.join(sorted(IMAGE_SUFFIXES))}; "
        f"videos: {', '.join(sorted(VIDEO_SUFFIXES))})"
    )


def check_media(path: str) -> str:
    """The absolute path of an attachable file; NinferError when it is missing or of another kind."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise NinferError(f"{path}: no such file")
    media_kind(p)
    return str(p.resolve())


def media_part(path: str) -> dict[str, Any]:
    kind = f"{media_kind(path)}_url"
    return {"type": kind, kind: {"url": path}}


def api_message(message: Message) -> dict[str, Any]:
    if not message.media:
        return {"role": message.role, "content": message.content}
    parts = [media_part(p) for p in message.media]
    if message.content:
        parts.append({"type": "text", "text": message.content})
    return {"role": message.role, "content": parts}


def api_messages(messages: Sequence[Message], system: str = "") -> list[dict[str, Any]]:
    """OpenAI-style messages: the system prompt, then every turn (failed replies left out)."""
    out = [{"role": "system", "content": system}] if system else []
    return out + [api_message(m) for m in messages if not m.meta.get("error")]


def has_media(messages: Sequence[Message]) -> bool:
    return any(m.media for m in messages)


def title_from(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1] + "…"

"""Where media come from: OpenAI-style message parts, `data:` URLs, local paths.

Accepted parts (in any user message's content list):
    {"type": "image_url", "image_url": {"url": URL}}   (or "image_url": URL)
    {"type": "image", "image": URL}                    (or "url" / "path" instead of "image")
    {"type": "video_url", "video_url": {"url": URL}}   (or "video_url": URL)
    {"type": "video", "video": URL}                    (or "url" / "path")
URL: `data:<mime>;base64,<payload>`, `file:///abs/path`, or a local path. http(s) URLs are the
server's business: it fetches them with size and time limits and puts the MediaSource itself in
the part (`{"type": "image", "image": MediaSource(...)}`), which `part_source` passes through.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote, urlparse

from .limits import MediaError

MediaKind = Literal["image", "video"]
_PART_KINDS: dict[str, MediaKind] = {"image": "image", "image_url": "image", "video": "video", "video_url": "video"}
_CHUNK = 1 << 20


@dataclass(frozen=True)
class MediaSource:
    """One image or video: in-memory bytes or a local file. `name` is what error messages show."""

    kind: MediaKind
    name: str
    data: bytes | None = None
    path: Path | None = None

    def read(self) -> bytes:
        if self.data is not None:
            return self.data
        assert self.path is not None
        try:
            return self.path.read_bytes()
        except OSError as e:
            raise MediaError(f"{self.name}: cannot read the file ({e.strerror})") from None

    def size(self) -> int:
        return len(self.data) if self.data is not None else self.path.stat().st_size  # type: ignore[union-attr]

    def digest(self) -> str:
        """sha256 of the content (the prepared-media cache key)."""
        h = hashlib.sha256()
        if self.data is not None:
            h.update(self.data)
            return h.hexdigest()
        try:
            with open(self.path, "rb") as f:  # type: ignore[arg-type]
                while chunk := f.read(_CHUNK):
                    h.update(chunk)
        except OSError as e:
            raise MediaError(f"{self.name}: cannot read the file ({e.strerror})") from None
        return h.hexdigest()


def source_from_url(kind: MediaKind, url: str) -> MediaSource:
    """A `data:` URL, a `file://` URL or a local path -> MediaSource (the file must exist)."""
    if not isinstance(url, str) or not url:
        raise MediaError(f"{kind}: expected a URL or a file path, got {url!r}")
    if url.startswith("data:"):
        return MediaSource(kind, f"{kind} data URL", data=_decode_data_url(kind, url))
    parsed = urlparse(url)
    if parsed.scheme in ("http", "https"):
        raise MediaError(
            f"{url}: http(s) {kind} URLs are accepted by the server only; download the file and pass its path"
        )
    if parsed.scheme == "file":
        path = Path(unquote(parsed.path))
    elif parsed.scheme and len(parsed.scheme) > 1:  # one letter: a Windows drive, i.e. a path
        raise MediaError(f"{url}: unsupported {kind} URL scheme '{parsed.scheme}' (use a data: URL or a file path)")
    else:
        path = Path(url)
    path = path.expanduser()
    if not path.is_file():
        raise MediaError(f"{path}: {kind} file not found")
    return MediaSource(kind, str(path), path=path)


def _decode_data_url(kind: MediaKind, url: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise MediaError(f"{kind} data URL: missing ',' before the payload")
    if not header.endswith(";base64"):
        raise MediaError(f"{kind} data URL: only base64 payloads are supported (header '{header[:40]}')")
    try:
        return base64.b64decode(payload, validate=False)
    except (binascii.Error, ValueError) as e:
        raise MediaError(f"{kind} data URL: invalid base64 ({e})") from None


def part_reference(part: Mapping[str, Any]) -> tuple[MediaKind, Any] | None:
    """(kind, URL / path / MediaSource) of a media part, or None for a text (or unknown) part."""
    if "type" in part:
        kind = _PART_KINDS.get(str(part["type"]))
    else:  # untyped parts: {"image": ...}
        kind = next((k for key, k in _PART_KINDS.items() if key in part), None)
    if kind is None:
        return None
    value = next((part[key] for key in (f"{kind}_url", kind, "url", "path") if part.get(key) is not None), None)
    if isinstance(value, Mapping):
        value = value.get("url")
    if value is None:
        raise MediaError(f"a {kind} part has no URL or path: {dict(part)!r:.120}")
    return kind, value


def part_source(part: Mapping[str, Any]) -> MediaSource | None:
    """The media a message part refers to, or None for a text (or unknown) part."""
    reference = part_reference(part)
    if reference is None:
        return None
    kind, value = reference
    return value if isinstance(value, MediaSource) else source_from_url(kind, value)


def split_media(messages: Sequence[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], list[MediaSource]]:
    """(messages with each media part replaced by `{"type": "image"|"video"}` -- the shape every Qwen
    chat template renders as one placeholder --, the media in prompt order)."""
    out: list[dict[str, Any]] = []
    sources: list[MediaSource] = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            out.append(dict(message))
            continue
        parts = []
        for part in content:
            source = part_source(part) if isinstance(part, Mapping) else None
            if source is None:
                parts.append(part)
            else:
                sources.append(source)
                parts.append({"type": source.kind})
        out.append({**message, "content": parts})
    return out, sources

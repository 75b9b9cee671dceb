"""Server-sent events: `data: {json}` frames (optionally named with `event:`), `[DONE]`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

from fastapi.responses import StreamingResponse

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "Connection": "keep-alive"}


def sse(data: Mapping[str, Any], event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


def sse_response(body: AsyncIterator[bytes], media_type: str = "text/event-stream") -> StreamingResponse:
    """A stream of SSE frames (or, with another media type, of lines such as Ollama's NDJSON)."""
    return StreamingResponse(body, media_type=media_type, headers=SSE_HEADERS)

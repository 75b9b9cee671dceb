"""API-key check for every route except /health (and CORS preflights, answered before it).

Clients send the key as `Authorization: Bearer KEY` (OpenAI) or `x-api-key: KEY` (Anthropic).
With no key configured any key, or none, is accepted: editors always send one.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import ApiError, is_anthropic

PUBLIC_PATHS = frozenset({"/health"})


def presented_keys(headers: list[tuple[bytes, bytes]]) -> list[str]:
    keys = []
    for name, value in headers:
        text = value.decode("latin-1").strip()
        if name == b"authorization" and text[:7].lower() == "bearer ":
            keys.append(text[7:].strip())
        elif name == b"x-api-key":
            keys.append(text)
    return keys


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str | None):
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.api_key is None or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        keys = presented_keys(scope["headers"])
        if any(hmac.compare_digest(k.encode(), self.api_key.encode()) for k in keys):
            await self.app(scope, receive, send)
            return
        message = "invalid API key" if keys else "missing API key (send 'Authorization: Bearer KEY' or 'x-api-key')"
        error = ApiError(401, message, headers={"WWW-Authenticate": "Bearer"})
        await error.response(is_anthropic(scope["path"]))(scope, receive, send)

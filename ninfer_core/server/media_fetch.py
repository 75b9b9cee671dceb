"""Turning a request's media parts into MediaSources, on the event loop, before the engine sees them.

A network client names media by URL, so this is where the server decides what it will read:
`data:` URLs always; http(s) URLs by downloading them here (a total time limit, few redirects,
the model's byte limit counted as the bytes arrive, image/* or video/* content only), never in
the engine thread; local paths and `file://` URLs only when the server was started with
`allow_local_media` (else any client could make the server read its files). Every failure is a
400 whose message and `param` name the part (and the URL). Once read, the images' token cost,
from their headers alone, is checked against the context limit: a request that cannot fit is
refused before any image is decoded.

http(s) URLs whose host resolves to a loopback, private, link-local or otherwise non-public
address are refused unless `allow_private_urls` (`--allow-private-media-urls`): else any client
could make the server request its own admin ports or the LAN (server-side request forgery).
Every hop of a redirect is checked. The check resolves the name itself, so a DNS answer that
changes between the check and the connection (rebinding) is not covered.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlparse

import httpx
from fastapi import Request
from starlette.concurrency import run_in_threadpool

from ..engine.service import EngineService
from ..errors import ContextLengthError, NinferError
from ..llm import LLM, ChatRequest
from ..media.limits import MIB, MediaError, MediaLimits
from ..media.sources import MediaKind, MediaSource, source_from_url
from .chat_input import MediaPart, pending_media
from .errors import ApiError

# besides image/* and video/*: servers that do not know the type, and mp4 / mkv under application/
_GENERIC_TYPES = ("", "application/octet-stream", "binary/octet-stream")
_VIDEO_TYPES = ("application/mp4", "application/x-matroska")


@dataclass(frozen=True)
class MediaFetchLimits:
    timeout_s: float = 30.0  # per URL, connect to last byte
    max_redirects: int = 3
    max_bytes: int | None = None  # per URL, at most the model's MediaLimits (image / video bytes)
    allow_private_urls: bool = False  # hosts on loopback / private / link-local addresses too

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise NinferError(f"the media download timeout must be positive, got {self.timeout_s} s")
        if self.max_redirects < 0 or (self.max_bytes is not None and self.max_bytes < 1):
            raise NinferError(f"invalid media download limits: {self}")


class MediaResolver:
    def __init__(self, allow_local: bool = False, limits: MediaFetchLimits | None = None):
        self.allow_local = allow_local
        self.limits = limits or MediaFetchLimits()

    async def resolve(
        self, pending: Sequence[tuple[dict[str, Any], MediaPart]], llm: LLM, context_limit: int
    ) -> None:
        """Replace, in its part, each pending MediaPart (see chat_input.pending_media) by its MediaSource;
        refuse images that cannot fit the context (from their headers, before anything decodes them)."""
        if not pending:
            return
        first = pending[0][1]
        if llm.vision is None:
            raise ApiError(400, f"{first.where}: {llm.no_vision_reason}", param=first.where, code="unsupported_content")
        media_limits = llm.vision.processor.limits
        if len(pending) > media_limits.max_media_items:  # before any download; prepare_all counts them all
            raise ApiError(400, f"the request has {len(pending)} images / videos, over the limit of "
                                f"{media_limits.max_media_items}", param="messages", code="invalid_media")
        for part, media in pending:
            part[media.kind] = await self.source(media, media_limits)
        sources = [part[media.kind] for part, media in pending]
        tokens = await run_in_threadpool(llm.vision.processor.image_tokens, sources)
        if tokens >= context_limit:
            raise ContextLengthError(f"the request's images alone take {tokens} tokens, but the context limit is "
                                     f"{context_limit} tokens", prompt_tokens=tokens, limit=context_limit)

    async def source(self, media: MediaPart, media_limits: MediaLimits) -> MediaSource:
        url, where = media.url, media.where
        scheme = "data" if url.startswith("data:") else urlparse(url).scheme.lower()
        if scheme in ("http", "https"):
            data = await self.fetch(media, self._max_bytes(media.kind, media_limits))
            return MediaSource(media.kind, f"{where} ({_shown(url)})", data=data)
        if scheme not in ("data", "file") and len(scheme) > 1:  # one letter: a Windows drive
            raise ApiError(400, f"{where}: unsupported {media.kind} URL scheme '{scheme}' (use a data: or http(s) "
                                f"URL)", param=where, code="invalid_media")
        if scheme != "data" and not self.allow_local:
            raise ApiError(400, f"{where}: local files ({_shown(url)}) are not read for network clients; send the "
                                f"{media.kind} as a data: or http(s) URL (or start the server with "
                                f"--allow-local-media)", param=where, code="local_media_not_allowed")
        try:
            source = source_from_url(media.kind, url)
        except MediaError as e:
            raise ApiError(400, f"{where}: {e}", param=where, code="invalid_media") from None
        return replace(source, name=f"{where} ({source.name})")

    def _max_bytes(self, kind: MediaKind, media_limits: MediaLimits) -> int:
        limit = media_limits.max_image_bytes if kind == "image" else media_limits.max_video_bytes
        return limit if self.limits.max_bytes is None else min(limit, self.limits.max_bytes)

    async def fetch(self, media: MediaPart, max_bytes: int) -> bytes:
        """The body of an http(s) URL, within the time, redirect, byte and content-type limits."""
        limits, shown = self.limits, _shown(media.url)

        def failure(reason: str) -> ApiError:
            return ApiError(400, f"{media.where}: cannot fetch {shown}: {reason}", param=media.where,
                            code="media_fetch_failed")

        hooks = {} if limits.allow_private_urls else {"request": [_refuse_private_hosts]}
        client = httpx.AsyncClient(follow_redirects=True, max_redirects=limits.max_redirects, timeout=limits.timeout_s,
                                   event_hooks=hooks)
        try:
            async with (asyncio.timeout(limits.timeout_s), client,
                        client.stream("GET", media.url, headers={"Accept": f"{media.kind}/*"}) as response):
                _check_response(response, media.kind, max_bytes, failure)
                chunks, size = [], 0
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > max_bytes:
                        raise failure(f"the {media.kind} is larger than the limit of {_size(max_bytes)}")
                    chunks.append(chunk)
        except (TimeoutError, httpx.TimeoutException):
            raise failure(f"no complete answer within {limits.timeout_s:g} s") from None
        except httpx.TooManyRedirects:
            raise failure(f"more than {limits.max_redirects} redirects") from None
        except PrivateAddressError as e:
            raise ApiError(400, f"{media.where}: cannot fetch {shown}: {e} (a server started with "
                                f"--allow-private-media-urls fetches those)", param=media.where,
                           code="media_url_not_allowed") from None
        except httpx.HTTPError as e:
            raise failure(str(e) or type(e).__name__) from None
        if size == 0:
            raise failure(f"the {media.kind} is empty")
        return b"".join(chunks)


class PrivateAddressError(Exception):
    """A media URL (or a redirect) points at an address the server does not fetch for clients."""


async def _refuse_private_hosts(request: httpx.Request) -> None:
    host = request.url.host
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, request.url.port or 0, type=socket.SOCK_STREAM)
    except OSError as e:
        raise httpx.ConnectError(f"cannot resolve {host}: {e}", request=request) from None
    for info in infos:
        address = ipaddress.ip_address(info[4][0].split("%")[0])  # IPv6 scope ids ("fe80::1%eth0") dropped
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        if not address.is_global or address.is_multicast:
            raise PrivateAddressError(f"{host} is a non-public address ({address})")


def _check_response(
    response: httpx.Response, kind: MediaKind, max_bytes: int, failure: Callable[[str], ApiError]
) -> None:
    if response.status_code != 200:
        raise failure(f"HTTP {response.status_code} {response.reason_phrase}".rstrip())
    content_type = response.headers.get("content-type", "").split(";")[0].strip().lower()
    if not (content_type.startswith(f"{kind}/") or content_type in _GENERIC_TYPES
            or (kind == "video" and content_type in _VIDEO_TYPES)):
        raise failure(f"the server sent '{content_type}' content, expected {kind}/*")
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise failure(f"the {kind} is {_size(int(declared))}, over the limit of {_size(max_bytes)}")


def _size(n: int) -> str:
    return f"{n / MIB:.1f} MiB" if n >= MIB else f"{n} bytes"


def _shown(url: str) -> str:
    return url if len(url) <= 200 else url[:200] + "..."


async def resolve_media(request: Request, chat: ChatRequest, service: EngineService) -> None:
    """Make `chat`'s media parts MediaSources for the service's model (a no-op for text-only
    requests); their token cost is checked against its context from their headers first."""
    pending = pending_media(chat.messages)
    if pending:
        await request.app.state.media.resolve(pending, service.llm, service.context_limit)

"""Running one request from a handler: take the requested model from the pool (loading it if need
be), submit, wait for admission, then collect (non-streaming) or stream; a client that goes away
cancels its request, freeing its KV. The model's lease is held until the response has ended.

Admission is awaited before any response byte is sent, so unknown-model, queue-full,
context-overflow and prompt errors still get their own HTTP status; later errors arrive inside
the stream. A client that leaves while its request is still queued takes it out of the queue at
once (its place goes to a client that is still there).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from ..engine.service import Admitted, ChatStream, EngineService, TokenStream
from ..llm import ChatRequest
from .chat_input import pending_media
from .errors import ApiError, to_api_error
from .media_fetch import resolve_media
from .model_pool import Lease, ModelPool
from .sse import sse_response

Submit = Callable[[EngineService], ChatStream | TokenStream]


@dataclass
class Started:
    stream: ChatStream | TokenStream
    events: AsyncIterator[Any]
    prompt_tokens: int
    model: str  # the served model's name (what the response reports)
    lease: Lease
    inflight: set[ChatStream | TokenStream]  # the app's (ServerHandle.stop cancels what is left)

    def end(self) -> None:
        """The response is over: stop the request (if still running), no longer in flight, and
        let the model go."""
        self.stream.cancel()
        self.inflight.discard(self.stream)
        self.lease.release()


def pool_of(request: Request) -> ModelPool:
    return request.app.state.pool


async def lease(request: Request, model: str | None) -> Lease:
    """The requested model (None: the default), loaded if need be, off the event loop."""
    return await run_in_threadpool(pool_of(request).lease, model)


async def start(request: Request, model: str | None, submit: Submit, *, chat: ChatRequest | None = None) -> Started:
    """Take the model, fetch `chat`'s media (the model's limits apply), submit (template and tokenizer
    work off the event loop) and wait until the engine takes the request; a disconnect meanwhile
    cancels the request at once (it leaves the queue at the engine's next turn) and raises
    ClientDisconnect. Without media to fetch, taking the model and submitting are one call in the
    thread pool: each trip there and back costs 0.13-0.2 ms (this CPU)."""
    if chat is not None and pending_media(chat.messages):  # fetched on the event loop, between the two
        held = await lease(request, model)
        try:
            await resolve_media(request, chat, held.service)
            stream = await run_in_threadpool(submit, held.service)
        except BaseException:
            held.release()
            raise
    else:
        held, stream = await run_in_threadpool(_lease_and_submit, pool_of(request), model, submit)
    inflight: set[ChatStream | TokenStream] = request.app.state.inflight
    inflight.add(stream)
    events = stream.__aiter__()
    admission = asyncio.ensure_future(events.__anext__())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((admission, gone), return_when=asyncio.FIRST_COMPLETED)
        if not admission.done():  # the client left first
            raise ClientDisconnect()
        first = admission.result()
    except BaseException:  # an engine error, the client gone, or this handler cancelled
        stream.cancel()
        inflight.discard(stream)
        held.release()
        raise
    finally:
        gone.cancel()
        if not admission.done():
            admission.cancel()
    assert isinstance(first, Admitted), first
    return Started(stream, events, first.prompt_tokens, held.name, held, inflight)


def _lease_and_submit(pool: ModelPool, model: str | None, submit: Submit) -> tuple[Lease, ChatStream | TokenStream]:
    """The model and the submitted request (blocking: the thread pool's); the lease goes back if submitting fails."""
    held = pool.lease(model)
    try:
        return held, submit(held.service)
    except BaseException:
        held.release()
        raise


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (its body has been read: nothing else can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _cancel_on_disconnect(request: Request, stream: ChatStream | TokenStream) -> None:
    await _disconnected(request)
    stream.cancel()


async def collect(request: Request, started: Started) -> list[Any]:
    """Every event of a non-streaming request; cancels it if the client disconnects meanwhile."""
    watcher = asyncio.create_task(_cancel_on_disconnect(request, started.stream))
    try:
        return [event async for event in started.events]
    finally:
        watcher.cancel()
        started.end()


def stream_response(
    started: Started, body: AsyncIterator[bytes], error_frame: Callable[[ApiError], bytes]
) -> StreamingResponse:
    """SSE response of `body`; an error mid-stream becomes `error_frame(error)`; a disconnect
    (the body's task is cancelled) or any end cancels the engine request."""

    async def frames() -> AsyncIterator[bytes]:
        try:
            async for chunk in body:
                yield chunk
        except Exception as e:  # noqa: BLE001 - every failure becomes an error event
            yield error_frame(to_api_error(e))
        finally:
            started.end()

    return sse_response(frames())

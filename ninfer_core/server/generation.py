"""Running one request on the shared engine from a handler: submit, wait for admission, then
collect (non-streaming) or stream; a client that goes away cancels its request, freeing its KV.

Admission is awaited before any response byte is sent, so queue-full, context-overflow and
prompt errors still get their own HTTP status; later errors arrive inside the stream. A client
that leaves while its request is still queued takes it out of the queue at once (its place goes
to a client that is still there).
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
from .errors import ApiError, to_api_error
from .sse import sse_response


@dataclass
class Started:
    stream: ChatStream | TokenStream
    events: AsyncIterator[Any]
    prompt_tokens: int
    inflight: set[ChatStream | TokenStream]  # the app's (ServerHandle.stop cancels what is left)

    def close(self) -> None:
        """Cancel the engine request if it is still running; it is no longer in flight."""
        self.stream.cancel()
        self.inflight.discard(self.stream)


def service_of(request: Request) -> EngineService:
    return request.app.state.slot.require()


async def start(request: Request, submit: Callable[[EngineService], ChatStream | TokenStream]) -> Started:
    """Submit (template and tokenizer work off the event loop) and wait until the engine takes it;
    a disconnect meanwhile cancels the request at once (it leaves the queue at the engine's next
    turn) and raises ClientDisconnect."""
    service = service_of(request)
    stream = await run_in_threadpool(submit, service)
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
        raise
    finally:
        gone.cancel()
        if not admission.done():
            admission.cancel()
    assert isinstance(first, Admitted), first
    return Started(stream, events, first.prompt_tokens, inflight)


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
        started.close()


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
            started.close()

    return sse_response(frames())

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
from collections.abc import AsyncIterator, Callable, Sequence
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
SubmitChoices = Callable[[EngineService], list[ChatStream] | list[TokenStream]]  # a stream per choice (`n`)


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
    """`start_choices` of one answer."""
    return (await start_choices(request, model, lambda service: [submit(service)], chat=chat))[0]


async def start_choices(request: Request, model: str | None, submit: SubmitChoices, *,
                        chat: ChatRequest | None = None) -> list[Started]:
    """Take the model, fetch `chat`'s media (the model's limits apply), submit (template and tokenizer
    work off the event loop; one stream per choice) and wait until the engine takes every choice; a
    disconnect meanwhile cancels them at once (they leave the queue at the engine's next turn) and
    raises ClientDisconnect, a choice the engine refuses cancels the others and raises its error.
    Without media to fetch, taking the model and submitting are one call in the thread pool: each
    trip there and back costs 0.13-0.2 ms (this CPU)."""
    if chat is not None and pending_media(chat.messages):  # fetched on the event loop, between the two
        held = await lease(request, model)
        try:
            await resolve_media(request, chat, held.service)
            streams = await run_in_threadpool(submit, held.service)
        except BaseException:
            held.release()
            raise
    else:
        held, streams = await run_in_threadpool(_lease_and_submit, pool_of(request), model, submit)
    leases = [held] + [held.share() for _ in streams[1:]]  # each choice ends on its own
    inflight: set[ChatStream | TokenStream] = request.app.state.inflight
    inflight.update(streams)
    events = [stream.__aiter__() for stream in streams]
    admissions = [asyncio.ensure_future(e.__anext__()) for e in events]
    admitted = asyncio.gather(*admissions)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((admitted, gone), return_when=asyncio.FIRST_COMPLETED)
        if not admitted.done():  # the client left first
            raise ClientDisconnect()
        firsts = admitted.result()  # an engine error of any choice raises here
    except BaseException:  # an engine error, the client gone, or this handler cancelled
        for stream, held_choice in zip(streams, leases):
            stream.cancel()
            inflight.discard(stream)
            held_choice.release()
        raise
    finally:
        gone.cancel()
        for admission in admissions:
            if not admission.done():
                admission.cancel()
        if not admitted.done():
            admitted.cancel()
        elif not admitted.cancelled():
            admitted.exception()  # retrieved (a failed choice's error is raised above)
    assert all(isinstance(first, Admitted) for first in firsts), firsts
    return [Started(stream, e, first.prompt_tokens, held_choice.name, held_choice, inflight)
            for stream, e, first, held_choice in zip(streams, events, firsts, leases)]


def _lease_and_submit(pool: ModelPool, model: str | None, submit: SubmitChoices
                      ) -> tuple[Lease, list[ChatStream | TokenStream]]:
    """The model and the submitted requests (blocking: the thread pool's); the lease goes back if submitting fails."""
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


async def _cancel_on_disconnect(request: Request, streams: Sequence[ChatStream | TokenStream]) -> None:
    await _disconnected(request)
    for stream in streams:
        stream.cancel()


async def collect(request: Request, started: Started) -> list[Any]:
    """Every event of a non-streaming request; cancels it if the client disconnects meanwhile."""
    return (await collect_choices(request, [started]))[0]


async def collect_choices(request: Request, choices: Sequence[Started]) -> list[list[Any]]:
    """Every event of each choice (read together); a disconnect meanwhile cancels them all."""
    watcher = asyncio.create_task(_cancel_on_disconnect(request, [c.stream for c in choices]))

    async def events(started: Started) -> list[Any]:
        return [event async for event in started.events]

    tasks = [asyncio.ensure_future(events(c)) for c in choices]
    try:
        return list(await asyncio.gather(*tasks))  # a choice's error at once
    finally:
        watcher.cancel()
        for task in tasks:
            task.cancel()
        for started in choices:
            started.end()


async def merged_events(choices: Sequence[Started]) -> AsyncIterator[tuple[int, Any]]:
    """(choice index, event) of every choice's stream as they come (each choice's in its order); a
    choice's error is raised at once (the caller's end() then stops the others)."""
    if len(choices) == 1:  # one answer: its events as they are (no task a token on the served path)
        async for event in choices[0].events:
            yield 0, event
        return
    iterators = [c.events for c in choices]
    waiting = {asyncio.ensure_future(it.__anext__()): i for i, it in enumerate(iterators)}
    try:
        while waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=waiting.__getitem__):  # the lower index first when both are ready
                i = waiting.pop(task)
                try:
                    event = task.result()
                except StopAsyncIteration:
                    continue
                yield i, event
                waiting[asyncio.ensure_future(iterators[i].__anext__())] = i
    finally:
        for task in waiting:
            if not task.cancel() and not task.cancelled():
                task.exception()  # a sibling that ended too (say with the same error): not logged as unread


def stream_response(
    started: Started | Sequence[Started], body: AsyncIterator[bytes], error_frame: Callable[[ApiError], bytes],
    media_type: str = "text/event-stream",
) -> StreamingResponse:
    """SSE response of `body`; an error mid-stream becomes `error_frame(error)`; a disconnect
    (the body's task is cancelled) or any end cancels the engine request (every choice's)."""
    choices = [started] if isinstance(started, Started) else list(started)

    async def frames() -> AsyncIterator[bytes]:
        try:
            async for chunk in body:
                yield chunk
        except Exception as e:  # noqa: BLE001 - every failure becomes an error event
            yield error_frame(to_api_error(e))
        finally:
            for choice in choices:
                choice.end()

    return sse_response(frames(), media_type)

"""The concurrent engine: many callers, one background thread that owns the LLMEngine.

Callers (server handlers on asyncio, the TUI, scripts on any thread) submit requests and read a
stream of events; the engine thread loops "admit waiting requests, run one batched step, hand
out the outputs", so concurrent requests decode together (continuous batching) and prompt chunks
interleave with their decode.

Admission. A request waits in a bounded queue until a sequence slot is free and the KV cache can
hold its worst case (prompt + the answer it may still write, capped by the context limit),
counted in pages on top of the worst cases of the requests already running. The engine reserves
pages as sequences grow, so admitting on worst cases means a running sequence can never run out
of pages mid-step. A full queue is refused at once (QueueFullError, the server's 429).

Chat parsing (template output -> reasoning / content / tool calls) runs on the consumer's side
(ChatStream), keeping the engine thread's per-token work to the engine itself.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from typing import Protocol

from ..errors import ContextLengthError, NinferError
from ..llm import LLM, ChatAssembler, ChatRequest, ChatStreamEvent, PreparedChat
from ..models.multimodal import MultimodalPrompt
from .llm_engine import EngineStats
from .request import GenerationRequest, StepOutput
from .sampling import SamplingParams

log = logging.getLogger(__name__)

DEFAULT_MAX_QUEUE = 64


class QueueFullError(NinferError):
    """Too many requests are waiting; try again after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class ServiceStoppedError(NinferError):
    """The service was stopped (or never started) while the request was pending."""


@dataclass(frozen=True)
class Admitted:
    """The request left the queue and is in the engine (its prompt is being read)."""

    prompt_tokens: int


@dataclass
class ServiceStats:
    engine: EngineStats
    waiting: int  # requests in the queue
    max_queue: int
    max_concurrency: int
    kv_reserved_tokens: int  # worst-case KV promised to running requests

    @property
    def kv_usage(self) -> float:
        cap = self.engine.kv_capacity_tokens
        return self.engine.kv_used_tokens / cap if cap else 0.0


class ServiceObserver(Protocol):
    """Request timings as the engine thread sees them (metrics); called on that thread, so keep it cheap."""

    def request_admitted(self, queued_s: float, prompt_tokens: int) -> None: ...

    def tokens_generated(self, count: int, first: bool, latency_s: float) -> None:
        """latency_s: time to first token since submit when `first`, else the gap since the previous output."""

    def request_finished(self, finish_reason: str, duration_s: float) -> None: ...


class _End:
    """Sentinel closing a stream."""


_END = _End()


class TokenStream:
    """One request's engine outputs (Admitted, StepOutput..., end), readable sync or async.

    Iterating raises the request's error, if it failed. `cancel()` (from any thread) aborts it:
    the engine thread drops it at its next loop turn and frees its KV pages.
    """

    def __init__(self, service: EngineService, request: GenerationRequest, reserve_tokens: int):
        self.service = service
        self.request = request
        self.reserve_tokens = reserve_tokens
        self.submitted_at = time.perf_counter()
        self.last_output_at: float | None = None
        self.finished = False
        self._items: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Event | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def cancel(self) -> None:
        if not self.finished:
            self.service._cancel(self)

    # -- producer side (engine thread) ------------------------------------------------------

    def _push(self, item: object) -> None:
        self._items.put(item)
        with self._lock:
            loop, ready = self._loop, self._ready
        if loop is not None and ready is not None:
            try:
                loop.call_soon_threadsafe(ready.set)
            except RuntimeError:  # the consumer's loop is closed: nobody is reading
                pass

    # -- consumer side ----------------------------------------------------------------------

    def _take(self, item: object) -> Admitted | StepOutput | None:
        """The item to hand out; None at the end of the stream; raises the request's error."""
        if item is _END or isinstance(item, BaseException):
            self.finished = True
            if isinstance(item, BaseException):
                raise item
            return None
        return item  # type: ignore[return-value]

    def __iter__(self) -> Iterator[Admitted | StepOutput]:
        while not self.finished and (item := self._take(self._items.get())) is not None:
            yield item

    async def __aiter__(self) -> AsyncIterator[Admitted | StepOutput]:
        with self._lock:
            self._loop, self._ready = asyncio.get_running_loop(), asyncio.Event()
        ready = self._ready
        while not self.finished:
            ready.clear()
            try:
                raw = self._items.get_nowait()
            except queue.Empty:
                await ready.wait()
                continue
            item = self._take(raw)
            if item is None:
                return
            yield item


class ChatStream:
    """A chat request's events: Admitted, then parser events (reasoning, content, tool-call
    start / argument pieces / end) and a final ChatFinished, sync or async."""

    def __init__(self, tokens: TokenStream, prepared: PreparedChat):
        self.tokens = tokens
        self.prepared = prepared
        self.assembler = ChatAssembler(prepared)

    @property
    def request_id(self) -> str:
        return self.tokens.request_id

    def cancel(self) -> None:
        self.tokens.cancel()

    def _convert(self, item: Admitted | StepOutput) -> list[Admitted | ChatStreamEvent]:
        return [item] if isinstance(item, Admitted) else self.assembler.feed(item)

    def __iter__(self) -> Iterator[Admitted | ChatStreamEvent]:
        for item in self.tokens:
            yield from self._convert(item)

    async def __aiter__(self) -> AsyncIterator[Admitted | ChatStreamEvent]:
        async for item in self.tokens:
            for event in self._convert(item):
                yield event


class EngineService:
    """Owns `llm.engine` on a background thread; `submit_*` may be called from any thread."""

    def __init__(
        self,
        llm: LLM,
        *,
        max_queue: int = DEFAULT_MAX_QUEUE,
        max_concurrency: int | None = None,
        observers: list[ServiceObserver] | None = None,
    ):
        if max_queue < 1:
            raise NinferError(f"the request queue needs room for at least 1 request (got {max_queue})")
        self.llm = llm
        self.engine = llm.engine
        cache = self.engine.cache
        self.max_queue = max_queue
        self.observers = list(observers or [])
        self.max_concurrency = min(max_concurrency or cache.max_seqs, cache.max_seqs)
        self.page_size = cache.page_size
        self.kv_capacity = cache.capacity_tokens
        # a single request can never use more than the whole cache, whatever --max-context says
        self.context_limit = min(self.engine.max_context, self.kv_capacity)
        self._cond = threading.Condition()
        self._waiting: collections.deque[TokenStream] = collections.deque()
        self._cancelled: list[TokenStream] = []
        self._running: dict[str, TokenStream] = {}
        self._reserved_pages = 0
        self._outbox: list[tuple[TokenStream, object]] = []  # engine-thread deliveries of this loop turn
        self._stop = False
        self._thread: threading.Thread | None = None
        self._stats = self._snapshot()

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> EngineService:
        if self._thread is None:
            self._stop = False
            self._thread = threading.Thread(target=self._loop, name="ninfer-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Fail pending requests with ServiceStoppedError and end the engine thread."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> EngineService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- submitting -------------------------------------------------------------------------

    def submit(
        self, prompt_token_ids: list[int], sampling: SamplingParams, multimodal: MultimodalPrompt | None = None
    ) -> TokenStream:
        """Queue a raw token request; raises ContextLengthError / QueueFullError / SamplingParamError at once."""
        sampling.check_vocabulary(self.llm.loaded.config.vocab_size)  # else the batched step would fail on it
        n = len(prompt_token_ids)
        limit = self.context_limit
        if n >= limit:
            raise ContextLengthError(
                f"the prompt has {n} tokens but the context limit is {limit} tokens "
                f"(at least one must be left for the answer)",
                prompt_tokens=n,
                limit=limit,
            )
        room = limit - n
        max_new = min(sampling.max_tokens or room, room)
        request = GenerationRequest(list(prompt_token_ids), replace(sampling, max_tokens=max_new), multimodal=multimodal)
        stream = TokenStream(self, request, reserve_tokens=n + max_new)
        with self._cond:
            if self._stop or self._thread is None:
                raise ServiceStoppedError("the engine service is not running")
            if len(self._waiting) >= self.max_queue:
                raise QueueFullError(
                    f"the server is busy: {len(self._waiting)} requests are already waiting", retry_after=1
                )
            self._waiting.append(stream)
            self._cond.notify_all()
        return stream

    def submit_chat(self, request: ChatRequest) -> ChatStream:
        prepared = self.llm.prepare_chat(request)
        return ChatStream(self.submit(prepared.prompt_token_ids, request.sampling, prepared.multimodal), prepared)

    def chat(self, request: ChatRequest) -> Iterator[ChatStreamEvent]:
        """Like LLM.chat, but through the shared engine (safe while other requests run)."""
        for event in self.submit_chat(request):
            if not isinstance(event, Admitted):
                yield event

    def stats(self) -> ServiceStats:
        with self._cond:
            return replace(self._stats, waiting=len(self._waiting))

    def _cancel(self, stream: TokenStream) -> None:
        with self._cond:
            self._cancelled.append(stream)
            self._cond.notify_all()

    # -- the engine thread ------------------------------------------------------------------

    def _pages(self, tokens: int) -> int:
        return math.ceil(tokens / self.page_size)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._stop or self._cancelled or self._waiting or self._running):
                    self._cond.wait()
                if self._stop:
                    break
                cancelled, self._cancelled = self._cancelled, []
                for stream in cancelled:
                    if stream in self._waiting:
                        self._waiting.remove(stream)
                admit = self._take_admissible()
            for stream in cancelled:
                self._drop(stream)
            for stream in admit:
                self._admit(stream)
            if self._running:
                self._step()
            with self._cond:
                self._stats = self._snapshot()
            self._flush()  # after the snapshot: a caller that saw its request end sees the freed KV
        self._shutdown()

    def _take_admissible(self) -> list[TokenStream]:
        """Pop, in order, the waiting requests that fit now (called with the lock held)."""
        admit: list[TokenStream] = []
        pages = self._reserved_pages
        total_pages = self.kv_capacity // self.page_size
        while self._waiting and len(self._running) + len(admit) < self.max_concurrency:
            need = self._pages(self._waiting[0].reserve_tokens)
            if pages + need > total_pages:
                break
            pages += need
            admit.append(self._waiting.popleft())
        return admit

    def _admit(self, stream: TokenStream) -> None:
        try:
            self.engine.add_request(stream.request)
        except NinferError as e:
            self._post(stream, e)
            return
        self._reserved_pages += self._pages(stream.reserve_tokens)
        self._running[stream.request_id] = stream
        prompt_tokens = len(stream.request.prompt_token_ids)
        self._observe("request_admitted", time.perf_counter() - stream.submitted_at, prompt_tokens)
        self._post(stream, Admitted(prompt_tokens))

    def _drop(self, stream: TokenStream) -> None:
        """A cancelled request (already out of the queue): out of the engine, its KV freed."""
        if self._running.pop(stream.request_id, None) is not None:
            self.engine.abort(stream.request_id)
            self._reserved_pages -= self._pages(stream.reserve_tokens)
        self._post(stream, ServiceStoppedError("the request was cancelled"))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # a bug in a step: fail the batch, keep serving the next ones
            log.exception("engine step failed")
            for request_id in list(self._running):
                self.engine.abort(request_id)
                self._finish(request_id, NinferError(f"internal engine error: {e}"))
            return
        for out in outputs:
            stream = self._running.get(out.request_id)
            if stream is None:
                continue
            now = time.perf_counter()
            first = stream.last_output_at is None
            self._observe("tokens_generated", len(out.new_token_ids), first,
                          now - (stream.submitted_at if first else stream.last_output_at))
            stream.last_output_at = now
            self._post(stream, out)
            if out.finished:
                self._observe("request_finished", out.finish_reason or "stop", now - stream.submitted_at)
                self._finish(out.request_id)

    def _finish(self, request_id: str, error: BaseException | None = None) -> None:
        stream = self._running.pop(request_id)
        self._reserved_pages -= self._pages(stream.reserve_tokens)
        self._post(stream, error if error is not None else _END)

    def _shutdown(self) -> None:
        stopped = ServiceStoppedError("the engine service was stopped")
        with self._cond:
            waiting, self._waiting = list(self._waiting), collections.deque()
            self._cancelled = []
        for request_id in list(self._running):
            self.engine.abort(request_id)
            self._finish(request_id, stopped)
        for stream in waiting:
            self._post(stream, stopped)
        self._stats = self._snapshot()
        self._flush()

    def _observe(self, hook: str, *args: object) -> None:
        for observer in self.observers:
            try:
                getattr(observer, hook)(*args)
            except Exception:  # metrics must never stop the engine
                log.exception("service observer %s failed", hook)

    def _post(self, stream: TokenStream, item: object) -> None:
        self._outbox.append((stream, item))

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, []
        for stream, item in outbox:
            stream._push(item)

    def _snapshot(self) -> ServiceStats:
        return ServiceStats(
            engine=self.engine.stats(),
            waiting=len(self._waiting),
            max_queue=self.max_queue,
            max_concurrency=self.max_concurrency,
            kv_reserved_tokens=self._reserved_pages * self.page_size,
        )

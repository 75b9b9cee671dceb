"""The concurrent engine: many callers, one background thread that owns the LLMEngine.

Callers (server handlers on asyncio, the TUI, scripts on any thread) submit requests and read a
stream of events; the engine thread loops "hand new requests and cancellations to the engine,
run one batched step, hand out the outputs", so concurrent requests decode together (continuous
batching) and prompt chunks interleave with their decode.

Admission, KV pages and preemption belong to the engine's scheduler (engine/scheduler.py): this
thread only forwards requests to it. A request is `Admitted` once the engine has accepted it
(prompt checked); it may still wait there for a slot. The queue of requests not yet running is
bounded: beyond `max_queue` a request is refused at once (QueueFullError, the server's 429).

Chat parsing (template output -> reasoning / content / tool calls) runs on the consumer's side
(ChatStream), keeping the engine thread's per-token work to the engine itself.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from ..errors import ContextLengthError, EngineError, NinferError, logged_internal_error
from ..llm import LLM, ChatAssembler, ChatRequest, ChatStreamEvent, PreparedChat
from ..models.multimodal import MultimodalPrompt
from ..threads import release_openmp_workers
from .grammar import Grammar
from .llm_engine import EngineStats
from .request import GenerationRequest, StepOutput
from .sampling import SamplingParams, choice_sampling

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
    kv_reserved_tokens: int  # KV held by running requests

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

    def __init__(self, service: EngineService, request: GenerationRequest):
        self.service = service
        self.request = request
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
        self.engine.max_running = self.max_concurrency
        self.kv_capacity = cache.capacity_tokens
        self.context_limit = self.engine.max_context
        self._cond = threading.Condition()
        self._inbox: list[TokenStream] = []
        self._cancelled: list[TokenStream] = []
        self._streams: dict[str, TokenStream] = {}  # in the engine (waiting there or running)
        self._outbox: list[tuple[TokenStream, object]] = []  # engine-thread deliveries of this loop turn
        self._stop = False
        self._thread: threading.Thread | None = None
        self._warmed = False  # the first start runs a throw-away request in the engine thread
        self._stats = self._snapshot()

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> EngineService:
        """Start the engine thread; returns once it has run a throw-away request (`warm_thread`)."""
        if self._thread is None:
            self._stop = False
            if self.engine.device.type == "cpu":  # the engine thread alone runs torch's CPU ops from here
                release_openmp_workers()
            warm = threading.Event()
            self._thread = threading.Thread(target=self._loop, args=(warm,), name="ninfer-engine", daemon=True)
            self._thread.start()
            warm.wait()
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
        self, prompt_token_ids: list[int], sampling: SamplingParams, multimodal: MultimodalPrompt | None = None,
        checkpoints: tuple[int, ...] = (),
        grammar: Grammar | None = None,
        embed: bool = False,
    ) -> TokenStream:
        """Queue a raw token request (`grammar`: constrained; `embed`: the prompt's embedding, with
        embeddings.EMBED_SAMPLING); raises ContextLengthError / QueueFullError / SamplingParamError at once."""
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
        request = GenerationRequest(list(prompt_token_ids), sampling, multimodal=multimodal, checkpoints=checkpoints,
                                    grammar=grammar, embed=embed, draft_tokens=0 if embed else None)
        stream = TokenStream(self, request)
        with self._cond:
            if self._stop or self._thread is None:
                raise ServiceStoppedError("the engine service is not running")
            waiting = len(self._inbox) + self._stats.engine.waiting
            if waiting >= self.max_queue:
                raise QueueFullError(f"the server is busy: {waiting} requests are already waiting", retry_after=1)
            self._inbox.append(stream)
            self._cond.notify_all()
        return stream

    def submit_chat(self, request: ChatRequest) -> ChatStream:
        return self.submit_chat_choices(request, 1)[0]

    def submit_chat_choices(self, request: ChatRequest, n: int) -> list[ChatStream]:
        """`submit_choices` of a chat, its prompt rendered once."""
        prepared = self.llm.prepare_chat(request)
        return [ChatStream(tokens, prepared) for tokens in self.submit_choices(
            [prepared.prompt_token_ids], request.sampling, n, prepared.multimodal, prepared.checkpoints,
            prepared.grammar)]

    def submit_choices(self, prompts: Sequence[list[int]], sampling: SamplingParams, n: int,
                       multimodal: MultimodalPrompt | None = None, checkpoints: tuple[int, ...] = (),
                       grammar: Grammar | None = None, embed: bool = False) -> list[TokenStream]:
        """n answers to each prompt (OpenAI's `n`, Completions' list of prompts): choice p * n + i answers
        prompt p, seeded seed + i (engine/sampling.py `choice_sampling`). All or none: if one is
        refused, the ones before it are cancelled and its error raised."""
        streams: list[TokenStream] = []
        try:
            for prompt_token_ids in prompts:
                for choice in choice_sampling(sampling, n):
                    streams.append(self.submit(prompt_token_ids, choice, multimodal, checkpoints, grammar, embed))
        except BaseException:
            for stream in streams:
                stream.cancel()
            raise
        return streams

    def chat(self, request: ChatRequest) -> Iterator[ChatStreamEvent]:
        """Like LLM.chat, but through the shared engine (safe while other requests run)."""
        for event in self.submit_chat(request):
            if not isinstance(event, Admitted):
                yield event

    def stats(self) -> ServiceStats:
        with self._cond:
            return replace(self._stats, waiting=self._stats.waiting + len(self._inbox))

    def _cancel(self, stream: TokenStream) -> None:
        with self._cond:
            self._cancelled.append(stream)
            self._cond.notify_all()

    # -- the engine thread ------------------------------------------------------------------

    def _loop(self, warm: threading.Event) -> None:
        try:
            if not self._warmed and not self.engine.has_unfinished():
                self._warmed = True
                self.engine.warm_thread()
        except Exception:  # noqa: BLE001 - a failing engine fails the requests with its own error
            log.exception("the engine thread's warm-up request failed")
        finally:
            warm.set()
        while True:
            with self._cond:
                while not (self._stop or self._cancelled or self._inbox or self.engine.has_unfinished()):
                    self._cond.wait()
                if self._stop:
                    break
                cancelled, self._cancelled = self._cancelled, []
                new, self._inbox = self._inbox, []
            for stream in new:
                if stream not in cancelled:  # a client that left while its request was in the inbox
                    self._add(stream)
            self._flush()  # admissions before the step: their callers start answering while it runs
            for stream in cancelled:
                self._drop(stream)
            if self.engine.has_unfinished():
                self._step()
            with self._cond:
                self._stats = self._snapshot()
            self._flush()  # after the snapshot: a caller that saw its request end sees the freed KV
        self._shutdown()

    def _add(self, stream: TokenStream) -> None:
        try:
            self.engine.add_request(stream.request)
        except NinferError as e:  # the request's fault
            self._post(stream, e)
            return
        except Exception:  # a bug: this request fails, the engine thread goes on
            self._post(stream, EngineError(logged_internal_error(log, "adding a request to the engine failed")))
            return
        self._streams[stream.request_id] = stream
        prompt_tokens = len(stream.request.prompt_token_ids)
        self._observe("request_admitted", time.perf_counter() - stream.submitted_at, prompt_tokens)
        self._post(stream, Admitted(prompt_tokens))

    def _drop(self, stream: TokenStream) -> None:
        """A cancelled request: out of the engine (its KV freed), its stream ended."""
        if self._streams.pop(stream.request_id, None) is not None:
            self.engine.abort(stream.request_id)
        if stream in self._inbox:
            self._inbox.remove(stream)
        self._post(stream, ServiceStoppedError("the request was cancelled"))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:  # a bug in a step: fail the batch, keep serving the next ones
            message = logged_internal_error(log, "engine step failed")
            for request_id in list(self._streams):
                self.engine.abort(request_id)
                self._finish(request_id, EngineError(message))
            return
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            now = time.perf_counter()
            if out.error is not None:  # the engine failed this request alone (and logged why)
                self._finish(out.request_id, EngineError(out.error))
                continue
            first = stream.last_output_at is None
            self._observe("tokens_generated", len(out.new_token_ids), first,
                          now - (stream.submitted_at if first else stream.last_output_at))
            stream.last_output_at = now
            self._post(stream, out)
            if out.finished:
                self._observe("request_finished", out.finish_reason or "stop", now - stream.submitted_at)
                self._finish(out.request_id)

    def _finish(self, request_id: str, error: BaseException | None = None) -> None:
        stream = self._streams.pop(request_id)
        self._post(stream, error if error is not None else _END)

    def _shutdown(self) -> None:
        stopped = ServiceStoppedError("the engine service was stopped")
        with self._cond:
            waiting, self._inbox = list(self._inbox), []
            self._cancelled = []
        for request_id in list(self._streams):
            self.engine.abort(request_id)
            self._finish(request_id, stopped)
        while self.engine.has_unfinished():  # let a launched step finish; aborted requests free their KV
            self.engine.step()
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
        engine = self.engine.stats()
        return ServiceStats(
            engine=engine,
            waiting=engine.waiting,
            max_queue=self.max_queue,
            max_concurrency=self.max_concurrency,
            kv_reserved_tokens=engine.kv_used_tokens,
        )

"""What the chat talks to: the local engine (through the concurrent EngineService) or a remote
OpenAI-compatible server (remote.py). Both hand out a `Generation`: an iterator of reasoning /
content deltas ending with a TurnDone, readable on a worker thread and cancellable from the UI.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from ninfer_core.capabilities import Capabilities
from ninfer_core.chat.output_parser import ContentDelta, ReasoningDelta
from ninfer_core.engine.service import ChatStream, EngineService, ServiceStats, ServiceStoppedError
from ninfer_core.llm import LLM, ChatFinished, ChatRequest


@dataclass
class TurnResult:
    text: str
    reasoning: str
    finish_reason: str  # stop | length | abort | tool_calls
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    prefill_tok_s: float
    decode_tok_s: float


@dataclass
class TurnDone:
    result: TurnResult


GenerationEvent = ReasoningDelta | ContentDelta | TurnDone


class Generation(Protocol):
    """One reply being generated. Iterate on a worker thread; `cancel()` from any thread ends the
    iteration early (without a TurnDone) and sets `cancelled`."""

    cancelled: bool

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def completion_tokens(self) -> int: ...

    @property
    def reasoning_tokens(self) -> int: ...

    def __iter__(self) -> Iterator[GenerationEvent]: ...

    def cancel(self) -> None: ...


class Backend(Protocol):
    name: str  # the model's name (local) or id (remote)
    remote: bool
    context_limit: int | None  # tokens per chat (prompt + answer); None when the server does not say

    @property
    def supports_media(self) -> bool | None:
        """True / False when known up front; None: only the server's answer tells."""

    @property
    def capabilities(self) -> Capabilities | None:
        """Tools, vision, thinking (None: a remote server that does not say)."""

    def start(self, request: ChatRequest) -> Generation:
        """Submit a chat request (raises NinferError, e.g. ContextLengthError, before any output)."""

    def service_stats(self) -> ServiceStats | None:
        """Live engine counters (local only)."""

    @property
    def device(self) -> str:
        """Where the model runs: cpu, cuda:N, or "remote"."""

    @property
    def location(self) -> str:
        """For the title bar: the device, or the remote server's URL."""

    def close(self) -> None: ...


class LocalGeneration:
    def __init__(self, stream: ChatStream):
        self.stream = stream
        self.cancelled = False

    @property
    def prompt_tokens(self) -> int:
        return len(self.stream.prepared.prompt_token_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.stream.assembler.token_ids)

    @property
    def reasoning_tokens(self) -> int:
        return self.stream.assembler.reasoning_tokens

    def cancel(self) -> None:
        self.cancelled = True
        self.stream.cancel()

    def __iter__(self) -> Iterator[GenerationEvent]:
        try:
            for event in self.stream:
                if isinstance(event, (ReasoningDelta, ContentDelta)):  # (no tools are declared)
                    yield event
                elif isinstance(event, ChatFinished):
                    r = event.result
                    yield TurnDone(TurnResult(
                        text=r.text, reasoning=r.reasoning, finish_reason=r.finish_reason,
                        prompt_tokens=len(r.prompt_token_ids), completion_tokens=len(r.token_ids),
                        reasoning_tokens=r.reasoning_tokens, prefill_tok_s=r.timings.prefill_tok_s,
                        decode_tok_s=r.timings.decode_tok_s,
                    ))
        except ServiceStoppedError:
            if not self.cancelled:
                raise


class LocalBackend:
    """An LLM owned by an EngineService; the embedded server (when on) shares the same service."""

    remote = False

    def __init__(self, llm: LLM, name: str | None = None, max_queue: int = 16):
        self.llm = llm
        self.name = name or llm.name
        self.service = EngineService(llm, max_queue=max_queue).start()
        self.context_limit: int | None = self.service.context_limit

    @property
    def supports_media(self) -> bool:
        return self.llm.vision is not None

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities.of(self.llm)

    @property
    def device(self) -> str:
        return str(self.llm.loaded.device)

    @property
    def location(self) -> str:
        return self.device

    def start(self, request: ChatRequest) -> LocalGeneration:
        """Media in the messages are read by the model's vision tower (MediaError without one)."""
        return LocalGeneration(self.service.submit_chat(request))

    def service_stats(self) -> ServiceStats:
        return self.service.stats()

    def close(self) -> None:
        self.service.stop()

"""What goes into the engine (a request) and what comes out of one step (an output per request)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .logprobs import TokenLogprob
from .sampling import SamplingParams

if TYPE_CHECKING:
    from ..models.multimodal import MultimodalPrompt
    from .grammar import Grammar

_ids = itertools.count()


def new_request_id() -> str:
    return f"req-{next(_ids)}"


@dataclass
class GenerationRequest:
    prompt_token_ids: list[int]
    sampling: SamplingParams
    request_id: str = field(default_factory=new_request_id)
    multimodal: MultimodalPrompt | None = None  # images / videos; their pads are expanded in prompt_token_ids
    draft_tokens: int | None = None  # speculative drafts per round: None = the engine's setting, 0 = off
    checkpoints: tuple[int, ...] = ()  # prompt positions worth a prefix-cache checkpoint (message starts)
    grammar: Grammar | None = None  # the answer must match it (engine/grammar.py); such a request never drafts
    # the prompt's embedding comes with the first token (StepOutput.embedding): the final norm of its last
    # token's hidden state; such a request samples that one token (max_tokens 1) and nothing else
    embed: bool = False


@dataclass
class Timings:
    """Wall-clock phases of one request, in seconds (prefill = prompt processing up to the first token)."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        """(completion - 1) / decode time: the first token comes from prefill (methodology of the reference)."""
        n = self.completion_tokens - 1
        return n / self.decode_s if self.decode_s > 0 and n > 0 else 0.0


@dataclass
class SpecStats:
    """Speculative decoding of one request (or, summed, of the engine): a round is one verify
    forward the request took part in; it yields the accepted drafts plus one target token."""

    method: str
    draft_tokens: int  # K: drafts asked per round
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    round_tokens: int = 0  # tokens the rounds emitted (less than accepted + rounds when a stop cut one)

    @property
    def rejected(self) -> int:
        return self.drafted - self.accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.round_tokens / self.rounds if self.rounds else 0.0

    def to_json(self) -> dict[str, float | int | str]:
        return {
            "method": self.method,
            "draft_tokens": self.draft_tokens,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "rejected": self.rejected,
            "acceptance_rate": self.acceptance_rate,
            "rounds": self.rounds,
            "tokens_per_round": self.tokens_per_round,
        }


@dataclass
class StepOutput:
    """New tokens and text of one request after an engine step."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    timings: Timings | None = None
    drafted: int = 0  # speculative drafts verified in this step
    accepted: int = 0  # of which accepted (new_token_ids holds them plus the target's own token)
    spec: SpecStats | None = None  # when finished: the request's speculative totals (None: not speculative)
    # finish_reason "error": what went wrong with this request (the others go on); always the
    # engine's fault (errors.EngineError): a request's own faults are refused by add_request
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked (SamplingParams.logprobs)
    # with the first token, when the request asked (SamplingParams.prompt_logprobs): one per prompt
    # token after the first (nothing predicts the first)
    prompt_logprobs: list[TokenLogprob] | None = None
    embedding: list[float] | None = None  # with the first token, for GenerationRequest.embed (fp32 values)

    def text_logprobs(self) -> list[TokenLogprob]:
        """The logprobs of the new tokens that are text: all but an end-of-answer or stop id that
        ended the request (OpenAI reports none for it)."""
        if self.logprobs is None:
            return []
        return self.logprobs[:-1] if self.finished and isinstance(self.stop_reason, int) else self.logprobs

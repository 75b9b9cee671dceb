"""One request in the engine: its tokens, its cache share, its detokenizer and stop state.

Cache bookkeeping: `num_cached` counts the tokens whose KV / GDN state a launched forward
writes (it runs ahead of `output_ids` while a step is in flight: `num_pending` sampled tokens
are not on the host yet). `prefill_len` is how many tokens are read as a prompt: the prompt, or
after a preemption the prompt plus the answer so far (recomputed, then decoding continues).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..cache import SequenceCache
from ..detokenizer import IncrementalDetokenizer
from ..stop_strings import StopStringFilter
from .grammar import GrammarMatcher
from .logprobs import TokenLogprob
from .request import GenerationRequest, SpecStats, Timings
from .sampling import TokenHistory


@dataclass
class Sequence:
    request: GenerationRequest
    cache: SequenceCache | None  # None while waiting (not admitted, or preempted)
    detokenizer: IncrementalDetokenizer
    stops: StopStringFilter
    generator: torch.Generator | None
    max_new_tokens: int  # after capping by the context limit
    output_ids: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose KV / state are in the cache (or being written by a launched step)
    prefill_len: int = 0  # tokens to read as a prompt (0: the prompt's length)
    num_pending: int = 0  # sampled by a launched step, not yet appended
    inflight: int = 0  # launched steps that read or write this sequence's cache
    preemptions: int = 0
    penalties_ready: bool = False  # its row of the engine's penalty tables holds its history
    timings: Timings = field(default_factory=Timings)
    started_at: float = field(default_factory=time.perf_counter)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    draft_limit: int = 0  # speculative drafts per round (0: plain decode)
    spec: SpecStats | None = None  # speculative totals, when draft_limit > 0
    grammar: GrammarMatcher | None = None  # a constrained request: every answer token goes through it
    # SamplingParams.prompt_logprobs: entry i is prompt token i + 1's, filled as its chunk is read, handed
    # out with the first token (then None: a preempted request reading its prompt again scores nothing)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    embedding: torch.Tensor | None = None  # GenerationRequest.embed: on the host (or being copied there)

    @property
    def bans_end(self) -> bool:
        """Its answer may not end yet (SamplingParams.min_tokens): end-of-answer and stop ids are masked."""
        return len(self.output_ids) < self.request.sampling.min_tokens

    @property
    def scores_prompt(self) -> bool:
        """Its prompt chunks need logits at every token (their logprobs are still to be reported)."""
        return self.prompt_logprobs is not None

    def __post_init__(self) -> None:
        self.prefill_len = self.prefill_len or len(self.request.prompt_token_ids)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def rope_delta(self) -> int:
        """Position offset of generated tokens: media in the prompt advance mRoPE positions unevenly."""
        mm = self.request.multimodal
        return mm.rope_delta if mm is not None else 0

    @property
    def in_prefill(self) -> bool:
        return self.num_cached < self.prefill_len

    @property
    def tokens_left(self) -> int:
        """Answer tokens it may still be scheduled for (pending ones counted)."""
        return self.max_new_tokens - len(self.output_ids) - self.num_pending

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def tokens(self, n: int) -> list[int]:
        """Its first n tokens (prompt, then answer)."""
        prompt = self.prompt_ids
        return list(prompt[:n]) if n <= len(prompt) else [*prompt, *self.output_ids[: n - len(prompt)]]

    def media_keys(self, n: int) -> list[object] | None:
        """A content key per token of the first n for a prompt with media (None: text only)."""
        mm = self.request.multimodal
        return None if mm is None else mm.token_keys(n)

    def token_at(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    def history(self) -> TokenHistory:
        return TokenHistory(prompt_ids=self.prompt_ids, output_ids=self.output_ids)

"""One speculative decode step for a batch: draft, verify in one target forward, keep, commit.

1. K per sequence: its limit (or, with an adaptive policy, the policy's choice up to the limit:
   adaptive.py), capped so the answer cannot run past max_tokens; then the largest K <= that for
   which every sequence's KV pages fit (uniform: padded rows write KV too).
2. The drafter proposes; the verify batch is [B, 1 + longest draft] = [last token, drafts, pad].
3. One target forward (logits for all rows, GDN state deferred, drafter layers captured; a CUDA
   graph replay where the engine has one for the shape). A round without drafts is a plain
   decode step instead (nothing to defer).
4. Per sequence the target distributions p_0..p_k (exact sampler distributions, penalties with
   the drafts counted as generated) decide the kept tokens (verify.py).
5. The GDN slots advance through the kept tokens only (rollback.py, through `Verified.commit`:
   the commit graph of the verify's shape, or eagerly); the engine appends them
   (stop checks may cut the run short); the drafter observes the kept rows; surplus KV pages go.
Sequences asking no drafts ride along as rows of width 1 (+ padding).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...cache import CacheManager
from ...errors import NinferError
from ...models.base import ForwardBatch, ForwardOutput
from ..request import GenerationRequest, SpecStats, StepOutput
from ..sampling import Sampler, TokenHistory
from ..sequence import Sequence
from .adaptive import AdaptiveDraft
from .base import Draft, Drafter, Observation
from .verify import accept_greedy, accept_stochastic


@dataclass
class Verified:
    """A verify forward (logits "all", GDN pools untouched) and how to keep its accepted prefix."""

    batch: ForwardBatch
    out: ForwardOutput
    commit: Callable[[torch.Tensor], None]  # counts [B] int64 on the device: GDN slots advance that far


# run(seqs, ids [B, T], capture_layers) -> the verify forward
VerifyForward = Callable[[list[Sequence], torch.Tensor, tuple[int, ...]], Verified]
Append = Callable[[Sequence, list[int]], StepOutput]


class Speculator:
    """The engine's decode step with a drafter; also keeps the aggregate counters (`totals`)."""

    def __init__(self, drafter: Drafter, draft_tokens: int, cache: CacheManager, sampler: Sampler,
                 adaptive: AdaptiveDraft | None = None):
        if not 1 <= draft_tokens <= drafter.max_draft_tokens:
            raise NinferError(f"--draft-tokens {draft_tokens} is out of range for {drafter.method} drafts "
                              f"(1..{drafter.max_draft_tokens})")
        self.drafter, self.draft_tokens, self.cache, self.sampler = drafter, draft_tokens, cache, sampler
        self.adaptive = adaptive  # None: every round drafts the sequence's limit
        self.totals = SpecStats(method=drafter.method, draft_tokens=draft_tokens)

    def limit(self, request: GenerationRequest) -> int:
        """Drafts per round for a request: its own setting (0 = none), else the engine's."""
        k = self.draft_tokens if request.draft_tokens is None else request.draft_tokens
        if not 0 <= k <= self.drafter.max_draft_tokens:
            raise NinferError(f"draft_tokens {k} is out of range for {self.drafter.method} drafts "
                              f"(0..{self.drafter.max_draft_tokens})")
        return k

    def capture_layers(self, seq: Sequence) -> tuple[int, ...]:
        return self.drafter.capture_layers if seq.draft_limit else ()

    def observe_prefill(self, seq: Sequence, batch: ForwardBatch, out: ForwardOutput) -> None:
        """A prompt chunk of a speculating sequence went through the target (its next token is known)."""
        if seq.draft_limit and not seq.finished:
            self.drafter.observe(Observation([seq], [0], [batch.num_new_tokens], batch, out))

    def release(self, seq: Sequence) -> None:
        self.drafter.release(seq)
        if self.adaptive is not None:
            self.adaptive.release(seq.request_id)

    def decode(self, seqs: list[Sequence], run: VerifyForward, append: Append) -> list[StepOutput]:
        ks = self._fit([min(self._wanted(s), s.max_new_tokens - len(s.output_ids) - 1) for s in seqs], seqs)
        drafts = [Draft([]) for _ in seqs]
        asking = [i for i, k in enumerate(ks) if k > 0]
        if asking:
            for i, draft in zip(asking, self.drafter.propose([seqs[i] for i in asking], [ks[i] for i in asking])):
                drafts[i] = draft
        width = 1 + max(len(d.tokens) for d in drafts)
        ids = torch.tensor([[s.output_ids[-1], *d.tokens] + [s.output_ids[-1]] * (width - 1 - len(d.tokens))
                            for s, d in zip(seqs, drafts)], dtype=torch.long, device=self.cache.device)
        verified = run(seqs, ids, self.drafter.capture_layers)
        batch, out = verified.batch, verified.out
        kept = self._accept(seqs, drafts, out.logits)
        verified.commit(torch.tensor([len(k) for k in kept], dtype=torch.long, device=self.cache.device))
        outputs = []
        for seq, draft, tokens in zip(seqs, drafts, kept):
            seq.num_cached += len(tokens)
            output = append(seq, tokens)
            if seq.draft_limit:
                output.drafted, output.accepted = len(draft.tokens), len(tokens) - 1
                self._count(seq, output)
                if self.adaptive is not None:
                    self.adaptive.update(seq.request_id, output.drafted, output.accepted)
            outputs.append(output)
        watched = [i for i, s in enumerate(seqs) if s.draft_limit and not s.finished]
        if watched:
            self.drafter.observe(Observation([seqs[i] for i in watched], watched, [len(kept[i]) for i in watched],
                                             batch, out))
        for seq in seqs:
            self.cache.truncate(seq.cache, seq.num_tokens)
        return outputs

    def _wanted(self, seq: Sequence) -> int:
        """Drafts for this round before the caps: the limit, or the adaptive policy's choice under it."""
        if self.adaptive is None or not seq.draft_limit:
            return seq.draft_limit
        return self.adaptive.choose(seq.request_id, seq.draft_limit)

    def _fit(self, ks: list[int], seqs: list[Sequence]) -> list[int]:
        """Reserve each sequence's next token, then as many extra KV positions as all can get."""
        for seq in seqs:
            self.cache.reserve(seq.cache, seq.num_tokens)
        extra = max(ks, default=0)
        free = self.cache.free_tokens // self.cache.page_size
        page = self.cache.page_size
        while extra > 0 and sum(max(0, math.ceil((s.num_tokens + extra) / page) - len(s.cache.pages))
                                for s in seqs) > free:
            extra -= 1
        for seq in seqs:
            self.cache.reserve(seq.cache, seq.num_tokens + extra)
        return [min(k, extra) for k in ks]

    def _accept(self, seqs: list[Sequence], drafts: list[Draft], logits: torch.Tensor) -> list[list[int]]:
        """The kept tokens per sequence from the target's logits [B, T, V]. Row t of a sequence is
        judged with the history output + drafts[:t], exactly as plain decoding would see it."""
        kept: list[list[int]] = [[] for _ in seqs]
        for greedy in (True, False):
            index = [b for b, s in enumerate(seqs) if s.request.sampling.is_greedy == greedy]
            if not index:
                continue
            rows, params, histories = [], [], []
            for b in index:
                for t in range(len(drafts[b].tokens) + 1):
                    rows.append(logits[b, t])
                    params.append(seqs[b].request.sampling)
                    histories.append(TokenHistory(seqs[b].prompt_ids, seqs[b].output_ids + drafts[b].tokens[:t]))
            stacked = torch.stack(rows).float()
            if greedy:  # the argmax of the penalised logits, no draws
                targets = self.sampler.sample(stacked, params, histories, [None] * len(rows)).tolist()
            else:
                p = self.sampler.distribution(stacked, params, histories)
            start = 0
            for b in index:
                n = len(drafts[b].tokens) + 1
                if greedy:
                    kept[b] = accept_greedy(drafts[b].tokens, targets[start : start + n])
                else:
                    generator = seqs[b].generator
                    assert generator is not None  # every sampled request has its own
                    kept[b] = accept_stochastic(drafts[b], p[start : start + n], generator)
                start += n
        return kept

    def _count(self, seq: Sequence, output: StepOutput) -> None:
        for stats in (seq.spec, self.totals):
            assert stats is not None
            stats.drafted += output.drafted
            stats.accepted += output.accepted
            stats.rounds += 1
            stats.round_tokens += len(output.new_token_ids)

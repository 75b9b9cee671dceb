"""Speculative decoding's two questions for the engine: which drafts, and which of them to keep.

A round (driven by `LLMEngine`, which alone appends tokens and advances or truncates caches):
1. K per sequence (`wanted`): its limit, or an adaptive policy's choice under it (adaptive.py),
   capped so the answer cannot run past max_tokens; the scheduler then trims K to the KV pages
   every sequence can get.
2. The drafter proposes (`propose`); the engine verifies [last token, drafts, pad] in one target
   forward (logits for every row, GDN state deferred), or runs a plain decode step when no
   sequence drafts.
3. `judge`: per sequence the target distributions p_0..p_k (exact sampler distributions,
   penalties with the drafts counted as generated, from the engine's device tables) decide the
   kept tokens (verify.py).
4. The engine commits the kept prefix of the GDN state (rollback.py), appends the tokens, shows
   the drafter the kept rows (`observe`) and frees surplus pages; `record` counts the round.
Sequences asking no drafts ride along as rows of width 1 (+ padding); grammar-constrained
sequences never draft (engine/grammar.py), and `judge` masks their single row like plain sampling.
"""

from __future__ import annotations

import torch

from ...errors import NinferError
from ...models.base import ForwardBatch, ForwardOutput
from ...ops.dispatch import upload
from ..grammar import constrain
from ..request import GenerationRequest, SpecStats, StepOutput
from ..penalties import Generated, PenaltyTables
from ..sampling import Sampler, TokenHistory, finite_rows
from ..sequence import Sequence
from .adaptive import AdaptiveDraft
from .base import Draft, Drafter, Observation, draft_matrix, read_with
from .verify import accept_greedy, judge_stochastic, stochastic_kept


class Speculator:
    """Drafts and their verdicts for the engine; also keeps the aggregate counters (`totals`)."""

    def __init__(self, drafter: Drafter, draft_tokens: int, sampler: Sampler, adaptive: AdaptiveDraft | None = None):
        if not 1 <= draft_tokens <= drafter.max_draft_tokens:
            raise NinferError(f"--draft-tokens {draft_tokens} is out of range for {drafter.method} drafts "
                              f"(1..{drafter.max_draft_tokens})")
        self.drafter, self.draft_tokens, self.sampler = drafter, draft_tokens, sampler
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

    def observe(self, seqs: list[Sequence], kept: list[list[int]], batch: ForwardBatch, out: ForwardOutput) -> None:
        """A verify's kept rows become part of their sequences (before the engine appends `kept`, the
        token after each kept row): the drafter conditions on them. A row whose sampling failed
        (its last token -1) ends its sequence: not watched."""
        watched = [i for i, s in enumerate(seqs) if s.draft_limit and not s.finished and kept[i][-1] >= 0]
        if watched:
            self.drafter.observe(Observation([seqs[i] for i in watched], watched, [len(kept[i]) for i in watched],
                                             batch, out, [kept[i] for i in watched]))

    def release(self, seq: Sequence) -> None:
        self.drafter.release(seq)
        if self.adaptive is not None:
            self.adaptive.release(seq.request_id)

    def wanted(self, seqs: list[Sequence]) -> list[int]:
        """Drafts each sequence asks for this round, before the KV cap (none past max_tokens)."""
        return [min(self._wanted(s, len(seqs)), s.tokens_left - 1) for s in seqs]

    def propose(self, seqs: list[Sequence], ks: list[int], penalties: PenaltyTables | None = None) -> list[Draft]:
        """`penalties`: the engine's tables, current for every penalised sequence (None: none has any)."""
        drafts = [Draft([]) for _ in seqs]
        asking = [i for i, k in enumerate(ks) if k > 0]
        if asking:
            proposed = self.drafter.propose([seqs[i] for i in asking], [ks[i] for i in asking], penalties)
            for i, draft in zip(asking, proposed):
                drafts[i] = draft
        return drafts

    def record(self, seq: Sequence, output: StepOutput, draft: Draft, kept: int) -> None:
        """Count a sequence's round (its drafts and how many were accepted) into `output` and the totals."""
        if not seq.draft_limit:
            return
        output.drafted, output.accepted = len(draft.tokens), kept - 1
        for stats in (seq.spec, self.totals):
            assert stats is not None
            stats.drafted += output.drafted
            stats.accepted += output.accepted
            stats.rounds += 1
            stats.round_tokens += len(output.new_token_ids)
        if self.adaptive is not None:
            self.adaptive.update(seq.request_id, output.drafted, output.accepted)

    def _wanted(self, seq: Sequence, batch: int) -> int:
        """Drafts for this round before the caps: the limit, or the adaptive policy's choice under it
        (for a round of `batch` sequences)."""
        if self.adaptive is None or not seq.draft_limit:
            return seq.draft_limit
        return self.adaptive.choose(seq.request_id, seq.draft_limit, batch, not seq.request.sampling.is_greedy)

    def judge(self, seqs: list[Sequence], drafts: list[Draft], logits: torch.Tensor,
              penalties: PenaltyTables | None = None) -> list[list[int]]:
        """The kept tokens per sequence from the target's logits [B, T, V]. Row t of a sequence is
        judged with the history output + drafts[:t], exactly as plain decoding would see it (a
        constrained sequence's one row through its grammar mask); `penalties`: as in `propose`.
        A sequence whose judged logits were not finite (or whose grammar left no token) ends in
        token -1, as the plain sampler's rows do."""
        unread = TokenHistory(())  # the penalties come from the tables: the sampler reads no history
        verdicts: list[tuple[bool, list[int], torch.Tensor]] = []  # per group: its sequences' verdict, on the device
        for greedy in (True, False):
            index = [b for b, s in enumerate(seqs) if s.request.sampling.is_greedy == greedy]
            if not index:
                continue
            group = [drafts[b] for b in index]
            width = max(d.count for d in group)
            # penalised rows: row t of the i-th sequence has its drafts 0..t-1 (entries of the group's
            # draft matrix, which may still be on the device) generated after its slot's history
            rows, params, matchers, slots, extra_rows, extra_at = [], [], [], [], [], []
            for i, b in enumerate(index):
                for t in range(drafts[b].count + 1):
                    rows.append(logits[b, t])
                    params.append(seqs[b].request.sampling)
                    matchers.append(seqs[b].grammar)  # constrained sequences never draft: only t = 0
                    if params[-1].has_penalties:
                        extra_rows += [len(slots)] * t
                        extra_at += range(i * width, i * width + t)
                        slots.append(seqs[b].cache.slot)
            stacked = constrain(torch.stack(rows).float(), matchers)
            device = stacked.device
            # the drafts as a device matrix, for the penalties and rejection sampling (made once)
            matrix = draft_matrix(group, width, device) if slots or not greedy else None
            if slots:
                assert penalties is not None, "penalised rows need the engine's penalty tables"
                at = upload([r for r, p in enumerate(params) if p.has_penalties], torch.long, device)
                pairs = upload([extra_rows, extra_at], torch.long, device)
                extra = Generated(pairs[0], matrix.view(-1)[pairs[1]])
                stacked = stacked.index_copy(0, at, penalties.apply_rows(
                    stacked.index_select(0, at), slots, extra, [p for p in params if p.has_penalties]))
            histories = [unread] * len(rows)
            if greedy:  # the argmax of the penalised logits, no draws
                verdict = self.sampler.sample(stacked, params, histories, [None] * len(rows), penalised=True)
            else:
                finite = finite_rows(stacked)
                p = self.sampler.distribution(stacked, params, histories, penalised=True, finite=finite)
                generators = [seqs[b].generator for b in index]
                assert all(g is not None for g in generators)  # every sampled request has its own
                verdict = judge_stochastic(group, p, generators, finite, matrix)
            verdicts.append((greedy, index, verdict))
        # the round's one read of the device: every group's verdict and the drafts still there
        host = read_with(drafts, torch.cat([verdict for _, _, verdict in verdicts]))
        kept: list[list[int]] = [[] for _ in seqs]
        for greedy, index, verdict in verdicts:
            values, host = host[: verdict.numel()], host[verdict.numel() :]
            if greedy:  # values: the target's token after each row
                for b in index:
                    n = drafts[b].count + 1
                    kept[b], values = accept_greedy(drafts[b].tokens, values[:n]), values[n:]
            else:
                for b, tokens in zip(index, stochastic_kept([drafts[b] for b in index], values)):
                    kept[b] = tokens
        return kept

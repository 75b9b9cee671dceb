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
   kept tokens (verify.py), on the device, their read started (`Verdict`).
4. From the device verdict the engine commits the kept prefix of the GDN state (rollback.py) and
   shows the drafter the kept rows (`observe`); then it waits for the read, the drafter settles
   its host state, and the engine appends the tokens and frees surplus pages; `record` counts the
   round.
Sequences asking no drafts ride along as rows of width 1 (+ padding); grammar-constrained
sequences never draft (engine/grammar.py), and `judge` masks their single row like plain sampling.
"""

from __future__ import annotations

from collections.abc import Callable

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
from .base import Draft, Drafter, Observation, draft_matrix, start_read
from .verify import Verdict, accept_greedy, greedy_verdict, judge_stochastic, stochastic_kept, stochastic_verdict


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

    def observe(self, seqs: list[Sequence], verdict: Verdict, batch: ForwardBatch,
                out: ForwardOutput) -> Callable[[list[list[int]]], None]:
        """A verify's kept rows become part of their sequences: the drafter conditions on them from
        the verdict on the device, before the host has read it (a failed sequence's rows go too,
        harmlessly: it ends). Returns what the drafter is told once the kept tokens are read."""
        watched = [i for i, s in enumerate(seqs) if s.draft_limit and not s.finished]
        if not watched:
            return lambda kept: None
        counts, following = verdict.counts, verdict.following
        if len(watched) < len(seqs):
            at = upload(watched, torch.long, counts.device)
            counts, following = counts[at], following[at]
        obs = Observation([seqs[i] for i in watched], watched, None, batch, out, following, counts - 1)
        self.drafter.observe(obs)
        return lambda kept: self.drafter.settle(obs, [len(kept[i]) for i in watched])

    @property
    def follows_plain_steps(self) -> bool:
        """Whether rounds without drafts may run as plain decode steps: the drafter learns from a
        step's sampled tokens on the device (MTP, n-gram), not from captured layers (DFlash)."""
        return not self.drafter.capture_layers

    def observe_step(self, seqs: list[Sequence], batch: ForwardBatch, out: ForwardOutput,
                     tokens: torch.Tensor) -> None:
        """A plain decode step's rows, one token each, sampled on the device (`tokens` [len(seqs)], -1
        where sampling failed: that sequence ends): the drafter conditions on them before the host
        has read them. The adaptive policy counts the round now, not when it is read: a round
        without drafts has no outcome to wait for, and the next round's choice, made while this one
        is in flight, sees it as the synchronous engine's would (its probes come on time)."""
        watched = [i for i, s in enumerate(seqs) if s.draft_limit and not s.finished]
        if not watched:
            return
        if self.adaptive is not None:
            for i in watched:
                self.adaptive.update(seqs[i].request_id, 0, 0)
        if len(watched) < len(seqs):
            tokens = tokens[upload(watched, torch.long, tokens.device)]
        self.drafter.observe(Observation([seqs[i] for i in watched], watched, [1] * len(watched), batch, out,
                                         tokens.clamp_min(0)[:, None], torch.zeros_like(tokens)))

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

    def record(self, seq: Sequence, output: StepOutput, draft: Draft, kept: int, learned: bool = False,
               asked: int = 0) -> None:
        """Count a sequence's round (its drafts and how many were accepted) into `output` and the totals,
        and for the adaptive policy unless it `learned` of the round already (`observe_step`); `asked`:
        the drafts the round asked the drafter for."""
        if not seq.draft_limit:
            return
        output.drafted, output.accepted = len(draft.tokens), kept - 1
        for stats in (seq.spec, self.totals):
            assert stats is not None
            stats.drafted += output.drafted
            stats.accepted += output.accepted
            stats.rounds += 1
            stats.round_tokens += len(output.new_token_ids)
        if self.adaptive is not None and not learned:
            self.adaptive.update(seq.request_id, output.drafted, output.accepted, asked)

    def _wanted(self, seq: Sequence, batch: int) -> int:
        """Drafts for this round before the caps: the limit, or the adaptive policy's choice under it
        (for a round of `batch` sequences)."""
        if self.adaptive is None or not seq.draft_limit:
            return seq.draft_limit
        return self.adaptive.choose(seq.request_id, seq.draft_limit, batch, not seq.request.sampling.is_greedy)

    def judge(self, seqs: list[Sequence], drafts: list[Draft], logits: torch.Tensor,
              penalties: PenaltyTables | None = None) -> Verdict:
        """The kept tokens per sequence from the target's logits [B, T, V], on the device and being
        read (verify.py `Verdict`). Row t of a sequence is judged with the history output +
        drafts[:t], exactly as plain decoding would see it (a constrained sequence's one row through
        its grammar mask); `penalties`: as in `propose`. A sequence whose judged logits were not
        finite (or whose grammar left no token) ends in token -1, as the plain sampler's rows do."""
        unread = TokenHistory(())  # the penalties come from the tables: the sampler reads no history
        # per group: its sequences, their verdict and drafts (`draft_matrix`), on the device
        verdicts: list[tuple[bool, list[int], torch.Tensor, torch.Tensor]] = []
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
            # the drafts as a device matrix, for the penalties, the judge and the verdict (made once)
            matrix = draft_matrix(group, width, device)
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
            verdicts.append((greedy, index, verdict, matrix))
        # the round's one read of the device, started: every group's verdict and the drafts still there
        finish = start_read(drafts, torch.cat([verdict for _, _, verdict, _ in verdicts]))

        def kept() -> list[list[int]]:
            host = finish()
            out: list[list[int]] = [[] for _ in seqs]
            for greedy, index, verdict, _ in verdicts:
                values, host = host[: verdict.numel()], host[verdict.numel() :]
                if greedy:  # values: the target's token after each row
                    for b in index:
                        n = drafts[b].count + 1
                        out[b], values = accept_greedy(drafts[b].tokens, values[:n]), values[n:]
                else:
                    for b, tokens in zip(index, stochastic_kept([drafts[b] for b in index], values)):
                        out[b] = tokens
            return out

        counts, following = self._device_verdict(seqs, drafts, verdicts, logits.device)
        return Verdict(counts, following, kept)

    @staticmethod
    def _device_verdict(seqs: list[Sequence], drafts: list[Draft],
                        verdicts: list[tuple[bool, list[int], torch.Tensor, torch.Tensor]],
                        device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Every group's kept counts [B] and following tokens [B, W] (the verify's width) on the
        device; a failed sequence's -1 becomes 0 there (any id does for rows the host drops)."""
        width = 1 + max(d.count for d in drafts)
        parts = []
        for greedy, index, verdict, matrix in verdicts:
            ks = [drafts[b].count for b in index]
            if not greedy:
                parts.append((index, *stochastic_verdict(verdict, matrix)))
                continue
            w = matrix.shape[1]
            if all(k == w for k in ks):  # the verdict's rows as they lie: k + 1 a sequence
                targets = verdict.view(len(index), w + 1)
            else:  # sequence i's row t at its offset + t, its last row repeated past its k
                offsets = [sum(k + 1 for k in ks[:i]) for i in range(len(ks))]
                at = [[o + min(t, k) for t in range(w + 1)] for o, k in zip(offsets, ks)]
                targets = verdict[upload(at, torch.long, device)]
            parts.append((index, *greedy_verdict(targets, matrix, ks)))
        if len(parts) == 1:  # one group: every sequence, in order
            _, counts, following = parts[0]
            return counts, following.clamp_min(0)
        counts = torch.zeros(len(seqs), dtype=torch.long, device=device)
        following = torch.zeros(len(seqs), width, dtype=torch.long, device=device)
        for index, group_counts, group_following in parts:
            at = upload(index, torch.long, device)
            counts.index_copy_(0, at, group_counts)
            following[at, : group_following.shape[1]] = group_following.clamp_min(0)
        return counts, following

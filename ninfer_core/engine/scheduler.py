"""The scheduler: the one owner of waiting and running sequences and of their share of the cache.

Each step it builds a `StepPlan`: every running sequence that is generating gets a decode row,
and prompt chunks of sequences still reading their prompts fill the rest of the token budget
(several sequences per step, oldest first), so a burst of prompts starts together and a mixed
step reads the weights once.

Admission (waiting -> running) needs a free state slot and free KV pages for the whole prompt on
top of the prompts already admitted but not yet read; the answer's pages are taken as it grows.
When a running sequence cannot get the page for its next token, the most recently admitted
sequence is preempted: its cache is freed and it goes back to the front of the queue with its
answer so far, which is read as part of its prompt when it is admitted again (recompute, as vLLM
does). Nothing is lost: the client only waits.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass, field

from ..cache import CacheManager
from .sequence import Sequence

# prompts longer than a prompt graph holds, up to this many times its length, are read in
# graph-sized pieces: on the H200 (35B, 2,048-token graphs) 2,560 / 3,072 tokens took 114 / 132 ms in
# pieces, 165 / 144 ms as one eager chunk; from 4,096 the eager chunk wins (137 vs 159 ms): its host
# time is hidden. A ratio, not a token count: bf16 experts' graphs stop at 16 tokens, and a 3,000-token
# prompt in 16-token pieces would take 188 steps.
PIECES_RATIO = 1.5


@dataclass
class PrefillChunk:
    """Tokens start..end of a sequence's prompt, read in this step."""

    seq: Sequence
    start: int
    end: int
    # checkpoints inside the chunk (positions, at most two: ForwardBatch.fork) and the state slots
    # the forward writes them to (the engine reserves them)
    forks: list[int] = field(default_factory=list)
    fork_slots: list[int] = field(default_factory=list)

    @property
    def last(self) -> bool:
        """The chunk that ends the prompt: its last row gives the next token."""
        return self.end == self.seq.prefill_len

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass
class StepPlan:
    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills

    @property
    def sequences(self) -> list[Sequence]:
        return self.decodes + [c.seq for c in self.prefills]


class Scheduler:
    def __init__(self, cache: CacheManager, max_batched_tokens: int, forks: bool = False, fork_tail: int = 0,
                 graph_piece: int = 0, scored_chunk: int = 0):
        """forks: a chunk takes the first checkpoint inside it as a fork (ForwardBatch.fork), and a
        second one if that lies within `fork_tail` tokens of the chunk's end, and ends at the next
        one; else every checkpoint ends a chunk. graph_piece: the longest prompt chunk a CUDA graph
        reads; a prompt with more than that left, but at most `pieces_up_to` (PIECES_RATIO times
        that), is read in pieces of that length: an eager forward's host time (~4,400 launches,
        ~150 ms on the 35B) is more than the pieces' extra weight reads there. scored_chunk: the
        longest chunk of a prompt whose tokens are scored (logits at every token; 0: no cap)."""
        self.cache = cache
        self.max_batched_tokens = max_batched_tokens
        self.forks = forks
        self.fork_tail = fork_tail
        self.graph_piece = graph_piece
        self.pieces_up_to = int(graph_piece * PIECES_RATIO)
        self.scored_chunk = scored_chunk
        self.max_running = cache.max_seqs  # the service may cap it lower (--max-concurrency)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # admitted, in admission order; each holds a slot
        self.preemptions = 0

    # -- the queue ------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove_waiting(self, seq: Sequence) -> None:
        self.waiting.remove(seq)

    def find(self, request_id: str) -> Sequence | None:
        return next((s for s in [*self.running, *self.waiting] if s.request_id == request_id), None)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the ledger -----------------------------------------------------------------------------

    def release(self, seq: Sequence) -> None:
        """The sequence ended (no launched step touches it any more): its slot and pages go back."""
        self.running.remove(seq)
        self._free(seq)

    def _free(self, seq: Sequence) -> None:
        if seq.cache is not None:
            self.cache.free(seq.cache)
            seq.cache = None

    def pages_for(self, seq: Sequence, tokens: int) -> int:
        """Pages the sequence still needs to hold `tokens` tokens."""
        have = len(seq.cache.pages) if seq.cache is not None else 0
        return max(0, math.ceil(tokens / self.cache.page_size) - have)

    def can_grow(self, seqs: list[Sequence], extra: int = 1) -> bool:
        """Whether every sequence can get pages for `extra` more tokens without a preemption."""
        need = sum(self.pages_for(s, s.num_cached + extra) for s in seqs)
        return need <= self.cache.free_pages

    def reserve_drafts(self, seqs: list[Sequence], wanted: list[int]) -> list[int]:
        """Draft counts that fit: each sequence already holds its next token's page; the extra
        positions are the most every sequence can get from the free pages (never preempting)."""
        extra = max(wanted, default=0)
        free = self.cache.free_pages
        while extra > 0 and sum(self.pages_for(s, s.num_cached + 1 + extra) for s in seqs) > free:
            extra -= 1
        for seq in seqs:
            assert seq.cache is not None
            self.cache.reserve(seq.cache, seq.num_cached + 1 + extra)
        return [min(k, extra) for k in wanted]

    # -- planning -------------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        while True:
            for seq in list(self.running):
                if seq in self.running and not seq.finished and not seq.in_prefill and seq.tokens_left > 0:
                    if self._make_room(seq, seq.num_cached + 1, plan):
                        plan.decodes.append(seq)
            self._admit()
            self._plan_prefills(plan)
            blocked = [s for s in self.running if s.in_prefill and not s.finished and s.inflight == 0]
            if not plan.empty or not blocked or len(self.running) == 1:
                return plan
            self.preempt(blocked[-1])  # prompts wait for pages nobody frees: make room

    def _plan_prefills(self, plan: StepPlan) -> None:
        """Prompt chunks, oldest sequence first, within the token budget and the free pages."""
        budget = self.max_batched_tokens - len(plan.decodes)
        page = self.cache.page_size
        for seq in self.running:
            if budget <= 0:
                break
            if seq.finished or not seq.in_prefill:
                continue
            assert seq.cache is not None
            room = (len(seq.cache.pages) + self.cache.free_pages) * page
            left = seq.prefill_len - seq.num_cached
            piece = self.graph_piece if 0 < self.graph_piece < left <= self.pieces_up_to else left
            if seq.scores_prompt and self.scored_chunk:
                piece = min(piece, self.scored_chunk)
            reach = min(seq.num_cached + piece, seq.num_cached + budget, room)
            cuts = self._checkpoints_ahead(seq)
            forks = [cuts.pop(0)] if self.forks and cuts and cuts[0] < reach else []
            if forks and cuts and cuts[0] < reach and min([reach, *cuts[1:2]]) - cuts[0] <= self.fork_tail:
                forks.append(cuts.pop(0))  # a chat's answer start after its history end
            end = min([reach, *cuts[:1]])  # the chunk ends at its next checkpoint (engine._prefilled)
            if end <= seq.num_cached:
                continue
            self.cache.reserve(seq.cache, end)
            plan.prefills.append(PrefillChunk(seq, seq.num_cached, end, forks))
            budget -= end - seq.num_cached

    def _checkpoints_ahead(self, seq: Sequence) -> list[int]:
        """The positions past num_cached where the state is to be kept, in order: where the request
        asks (its last message's start, its answer start) and, for a long prompt, its last token.

        A requested position before the prompt's last page is a fork far from the chunk's end (a GDN
        model's costs ~3 ms: a chat-shaped prompt's +2.7-3.3 ms on the 35B, H100). Where the prompt
        resumed from the cache it is kept only if it at least doubles the cached prefix: a continuing
        conversation resumes at its previous answer start and would pay it every turn (an agent every
        step) for the rare edit of its last message, which resumes at that answer start anyway; a
        first request and one that adds a long shared part (few-shot turns after a cached system
        prompt) keep it."""
        if self.cache.prefix is None:
            return []
        resumed = seq.timings.cached_tokens
        wanted = {p for p in seq.request.checkpoints
                  if seq.num_cached < p < seq.prefill_len and (self._in_last_page(seq, p) or p >= 2 * resumed)}
        if self._split_last(seq):
            wanted.add(seq.prefill_len - 1)
        return sorted(wanted)

    def _split_last(self, seq: Sequence) -> bool:
        """Whether the state before the prompt's last token is kept: with the prefix cache, a long
        prompt is checkpointed one token before its end, so that sending it again (a regenerated
        answer, a retried request) finds all but that token cached; short prompts skip it (a
        checkpoint slot; without forks, a step) unless the model has no recurrent state (its
        checkpoints hold none: PrefixCache.split_min), and so do prompts with a checkpoint of their own
        in their last page (a chat's answer start: sent again, it hits there)."""
        prefix = self.cache.prefix
        return (prefix is not None and seq.prefill_len >= prefix.split_min
                and seq.num_cached < seq.prefill_len - 1
                and not any(self._in_last_page(seq, p) for p in seq.request.checkpoints))

    def _in_last_page(self, seq: Sequence, p: int) -> bool:
        """Whether prompt position p lies in the prompt's last page (a chat's answer start does)."""
        return seq.prefill_len - self.cache.page_size <= p < seq.prefill_len

    def _admit(self) -> None:
        """Move waiting sequences to running while a slot and their prompt's pages are free; a
        prompt that repeats a cached prefix starts after it (prefix_cache.py)."""
        free = self.cache.free_pages - sum(self.pages_for(s, s.prefill_len + 1)
                                           for s in self.running if s.in_prefill and not s.finished)
        prefix = self.cache.prefix
        while self.waiting and self.cache.num_free_slots and len(self.running) < self.max_running:
            seq = self.waiting[0]
            tokens, keys = seq.tokens(seq.prefill_len), seq.media_keys(seq.prefill_len)
            # a scored prompt needs the logits of every token: nothing of it comes from the cache
            hit = prefix.lookup(tokens, keys, seq.prefill_len) if prefix is not None and not seq.scores_prompt else None
            need = math.ceil((seq.prefill_len + 1) / self.cache.page_size)
            if hit is not None:  # shared pages need none of their own, but stop being evictable
                need += sum(page in prefix.evictable for page in hit.pages) - len(hit.pages)
            if need > free:
                break
            self.waiting.popleft()
            if not seq.preemptions:
                seq.started_at = time.perf_counter()  # timings count from admission, not from the queue
            seq.cache = self.cache.allocate()
            if prefix is not None:
                prefix.count(seq.prefill_len, hit)
            if hit is not None:
                self.cache.resume(seq.cache, hit)
                seq.num_cached = hit.tokens
                if not seq.preemptions:
                    seq.timings.cached_tokens = hit.tokens
            self.running.append(seq)
            free -= need

    def note_progress(self, seq: Sequence, checkpoint: bool = False, filled: int | None = None) -> None:
        """The sequence's tokens below min(num_cached, known tokens) are in the cache (or queued):
        index its full pages there, and with `checkpoint` snapshot its state at num_cached (or keep
        the slot a fork `filled` with it: CacheManager.checkpoint)."""
        if self.cache.prefix is None or seq.cache is None:
            return
        known = min(seq.num_cached, seq.num_tokens)
        tokens, keys = seq.tokens(known), seq.media_keys(known)
        self.cache.index_pages(seq.cache, tokens, keys, known)
        if checkpoint and known == seq.num_cached:
            self.cache.checkpoint(seq.cache, tokens, keys, known, filled)
        elif filled is not None:
            self.cache.prefix.return_slot(filled)

    def _make_room(self, seq: Sequence, tokens: int, plan: StepPlan) -> bool:
        """Reserve the sequence's pages for `tokens` tokens, preempting the most recently admitted
        other sequences as needed; False when the sequence itself had to be preempted."""
        assert seq.cache is not None
        while not self.cache.can_reserve(seq.cache, tokens):
            victim = next((s for s in reversed(self.running) if s is not seq and s.inflight == 0), None)
            if victim is None:
                self.preempt(seq)
                return False
            if victim in plan.decodes:
                plan.decodes.remove(victim)
            self.preempt(victim)
        self.cache.reserve(seq.cache, tokens)
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free the sequence's cache and queue it first, to recompute prompt + answer so far."""
        assert seq.inflight == 0, "a launched step still writes this sequence's cache"
        self.running.remove(seq)
        self._free(seq)
        seq.num_cached = 0
        seq.prefill_len = seq.num_tokens
        seq.penalties_ready = False
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

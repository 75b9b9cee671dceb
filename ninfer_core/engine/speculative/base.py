"""The contract between the speculative engine and its drafters (n-gram, MTP, DFlash).

A round: the drafter proposes up to K tokens per sequence (`propose`), the target verifies all of
them in one forward, the accepted prefix plus one target token is kept, and the drafter is shown
the target rows that are now part of the sequence (`observe`) so it can condition its next
proposal on them (hidden states for MTP, layer features for DFlash). Prompt chunks are observed
the same way as they are prefilled.

Cache indices: a drafter with its own KV cache (MTP, DFlash) keeps entry i at the target's
cache index i in pages of the same ids as the target's (its pools have as many pages), so the
target's block table addresses it too. Before `propose`, the engine has reserved pages for
indices up to `seq.num_cached + k`; an observation may also write (and later ignore) padded rows
up to the verify width, inside that reservation.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...models.base import ForwardBatch, ForwardOutput
from ...ops.dispatch import upload
from ..penalties import PenaltyTables
from ..sampling import Sampler, TokenHistory
from ..sequence import Sequence


class Draft:
    """Proposed tokens for one sequence and the distribution each was drawn from (`probs` [count,
    V]; None: a deterministic proposal, q one-hot). A drafter may hand its tokens over still on the
    device (`pending`, [count] int64): the engine writes them into the verify batch unread and the
    judge reads them with its own result (`read_with`), so a round syncs once; `tokens`
    reads them (a sync) where anything else asks first."""

    def __init__(self, tokens: list[int] | None = None, probs: torch.Tensor | None = None,
                 pending: torch.Tensor | None = None):
        assert (tokens is None) != (pending is None), "a draft's tokens are on the host or on the device"
        self._tokens, self.probs, self.pending = tokens, probs, pending

    @property
    def count(self) -> int:
        return len(self._tokens) if self._tokens is not None else self.pending.numel()

    def host_or(self, fill: int) -> list[int]:
        """The tokens where the host has them, else `fill` in each place (read nothing)."""
        return self._tokens if self._tokens is not None else [fill] * self.count

    @property
    def tokens(self) -> list[int]:
        if self._tokens is None:
            read_with([self], None)
        return self._tokens


def read_with(drafts: list[Draft], values: torch.Tensor | None) -> list:
    """The tokens of the drafts still on the device, read in one copy with `values` (a 1-D device
    tensor: its values are returned): one host sync for both."""
    return start_read(drafts, values)()


def start_read(drafts: list[Draft], values: torch.Tensor | None) -> Callable[[], list]:
    """`read_with`, its copy started now and waited for by the returned call: the GPU takes more
    work meanwhile (a CUDA copy into pinned memory, then an event the call waits for)."""
    pending = [d for d in drafts if d._tokens is None]
    parts = ([] if values is None else [values.long()]) + [d.pending for d in pending]
    n = 0 if values is None else values.numel()
    if not parts:
        return list
    device = torch.cat(parts)
    event = None
    if device.is_cuda:
        host = torch.empty(device.shape, dtype=device.dtype, pin_memory=True)
        host.copy_(device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
    else:
        host = device

    def finish() -> list:
        if event is not None:
            event.synchronize()
        read = host.tolist()
        at = n
        for d in pending:
            d._tokens, d.pending = read[at : at + d.count], None
            at += d.count
        return read[:n]

    return finish


def place_pending(ids: torch.Tensor, drafts: list[Draft], start: int = 1) -> None:
    """The drafts still on the device into rows of ids [B, T] from column `start` (a verify batch's:
    the last token, then the drafts), without reading them."""
    for b, d in enumerate(drafts):
        if d.pending is not None and d.count:
            ids[b, start : start + d.count].copy_(d.pending)


def draft_matrix(drafts: list[Draft], width: int, device: torch.device) -> torch.Tensor:
    """[B, width] int64 on `device`: row b draft b's tokens, then zeros; nothing read from the device."""
    matrix = upload([d.host_or(0) + [0] * (width - d.count) for d in drafts], torch.long, device)
    place_pending(matrix, drafts, start=0)
    return matrix


@dataclass
class Observation:
    """Target rows that became part of their sequences: `seqs[i]` owns batch row `rows[i]`, whose
    first `counts[i]` tokens (cache indices `batch.cache_lens[row] + t`) are kept, and the token
    that follows each is `following[i][t]`, or the sequence's own where `following` is None. Rows
    past `counts[i]` are padding or rejected. A verify's observation may come before the host has
    read its verdict: `following` and `last` on the device, `counts` None until the drafter's
    `settle`."""

    seqs: list[Sequence]
    rows: list[int]
    counts: list[int] | None
    batch: ForwardBatch
    out: ForwardOutput
    following: list[list[int]] | torch.Tensor | None = None
    last: torch.Tensor | None = None  # [len(seqs)] counts[i] - 1 on the device, with `following` there

    def start(self, i: int) -> int:
        """The cache index of seqs[i]'s first row, from the host's copy of the lengths where the
        batch has one (reading the device's waits for every queued kernel)."""
        row, host = self.rows[i], self.batch.host_cache_lens
        return host[row] if host is not None else int(self.batch.cache_lens[row])

    def device_rows(self, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """On the device, in one upload: [len(seqs), T] the token after each row's position (`pad`
        past counts[i]), then [len(seqs)] each one's batch row and its last kept row counts[i] - 1."""
        device = self.batch.input_ids.device
        if isinstance(self.following, torch.Tensor):  # the device verdict's (entries past counts[i]: any id)
            assert self.last is not None
            return self.following, upload(self.rows, torch.long, device), self.last
        assert self.counts is not None
        width = self.batch.num_new_tokens
        table = []
        for i, (seq, row, count) in enumerate(zip(self.seqs, self.rows, self.counts)):
            if self.following is not None:
                after = self.following[i]
            else:
                after = [seq.token_at(self.start(i) + t + 1) for t in range(count)]
            tokens = after + [pad] * (width - count)
            table.append(tokens + [row, count - 1])
        host = upload(table, torch.long, device)
        return host[:, :width], host[:, width], host[:, width + 1]


class Drafter(ABC):
    method: str
    max_draft_tokens: int  # the largest K this drafter supports
    capture_layers: tuple[int, ...] = ()  # target layers whose outputs `observe` needs
    cache_bytes: int = 0  # memory of the drafter's own KV cache

    def observe(self, obs: Observation) -> None:
        """The target committed these rows (see Observation): the drafter's device work, and where
        obs.counts is known its host bookkeeping too (`settle`). Default: nothing to learn."""

    def settle(self, obs: Observation, counts: list[int]) -> None:
        """The kept counts of an observation made before the verdict was read. Default: nothing."""

    @abstractmethod
    def propose(self, seqs: list[Sequence], counts: list[int], penalties: PenaltyTables | None = None) -> list[Draft]:
        """At most counts[i] >= 1 tokens following each sequence's last token. `penalties`: the
        engine's tables, each penalised sequence's row holding its history (None: none has
        penalties); a drafter may read sampled rows' penalties from them instead of the host lists."""

    def release(self, seq: Sequence) -> None:
        """The sequence ended: drop what the drafter keeps for it."""


def uniform(generator: torch.Generator, n: int = 1, out: torch.Tensor | None = None) -> torch.Tensor:
    """n float64 uniforms from a request's own generator (on the generator's device; into `out`, n
    long, where given: the same draws)."""
    return torch.rand(n, dtype=torch.float64, generator=generator, device=generator.device, out=out)


def choose_drafts(sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence], histories: list[TokenHistory],
                  u: torch.Tensor | None = None) -> tuple[list[int], list[torch.Tensor | None]]:
    """One draft token per row of a drafter's logits [N, V]: argmax for greedy requests (q one-hot),
    else a draw from q = the request's own sampling distribution over the drafter's logits, with
    u[j] for the j-th sampled row (None: one uniform from each one's generator)."""
    tokens = logits.argmax(-1).tolist()
    probs: list[torch.Tensor | None] = [None] * len(seqs)
    stochastic = [i for i, s in enumerate(seqs) if not s.request.sampling.is_greedy]
    if stochastic:
        if u is None:
            u = torch.cat([uniform(seqs[i].generator).to(logits.device) for i in stochastic])
        drawn, q = sampler.draw(logits[stochastic].float(), [seqs[i].request.sampling for i in stochastic],
                                [histories[i] for i in stochastic], u)
        for j, (i, token) in enumerate(zip(stochastic, drawn.tolist())):
            tokens[i], probs[i] = token, q[j]
    return tokens, probs

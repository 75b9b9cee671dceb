"""Which draft tokens to keep: greedy matching and lossless rejection sampling.

Inputs per sequence: the draft d_1..d_k and the target's distributions p_0..p_k from one verify
forward (p_t is the exact distribution the plain sampler would draw the token after d_1..d_t
from: penalties with the drafts counted as generated, temperature, top-k / top-p / min-p).

Greedy: keep the longest prefix with d_{t+1} = argmax p_t, then the target's own argmax token.

Stochastic (Leviathan et al. 2023, Chen et al. 2023): for t = 0.., accept d_{t+1} with
probability min(1, p_t(d) / q_t(d)); at the first rejection emit a draw from
normalize(max(0, p_t - q_t)) and stop; if all k are accepted emit a draw from p_k. Every emitted
token is then distributed exactly as plain sampling from p. A deterministic drafter (n-gram, or
greedy MTP/DFlash) has q one-hot: accept with probability p_t(d), resample from p_t without d.

Draws come from the request's own generator (k + 1 uniforms per round, whatever is accepted),
so a seeded request is reproducible for a given drafter and K. A round's sampled sequences are
judged together on the device (`judge_stochastic`, whose verdict the Speculator reads with the
greedy rows' and the drafts: one host sync for the round), where a sequence at a time took four
(its rejection index, the residual's emptiness, the draw); the last token is drawn over 64-bit
fixed-point masses (ops/rejection.py: the CUDA kernel and its torch reference agree exactly).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...ops import rejection
from ...ops.dispatch import upload
from .base import Draft, draft_matrix, uniform


@dataclass
class Verdict:
    """A round's verdict on the device, its read under way: `counts` [B] int64 (each sequence's kept
    tokens, its accepted drafts + 1) and `following` [B, W] int64 (its kept tokens in order, the
    token after each row; entries past counts[b] any valid id) let the GDN commit and the drafter's
    catch-up go before the host waits; `kept()` waits for the read (the round's one sync) and gives
    the kept tokens, a failed sequence's ending in -1."""

    counts: torch.Tensor
    following: torch.Tensor
    read: Callable[[], list[list[int]]]
    _kept: list[list[int]] | None = None

    def kept(self) -> list[list[int]]:
        if self._kept is None:
            self._kept = self.read()
        return self._kept


def greedy_verdict(targets: torch.Tensor, drafts: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`accept_greedy` on the device for G sequences: targets [G, W + 1] (the target's token after
    each row), drafts [G, W] (`draft_matrix`), counts[g] drafts each -> (kept counts [G], following
    [G, W + 1]: the targets, which are the kept tokens up to the first mismatch)."""
    width = drafts.shape[1]
    match = drafts == targets[:, :width]
    if any(c != width for c in counts):
        match &= torch.arange(width, device=drafts.device) < upload(counts, torch.long, drafts.device)[:, None]
    return match.long().cumprod(1).sum(1) + 1, targets


def stochastic_verdict(verdict: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`judge_stochastic`'s verdict [2G] (accepted n, then the last token) and the drafts [G, W] ->
    (kept counts n + 1 [G], following [G, W + 1]: the accepted drafts, then the last token)."""
    n, last = verdict.view(2, -1)
    column = torch.arange(drafts.shape[1] + 1, device=drafts.device)
    padded = torch.nn.functional.pad(drafts, (0, 1))
    return n + 1, torch.where(column < n[:, None], padded, last[:, None])


def accept_greedy(draft: list[int], target: list[int]) -> list[int]:
    """target[t] = the target's token after draft[:t], t = 0..k. Returns the emitted tokens."""
    n = 0
    while n < len(draft) and draft[n] == target[n]:
        n += 1
    return draft[:n] + [target[n]]


def stochastic_kept(drafts: list[Draft], verdict: list[int]) -> list[list[int]]:
    """The kept tokens from `judge_stochastic`'s verdict read to the host (the drafts read too)."""
    counts, last = verdict[: len(drafts)], verdict[len(drafts) :]
    return [d.tokens[:m] + [t] for d, m, t in zip(drafts, counts, last)]


def judge_stochastic(drafts: list[Draft], p: torch.Tensor, generators: list[torch.Generator],
                     finite: torch.Tensor | None = None, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """B sequences judged at once on p's device, nothing read: [2B] int64, each sequence's accepted
    draft count, then each one's last token (`stochastic_kept` turns them, read, into the kept
    tokens; ops/rejection.py does the work). p holds each sequence's k_b + 1 rows back to back; each
    generator gives its k_b + 1 uniforms first, in batch order, as one sequence at a time would.
    `finite` [rows of p]: False where the row's logits were not finite: a sequence with such a row
    among those it was judged on keeps no draft and gets token -1 (the engine fails it). `tokens`:
    the drafts' `draft_matrix` where the caller made it."""
    device, ks = p.device, [d.count for d in drafts]
    width = max(ks)
    u = torch.zeros(len(drafts), width + 1, dtype=torch.float64, device=device)
    for b, (generator, k) in enumerate(zip(generators, ks)):
        uniform(generator, k + 1, out=u[b, : k + 1])
    tokens = draft_matrix(drafts, width, device) if tokens is None else tokens
    drawn = [d for d in drafts if d.probs is not None]  # drafts with their q; the others are one-hot
    q = torch.cat([d.probs.to(device) for d in drawn]) if drawn else None
    meta, p_row, q_row = [], 0, 0
    for d in drafts:
        meta.append([d.count, p_row, q_row if d.probs is not None else -1])
        p_row += d.count + 1
        q_row += d.count if d.probs is not None else 0
    return rejection.judge(p, q, tokens, u, upload(meta, torch.long, device), finite)

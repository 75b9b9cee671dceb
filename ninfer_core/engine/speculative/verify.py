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
(its rejection index, the residual's emptiness, the draw).
"""

from __future__ import annotations

import torch

from ...ops.dispatch import upload
from ..sampling import draw_from_probs
from .base import Draft, draft_matrix, read_with, uniform


def accept_greedy(draft: list[int], target: list[int]) -> list[int]:
    """target[t] = the target's token after draft[:t], t = 0..k. Returns the emitted tokens."""
    n = 0
    while n < len(draft) and draft[n] == target[n]:
        n += 1
    return draft[:n] + [target[n]]


def accept_stochastic(draft: Draft, p: torch.Tensor, generator: torch.Generator) -> list[int]:
    """p [k+1, V] target distributions. Returns the accepted drafts plus one more token."""
    return accept_stochastic_rows([draft], p, [generator])[0]


def accept_stochastic_rows(drafts: list[Draft], p: torch.Tensor, generators: list[torch.Generator],
                           finite: torch.Tensor | None = None) -> list[list[int]]:
    """`accept_stochastic` for B sequences at once, on p's device with one host sync for the batch
    (per sequence it took four): p holds each sequence's k_b + 1 rows back to back. Each generator
    gives its k_b + 1 uniforms first, in batch order, as one sequence at a time would. `finite`
    [rows of p]: False where the row's logits were not finite: a sequence with such a row among
    those it was judged on keeps no draft and gets token -1 (the engine fails it)."""
    return stochastic_kept(drafts, read_with(drafts, judge_stochastic(drafts, p, generators, finite)))


def stochastic_kept(drafts: list[Draft], verdict: list[int]) -> list[list[int]]:
    """The kept tokens from `judge_stochastic`'s verdict read to the host (the drafts read too)."""
    counts, last = verdict[: len(drafts)], verdict[len(drafts) :]
    return [d.tokens[:m] + [t] for d, m, t in zip(drafts, counts, last)]


def judge_stochastic(drafts: list[Draft], p: torch.Tensor, generators: list[torch.Generator],
                     finite: torch.Tensor | None = None, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """`accept_stochastic_rows` on the device, nothing read: [2B] int64, each sequence's accepted
    draft count, then each one's last token (`stochastic_kept` turns them into the kept tokens).
    `tokens`: the drafts' `draft_matrix` where the caller made it already."""
    device, ks = p.device, [d.count for d in drafts]
    width = max(ks)
    u = torch.zeros(len(drafts), width + 1, dtype=torch.float64, device=device)
    for b, (generator, k) in enumerate(zip(generators, ks)):
        u[b, : k + 1] = uniform(generator, k + 1).to(device)
    k_rows = upload(ks, torch.long, device)
    starts = [sum(ks[:b]) + b for b in range(len(ks))]
    # row of (b, t) in p, t past k_b clamped to b's last row
    rows = upload([[start + min(t, k) for t in range(width + 1)] for start, k in zip(starts, ks)], torch.long, device)
    tokens = draft_matrix(drafts, width, device) if tokens is None else tokens
    drawn = [d for d in drafts if d.probs is not None]  # drafts with their q; the others are one-hot
    q_all = torch.cat([d.probs.to(device) for d in drawn]) if drawn else None
    q_starts, at = [], 0
    for d in drafts:
        q_starts.append(at if d.probs is not None else -1)
        at += d.count if d.probs is not None else 0
    has_q = upload([s >= 0 for s in q_starts], torch.bool, device)
    q_rows = upload([[min(max(s, 0) + min(t, max(k - 1, 0)), max(at - 1, 0)) for t in range(max(width, 1))]
                     for s, k in zip(q_starts, ks)], torch.long, device)  # (b, t)'s q row, clamped into q_all
    if width:
        p_d = p[rows[:, :width], tokens].double()
        q_d = torch.ones_like(p_d) if q_all is None else torch.where(
            has_q[:, None], q_all[q_rows[:, :width], tokens].double(), 1.0)
        rejected = (u[:, :width] * q_d >= p_d) & (torch.arange(width, device=device) < k_rows[:, None])
        n = torch.where(rejected.any(1), rejected.to(torch.int8).argmax(1), k_rows)
    else:
        n = k_rows
    p_n = p[rows.gather(1, n[:, None]).squeeze(1)].double()
    # the draft's q at the first rejection (nothing where every draft was accepted: p_k itself)
    rejecting = n < k_rows
    q_n = torch.zeros_like(p_n)
    if q_all is not None:
        q_at_n = q_rows.gather(1, n.clamp(max=q_rows.shape[1] - 1)[:, None]).squeeze(1)
        q_n = torch.where((has_q & rejecting)[:, None], q_all[q_at_n].double(), q_n)
    if width:  # one-hot drafts: q is 1 at the rejected token
        one_hot = (~has_q & rejecting).double()
        q_n.scatter_add_(1, tokens.gather(1, n.clamp(max=width - 1)[:, None]), one_hot[:, None])
    residual = (p_n - q_n).clamp(min=0)
    residual = torch.where((residual > 0).any(1, keepdim=True), residual, p_n)  # p == q: rounding; p is the answer
    token = draw_from_probs(residual, u.gather(1, k_rows[:, None]).squeeze(1))
    if finite is not None:  # a row past the one the token came from is never judged, as in plain decoding
        invalid = (~finite[rows] & (torch.arange(width + 1, device=device) <= n[:, None])).any(1)
        n, token = n.masked_fill(invalid, 0), token.masked_fill(invalid, -1)
    return torch.cat([n, token])

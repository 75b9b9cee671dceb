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
so a seeded request is reproducible for a given drafter and K.
"""

from __future__ import annotations

import torch

from ..sampling import draw_from_probs
from .base import Draft, uniform


def accept_greedy(draft: list[int], target: list[int]) -> list[int]:
    """target[t] = the target's token after draft[:t], t = 0..k. Returns the emitted tokens."""
    n = 0
    while n < len(draft) and draft[n] == target[n]:
        n += 1
    return draft[:n] + [target[n]]


def accept_stochastic(draft: Draft, p: torch.Tensor, generator: torch.Generator) -> list[int]:
    """p [k+1, V] target distributions. Returns the accepted drafts plus one more token."""
    k = len(draft.tokens)
    u = uniform(generator, k + 1).to(p.device)
    if k:
        ids = torch.tensor(draft.tokens, device=p.device)
        rows = torch.arange(k, device=p.device)
        p_d = p[rows, ids].double()
        q_d = torch.ones_like(p_d) if draft.probs is None else draft.probs.to(p.device)[rows, ids].double()
        rejected = (u[:k] * q_d >= p_d).nonzero()
        n = int(rejected[0, 0]) if rejected.numel() else k
    else:
        n = 0
    if n == k:
        return draft.tokens + [int(draw_from_probs(p[k : k + 1], u[k:]))]
    q = _draft_row(draft, n, p)
    residual = (p[n].double() - q).clamp(min=0)
    if not bool((residual > 0).any()):  # p == q: a rejection had probability 0 (rounding); p is the answer
        residual = p[n].double()
    return draft.tokens[:n] + [int(draw_from_probs(residual[None], u[k:]))]


def _draft_row(draft: Draft, t: int, p: torch.Tensor) -> torch.Tensor:
    if draft.probs is not None:
        return draft.probs[t].to(p.device).double()
    q = torch.zeros(p.shape[-1], dtype=torch.float64, device=p.device)
    q[draft.tokens[t]] = 1.0
    return q

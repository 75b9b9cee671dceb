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

import torch

from ...ops import rejection
from ...ops.dispatch import upload
from .base import Draft, draft_matrix, uniform


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

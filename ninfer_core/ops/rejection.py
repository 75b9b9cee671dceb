"""Speculative rejection sampling of a round on the device (engine/speculative/verify.py's rule):
each sequence's accepted draft count and last token, for the whole batch at once. The CUDA kernel
(csrc/sampling.cu `judge_rows`: two launches) for CUDA tensors, else the torch reference; both
draw the last token over 64-bit fixed-point masses (the sampler's), so they agree bit for bit, and
the sums are exact whatever their order."""

from __future__ import annotations

import torch

from . import dispatch
from .sampling import SAMPLE_MAX_SEGMENTS

MAX_DRAFTS = 32  # sampling.h kJudgeMaxDrafts: a warp's lanes judge one draft each


def fixed_point_scale(vocab: int) -> float:
    """The mass of probability 1: vocab * scale <= 2^62, so a row's sum fits in 64 bits."""
    return 2.0 ** (62 - max(vocab - 1, 0).bit_length())


def judge_ref(p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor, u: torch.Tensor, meta: torch.Tensor,
              finite: torch.Tensor | None = None) -> torch.Tensor:
    """[2B] int64: each sequence's accepted drafts n, then its last token (csrc/sampling.h
    `JudgeArgs` says the inputs). No host sync."""
    device, width, vocab = p.device, drafts.shape[1], p.shape[1]
    k, p0, q0 = meta.unbind(1)
    t = torch.arange(width + 1, device=device)
    rows = p0[:, None] + torch.minimum(t[None], k[:, None])  # (b, t)'s p row, t past k at k
    has_q = q0 >= 0
    q_rows = None
    if q is not None and q.shape[0]:  # (b, t)'s q row, t past k - 1 at k - 1, clamped into q
        q_rows = (q0.clamp(min=0)[:, None] + torch.minimum(t[None, :max(width, 1)], (k - 1).clamp(min=0)[:, None]))
        q_rows = q_rows.clamp(max=q.shape[0] - 1)
    if width:
        p_d = p[rows[:, :width], drafts].double()
        q_d = torch.ones_like(p_d) if q_rows is None else torch.where(
            has_q[:, None], q[q_rows[:, :width], drafts].double(), 1.0)
        rejected = (u[:, :width] * q_d >= p_d) & (t[None, :width] < k[:, None])
        n = torch.where(rejected.any(1), rejected.to(torch.int8).argmax(1), k)
    else:
        n = k
    p_n = p[rows.gather(1, n[:, None])[:, 0]].double()
    rejecting = n < k
    q_n = torch.zeros_like(p_n)
    if q_rows is not None:  # the rejected draft's q
        q_at_n = q_rows.gather(1, n.clamp(max=q_rows.shape[1] - 1)[:, None])[:, 0]
        q_n = torch.where((has_q & rejecting)[:, None], q[q_at_n].double(), q_n)
    if width:  # one-hot drafts: q is 1 at the rejected token
        one_hot = (~has_q & rejecting).double()[:, None]
        q_n.scatter_add_(1, drafts.gather(1, n.clamp(max=width - 1)[:, None]), one_hot)
    scale = fixed_point_scale(vocab)
    residual = ((p_n - q_n).clamp(min=0) * scale).round().long()
    mass = torch.where((residual.sum(1) > 0)[:, None], residual, (p_n * scale).round().long())
    cdf = mass.cumsum(1)
    total = cdf[:, -1]
    draw = (u.gather(1, k[:, None])[:, 0].clamp(0, 1) * total.double()).long()
    target = torch.minimum(draw, total - 1)
    token = torch.searchsorted(cdf, target[:, None], right=True)[:, 0]  # the first running mass above it
    token = torch.where(total > 0, token, -1)
    if finite is not None:  # a row past the one the token came from is never judged, as in plain decoding
        invalid = (~finite[rows] & (t[None] <= n[:, None])).any(1)
        n, token = n.masked_fill(invalid, 0), token.masked_fill(invalid, -1)
    return torch.cat([n, token])


def judge(p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor, u: torch.Tensor, meta: torch.Tensor,
          finite: torch.Tensor | None = None) -> torch.Tensor:
    """`judge_ref`; on CUDA two kernel launches where the reference takes ~45."""
    if p.device.type != "cuda" or not dispatch.kernels_available() or drafts.shape[1] > MAX_DRAFTS:
        return judge_ref(p, q, drafts, u, meta, finite)
    batch = drafts.shape[0]
    out = torch.empty(2 * batch, dtype=torch.long, device=p.device)
    dispatch.extension().judge_rows(  # shapes, dtypes and layouts checked there
        out=out, p=p.contiguous(), q=None if q is None or not q.shape[0] else q.contiguous(),
        drafts=drafts.contiguous(), u=u.contiguous(), meta=meta.contiguous(),
        finite=None if finite is None else finite.contiguous(),
        sums=torch.empty(2 * batch * SAMPLE_MAX_SEGMENTS, dtype=torch.long, device=p.device),
        stream=dispatch.stream_handle(p))
    return out

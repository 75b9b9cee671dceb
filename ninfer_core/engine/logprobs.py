"""Log-probabilities of sampled tokens, as OpenAI reports them: the log-softmax of the model's
logits before any sampling transform (penalties, logit_bias, grammar mask, temperature, top-k /
top-p / min-p), for the chosen token and the `n` most likely ones (n <= MAX_TOP_LOGPROBS).

Computed on the device next to sampling and copied to the host with the tokens (one packed
float64 tensor per step), so asking for logprobs does not stop a step from overlapping the next.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..ops.dispatch import upload

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token: its log-probability and the most likely alternatives (best first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def log_softmax_rows(logits: torch.Tensor, wanted: Sequence[int | None]) -> LogSoftmax | None:
    """The log-softmax of the rows of logits [R, V] whose `wanted` count (alternatives) is not
    None; None when no row asks."""
    rows = [i for i, n in enumerate(wanted) if n is not None]
    if not rows:
        return None
    index = upload(rows, torch.long, logits.device)
    scores = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    return LogSoftmax(rows, [wanted[i] or 0 for i in rows], scores, index)


@dataclass
class LogprobRows:
    """The logprobs of the rows of a sampled batch that asked for them: `rows[i]` (a row of the
    batch) keeps `counts[i]` alternatives; `packed` [n, 1 + 2k] holds per row the chosen token's
    logprob, then k alternative ids, then their logprobs (on the device, or copied to the host)."""

    rows: list[int]
    counts: list[int]
    packed: torch.Tensor

    def to_host(self) -> LogprobRows:
        """A copy on the host, non-blocking on CUDA (read it after the step's event)."""
        if self.packed.device.type != "cuda":
            return self
        host = torch.empty(self.packed.shape, dtype=self.packed.dtype, pin_memory=True)
        host.copy_(self.packed, non_blocking=True)
        return LogprobRows(self.rows, self.counts, host)

    def entries(self, tokens: Sequence[int]) -> dict[int, TokenLogprob]:
        """Row -> its TokenLogprob (`tokens`: the sampled ids of the whole batch, on the host)."""
        k = (self.packed.shape[1] - 1) // 2
        out = {}
        for values, row, n in zip(self.packed.tolist(), self.rows, self.counts):
            top = tuple((int(t), v) for t, v in zip(values[1 : 1 + n], values[1 + k : 1 + k + n]))
            out[row] = TokenLogprob(tokens[row], values[0], top)
        return out


@dataclass
class LogSoftmax:
    """Log-probabilities of the asking rows [n, V], before the token is drawn."""

    rows: list[int]
    counts: list[int]
    scores: torch.Tensor
    index: torch.Tensor  # `rows` on the device

    def pick(self, tokens: torch.Tensor) -> LogprobRows:
        """The chosen tokens' logprobs (tokens: [R] ids of the whole batch; -1 rows read id 0)."""
        chosen = self.scores.gather(1, tokens.index_select(0, self.index).clamp(min=0)[:, None])
        k = max(self.counts)
        top = torch.topk(self.scores, k, dim=-1) if k else None
        parts = [chosen.double()] + ([top.indices.double(), top.values.double()] if top is not None else [])
        return LogprobRows(self.rows, self.counts, torch.cat(parts, dim=1))

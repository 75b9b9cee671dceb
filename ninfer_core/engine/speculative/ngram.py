"""N-gram / prompt-lookup drafts: no weights, any model.

The last n tokens (n = max_n down to min_n, first hit wins) are looked up in everything the
sequence holds (prompt + output); at the most recent earlier occurrence, the tokens that
followed it are the draft. The copy continues into the draft itself when it runs past the end,
so a loop of period p keeps proposing its continuation (draft[i] = tokens[j + 1 + i mod p]).
Drafts are deterministic: the verifier treats q as one-hot.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ...errors import NinferError
from ..penalties import PenaltyTables
from ..sequence import Sequence
from .base import Draft, Drafter


def lookup(tokens: np.ndarray, k: int, max_n: int, min_n: int) -> list[int]:
    """Up to k tokens continuing `tokens` by copying what followed its longest repeated suffix."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        windows = sliding_window_view(tokens[: length - 1], n)  # windows ending before the last token
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if hits.size:
            end = int(hits[-1]) + n - 1  # last index of the most recent earlier occurrence
            period = length - 1 - end
            return [int(tokens[end + 1 + i % period]) for i in range(k)]
    return []


class _TokenBuffer:
    """A sequence's ids as a growing numpy array (appending is amortised O(1))."""

    def __init__(self) -> None:
        self.data = np.zeros(256, dtype=np.int64)
        self.size = 0

    def sync(self, seq: Sequence) -> np.ndarray:
        total = seq.num_tokens
        if total > len(self.data):
            self.data = np.resize(self.data, max(total, 2 * len(self.data)))
        for i in range(self.size, total):
            self.data[i] = seq.token_at(i)
        self.size = total
        return self.data[:total]


class NgramDrafter(Drafter):
    method = "ngram"
    max_draft_tokens = 15

    def __init__(self, max_n: int = 4, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise NinferError(f"n-gram drafts need 1 <= min_n <= max_n (got {min_n}, {max_n})")
        self.max_n, self.min_n = max_n, min_n
        self._buffers: dict[str, _TokenBuffer] = {}

    def propose(self, seqs: list[Sequence], counts: list[int], penalties: PenaltyTables | None = None) -> list[Draft]:
        drafts = []
        for seq, k in zip(seqs, counts):
            tokens = self._buffers.setdefault(seq.request_id, _TokenBuffer()).sync(seq)
            drafts.append(Draft(lookup(tokens, k, self.max_n, self.min_n)))
        return drafts

    def release(self, seq: Sequence) -> None:
        self._buffers.pop(seq.request_id, None)

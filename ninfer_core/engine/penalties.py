"""Repetition / presence / frequency penalties from token tables on the device.

`apply_penalties` (sampling.py) reads each row's history from host lists; with steps in flight
the newest token is still on the device, so the engine keeps per slot what the penalties read
instead: how often each token was generated (`counts`) and which tokens were seen in prompt or
answer (`seen`). A sampled step updates both by a scatter of its device ids: no host sync. A
speculative round reads them too (its judge's rows, the MTP sampling chain: each row's history
plus the drafts before it) and adds its kept tokens from the host, where it knows them anyway;
apply_penalties' host path cost a device sync or two per row and history (its id checks and
`unique`) and a copy of the whole history per verify row. The arithmetic is the reference's,
elementwise over the row (untouched entries unchanged), so the penalised logits are the same bit
for bit.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..ops.dispatch import upload
from ..ops.penalties import penalise, record_tokens
from .sampling import SamplingParams


@dataclass
class Generated:
    """Tokens generated after rows of the tables (or of rows taken from them): ids[i] in row rows[i],
    both [N] int64 on the tables' device (a verify row's drafts may still be there, unread)."""

    rows: torch.Tensor
    ids: torch.Tensor

    @classmethod
    def of(cls, rows: Iterable[int], tokens: list[list[int]], device: torch.device) -> Generated:
        """From the host: tokens[i] generated in row rows[i]."""
        pairs = upload([[r for r, ts in zip(rows, tokens) for _ in ts], [t for ts in tokens for t in ts]],
                       torch.long, device)
        return cls(pairs[0], pairs[1])


class PenaltyTables:
    def __init__(self, num_slots: int, vocab: int, device: torch.device):
        self.counts = torch.zeros(num_slots, vocab, dtype=torch.int32, device=device)
        self.seen = torch.zeros(num_slots, vocab, dtype=torch.bool, device=device)

    def reset(self, slot: int, prompt_ids: list[int], output_ids: list[int]) -> None:
        """A sequence starts sampling in this slot with these tokens already in its history."""
        self.counts[slot].zero_()
        self.seen[slot].zero_()
        prompt = upload(prompt_ids, torch.long, self.seen.device)
        self.seen[slot].index_fill_(0, prompt, True)
        self.add([slot], [output_ids])

    def add(self, slots: list[int], tokens: list[list[int]]) -> None:
        """Host tokens generated in these slots (a prompt's answer so far, a speculative round's kept
        tokens): counted and seen, in one scatter."""
        generated = Generated.of(slots, tokens, self.counts.device)
        record_tokens(self.seen, self.counts, generated.rows, generated.ids)

    def rows(self, slots: list[int], extra: Generated) -> tuple[torch.Tensor, torch.Tensor]:
        """(seen [R, V], counts [R, V]) of R rows: row r the history in slot slots[r] with `extra`'s
        tokens of row r generated after it (a verify's row t: the drafts before it)."""
        index = upload(slots, torch.long, self.counts.device)
        seen, counts = self.seen.index_select(0, index), self.counts.index_select(0, index)
        record_tokens(seen, counts, extra.rows, extra.ids)
        return seen, counts

    def apply(self, logits: torch.Tensor, slots: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Penalised logits [R, V] for rows in `slots` [R] (device), each with its params."""
        columns = penalty_columns(params, logits.dtype, logits.device)
        return penalise(logits, self.seen, self.counts, *columns, rows=slots)

    def apply_rows(self, logits: torch.Tensor, slots: list[int], extra: Generated,
                   params: list[SamplingParams]) -> torch.Tensor:
        """Penalised logits [R, V]: row r with the history in slots[r] and `extra`'s tokens of row r
        after it (`rows`)."""
        return penalise(logits, *self.rows(slots, extra), *penalty_columns(params, logits.dtype, logits.device))

    def record(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Sampled tokens [R] (device; -1 = none) of rows in `slots` [R] (distinct); no host sync."""
        record_tokens(self.seen, self.counts, slots, tokens)


def penalty_columns(params: list[SamplingParams], dtype: torch.dtype,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (repetition, presence, frequency) [R] on `device`, unset ones neutral (1, 0, 0)."""
    columns = ([p.repetition_penalty or 1.0 for p in params], [p.presence_penalty or 0.0 for p in params],
               [p.frequency_penalty or 0.0 for p in params])
    return tuple(upload(columns, dtype, device))  # one copy

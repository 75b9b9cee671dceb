"""Repetition / presence / frequency penalties from token tables on the device.

`apply_penalties` (sampling.py) reads each row's history from host lists; with steps in flight
the newest token is still on the device, so the engine keeps per slot what the penalties read
instead: how often each token was generated (`counts`) and which tokens were seen in prompt or
answer (`seen`). A sampled step updates both by a scatter of its device ids: no host sync.
The arithmetic is the reference's, elementwise over the row (untouched entries unchanged), so
the penalised logits are the same bit for bit.
"""

from __future__ import annotations

import torch

from .sampling import SamplingParams


class PenaltyTables:
    def __init__(self, num_slots: int, vocab: int, device: torch.device):
        self.counts = torch.zeros(num_slots, vocab, dtype=torch.int32, device=device)
        self.seen = torch.zeros(num_slots, vocab, dtype=torch.bool, device=device)

    def reset(self, slot: int, prompt_ids: list[int], output_ids: list[int]) -> None:
        """A sequence starts sampling in this slot with these tokens already in its history."""
        self.counts[slot].zero_()
        self.seen[slot].zero_()
        self.extend(slot, prompt_ids, output_ids)

    def extend(self, slot: int, seen_ids: list[int], output_ids: list[int]) -> None:
        """Host tokens that joined the slot's history: `seen_ids` (a prompt) seen only, `output_ids`
        generated (seen and counted)."""
        device = self.counts.device
        seen = torch.tensor(seen_ids + output_ids, dtype=torch.long).to(device, non_blocking=True)
        self.seen[slot].index_fill_(0, seen, True)
        if output_ids:
            out = torch.tensor(output_ids, dtype=torch.long).to(device, non_blocking=True)
            self.counts[slot].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))

    def apply(self, logits: torch.Tensor, slots: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Penalised logits [R, V] for rows in `slots` [R] (device), each with its params."""
        return penalise(logits, self.seen.index_select(0, slots), self.counts.index_select(0, slots),
                        *penalty_columns(params, logits.dtype, logits.device))

    def record(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Sampled tokens [R] (device; -1 = none) of rows in `slots` [R]; no host sync (a
        boolean mask would need one, so invalid rows add 0 at id 0 instead)."""
        valid = tokens >= 0
        ids = tokens.clamp(min=0)
        self.counts.index_put_((slots, ids), valid.to(torch.int32), accumulate=True)
        self.seen.index_put_((slots, ids), self.seen[slots, ids] | valid)


def penalty_columns(params: list[SamplingParams], dtype: torch.dtype,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (repetition, presence, frequency) [R] on `device`, unset ones neutral (1, 0, 0)."""
    columns = ([p.repetition_penalty or 1.0 for p in params], [p.presence_penalty or 0.0 for p in params],
               [p.frequency_penalty or 0.0 for p in params])
    return tuple(torch.tensor(c, dtype=dtype).to(device, non_blocking=True) for c in columns)


def penalise(logits: torch.Tensor, seen: torch.Tensor, counts: torch.Tensor, rep: torch.Tensor,
             presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """logits [R, V] with rows' seen [R, V] bool, generated counts [R, V] and penalties [R]: a neutral
    row (1, 0, 0) comes back bit for bit (x - 0 is x)."""
    rep, presence, frequency = rep[:, None], presence[:, None], frequency[:, None]
    counts = counts.to(logits.dtype)
    out = torch.where(seen & (rep != 1), torch.where(logits < 0, logits * rep, logits / rep), logits)
    return out - (frequency * counts + presence * (counts > 0).to(logits.dtype))

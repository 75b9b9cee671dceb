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
        device = self.counts.device
        self.counts[slot].zero_()
        self.seen[slot].zero_()
        seen = torch.tensor(prompt_ids + output_ids, dtype=torch.long).to(device, non_blocking=True)
        self.seen[slot].index_fill_(0, seen, True)
        if output_ids:
            out = torch.tensor(output_ids, dtype=torch.long).to(device, non_blocking=True)
            self.counts[slot].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))

    def apply(self, logits: torch.Tensor, slots: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Penalised logits [R, V] for rows in `slots` [R] (device), each with its params."""
        rep = torch.tensor([p.repetition_penalty or 1.0 for p in params], dtype=logits.dtype)
        presence = torch.tensor([p.presence_penalty or 0.0 for p in params], dtype=logits.dtype)
        frequency = torch.tensor([p.frequency_penalty or 0.0 for p in params], dtype=logits.dtype)
        rep, presence, frequency = (t.to(logits.device, non_blocking=True)[:, None] for t in (rep, presence, frequency))
        seen = self.seen.index_select(0, slots)
        counts = self.counts.index_select(0, slots).to(logits.dtype)
        out = torch.where(seen & (rep != 1), torch.where(logits < 0, logits * rep, logits / rep), logits)
        return out - (frequency * counts + presence * (counts > 0).to(logits.dtype))

    def record(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Sampled tokens [R] (device; -1 = none) of rows in `slots` [R]; no host sync (a
        boolean mask would need one, so invalid rows add 0 at id 0 instead)."""
        valid = tokens >= 0
        ids = tokens.clamp(min=0)
        self.counts.index_put_((slots, ids), valid.to(torch.int32), accumulate=True)
        self.seen.index_put_((slots, ids), self.seen[slots, ids] | valid)

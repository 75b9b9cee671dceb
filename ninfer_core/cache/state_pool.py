"""Per-sequence Gated DeltaNet state: one slot per running sequence, for every GDN layer.

conv[layer]      [num_slots, conv_dim, K-1]  last K-1 pre-conv qkv inputs, model dtype
recurrent[layer] [num_slots, Hv, dk, dv]     delta-rule state, fp32 (fp64 if the model is fp64)

Unlike KV, this state cannot be truncated: speculative rollback snapshots a slot before the
verify step and restores it (or copies a sibling slot) afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ModelConfig
from .sizes import gdn_layer_slot_bytes, gdn_state_bytes_per_slot


@dataclass
class StateSnapshot:
    """A copy of one slot's state in every GDN layer."""

    conv: dict[int, torch.Tensor]
    recurrent: dict[int, torch.Tensor]


def state_bytes_per_slot(config: ModelConfig, dtype: torch.dtype) -> int:
    """One sequence's GDN state over every GDN layer (before allocating a pool)."""
    return gdn_state_bytes_per_slot(config, dtype.itemsize)


class StatePool:
    def __init__(
        self,
        layers: list[int],
        num_slots: int,
        conv_dim: int,
        conv_kernel: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.layers = list(layers)
        self.num_slots = num_slots
        state_dtype = torch.promote_types(dtype, torch.float32)  # fp32, or fp64 for a float64 model
        self.conv = {
            i: torch.zeros(num_slots, conv_dim, conv_kernel - 1, dtype=dtype, device=device) for i in self.layers
        }
        self.recurrent = {
            i: torch.zeros(num_slots, num_v_heads, head_k_dim, head_v_dim, dtype=state_dtype, device=device)
            for i in self.layers
        }
        self.bytes_per_slot = len(self.layers) * gdn_layer_slot_bytes(
            conv_dim, conv_kernel, num_v_heads, head_k_dim, head_v_dim, dtype.itemsize
        )

    @property
    def nbytes(self) -> int:
        return self.bytes_per_slot * self.num_slots

    def reset(self, slot: int) -> None:
        """Zero a slot: the state of a sequence that has seen no tokens. One multi-tensor kernel a
        dtype (torch's foreach ops) where a zero_ a tensor took two launches per GDN layer (60 for
        the 35B) at every new sequence."""
        if self.layers:  # the foreach ops take no empty list (a model without GDN layers)
            torch._foreach_zero_(self._slot(slot))

    def snapshot(self, slot: int) -> StateSnapshot:
        return StateSnapshot(
            conv={i: self.conv[i][slot].clone() for i in self.layers},
            recurrent={i: self.recurrent[i][slot].clone() for i in self.layers},
        )

    def restore(self, slot: int, snap: StateSnapshot) -> None:
        if self.layers:
            torch._foreach_copy_(self._slot(slot), [*(snap.conv[i] for i in self.layers),
                                                    *(snap.recurrent[i] for i in self.layers)])

    def copy(self, src: int, dst: int) -> None:
        if self.layers:
            torch._foreach_copy_(self._slot(dst), self._slot(src))

    def _slot(self, slot: int) -> list[torch.Tensor]:
        """A slot's state tensors (views into the pools): every layer's conv, then every recurrent."""
        return [*(self.conv[i][slot] for i in self.layers), *(self.recurrent[i][slot] for i in self.layers)]

"""Dense SwiGLU feed-forward: `down(silu(gate(x)) * up(x))` (Qwen3.5 dense, shared expert, Llama).

gate_proj and up_proj (checkpoint names) run as one GEMM (`gate_up_proj`, output [gate | up])."""

from __future__ import annotations

import torch
from torch import nn

from ..ops.activation import silu_mul
from .linear import MergedLinear


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, {"gate_proj": intermediate_size, "up_proj": intermediate_size})
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj.linear(x)))

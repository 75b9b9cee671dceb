"""Dense SwiGLU feed-forward: `down(silu(gate(x)) * up(x))` (Qwen3.5 dense, shared expert, Llama).

gate_proj and up_proj (checkpoint names) run as one GEMM (`gate_up_proj`, output [gate | up])."""

from __future__ import annotations

import torch
from torch import nn

from ..ops import cpu_layer
from ..ops.activation import sigmoid_mul, silu_mul
from ..ops.kquant import KQuantLinear, KQuantWeight
from ..ops.quant import QuantizedWeight, QuantLinear, quant_linear_gated, quant_swiglu
from .linear import MergedLinear
from .norm import RMSNorm


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, {"gate_proj": intermediate_size, "up_proj": intermediate_size})
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._swiglu(x))

    def add_norm_forward(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm,
                         route_rows: torch.Tensor | None = None,
                         live: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(h), s) for (h, s) = norm.add_norm(x, residual): a decode step's whole block in one
        CPU call where it applies (cpu_layer.mlp_block: a dense layer's Python, ~3 wrapped calls, goes).
        route_rows, live: SparseMoE's routing of padding rows, which a dense MLP has none of (a decoder
        layer calls either block alike)."""
        if x.device.type == "cpu":
            fused = cpu_layer.mlp_block(x, residual, norm, self.gate_up_proj.linear, self.down_proj)
            if fused is not None:
                return fused
        h, residual = norm.add_norm(x, residual)
        return self(h), residual

    def gated(self, x: torch.Tensor, gate: torch.Tensor, add: torch.Tensor) -> torch.Tensor:
        """add + sigmoid(gate) * self(x): a shared expert's output gate and the routed experts' sum,
        in the down projection's epilogue where its weights are quantized (decode sizes, CUDA)."""
        h = self._swiglu(x)
        if isinstance(self.down_proj, QuantLinear):
            return quant_linear_gated(h, self.down_proj.quantized, gate, add, self.down_proj.bias)
        return sigmoid_mul(self.down_proj(h), gate, add=add)

    def quantized(self) -> tuple[QuantizedWeight | KQuantWeight, QuantizedWeight | KQuantWeight] | None:
        """(gate_up [2I, H], down [H, I]) when both are quantized without a bias, for kernels that
        take the whole MLP (the MoE decode kernels' shared expert; K-quant blocks: the CPU's); else None."""
        gate_up, down = self.gate_up_proj.linear, self.down_proj
        if all(isinstance(m, (QuantLinear, KQuantLinear)) and m.bias is None for m in (gate_up, down)):
            return gate_up.quantized, down.quantized
        return None

    def _swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up, in the gate_up projection's epilogue where its weights are quantized."""
        linear = self.gate_up_proj.linear
        if isinstance(linear, QuantLinear) and linear.bias is None:
            return quant_swiglu(x, linear.quantized)
        return silu_mul(linear(x))

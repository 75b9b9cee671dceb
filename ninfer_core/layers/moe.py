"""Sparse mixture of experts: softmax top-k router, fused 3-D expert weights, shared expert.

Expert weights stay in the checkpoint's fused layout and are indexed in place (never gathered
into per-token copies): `gate_up_proj` [E, 2I, H] with rows 0..I-1 the gate projection, and
`down_proj` [E, H, I].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .mlp import MLP


def route(
    logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] -> (weights [N, k] in the logits' dtype, expert ids [N, k]).

    Softmax over all experts in fp32, keep the top k, optionally rescale them to sum to 1.
    """
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def fused_experts(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """x [N, H]; each token sums its k experts' SwiGLU outputs times the routing weights.

    Reference loop over the experts that were hit (a grouped-GEMM kernel replaces it).
    """
    inter = down_proj.shape[-1]
    out = torch.zeros_like(x)
    for expert in torch.unique(ids).tolist():
        token, slot = torch.where(ids == expert)
        gate_up = F.linear(x[token], gate_up_proj[expert])
        hidden = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = F.linear(hidden, down_proj[expert]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


class Experts(nn.Module):
    """Holds the fused expert tensors under the checkpoint's names."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        if config.shared_expert_intermediate_size:
            self.shared_expert = MLP(config.hidden_size, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        else:
            self.shared_expert = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        out = fused_experts(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.reshape(shape)

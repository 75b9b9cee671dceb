"""Qwen3.5 / Qwen3.6 multi-token prediction (MTP) block: the checkpoint's own one-layer drafter.

    x = fc(concat[pre_fc_norm_embedding(embed(t_{i+1})), pre_fc_norm_hidden(h_i)])
    x = decoder_layer(x)          # full attention (own KV cache) + the model's FFN kind (MoE for 35B)
    h'_i = norm(x);  logits = lm_head(h'_i)   -> predicts t_{i+2}

Conventions confirmed against vLLM (`qwen3_5_mtp.py`, `qwen3_next_mtp.py`, `qwen3_next.py`):
- the concat order is [embedding | hidden] (fc input 2H -> H);
- h_i is the target's hidden state AFTER its final norm: vLLM's target forward returns
  `self.norm(hidden_states, residual)` and hands those hidden states to the proposer (its
  `compute_logits` applies lm_head to them directly);
- the MTP decoder layer starts a fresh residual stream from fc's output, and the block ends with
  `mtp.norm`; its output feeds lm_head (shared with the target) and, for the next draft step, goes
  back in as h (so K-step drafting reuses the one layer, fed its own normed output);
- entry i sits at the target's position i (the MTP KV cache is indexed like the target's).

Norms are the model's (zero-centred for Qwen3.5). The embedding and lm_head are the target's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch
from torch import nn

from ..config import ModelConfig
from ..layers.linear import load_parameters
from ..layers.norm import RMSNorm
from .decoder import DecoderLayer, StepContext

PREFIX = "mtp."


def mtp_layer_config(config: ModelConfig) -> ModelConfig:
    """The target's config reduced to the MTP block's single full-attention layer."""
    return replace(config, num_layers=1, layer_types=["full_attention"])


class MTPHead(nn.Module):
    """Parameter names equal the checkpoint's `mtp.*` names without the prefix."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden, eps, zc = config.hidden_size, config.rms_eps, config.norm_zero_centered
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(hidden, eps, zc)
        self.pre_fc_norm_hidden = RMSNorm(hidden, eps, zc)
        self.layers = nn.ModuleList([DecoderLayer(mtp_layer_config(config), 0)])
        self.norm = RMSNorm(hidden, eps, zc)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, step: StepContext) -> torch.Tensor:
        """embeds = embed(t_{i+1}), hidden = normed h_i, both [B, T, H] -> normed h'_i [B, T, H].
        `step` indexes the MTP's own KV cache (layer 0 of `step.cache.kv`)."""
        x = torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)
        delta, residual = self.layers[0](self.fc(x), None, step)
        return self.norm.add_norm(delta, residual)[0]

    def load(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy every parameter from `weights` (canonical `mtp.*` names, fused experts; merged
        projections from their parts)."""
        load_parameters(self, weights.__getitem__, set(weights), prefix=PREFIX)

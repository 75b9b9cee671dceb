"""Qwen3.5 / Qwen3.6 text model: hybrid Gated DeltaNet + gated attention, MoE or dense FFN.

Layer i is a GDN ("linear_attention") or a gated full-attention layer per `config.layer_types`
(see `decoder.py`); positions may be 3-axis (interleaved mRoPE) for multimodal prompts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..config import QWEN_ARCHS, ModelConfig
from .decoder import DecoderModel


class Qwen3_5ForCausalLM(DecoderModel):
    archs = QWEN_ARCHS

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.mtp_weights: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def load_weights(self, get: Callable[[str], torch.Tensor], names: set[str]) -> None:
        """Name-for-name copy; `mtp.*` tensors are kept in `self.mtp_weights` for speculative
        decoding; other names the model has no place for (the vision tower) are left to others."""
        self.copy_parameters(get, names)
        self.mtp_weights = {name: get(name) for name in sorted(names) if name.startswith("mtp.")}

"""Llama-family text models (Llama, SmolLM, Mistral, Qwen2, Qwen3): attention + SwiGLU decoders.

Every layer is `h += attn(input_layernorm(h)); h += mlp(post_attention_layernorm(h))` with plain
RMSNorm (`x * w`), full RoPE, GQA; Qwen2 adds q/k/v bias and Qwen3 a per-head q/k RMSNorm, both
switched by ModelConfig flags inside the shared `Attention` layer. The decoder shell is shared
with Qwen3.5 (`decoder.py`); only the arch checks and the loading rules live here. Weights come by canonical name from safetensors (`model.`
stripped) or from a GGUF file (llama.cpp names mapped and q/k un-permuted by the reader).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..cache import ModelCache
from ..config import LLAMA_ARCHS, ModelConfig
from ..errors import ModelLoadError
from ..layers.linear import merged_sources, source_names
from .base import ForwardBatch, ForwardOutput
from .decoder import DecoderModel

# Checkpoint tensors that carry nothing we need (recomputed rotary tables in old checkpoints).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LlamaForCausalLM(DecoderModel):
    archs = LLAMA_ARCHS

    def __init__(self, config: ModelConfig):
        if config.is_moe or set(config.layer_types) != {"full_attention"} or config.norm_zero_centered:
            raise ModelLoadError(f"'{config.arch}' config is not a dense attention-only decoder with plain RMSNorm")
        super().__init__(config)

    def forward(self, batch: ForwardBatch, cache: ModelCache) -> ForwardOutput:
        if batch.mrope_positions is not None:
            raise ValueError(f"'{self.config.arch}' is a text-only model: mRoPE positions are not accepted")
        return super().forward(batch, cache)

    @torch.no_grad()
    def load_weights(self, get: Callable[[str], torch.Tensor], names: set[str]) -> None:
        """Name-for-name copy (merged projections from their parts). A tensor the model has no
        place for is an error (the config does not describe the checkpoint: say, q_norm weights
        without qk_norm), except a stored `lm_head.weight` when the embeddings are tied and stale
        rotary tables."""
        sources = merged_sources(self)  # merged projections take their parts' names
        params = {src for name, _ in self.named_parameters() for src in source_names(sources, name)}
        tied_head = {"lm_head.weight"} if self.config.tie_word_embeddings else set()
        unexpected = sorted(n for n in names - params - tied_head if not n.endswith(_IGNORED_SUFFIXES))
        if unexpected:
            raise ModelLoadError(
                f"checkpoint has tensors the '{self.config.arch}' config has no place for: {', '.join(unexpected[:8])}"
            )
        self.copy_parameters(get, names)

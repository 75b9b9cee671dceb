"""Llama-family text models (Llama, SmolLM, Mistral, Qwen2, Qwen3): attention + SwiGLU decoders.

Every layer is `h += attn(input_layernorm(h)); h += mlp(post_attention_layernorm(h))` with plain
RMSNorm (`x * w`), full RoPE, GQA; Qwen2 adds q/k/v bias and Qwen3 a per-head q/k RMSNorm, both
switched by ModelConfig flags inside the shared `Attention` layer. The decoder layer and the
per-step context are the Qwen3.5 model's (its full-attention branch is exactly this layer), so
only the model shell lives here. Weights come by canonical name from safetensors (`model.`
stripped) or from a GGUF file (llama.cpp names mapped and q/k un-permuted by the reader).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..cache import ModelCache
from ..config import LLAMA_ARCHS, ModelConfig
from ..errors import ModelLoadError
from ..layers.attention import AttentionMetadata
from ..layers.norm import RMSNorm
from ..layers.rope import RotaryEmbedding
from .base import ForwardBatch, ForwardOutput
from .qwen3_5 import DecoderLayer, StepContext

# Checkpoint tensors that carry nothing we need (recomputed rotary tables in old checkpoints).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.arch not in LLAMA_ARCHS:
            raise ModelLoadError(f"LlamaForCausalLM cannot run arch '{config.arch}' (expected one of {LLAMA_ARCHS})")
        if config.is_moe or set(config.layer_types) != {"full_attention"} or config.norm_zero_centered:
            raise ModelLoadError(f"'{config.arch}' config is not a dense attention-only decoder with plain RMSNorm")
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_eps, zero_centered=False)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary_emb = RotaryEmbedding(config.rotary_dim, config.rope_theta)

    def forward(self, batch: ForwardBatch, cache: ModelCache) -> ForwardOutput:
        if batch.mrope_positions is not None:
            raise ValueError(f"'{self.config.arch}' is a text-only model: mRoPE positions are not accepted")
        if batch.inputs_embeds is not None:
            x = batch.inputs_embeds.to(self.embed_tokens.weight.dtype)
        else:
            x = self.embed_tokens(batch.input_ids)
        cos, sin = self.rotary_emb(batch.positions, x.dtype)
        attn = AttentionMetadata.build(
            batch.block_table, batch.cache_lens, batch.num_new_tokens, cache.page_size, cache.kv.num_pages
        )
        step = StepContext(cos=cos, sin=sin, attn=attn, slots=batch.slots, cache=cache)
        for layer in self.layers:
            x = layer(x, step)

        logits = None
        if batch.logits != "none":
            last = x[:, -1:] if batch.logits == "last" else x
            logits = self.lm_head(self.norm(last)).float()
        return ForwardOutput(logits=logits, hidden_states=x)

    @torch.no_grad()
    def load_weights(self, get: Callable[[str], torch.Tensor], names: set[str]) -> None:
        """Copy every parameter from the tensor of the same canonical name.

        A tensor the model has no place for is an error (it means the config does not describe
        the checkpoint: say, q_norm weights under a config without qk_norm), except a stored
        `lm_head.weight` when the embeddings are tied and stale rotary tables. The tie is
        re-made first: `to_empty()` after building on the meta device unties the two.
        """
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        params = dict(self.named_parameters())
        tied_head = {"lm_head.weight"} if self.config.tie_word_embeddings else set()
        unexpected = sorted(n for n in names - params.keys() - tied_head if not n.endswith(_IGNORED_SUFFIXES))
        if unexpected:
            raise ModelLoadError(
                f"checkpoint has tensors the '{self.config.arch}' config has no place for: {', '.join(unexpected[:8])}"
            )
        for name, param in params.items():
            if name not in names:
                raise ModelLoadError(f"checkpoint is missing tensor '{name}' (expected shape {tuple(param.shape)})")
            tensor = get(name)
            if tuple(tensor.shape) != tuple(param.shape):
                raise ModelLoadError(f"tensor '{name}' has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
            param.copy_(tensor)

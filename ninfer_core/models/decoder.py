"""The decoder shell every text model shares: embed, layers over a paged cache, final norm, lm_head.

A layer is `h += mixer(input_layernorm(h)); h += ffn(post_attention_layernorm(h))`; the mixer is
gated DeltaNet or (gated) attention per `config.layer_types`, the FFN a sparse MoE or a dense
SwiGLU MLP. Llama-family models are the all-attention, dense, plain-RMSNorm case of the same
shell. Parameter names equal the canonical checkpoint names, so loading is a name-for-name copy, except
merged projections (q|k|v, GDN in_proj, gate|up, router|shared gate), which load from their parts
(`layers/linear.py`): one GEMM instead of several per decode step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..cache import ModelCache
from ..config import ModelConfig
from ..errors import ModelLoadError
from ..layers.attention import Attention, AttentionMetadata
from ..layers.gdn import GatedDeltaNet, GDNRecord
from ..layers.linear import load_parameters
from ..layers.mlp import MLP
from ..layers.moe import SparseMoE
from ..layers.norm import RMSNorm
from ..layers.rope import RotaryEmbedding
from ..ops.quant import QuantEmbedding
from .base import ForwardBatch, ForwardOutput

LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass
class StepContext:
    """What every layer of one forward shares: rotary tables, KV indexing, state slots, the cache."""

    cos: torch.Tensor
    sin: torch.Tensor
    attn: AttentionMetadata
    slots: torch.Tensor
    cache: ModelCache
    gdn_records: dict[int, GDNRecord] | None = None  # verify forwards: GDN layers record, pools untouched


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.is_linear = config.layer_types[layer_idx] == "linear_attention"
        eps, zc = config.rms_eps, config.norm_zero_centered
        self.input_layernorm = RMSNorm(config.hidden_size, eps, zc)
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config)
        else:
            self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, zc)
        self.mlp = SparseMoE(config) if config.is_moe else MLP(config.hidden_size, config.intermediate_size)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, step: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(delta, residual) -> (delta, residual): the stream is residual + delta, kept apart so
        that every residual add runs inside the next RMSNorm kernel (two launches fewer per layer).
        The first layer gets the embeddings as `x` and no residual."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_norm(x, residual)
        i = self.layer_idx
        if self.is_linear:
            pools = (step.cache.state.conv[i], step.cache.state.recurrent[i], step.slots)
            if step.gdn_records is None:
                h = self.linear_attn(h, *pools)
            else:
                h, step.gdn_records[i] = self.linear_attn.verify(h, *pools)
        else:
            h = self.self_attn(h, step.cos, step.sin, step.cache.kv.layer(i), step.attn)
        h, residual = self.post_attention_layernorm.add_norm(h, residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    """Subclasses check the config's arch and decide which checkpoint tensors they accept."""

    archs: tuple[str, ...] = ()

    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.arch not in self.archs:
            raise ModelLoadError(f"{type(self).__name__} cannot run arch '{config.arch}' (expected one of {self.archs})")
        unknown = sorted(set(config.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ModelLoadError(f"unsupported layer types {unknown} (supported: {LAYER_TYPES})")
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_eps, config.norm_zero_centered)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.rotary_emb = RotaryEmbedding(config.rotary_dim, config.rope_theta, config.mrope_section)

    def tie_weights(self) -> None:
        """lm_head shares the embedding table: the same Parameter, or for a quantized table
        (`QuantEmbedding`) a QuantLinear over its buffers, unless a recipe gave lm_head its own
        quantized copy. Again after `to_empty()`, which unties them."""
        if not self.config.tie_word_embeddings:
            return
        if isinstance(self.embed_tokens, QuantEmbedding):
            self.lm_head = self.embed_tokens.tied_head()
        elif type(self.lm_head) is nn.Linear:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, batch: ForwardBatch, cache: ModelCache) -> ForwardOutput:
        if batch.inputs_embeds is not None:
            x = batch.inputs_embeds.to(self.norm.weight.dtype)  # the model dtype (the table may be quantized)
        else:
            x = self.embed_tokens(batch.input_ids)
        positions = batch.mrope_positions if batch.mrope_positions is not None else batch.positions
        cos, sin = self.rotary_emb(positions, x.dtype)
        attn = AttentionMetadata.build(
            batch.block_table, batch.cache_lens, batch.num_new_tokens, cache.page_size, cache.kv.num_pages
        )
        step = StepContext(cos=cos, sin=sin, attn=attn, slots=batch.slots, cache=cache,
                           gdn_records={} if batch.verify else None)
        captured: dict[int, torch.Tensor] = {}
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, step)
            if layer.layer_idx in batch.capture_layers:
                captured[layer.layer_idx] = x + residual
        normed, x = self.norm.add_norm(x, residual)  # x: the last layer's output, before the norm
        logits = None
        if batch.logits != "none":
            last = normed[:, -1:] if batch.logits == "last" else normed
            logits = self.lm_head(last).float()
        features = torch.cat([captured[i] for i in batch.capture_layers], dim=-1) if batch.capture_layers else None
        return ForwardOutput(logits=logits, hidden_states=x, captured=features, gdn_records=step.gdn_records)

    @torch.no_grad()
    def copy_parameters(self, get: Callable[[str], torch.Tensor], names: set[str]) -> None:
        """Copy every parameter from the tensor of the same canonical name (tie re-made first:
        `to_empty()` after a meta-device build unties lm_head from the embeddings)."""
        self.tie_weights()
        load_parameters(self, get, names)

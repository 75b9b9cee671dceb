"""DFlash block-diffusion drafter (z-lab, arXiv 2602.06036): one pass proposes a block of tokens.

Architecture (checked against z-lab's `dflash/model.py`; tensor names from its checkpoints):
- context: the target's outputs after layers `target_layer_ids` (HF `hidden_states[i + 1]`, i.e.
  the residual stream after layer i, before any final norm), concatenated in that order, then
  `hidden_norm(fc(.))` -> c [H]. Every layer projects c with its own k_proj / v_proj (+ k_norm,
  RoPE at the context token's position) into keys / values; they are cached per position.
- block: [the sequence's last token, mask x K] embedded with the target's embedding
  (x `input_embedding_scale`), through `num_hidden_layers` Qwen3 layers: plain RMSNorm, q/k
  RMSNorm per head, full RoPE, no output gate, SwiGLU MLP. Queries come from the block only;
  keys / values are [cached context, block]. Attention inside the block is bidirectional unless
  the config asks otherwise (`is_causal`; sliding-window layers are causal when it is unset).
- out: `norm`, the target's lm_head (x `output_multiplier`, optional tanh softcap); rows 1..K
  are the drafts for the K tokens after the last one.
Not supported (refused with a message): DFlash2 checkpoints (dynamic conv + candidate selector).
Config keys are read from `dflash_config` first, then the top level, as z-lab does.
Positions are plain token indices (the drafter has 1-D RoPE of its own; media positions of the
target do not apply).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..cache.kv_pool import KVLayer
from ..config import ModelConfig, read_json_object
from ..errors import ModelLoadError
from ..layers.attention import Attention
from ..layers.linear import load_parameters
from ..layers.mlp import MLP
from ..layers.norm import RMSNorm
from ..layers.rope import RotaryEmbedding, apply_rotary
from ..ops.attention import write_kv


@dataclass
class DFlashConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_eps: float
    rope_theta: float
    attention_bias: bool
    windows: list[int | None]  # per layer: sliding window, None = full
    causal: list[bool]  # per layer: causal attention inside the block
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    logit_softcap: float | None = None
    torch_dtype: str = "bfloat16"

    @classmethod
    def from_dir(cls, directory: str | Path) -> DFlashConfig:
        path = Path(directory) / "config.json"
        return cls.from_dict(read_json_object(path, "--draft-model must be a DFlash checkpoint directory"), path)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], path: Path) -> DFlashConfig:
        archs = raw.get("architectures") or []
        if "DFlash2DraftModel" in archs:
            raise ModelLoadError(f"{path}: DFlash2 drafters (dynamic conv + candidate selector) are not supported")
        extra = raw.get("dflash_config") or {}

        def value(key: str, default: Any = None) -> Any:
            return extra.get(key, raw.get(key, default))

        def need(key: str) -> Any:
            v = value(key)
            if v is None:
                raise ModelLoadError(f"{path}: missing required key '{key}' (DFlash drafter config)")
            return v

        layers = int(need("num_hidden_layers"))
        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ModelLoadError(f"{path}: RoPE scaling '{rope.get('rope_type')}' is not supported for drafters")
        types = raw.get("layer_types") or ["full_attention"] * layers
        if len(types) != layers or set(types) - {"full_attention", "sliding_attention"}:
            raise ModelLoadError(f"{path}: layer_types {types} do not fit {layers} full / sliding attention layers")
        is_causal = value("is_causal")
        softcap = value("final_logit_softcapping")
        return cls(
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(value("num_key_value_heads", heads)),
            head_dim=int(value("head_dim") or hidden // heads),
            intermediate_size=int(need("intermediate_size")),
            vocab_size=int(need("vocab_size")),
            rms_eps=float(value("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            attention_bias=bool(value("attention_bias", False)),
            windows=[int(need("sliding_window")) if t == "sliding_attention" else None for t in types],
            causal=[t == "sliding_attention" if is_causal is None else bool(is_causal) for t in types],
            block_size=int(value("block_size", 16)),
            mask_token_id=int(need("mask_token_id")),
            target_layer_ids=[int(i) for i in need("target_layer_ids")],
            embedding_scale=float(value("input_embedding_scale", 1.0)),
            output_multiplier=float(value("output_multiplier", 1.0)),
            logit_softcap=float(softcap) if softcap else None,
            torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"),
        )

    def layer_config(self) -> ModelConfig:
        """The shared layers' view: Qwen3 attention (q/k norm, no gate), plain RMSNorm, full RoPE."""
        return ModelConfig(
            arch="qwen3", vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_layers=self.num_layers,
            layer_types=["full_attention"] * self.num_layers, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, rms_eps=self.rms_eps, rope_theta=self.rope_theta,
            qk_norm=True, attention_bias=self.attention_bias, intermediate_size=self.intermediate_size,
        )

    def check_target(self, target: ModelConfig) -> None:
        """Refuse a drafter trained for another model shape."""
        problems = []
        if self.hidden_size != target.hidden_size:
            problems.append(f"hidden size {self.hidden_size} != target's {target.hidden_size}")
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_layers]
        if bad:
            problems.append(f"target_layer_ids {bad} outside the target's {target.num_layers} layers")
        if not 0 <= self.mask_token_id < target.vocab_size:
            problems.append(f"mask_token_id {self.mask_token_id} outside the target's vocabulary ({target.vocab_size})")
        if problems:
            raise ModelLoadError(f"DFlash drafter does not fit the target model: {'; '.join(problems)}")


class DFlashLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_eps, zero_centered=False)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_eps, zero_centered=False)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def project(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [B, T, H] -> raw queries [B, T, Hq*D] (one merged q/k/v GEMM; callers that need them
        norm and rotate), this layer's keys (normed, RoPE'd) and values [B, T, Hkv, D]."""
        attn = self.self_attn
        q, k, v = attn.qkv_proj(h)
        shape = (*h.shape[:2], attn.num_kv_heads, attn.head_dim)
        return q, apply_rotary(attn.k_norm(k.view(shape)), cos, sin), v.view(shape)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, block_table: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Block hidden states [B, T, H]: queries from the block, keys from [cached context, block]."""
        attn = self.self_attn
        h = self.input_layernorm(x)
        batch, width, _ = h.shape
        q, k, v = self.project(h, cos, sin)
        q = apply_rotary(attn.q_norm(q.view(batch, width, attn.num_heads, attn.head_dim)), cos, sin)
        out = block_attention(q, k, v, k_cache, v_cache, block_table, mask, attn.scale)
        x = x + attn.o_proj(out.reshape(batch, width, -1))
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class BlockInputs:
    """Where a block's context lives: KV pages (block table) and how many cached entries count."""

    positions: torch.Tensor  # [B, T] block token indices
    block_lens: torch.Tensor  # [B] real block tokens per row (rows are padded to T)
    ctx_lens: torch.Tensor  # [B] cached context entries (indices 0 .. ctx_len - 1)
    block_table: torch.Tensor  # [B, P] page ids of the drafter cache


class DFlashModel(nn.Module):
    """Parameter names equal the checkpoint's (`layers.N.*`, `fc`, `hidden_norm`, `norm`)."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        layer_config = config.layer_config()
        hidden = config.hidden_size
        self.layers = nn.ModuleList(DFlashLayer(layer_config) for _ in range(config.num_layers))
        self.fc = nn.Linear(len(config.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, config.rms_eps, zero_centered=False)
        self.norm = RMSNorm(hidden, config.rms_eps, zero_centered=False)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta)

    def write_context(self, features: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                      k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> None:
        """Target features [B, T, n*H] at `positions` -> every layer's context K/V at `slot_mapping`."""
        context = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))
        cos, sin = self.rotary_emb(positions, context.dtype)
        for layer, k_cache, v_cache in zip(self.layers, k_caches, v_caches):
            _, k, v = layer.project(context, cos, sin)
            write_kv(KVLayer(k_cache, v_cache), k, v, slot_mapping)

    def forward(self, embeds: torch.Tensor, where: BlockInputs, k_caches: list[torch.Tensor],
                v_caches: list[torch.Tensor]) -> torch.Tensor:
        """Block embeddings [B, T, H] -> normed hidden states [B, T, H] (caches are only read)."""
        x = embeds
        cos, sin = self.rotary_emb(where.positions, x.dtype)
        for i, layer in enumerate(self.layers):
            mask = self._mask(where, k_caches[i].shape[1], i)
            x = layer(x, cos, sin, k_caches[i], v_caches[i], where.block_table, mask)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        logits = lm_head(hidden).float() * self.config.output_multiplier
        cap = self.config.logit_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    def _mask(self, where: BlockInputs, page_size: int, layer: int) -> torch.Tensor:
        """[B, T, P*page + T] which keys each block query sees: live context entries and real block
        tokens, restricted by the layer's causality and sliding window."""
        device = where.positions.device
        ctx_index = torch.arange(where.block_table.shape[1] * page_size, device=device)
        key_pos = torch.cat((ctx_index.expand(len(where.positions), -1), where.positions), dim=1)
        block_index = torch.arange(where.positions.shape[1], device=device)
        live = torch.cat((ctx_index[None] < where.ctx_lens[:, None], block_index[None] < where.block_lens[:, None]), 1)
        query_pos = where.positions[:, :, None]
        mask = live[:, None, :].expand(-1, where.positions.shape[1], -1)
        if self.config.causal[layer]:
            mask = mask & (key_pos[:, None, :] <= query_pos)
        window = self.config.windows[layer]
        if window is not None:
            mask = mask & (query_pos - key_pos[:, None, :] < window)
            if not self.config.causal[layer]:
                mask = mask & (key_pos[:, None, :] - query_pos < window)
        return mask

    def load(self, get, names: set[str]) -> None:
        """Name-for-name copy from the drafter checkpoint (merged projections from their parts);
        refuses missing / misshapen tensors."""
        try:
            load_parameters(self, get, names)
        except ModelLoadError as e:
            raise ModelLoadError(f"DFlash {e}") from None


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_table: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q, k, v [B, T, H(kv), D] of the block; keys are the paged context then the block's own.
    mask [B, T, P*page + T]. Returns [B, T, H, D]."""
    keys = torch.cat((k_cache[block_table].flatten(1, 2).to(q.dtype), k), dim=1)
    values = torch.cat((v_cache[block_table].flatten(1, 2).to(q.dtype), v), dim=1)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=mask[:, None], scale=scale, enable_gqa=True)
    return out.transpose(1, 2)

"""Causal GQA attention over a paged KV cache.

Used by Qwen3.5 full-attention layers (output gate, zero-centred q/k norm, partial mRoPE) and by
Llama-family models (optional q/k norm, optional qkv bias); the flags come from ModelConfig.

KV cache layout per layer (`KVLayer`): k, v [num_pages, page_size, num_kv_heads, head_dim] in the
KV dtype (+ per-token scales for fp8 / int8). The token at cache index p of a sequence lives in
page `block_table[p // page_size]`, row `p % page_size`. A step first appends the new tokens'
k/v (`ops.attention.write_kv`), then attends over everything cached: `decode_attention` for up
to 16 new tokens per sequence (decode, speculative verify), `prefill_attention` for prompt chunks.
A decode step is bound by kernel launches, so there the q / k norm + rotary and the KV append are
one op (`norm_rotary_write_kv`) and the output gate rides in `decode_attention`'s final write:
on CUDA three launches between the q|k|v and o projections (prologue, attention, split-K reduce)
instead of six, with the same results.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..cache.kv_pool import KVLayer
from ..config import ModelConfig
from ..ops import cpu_layer
from ..ops.activation import sigmoid_mul
from ..ops.attention import (
    DECODE_MAX_TOKENS,
    decode_attention,
    kv_slots,
    norm_rotary_write_kv,
    prefill_attention,
    chunk_attention,
    write_kv,
)
from ..ops.rope import norm_rotary
from .linear import MergedLinear
from .norm import PendingNorm, RMSNorm


@dataclass
class AttentionMetadata:
    """Per-step indexing shared by every attention layer of one forward."""

    slot_mapping: torch.Tensor  # [B, T] int64 flat row (page * page_size + offset) of each new token
    block_table: torch.Tensor  # [B, P] int32 page ids, unused entries clamped to a valid page
    cache_lens: torch.Tensor  # [B] int64 tokens cached before this step
    host_cache_lens: tuple[int, ...] | None = None  # the same on the host, when the caller knows them
    padded: bool = False  # a padded prompt chunk: attention by the decode kernel, 16 tokens a row

    @classmethod
    def build(
        cls, block_table: torch.Tensor, cache_lens: torch.Tensor, num_new_tokens: int, page_size: int, num_pages: int,
        host_cache_lens: tuple[int, ...] | None = None, valid_tokens: torch.Tensor | None = None, pad_kv_row: int = 0,
    ) -> AttentionMetadata:
        slot_mapping, table = kv_slots(block_table, cache_lens, num_new_tokens, page_size, num_pages, valid_tokens,
                                       pad_kv_row)
        return cls(
            slot_mapping=slot_mapping,
            block_table=table,  # int32: what the decode kernel reads; converted once per step
            cache_lens=cache_lens,
            host_cache_lens=host_cache_lens,
            padded=valid_tokens is not None,
        )


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.output_gate = config.attn_output_gate
        self.scale = config.head_dim**-0.5
        q_out = config.num_heads * config.head_dim * (2 if self.output_gate else 1)
        kv_out = config.num_kv_heads * config.head_dim
        # The checkpoint's q/k/v_proj (all with a bias or none) as one GEMM, output [q | k | v].
        self.qkv_proj = MergedLinear(config.hidden_size, {"q_proj": q_out, "k_proj": kv_out, "v_proj": kv_out},
                                     bias=config.attention_bias)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_eps, config.norm_zero_centered)
            self.k_norm = RMSNorm(config.head_dim, config.rms_eps, config.norm_zero_centered)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor | PendingNorm,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: KVLayer,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, hidden]; appends the T new tokens' k/v to the cache."""
        if isinstance(x, PendingNorm) and x.x.device.type == "cpu":
            fused = cpu_layer.attention_mixer(x, self, cos, sin, kv, meta)  # the whole mixer in one call
            if fused is not None:
                out, x.summed = fused
                return out
        batch, num_new, _ = x.shape
        q, k, v = self.qkv_proj(x)
        q = q.view(batch, num_new, self.num_heads, -1)
        gate = None
        if self.output_gate:  # per head: [query | gate]
            q, gate = q.split(self.head_dim, dim=-1)
        k = k.view(batch, num_new, self.num_kv_heads, self.head_dim)
        v = v.view(batch, num_new, self.num_kv_heads, self.head_dim)
        q_weight, k_weight, eps, zero_centered = self._qk_norm()

        if num_new <= DECODE_MAX_TOKENS:
            q = norm_rotary_write_kv(q, k, v, cos, sin, kv, meta.slot_mapping, q_weight, k_weight, eps, zero_centered)
            out = decode_attention(q, kv, meta.block_table, meta.cache_lens, self.scale, gate=gate)
            return self.o_proj(out.reshape(batch, num_new, -1))
        q = norm_rotary(q, cos, sin, q_weight, eps, zero_centered)
        write_kv(kv, norm_rotary(k, cos, sin, k_weight, eps, zero_centered), v, meta.slot_mapping)
        if meta.padded:
            out = chunk_attention(q, kv, meta.block_table, meta.cache_lens, self.scale)
        else:
            out = prefill_attention(q, kv, meta.block_table, meta.cache_lens, self.scale, meta.host_cache_lens)
        if gate is not None:
            out = sigmoid_mul(out, gate)
        return self.o_proj(out.reshape(batch, num_new, -1))

    def _qk_norm(self) -> tuple[torch.Tensor | None, torch.Tensor | None, float, bool]:
        """(q weight, k weight, eps, zero_centered) of the head norms; no weights without qk_norm.
        Both norms come from the same config, so they share eps and zero_centered."""
        if self.q_norm is None:
            return None, None, 1e-6, False
        return self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.q_norm.zero_centered

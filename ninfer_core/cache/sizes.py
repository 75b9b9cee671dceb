"""Bytes of the cache, from the config alone and without torch: the pools allocate by these
numbers and the hub's fit estimates (`ninfer show`, the wizard) quote them, so both agree."""

from __future__ import annotations

from ..config import ModelConfig

KV_ITEM_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}
SCALED_KV = ("fp8", "int8")  # one fp32 scale per (token, kv head)
SCALE_BYTES = 4


def kv_token_bytes(num_kv_heads: int, head_dim: int, item_bytes: int, scaled: bool) -> int:
    """k + v of one token in one attention layer, scales included."""
    return 2 * num_kv_heads * (head_dim * item_bytes + (SCALE_BYTES if scaled else 0))


def kv_bytes_per_token(config: ModelConfig, kv_dtype: str) -> int:
    """KV bytes of one token over every attention layer, for a KV dtype name (bf16, fp8, ...)."""
    per_layer = kv_token_bytes(config.num_kv_heads, config.head_dim, KV_ITEM_BYTES[kv_dtype], kv_dtype in SCALED_KV)
    return len(config.full_attention_layers) * per_layer


def gdn_conv_dim(config: ModelConfig) -> int:
    """Channels of the GDN short conv: q, k (key heads) and v (value heads)."""
    return 2 * config.linear_num_key_heads * config.linear_key_head_dim + (
        config.linear_num_value_heads * config.linear_value_head_dim
    )


def gdn_layer_slot_bytes(conv_dim: int, conv_kernel: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                         item_bytes: int) -> int:
    """One slot of one GDN layer: the conv window in the model dtype, the recurrent state in fp32
    (fp64 for a float64 model)."""
    state_bytes = max(item_bytes, 4)
    return conv_dim * (conv_kernel - 1) * item_bytes + num_v_heads * head_k_dim * head_v_dim * state_bytes


def gdn_state_bytes_per_slot(config: ModelConfig, item_bytes: int) -> int:
    """One sequence's GDN state over every GDN layer, for a model dtype of `item_bytes` bytes."""
    return len(config.linear_attention_layers) * gdn_layer_slot_bytes(
        gdn_conv_dim(config), config.linear_conv_kernel_dim, config.linear_num_value_heads,
        config.linear_key_head_dim, config.linear_value_head_dim, item_bytes,
    )

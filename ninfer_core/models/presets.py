"""Exact shapes of the released Qwen3.6 text models, for synthetic (random-weight) benchmarks."""

from __future__ import annotations

from dataclasses import replace

from ..config import ModelConfig
from ..errors import NinferError

_QWEN36_COMMON = dict(
    vocab_size=248320,
    head_dim=256,
    rms_eps=1e-6,
    rope_theta=1e7,
    partial_rotary_factor=0.25,
    mrope_section=[11, 11, 10],
    mrope_interleaved=True,
    attn_output_gate=True,
    qk_norm=True,
    norm_zero_centered=True,
    linear_num_key_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    max_position_embeddings=262144,
    mtp_num_layers=1,
    eos_token_ids=[248046, 248044],
)


def _layer_types(num_layers: int, interval: int = 4) -> list[str]:
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]


PRESETS: dict[str, ModelConfig] = {
    "qwen3.6-35b-a3b": ModelConfig(
        arch="qwen3_5_moe",
        hidden_size=2048,
        num_layers=40,
        layer_types=_layer_types(40),
        num_heads=16,
        num_kv_heads=2,
        linear_num_value_heads=32,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        **_QWEN36_COMMON,
    ),
    "qwen3.6-27b": ModelConfig(
        arch="qwen3_5",
        hidden_size=5120,
        num_layers=64,
        layer_types=_layer_types(64),
        num_heads=24,
        num_kv_heads=4,
        linear_num_value_heads=48,
        intermediate_size=17408,
        **_QWEN36_COMMON,
    ),
}
# A few-MB model of the same design, for trying the bench on a CPU.
PRESETS["tiny-qwen3.6-moe"] = replace(
    PRESETS["qwen3.6-35b-a3b"],
    vocab_size=4096,
    hidden_size=256,
    num_layers=4,
    layer_types=_layer_types(4),
    num_heads=4,
    num_kv_heads=1,
    head_dim=64,
    mrope_section=[3, 3, 2],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    num_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=128,
    eos_token_ids=[],
)


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise NinferError(f"unknown synthetic model '{name}' (known: {', '.join(PRESETS)})")
    return PRESETS[name]

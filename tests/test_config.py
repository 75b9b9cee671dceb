"""config.json / generation_config.json -> ModelConfig / GenerationDefaults, and their errors."""

from __future__ import annotations

import json

import pytest

from ninfer_core.config import GenerationDefaults, load_config
from ninfer_core.errors import ModelLoadError
from tiny_checkpoints import write_tiny_qwen


@pytest.mark.parametrize("multimodal", [True, False])
@pytest.mark.parametrize("moe", [True, False])
def test_qwen_layouts_map_to_the_same_text_config(tmp_path, multimodal, moe):
    model = write_tiny_qwen(tmp_path, moe=moe, multimodal=multimodal)
    hf = model.config.get_text_config()
    cfg = load_config(tmp_path)
    assert cfg.arch == ("qwen3_5_moe" if moe else "qwen3_5")
    assert cfg.has_vision == multimodal
    assert cfg.layer_types == list(hf.layer_types)
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim)
    assert cfg.rotary_dim == int(hf.head_dim * hf.rope_parameters["partial_rotary_factor"])
    assert cfg.mrope_section == hf.rope_parameters["mrope_section"]
    assert cfg.norm_zero_centered and cfg.attn_output_gate and cfg.qk_norm
    assert cfg.is_moe == moe
    if moe:
        assert (cfg.num_experts, cfg.num_experts_per_tok) == (hf.num_experts, hf.num_experts_per_tok)
    else:
        assert cfg.intermediate_size == hf.intermediate_size
    assert cfg.mtp_num_layers == 1
    raw = json.loads((tmp_path / "config.json").read_text())
    stored = raw.get("dtype") or raw.get("torch_dtype") or raw["text_config"]["dtype"]
    assert cfg.torch_dtype == str(stored).removeprefix("torch.")  # transformers writes it at the top level


def write_config(tmp_path, raw) -> None:
    (tmp_path / "config.json").write_text(raw if isinstance(raw, str) else json.dumps(raw))


LLAMA = {"model_type": "llama", "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 10}


@pytest.mark.parametrize(
    "raw, needle",
    [
        ("{broken", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ({**LLAMA, "model_type": "gpt2"}, "unsupported model_type 'gpt2'"),
        ({k: v for k, v in LLAMA.items() if k != "hidden_size"}, "hidden_size"),
        ({**LLAMA, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3"),
        ({**LLAMA, "model_type": "qwen3_5", "layer_types": ["full_attention"] * 3}, "layer_types"),
        # wrong types and absurd sizes: refused before anything is built or allocated
        ({**LLAMA, "hidden_size": "abc"}, "'hidden_size' must be an integer in [1, 1048576], got 'abc'"),
        ({**LLAMA, "model_type": "qwen3_5", "layer_types": 5}, "'layer_types' must be a list of full_attention"),
        ({**LLAMA, "vocab_size": 2**40}, "'vocab_size' must be an integer in [1, 4194304], got 1099511627776"),
        ({**LLAMA, "num_attention_heads": True}, "'num_attention_heads' must be an integer"),
        ({**LLAMA, "rms_norm_eps": -1}, "'rms_norm_eps' must be a number"),
        ({**LLAMA, "eos_token_id": {"id": 2}}, "'eos_token_id' must be a token id"),
        ({**LLAMA, "rope_scaling": [1]}, "'rope_parameters' / 'rope_scaling' must be an object"),
        ({"model_type": "qwen3_5", "text_config": "x"}, "'text_config' an object"),
    ],
)
def test_bad_config_names_the_file_and_the_problem(tmp_path, raw, needle):
    write_config(tmp_path, raw)
    with pytest.raises(ModelLoadError) as err:
        load_config(tmp_path)
    message = str(err.value)
    assert needle in message and "config.json" in message and "\n" not in message


def test_missing_config(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json: not found"):
        load_config(tmp_path)


def test_generation_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "eos_token_id": [7, 9]})
    )
    d = GenerationDefaults.from_model_dir(tmp_path)
    assert (d.temperature, d.top_k, d.top_p, d.eos_token_ids) == (0.6, 20, 0.95, [7, 9])
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.6}))
    assert GenerationDefaults.from_model_dir(tmp_path).temperature == 0.0  # greedy checkpoint
    (tmp_path / "generation_config.json").write_text("{oops")
    with pytest.raises(ModelLoadError, match="generation_config.json"):
        GenerationDefaults.from_model_dir(tmp_path)

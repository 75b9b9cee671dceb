"""scripts/bench_cpu_gguf.py on the real SmolLM2 GGUF: `speed` against a stand-in llama-bench (the
real one is a C++ build CI does not have; the stand-in records what it was asked and answers in
llama-bench's JSON), `accuracy` teacher-forced against the exact path, and the bench harness's
prefill after cached tokens (`--prompt-depth`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ninfer_core.bench import BenchSetup, _build, _Harness
from ninfer_core.ops import dispatch

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_cpu_gguf.py"

pytestmark = pytest.mark.skipif(dispatch.cpu_extension() is None, reason="ninfer_core._cpu not built")

# prints llama-bench's `-o json` answer: 100 tok/s for a prompt test, 50 for a generation test
STAND_IN = """#!{python}
import json, sys
with open({log!r}, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
args = sys.argv[1:]
print(json.dumps([{{"avg_ts": 50.0 if args[args.index("-p") + 1] == "0" else 100.0}}]))
"""


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)


def test_speed_asks_llama_bench_for_the_same_tests(smollm_path, tmp_path):
    log, stand_in, out = tmp_path / "calls.jsonl", tmp_path / "llama-bench", tmp_path / "speed.json"
    stand_in.write_text(STAND_IN.format(python=sys.executable, log=str(log)))
    stand_in.chmod(0o755)
    proc = _run("speed", str(smollm_path), "--llama-bench", str(stand_in), "--threads", "1", "--prompt", "5",
                "--prompt-depth", "40", "--gen", "3", "--depth", "20", "--repeats", "2", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    model_and_threads = ["-m", str(smollm_path), "-t", "1", "-r", "1", "-o", "json"]
    prompt_test = model_and_threads + ["-p", "5", "-n", "0", "-d", "40"]
    generation_test = model_and_threads + ["-p", "0", "-n", "3", "-d", "20"]
    assert calls == [prompt_test, generation_test] * 2
    report = json.loads(out.read_text())
    assert (report["prompt"], report["prompt_depth"], report["gen"], report["depth"]) == (5, 40, 3, 20)
    (run,) = report["runs"]
    assert run["threads"] == 1 and len(run["rounds"]) == 2
    median = run["median"]
    assert median["llama_pp"] == 100.0 and median["llama_tg"] == 50.0
    assert median["ninfer_pp"] > 0 and median["ninfer_tg"] > 0
    assert run["prefill_ratio"] == pytest.approx(median["ninfer_pp"] / 100.0)
    assert run["decode_ratio"] == pytest.approx(median["ninfer_tg"] / 50.0)


def test_accuracy_sees_the_16_bit_cache_round(smollm_path, tmp_path):
    """The tests' exact CPU math (conftest): with an fp32 cache the decode path is the reference's
    own arithmetic (KL ~0); an fp16 cache's rounding is measured above that and stays small."""
    out = tmp_path / "accuracy.json"
    proc = _run("accuracy", str(smollm_path), "--tokens", "24", "--kv-dtypes", "fp32,fp16", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    exact, fp16 = report["decode_kv_fp32"], report["decode_kv_fp16"]
    assert report["tokens"] == 24 and report["math"] == "exact"
    assert exact["kl_mean"] < 1e-9 and exact["top1"] == 1.0
    assert 1e-9 < fp16["kl_mean"] < 1e-4 and fp16["top1"] == 1.0


@torch.inference_mode()
def test_prefill_after_cached_tokens(smollm_path):
    """`prefill(length, context)` runs its forwards at positions context .. context + length - 1,
    the cached tokens before them as the cache lengths (the warm-up chunk too)."""
    setup = BenchSetup(model=str(smollm_path), device="cpu", prefill_lengths=(40 + 12,), decode_contexts=(8,),
                       decode_batches=(1,), decode_steps=2, prefill_chunk=8)
    model, config, dev, dtype, _ = _build(setup)
    harness = _Harness(model, config, dev, dtype, setup)
    seen, forward = [], model.forward

    def recording(batch, cache):
        seen.append((batch.cache_lens.tolist(), batch.positions[0].tolist()))
        return forward(batch, cache)

    model.forward = recording
    run = harness.prefill(12, 40)
    assert run.tokens == 12 and run.seconds > 0
    assert seen[0] == ([40], list(range(40, 48)))  # the warm-up: one chunk
    assert seen[-2:] == [([40], list(range(40, 48))), ([48], list(range(48, 52)))]

"""The whole engine's kernel calls meet the bindings' C++ checks: a tiny Qwen3.5 MoE model with the
kernels' head dims runs prefill, decode, sampling and speculative verify on CPU tensors, every op on
its CUDA-kernel path into the real bindings, each stopped at the device check (kernel_stub.py
`engine_through_checks`). What the per-op tests pick by hand, this takes from the model: the merged
projections' views, the folded norms, the cache layouts, the verify rounds. Runs where
ninfer_core._C is built; the GPU tests then run the same calls for real."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernel_stub import ChecksOnly, engine_through_checks, kernels_on_cpu  # noqa: F401 - fixtures
from ninfer_core.engine.request import GenerationRequest
from ninfer_core.engine.sampling import SamplingParams
from ninfer_core.llm import LLM, EngineOptions
from tiny_model_dir import write_tiny_model_dir

# needs ninfer_core._C (kernels_on_cpu skips without it), built only where CUDA is: the device's
# `pytest -m cuda` runs these
pytestmark = pytest.mark.cuda

# head dims the kernels take (attention 64, GDN 32); int4 groups of 32 divide every FFN input
KERNEL_SHAPES = dict(
    hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=64, head_dim=64,
    linear_key_head_dim=32, linear_value_head_dim=32,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                         mrope_section=[8, 4, 4], mrope_interleaved=True),
)
PROMPTS = [([5, 17, 42, 99, 3] * 4, 0.0), ([11, 12, 13], 0.8), (list(range(20, 61)), 0.0), ([300, 301, 2, 9, 77], 0.0)]
EVERY_PATH = {"rmsnorm", "gdn_conv_prefill", "gdn_steps", "norm_rotary", "write_kv", "norm_rotary_write_kv",
              "decode_attention", "sigmoid_mul", "sample_rows"}
MOE = {"moe_route", "moe_router"}
QUANTIZED = {"quant_gemv", "dequant"}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[bool, Path]:
    """moe -> a tiny model directory (the 35B-A3B's layer kinds, or the 27B's dense FFN)."""
    dirs = {moe: tmp_path_factory.mktemp(f"tiny_kernel_shapes_moe{int(moe)}") for moe in (True, False)}
    for moe, directory in dirs.items():
        write_tiny_model_dir(directory, moe=moe, overrides=KERNEL_SHAPES | ({} if moe else {"intermediate_size": 128}))
    return dirs


@pytest.mark.parametrize(("moe", "weights", "kv_dtype", "spec"), [
    (True, "bf16", "auto", None), (True, "int4", "fp8", None), (True, "int8", "int8", "ngram"),
    (True, "int4", "auto", "mtp"), (False, "int4", "auto", None), (False, "int8", "fp8", "ngram"),
])
def test_engine_calls_pass_the_binding_checks(model_dirs, engine_through_checks: ChecksOnly, moe, weights, kv_dtype,
                                              spec):
    options = EngineOptions(device="cpu", dtype="bfloat16", max_seqs=4, max_context=256, kv_capacity=2048,
                            weights=weights, kv_dtype=kv_dtype, spec=spec)
    llm = LLM.load(str(model_dirs[moe]), options)
    requests = [GenerationRequest(p, SamplingParams(temperature=t, max_tokens=4, ignore_eos=True)) for p, t in PROMPTS]
    produced = {r.request_id: 0 for r in requests}
    for step in llm.engine.generate(requests):
        assert step.error is None, step.error
        produced[step.request_id] += len(step.new_token_ids)
    assert all(n == 4 for n in produced.values()), produced
    called = set(engine_through_checks.calls)
    assert EVERY_PATH <= called, EVERY_PATH - called
    assert (MOE <= called) == moe and (QUANTIZED <= called) == (weights != "bf16"), called
    assert ("moe_decode" in called) == (moe and weights != "bf16"), called
    if weights == "bf16":
        assert "silu_mul" in called
    if spec is not None:  # verify rounds: the fused steps over K + 1 tokens, then the commit
        assert engine_through_checks.calls["gdn_steps"] > engine_through_checks.calls["sample_rows"]

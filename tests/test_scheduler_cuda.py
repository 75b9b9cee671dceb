"""The engine loop on the GPU: varlen steps, overlapped steps and preemption give each request its
solo tokens (fp32, so only GEMM shapes differ between batch compositions), and a bf16 / int4
engine at kernel-friendly shapes runs prefill, mixed and graph decode steps without a single
fallback to a torch reference (NINFER_REQUIRE_KERNELS=1)."""

from __future__ import annotations

import pytest
import torch

from ninfer_core.engine.request import GenerationRequest
from ninfer_core.engine.sampling import SamplingParams
from ninfer_core.llm import LLM, EngineOptions
from test_scheduler import PROMPTS, greedy, sampled, solo, staggered
from tiny_model_dir import write_tiny_model_dir

pytestmark = pytest.mark.cuda

# head dims the attention / GDN kernels take, int4 groups dividing every FFN input
KERNEL_SHAPES = dict(hidden_size=128, head_dim=64, num_attention_heads=4, num_key_value_heads=2,
                     linear_key_head_dim=32, linear_value_head_dim=32, moe_intermediate_size=64,
                     shared_expert_intermediate_size=128,
                     rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                          mrope_section=[8, 4, 4], mrope_interleaved=True))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_sched_cuda")
    write_tiny_model_dir(directory, moe=True, overrides=KERNEL_SHAPES)
    return directory


def load(directory, **options) -> LLM:
    base = dict(device="cuda", dtype="float32", max_seqs=4, max_context=256, kv_capacity=1024)
    return LLM.load(str(directory), EngineOptions(**{**base, **options}))


def test_overlapped_mixed_steps_equal_solo_runs_on_cuda(model_dir):
    jobs = [(p, greedy(16)) for p in PROMPTS] + [(PROMPTS[2], sampled(16, 5))]
    reference = load(model_dir, cuda_graphs=False)
    reference.engine.overlap = False
    expected = [solo(reference, p, params) for p, params in jobs]
    llm = load(model_dir, prefill_chunk=16)
    assert llm.engine.overlap and llm.stats().cuda_graphs
    out = staggered(llm, jobs, every=2)
    assert [out[i] for i in range(len(jobs))] == expected


def test_preemption_on_cuda_loses_nothing(model_dir):
    jobs = [(p, greedy(24)) for p in PROMPTS]
    reference = load(model_dir, cuda_graphs=False)
    expected = [solo(reference, p, params) for p, params in jobs]
    llm = load(model_dir, kv_capacity=96, prefill_chunk=64)
    out = staggered(llm, jobs, every=1)
    assert [out[i] for i in range(len(jobs))] == expected
    assert llm.stats().preemptions > 0 and llm.engine.cache.active_tokens == 0


@pytest.mark.parametrize("weights", ["bf16", "int4"])
def test_no_kernel_falls_back(model_dir, monkeypatch, weights):
    """Prompts (chunked, several per step), mixed steps and graph decode of a bf16 model: every op
    on its kernel, or the run fails with KernelFallbackError."""
    monkeypatch.setenv("NINFER_REQUIRE_KERNELS", "1")
    llm = load(model_dir, dtype="bfloat16", weights=weights, prefill_chunk=32)
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=1, max_tokens=12, ignore_eos=True,
                            presence_penalty=0.5)
    requests = [GenerationRequest(p, params if i % 2 else greedy(12)) for i, p in enumerate(PROMPTS)]
    outputs = list(llm.engine.generate(requests))
    counts = {r.request_id: sum(len(o.new_token_ids) for o in outputs if o.request_id == r.request_id)
              for r in requests}
    assert set(counts.values()) == {12}
    assert torch.cuda.is_available() and llm.stats().cuda_graphs

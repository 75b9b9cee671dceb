"""The GPU decode path as a whole: CUDA graphs against eager, the quantized engine against the
unquantized one, automatic KV sizing. (Each kernel has its own tests beside its op.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ninfer_core.engine.request import GenerationRequest
from ninfer_core.engine.sampling import SamplingParams
from ninfer_core.llm import LLM, EngineOptions
from tiny_model_dir import write_tiny_model_dir

pytestmark = pytest.mark.cuda

# int4 groups (32) divide every FFN input; q/k/v, GDN and shared-expert projections reach 64 outputs.
WIDE = dict(hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=64)
PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11, 12, 13], list(range(20, 61)), [300, 301, 2, 9, 77]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny_fast")
    write_tiny_model_dir(directory, moe=True, overrides=WIDE)
    return directory


def generate(llm: LLM, prompts: list[list[int]], n: int = 24) -> list[list[int]]:
    requests = [GenerationRequest(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)) for p in prompts]
    out: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for step in llm.engine.generate(requests):
        out[step.request_id] += step.new_token_ids
    return [out[r.request_id] for r in requests]


def load(directory: Path, **options) -> LLM:
    base = dict(device="cuda", dtype="bfloat16", max_seqs=4, max_context=256, kv_capacity=2048)
    return LLM.load(str(directory), EngineOptions(**{**base, **options}))


@pytest.mark.parametrize("weights", ["bf16", "int4"])
@pytest.mark.parametrize("batch", [1, 4])
def test_graph_decode_is_identical_to_eager(model_dir, weights, batch):
    """Same kernels, same order, bucket = batch: the tokens must be bit-identical."""
    graphs = load(model_dir, weights=weights)
    eager = load(model_dir, weights=weights, cuda_graphs=False)
    assert graphs.stats().cuda_graphs and not eager.stats().cuda_graphs
    ours = generate(graphs, PROMPTS[:batch])
    assert graphs.stats().cuda_graphs, "graph capture failed and fell back to eager"
    assert ours == generate(eager, PROMPTS[:batch])


def test_graph_bucket_padding_and_growth(model_dir):
    """Batch 3 replays the 4-row graph (a spare row on the scratch slot); sequences finishing at
    different lengths change the batch mid-run. fp32: the only difference to eager is the GEMM
    shape (3 vs 4 rows), far below a token flip."""
    graphs = load(model_dir, dtype="float32", weights="bf16")
    eager = load(model_dir, dtype="float32", weights="bf16", cuda_graphs=False)
    requests = lambda: [GenerationRequest(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))  # noqa: E731
                        for p, n in zip(PROMPTS[:3], (40, 9, 25))]
    def run(llm):
        reqs = requests()
        out = {r.request_id: [] for r in reqs}
        for step in llm.engine.generate(reqs):
            out[step.request_id] += step.new_token_ids
        return [out[r.request_id] for r in reqs]
    assert run(graphs) == run(eager)
    assert graphs.stats().cuda_graphs and {key[0] for key in graphs.engine.graphs.graphs} >= {2, 4}


REPETITIVE = [[5, 6, 7, 8, 9] * 6, [40, 41, 42] * 9, list(range(100, 112)) * 3, [7, 7, 8] * 8]


@pytest.mark.parametrize("weights", ["bf16", "int4"])
@pytest.mark.parametrize("batch", [1, 4])
def test_graph_verify_is_identical_to_eager(model_dir, weights, batch):
    """Speculative rounds (n-gram drafts of varying width) replay verify + commit graphs: the same
    kernels as eager verification in the same order, so the tokens are bit-identical."""
    spec = dict(weights=weights, spec="ngram", draft_tokens=4)
    graphs, eager = load(model_dir, **spec), load(model_dir, **spec, cuda_graphs=False)
    ours = generate(graphs, REPETITIVE[:batch], n=40)
    assert graphs.stats().cuda_graphs, "graph capture failed and fell back to eager"
    widths = {key[1] for key in graphs.engine.graphs.graphs}
    assert any(w > 1 for w in widths), f"no verify graph was replayed: {widths}"
    assert graphs.stats().spec.accepted > 0
    assert ours == generate(eager, REPETITIVE[:batch], n=40)


def test_graph_verify_fp32_matches_plain_greedy(model_dir):
    """fp32: speculative greedy through verify graphs (3 rows on the 4-row bucket) equals plain
    greedy decode without drafts or graphs."""
    spec = load(model_dir, dtype="float32", weights="bf16", spec="ngram", draft_tokens=5)
    plain = load(model_dir, dtype="float32", weights="bf16", cuda_graphs=False)
    assert generate(spec, REPETITIVE[:3], n=48) == generate(plain, REPETITIVE[:3], n=48)
    assert spec.stats().cuda_graphs and any(key[1] > 1 for key in spec.engine.graphs.graphs)
    assert spec.stats().spec.rejected > 0


def test_quantized_engine_against_bf16(model_dir, capsys):
    """Teacher-forced logits of the int8 / int4 engines against the bf16 engine (KL, top-1), reported."""
    def logits(llm: LLM, ids: list[int]) -> torch.Tensor:
        from ninfer_core.models.base import ForwardBatch

        cache = llm.engine.cache
        seq = cache.allocate()
        cache.reserve(seq, len(ids))
        batch = ForwardBatch(input_ids=torch.tensor([ids], device="cuda"), positions=torch.arange(len(ids), device="cuda")[None],
                             cache_lens=torch.tensor([0], device="cuda"), slots=torch.tensor([seq.slot], device="cuda"),
                             block_table=cache.block_table([seq]), logits="all")
        with torch.inference_mode():
            out = llm.engine.model.forward(batch, cache.cache).logits[0].double().log_softmax(-1)
        cache.free(seq)
        return out

    ids = [i % 400 for i in range(7, 7 + 97 * 3, 3)]
    reference = logits(load(model_dir, weights="bf16"), ids)
    for weights, max_kl in (("int8", 0.01), ("int4", 0.2)):
        ours = logits(load(model_dir, weights=weights), ids)
        kl = (reference.exp() * (reference - ours)).sum(-1).mean().item()
        top1 = (reference.argmax(-1) == ours.argmax(-1)).double().mean().item()
        with capsys.disabled():
            print(f"\ntiny random model {weights} vs bf16: KL {kl:.4f}, top-1 {top1:.3f}")
        assert kl < max_kl


def test_kv_capacity_auto_fills_free_memory(model_dir):
    llm = LLM.load(str(model_dir), EngineOptions(device="cuda", dtype="bfloat16", max_seqs=2))
    stats = llm.stats()
    # the tiny model's limit (512 positions) caps it: 2 sequences x the model limit
    assert stats.kv_capacity_tokens >= 2 * 512 and llm.max_context == 512
    assert stats.kv_bytes > 0 and stats.weight_bytes > 0 and stats.kv_dtype == "bf16"
    fp8 = LLM.load(str(model_dir), EngineOptions(device="cuda", dtype="bfloat16", max_seqs=2, kv_dtype="fp8"))
    assert fp8.stats().kv_dtype == "fp8"
    assert generate(fp8, PROMPTS[:2], 8)  # runs end to end on fp8 pages

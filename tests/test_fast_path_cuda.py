"""The GPU decode path as a whole: CUDA graphs against eager, the quantized engine against the
unquantized one, automatic KV sizing. (Each kernel has its own tests beside its op.)"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ninfer_core.cache.sizing import plan_cache
from ninfer_core.config import load_config
from ninfer_core.engine.graph_capture import capture
from ninfer_core.engine.request import GenerationRequest
from ninfer_core.engine.speculative import Draft
from ninfer_core.engine.sampling import SamplingParams
from ninfer_core.llm import LLM, EngineOptions
from ninfer_core.models.base import ForwardBatch
from speculative_harness import SAMPLED, assert_same_drafts, eager_then_graph, run_with
from tiny_model_dir import WIDE, write_tiny_model_dir

pytestmark = pytest.mark.cuda

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
    """Same kernels, same order, bucket = batch: the tokens must be bit-identical. (Prompts are
    read eagerly on both: a padded prompt-chunk graph computes attention on another kernel, so it
    is compared by logits in test_prefill_graph_logits_match_eager.)"""
    graphs = load(model_dir, weights=weights)
    graphs.engine.prefill_graphs = None
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


def _forward_batch(cache, seqs, ids: torch.Tensor, start: list[int], **kw) -> ForwardBatch:
    lens = torch.tensor(start, device="cuda")
    return ForwardBatch(input_ids=ids, positions=lens[:, None] + torch.arange(ids.shape[1], device="cuda"),
                        cache_lens=lens, slots=torch.tensor([s.slot for s in seqs], device="cuda"),
                        block_table=cache.block_table(seqs), **kw)


@pytest.mark.parametrize("weights", ["bf16", "int4"])
def test_graph_verify_round_matches_eager(model_dir, weights):
    """One verify round (3 sequences on the 4-row bucket, 4 tokens each) and the commit of 0, 2
    and 4 of its tokens by graph replay, against the same round run eagerly from the same cache:
    logits and committed GDN states agree to the model dtype's rounding (the attention split
    count follows the block-table width, which differs between the two)."""
    from ninfer_core.engine.speculative.rollback import commit_gdn

    llm = load(model_dir, weights=weights)
    cache, model, graphs = llm.engine.cache, llm.engine.model, llm.engine.graphs
    seqs = [cache.allocate() for _ in PROMPTS[:3]]
    with torch.inference_mode():
        for seq, prompt in zip(seqs, PROMPTS):
            cache.reserve(seq, len(prompt) + 4)
            model.forward(_forward_batch(cache, [seq], torch.tensor([prompt], device="cuda"), [0], logits="none"),
                          cache.cache)
        state = cache.cache.state
        before = {i: (state.conv[i].clone(), state.recurrent[i].clone()) for i in state.layers}
        ids = torch.randint(0, 400, (3, 4), generator=torch.Generator().manual_seed(0)).cuda()
        batch = _forward_batch(cache, seqs, ids, [len(p) for p in PROMPTS[:3]], logits="all", verify=True)
        counts = torch.tensor([0, 2, 4], device="cuda")
        assert graphs.supports(batch)
        got = graphs.forward(batch)
        got_logits = got.logits.clone()
        graphs.commit(batch, counts)
        got_state = {i: (state.conv[i].clone(), state.recurrent[i].clone()) for i in state.layers}
        for i, (conv, rec) in before.items():
            state.conv[i].copy_(conv)
            state.recurrent[i].copy_(rec)
        want = model.forward(batch, cache.cache)
        commit_gdn(model, state, want.gdn_records, batch.slots, counts)
    assert (4, 4, ()) in graphs.graphs and got_logits.shape == want.logits.shape
    torch.testing.assert_close(got_logits, want.logits, atol=0.05, rtol=0.05)
    for i in state.layers:
        torch.testing.assert_close(got_state[i][0], state.conv[i], atol=0.02, rtol=0.02)
        torch.testing.assert_close(got_state[i][1], state.recurrent[i], atol=0.02, rtol=0.02)
        assert torch.equal(state.recurrent[i][seqs[0].slot], before[i][1][seqs[0].slot])  # kept 0 tokens


@pytest.mark.parametrize("batch", [1, 3])
def test_graph_verify_fp32_matches_plain_greedy(model_dir, batch):
    """fp32: speculative greedy through verify + commit graphs equals plain greedy decode without
    drafts or graphs. Drafts are the true continuation with one token corrupted per round, so
    every acceptance length 0..3 occurs (rollback of every length inside the graphs)."""
    from ninfer_core.engine.sampling import Sampler
    from ninfer_core.engine.speculative import Speculator
    from speculative_harness import ScriptedDrafter

    n = 48
    prompts = PROMPTS[:batch]
    plain = generate(load(model_dir, dtype="float32", weights="bf16", cuda_graphs=False), prompts, n)
    spec = load(model_dir, dtype="float32", weights="bf16", spec="ngram", draft_tokens=3)
    requests = [GenerationRequest(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)) for p in prompts]
    script = {r.request_id: tokens for r, tokens in zip(requests, plain)}
    engine = spec.engine
    engine.speculator = Speculator(ScriptedDrafter(script, spec.loaded.config.vocab_size), 3, Sampler())
    out: dict[str, list[int]] = {r.request_id: [] for r in requests}
    accepted = set()
    for step in engine.generate(requests):
        out[step.request_id] += step.new_token_ids
        if step.drafted == 3:
            accepted.add(step.accepted)
    assert [out[r.request_id] for r in requests] == plain
    assert accepted == {0, 1, 2, 3}
    assert spec.stats().cuda_graphs and any(key[1] == 4 for key in engine.graphs.graphs)


def test_quantized_engine_against_bf16(model_dir, capsys):
    """Teacher-forced logits of the int8 / int4 engines against the bf16 engine (KL, top-1), reported."""
    def logits(llm: LLM, ids: list[int]) -> torch.Tensor:
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


def test_capture_leaves_the_graph_launched_once():
    """graph_capture.capture runs fn as a warm-up, captures it, and replays the graph once (its first
    launch, the driver's upload, paid at capture): two runs before it returns, one more a replay."""
    count = torch.zeros(1, device="cuda")
    graph, out = capture(lambda: count.add_(1))
    torch.cuda.synchronize()
    assert count.item() == 2 and out is count
    graph.replay()
    torch.cuda.synchronize()
    assert count.item() == 3


def test_kv_capacity_auto_fills_free_memory(model_dir):
    llm = LLM.load(str(model_dir), EngineOptions(device="cuda", dtype="bfloat16", max_seqs=2))
    stats = llm.stats()
    # the tiny model's limit (512 positions) caps it: 2 sequences x the model limit
    assert stats.kv_capacity_tokens >= 2 * 512 and llm.max_context == 512
    assert stats.kv_bytes > 0 and stats.weight_bytes > 0 and stats.kv_dtype == "bf16"
    fp8 = LLM.load(str(model_dir), EngineOptions(device="cuda", dtype="bfloat16", max_seqs=2, kv_dtype="fp8"))
    assert fp8.stats().kv_dtype == "fp8"
    assert generate(fp8, PROMPTS[:2], 8)  # runs end to end on fp8 pages


def test_kv_sizing_counts_what_the_allocator_keeps_cached(model_dir):
    """Memory torch freed but keeps cached (a model quantized at load: the 35B's random bf16 weights
    left 2.2 GiB "free" on an 80 GB H100) goes back to the driver before the free memory is read."""
    config = load_config(model_dir)
    held = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    del held  # freed, still reserved by the caching allocator
    assert torch.cuda.memory_reserved() - torch.cuda.memory_allocated() >= 1 << 30
    plan = plan_cache(config, torch.device("cuda"), torch.bfloat16, kv_dtype="auto", max_seqs=2, max_context=None,
                      default_context=4096, kv_capacity=None)
    assert torch.cuda.memory_reserved() - torch.cuda.memory_allocated() < 1 << 30
    assert plan.kv_tokens >= 2 * 512 and plan.max_context == 512  # the tiny model's limit caps it


def test_mtp_graph_drafts_equal_eager_drafting(model_dir):
    """fp32, 3 sequences on the 4-row bucket: each round's drafts from the MTP graphs (catch-up and
    chain) equal the eager drafter's from the same state; speculative greedy equals plain greedy."""
    plain = generate(load(model_dir, dtype="float32", weights="bf16", cuda_graphs=False), PROMPTS[:3], 32)
    llm = load(model_dir, dtype="float32", weights="bf16", spec="mtp", draft_tokens=3)
    drafter = llm.engine.speculator.drafter
    graphs, propose = drafter.graphs, drafter.propose
    assert graphs is not None
    rounds: list[tuple[list[list[int]], list[list[int]]]] = []

    def both(seqs, counts, penalties=None):
        drafter.graphs = None
        eager = [d.tokens for d in propose(seqs, counts, penalties)]
        drafter.graphs = graphs
        graph = [d.tokens for d in propose(seqs, counts, penalties)]
        rounds.append((graph, eager))
        return [Draft(tokens) for tokens in graph]

    drafter.propose = both
    assert generate(llm, PROMPTS[:3], 32) == plain
    assert graphs.enabled and ("draft", 4, 3) in graphs.captured and rounds
    assert any(kind == "catch_up" for kind, _, _ in graphs.captured)
    assert all(graph == eager for graph, eager in rounds)


@pytest.mark.parametrize("penalties", [{}, dict(presence_penalty=1.5, repetition_penalty=1.2, frequency_penalty=0.3)])
def test_mtp_sampled_graph_drafts_equal_eager_drafting(model_dir, penalties):
    """fp32, two seeded sampled sequences beside a greedy one, without and with penalties: each round's
    drafts and their q from the sampling chain graph (a real capture; the penalised one reads the
    drafter's tables) equal the eager drafter's from the same state and generator states; the
    tokens are the engine's without graphs for the same seeds."""
    options = dict(dtype="float32", weights="bf16", spec="mtp", draft_tokens=3)
    params = [replace(p, max_tokens=32, **penalties) for p in SAMPLED]
    want = run_with(load(model_dir, cuda_graphs=False, **options).engine, params)
    llm = load(model_dir, **options)
    drafter = llm.engine.speculator.drafter
    assert drafter.graphs is not None
    rounds: list = []
    drafter.propose = eager_then_graph(drafter, rounds)
    assert run_with(llm.engine, params) == want
    kind = "penalised" if penalties else "sampled"
    assert drafter.graphs.enabled and any(k == kind for k, _, _ in drafter.graphs.captured)
    assert_same_drafts(rounds)


def first_logits(llm: LLM, prompt: list[int], cached: int = 0) -> torch.Tensor:
    """The logits of the prompt's last token, read as one chunk after `cached` tokens that come
    from the prefix cache."""
    engine = llm.engine
    engine.add_request(GenerationRequest(prompt, SamplingParams(temperature=0, max_tokens=1)))
    plan = engine.scheduler.schedule()
    (chunk,) = plan.prefills
    assert chunk.seq.num_cached == cached and chunk.last
    out = engine._forward([engine._prefill_batch(chunk)])[0].logits[0, -1].float().clone()
    engine.abort(chunk.seq.request_id)
    while engine.has_unfinished():
        engine.step()
    return out


@pytest.mark.parametrize("weights", ["bf16", "int4"])
def test_prefill_graph_logits_match_eager(model_dir, weights):
    """The first token's logits after a prompt read by its padded chunk graph (attention on the
    Triton chunk kernel, padding on the scratch page) against the eager read."""
    graphs = load(model_dir, weights=weights)
    eager = load(model_dir, weights=weights, cuda_graphs=False)
    assert graphs.engine.prefill_graphs is not None and graphs.engine.prefill_graphs.buckets
    for prompt in PROMPTS:
        got, want = first_logits(graphs, prompt), first_logits(eager, prompt)
        assert (got - want).norm() / want.norm() < 2e-2


def test_prefill_graph_continues_a_cached_prefix(model_dir):
    """A prompt that repeats a cached 200-token prompt: its 40 new tokens go through a chunk graph
    starting at the checkpoint (attention over the shared pages) and give the logits an eager
    engine without the cache computes for the whole prompt."""
    prefix = [(7 * i) % 290 + 5 for i in range(200)]
    prompt = prefix + [(11 * i) % 290 + 5 for i in range(40)]
    graphs = load(model_dir)
    eager = load(model_dir, cuda_graphs=False, prefix_cache=False)
    assert generate(graphs, [prefix], 1)  # checkpointed at the prompt's end
    got = first_logits(graphs, prompt, cached=200)
    want = first_logits(eager, prompt)
    assert (got - want).norm() / want.norm() < 2e-2


def prompt_logits(llm: LLM, prompt: list[int], checkpoints: tuple[int, ...] = ()
                  ) -> tuple[torch.Tensor, list[tuple[int, int, list[int]]]]:
    """The logits of the prompt's last token as the engine reads the prompt (its chunks: (start,
    end, forks)), checkpoints kept; the request is dropped afterwards."""
    engine = llm.engine
    engine.add_request(GenerationRequest(prompt, SamplingParams(temperature=0, max_tokens=1), checkpoints=checkpoints))
    chunks = []
    while True:
        (chunk,) = engine.scheduler.schedule().prefills
        out = engine._forward([engine._prefill_batch(chunk)])[0]
        chunks.append((chunk.start, chunk.end, list(chunk.forks)))
        engine._prefilled([chunk])
        if chunk.last:
            break
    logits = out.logits[0, -1].float().clone()
    engine.abort(chunk.seq.request_id)
    while engine.has_unfinished():
        engine.step()
    return logits, chunks


@pytest.mark.parametrize("weights", ["bf16", "int4"])
@pytest.mark.parametrize("length,checkpoints,forks",
                         [(300, (), [299]), (200, (100,), [100]), (300, (100,), [100, 299]), (300, (273,), [273, 299])],
                         ids=["fused_tail", "chunked_twice", "chunked_then_tail", "windows"])
def test_prefill_forks_match_the_split(model_dir, weights, length, checkpoints, forks):
    """With the prefix cache a prompt runs as one chunk that keeps the GDN state at its
    checkpoints (forks: before its last token by the fused steps, elsewhere by fla's chunked rule
    twice, or both, or within three windows of the fused steps by those after one chunked run; a
    chunk graph with int4 experts, eager with bf16 ones, whose graphs stop at 16 rows). Its logits
    are as close to the cache-off engine's as those of the chunks it replaces, and the same prompt
    again resumes from the last fork's checkpoint with the same logits."""
    prompt = [(7 * i) % 290 + 5 for i in range(length)]
    want = first_logits(load(model_dir, weights=weights, max_context=512, cuda_graphs=False, prefix_cache=False),
                        prompt)
    split = load(model_dir, weights=weights, max_context=512)
    split.engine.scheduler.forks = False
    forked = load(model_dir, weights=weights, max_context=512)
    split_logits, split_chunks = prompt_logits(split, prompt, checkpoints)
    got, chunks = prompt_logits(forked, prompt, checkpoints)
    assert chunks == [(0, length, forks)] and [end for _, end, _ in split_chunks] == [*forks, length]
    rel = lambda x: float((x - want).norm() / want.norm())  # noqa: E731
    assert rel(got) < 3e-2 and rel(got) <= 1.25 * rel(split_logits) + 5e-3, (rel(got), rel(split_logits))
    again = first_logits(forked, prompt, cached=forks[-1])
    assert rel(again) < 3e-2


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_folded_input_norm_is_bit_equal(model_dir, weights, monkeypatch):
    """A decode step (4 rows) and a verify round (1 row x 4 tokens) of the quantized tiny model with
    each mixer's input norm folded into its first GEMV (quant_linear_add_norm's kernel), and the
    final norm into lm_head's (every row gets logits), give the logits, the hidden states, the
    residual stream after every layer, the GDN states and records of the same steps with
    add_rmsnorm + quant_linear, bit for bit; the fold ran in every layer after the first and in
    lm_head."""
    from ninfer_core.ops import quant

    llm = load(model_dir, weights=weights, cuda_graphs=False)
    cache, model = llm.engine.cache, llm.engine.model
    first_projections = [layer.linear_attn.in_proj if layer.is_linear else layer.self_attn.qkv_proj
                         for layer in model.layers[1:]]
    assert all(isinstance(p.linear, quant.QuantLinear) for p in first_projections)
    assert isinstance(model.lm_head, quant.QuantLinear)
    seqs = [cache.allocate() for _ in PROMPTS]
    state = cache.cache.state
    with torch.inference_mode():
        for seq, prompt in zip(seqs, PROMPTS):
            cache.reserve(seq, len(prompt) + 4)
            model.forward(_forward_batch(cache, [seq], torch.tensor([prompt], device="cuda"), [0], logits="none"),
                          cache.cache)
    saved = {i: (state.conv[i].clone(), state.recurrent[i].clone()) for i in state.layers}
    starts = [len(p) for p in PROMPTS]
    layers = tuple(range(len(model.layers)))
    ids = torch.randint(0, 400, (4, 4), generator=torch.Generator().manual_seed(1)).cuda()
    batches = [_forward_batch(cache, seqs, ids[:, :1], starts, logits="all", capture_layers=layers),
               _forward_batch(cache, seqs[:1], ids[:1], starts[:1], logits="all", capture_layers=layers, verify=True)]
    folds = []
    gemv = quant._gemv

    def counted(*args, norm=None, **kwargs):
        folds.append(norm is not None)
        gemv(*args, norm=norm, **kwargs)

    monkeypatch.setattr(quant, "_gemv", counted)

    def run(batch: ForwardBatch) -> list[torch.Tensor]:
        for i, (conv, recurrent) in saved.items():
            state.conv[i].copy_(conv)
            state.recurrent[i].copy_(recurrent)
        with torch.inference_mode():
            out = model.forward(batch, cache.cache)
        records = [t for i in sorted(out.gdn_records or {}) for t in vars(out.gdn_records[i]).values() if t is not None]
        states = [t for i in state.layers for t in (state.conv[i], state.recurrent[i])]
        return [t.clone() for t in (out.logits, out.hidden_states, out.captured, *records, *states)]

    for batch in batches:
        assert batch.logits == "all"
        folds.clear()
        fused = run(batch)
        assert sum(folds) == len(first_projections) + 1  # + lm_head's
        assert folds[-1], "the final norm was not folded into lm_head"
        with monkeypatch.context() as unfolded:
            unfolded.setattr(quant, "_norm_rows", lambda *args: None)  # add_rmsnorm + quant_linear
            folds.clear()
            composed = run(batch)
            assert not any(folds)
        assert len(fused) == len(composed) and all(torch.equal(a, b) for a, b in zip(fused, composed))

"""The bookkeeping of engine/cuda_graph.py on the CPU: static buffers, bucket padding with spare
rows on the scratch slot / page, verify + commit replays, the MTP catch-up and draft chains.

A CUDA graph replays the kernels it captured over the same buffers. `FakeGraph` stands in for
one by calling the captured function again on `replay()`, which reads the same static buffers:
what the graph code loads into them, parks in the spare rows and hands back is then exercised in
CI without a GPU. (The GPU tests in test_fast_path_cuda.py replay real graphs.) The reference is
the same engine without graphs: greedy tokens must be identical, speculative or not, and the
scratch slot / page must be the only cache the spare rows touch.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ninfer_core.cache import CacheManager
from ninfer_core.engine import cuda_graph, prefill_graph
from ninfer_core.engine.cuda_graph import DecodeGraphs
from ninfer_core.engine.penalties import Generated
from ninfer_core.engine.llm_engine import LLMEngine
from ninfer_core.engine.prefill_graph import FORK_KINDS, PrefillGraphs, fork_kind
from ninfer_core.engine.request import GenerationRequest
from ninfer_core.engine.sampling import Sampler, SamplingParams
from ninfer_core.engine.speculative import Speculator
from ninfer_core.engine.speculative import mtp as mtp_module
from ninfer_core.engine.speculative.mtp import MTPDrafter
from ninfer_core.engine.speculative.ngram import NgramDrafter
from ninfer_core.layers.moe import SparseMoE
from speculative_harness import (PROMPTS, SAMPLED, assert_same_drafts, eager_then_graph, greedy, load, run_sampled,
                                 run_with, write_target)

torch.set_num_threads(1)
N_TOKENS = 40


class FakeGraph:
    """Replays by calling fn again and writing its results into the captured call's output
    tensors, as a real replay rewrites the graph's static outputs in place."""

    replays = 0

    def __init__(self, fn, outputs):
        self.fn, self.outputs = fn, outputs

    @torch.inference_mode()
    def replay(self) -> None:
        FakeGraph.replays += 1
        _copy_into(self.outputs, self.fn())


def _copy_into(static, fresh) -> None:
    if isinstance(static, torch.Tensor):
        static.copy_(fresh)
    elif isinstance(static, dict):
        for key in static:
            _copy_into(static[key], fresh[key])
    elif isinstance(static, (tuple, list)):
        for mine, theirs in zip(static, fresh, strict=True):
            _copy_into(mine, theirs)
    elif hasattr(static, "__dataclass_fields__"):
        for name in static.__dataclass_fields__:
            _copy_into(getattr(static, name), getattr(fresh, name))
    elif static is not None:
        raise TypeError(f"FakeGraph cannot rewrite a {type(static).__name__} output in place")


def fake_capture(fn, pool=None):
    """Like graph_capture.capture: one warm-up call, then the 'captured' call's outputs (a real
    capture runs no kernel, but replays the graph once: the fake's two calls are the real two runs)."""
    fn()
    result = fn()
    return FakeGraph(fn, result), result


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_target(tmp_path_factory)[0]


@pytest.fixture
def fake_graphs(monkeypatch):
    monkeypatch.setattr(cuda_graph, "capture", fake_capture)
    monkeypatch.setattr(prefill_graph, "capture", fake_capture)
    monkeypatch.setattr(mtp_module, "capture", fake_capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    FakeGraph.replays = 0


def engine(target, method: str | None, graphs: bool) -> LLMEngine:
    """The target's engine rebuilt over a cache with a scratch slot / page (and graphs)."""
    llm = load(target, spec="mtp") if method == "mtp" else load(target)
    loaded = llm.loaded
    cache = CacheManager(loaded.config, max_tokens=4096, max_seqs=4, dtype=torch.float32, scratch=True)
    decode_graphs = DecodeGraphs(loaded.model, cache, 4, 512) if graphs else None
    speculator = None
    if method == "ngram":
        speculator = Speculator(NgramDrafter(), 4, Sampler())
    elif method == "mtp":
        head = llm.engine.speculator.drafter.head  # the checkpoint's mtp.* weights, loaded once
        drafter = MTPDrafter(loaded.model, head, cache, Sampler(), decode_graphs)
        speculator = Speculator(drafter, 3, Sampler())
    return LLMEngine(loaded.model, loaded.config, loaded.tokenizer, cache, max_context=512, speculator=speculator,
                     graphs=decode_graphs)


def generate(eng: LLMEngine, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    requests = [GenerationRequest(p, greedy(n)) for p, n in zip(prompts, lengths)]
    out: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for step in eng.generate(requests):
        out[step.request_id] += step.new_token_ids
    return [out[r.request_id] for r in requests]


@pytest.mark.parametrize("method", [None, "ngram", "mtp"])
def test_graph_replays_match_eager(target, fake_graphs, method):
    """3 sequences on the 4-row bucket, finishing at different lengths (the batch shrinks to 2 and
    1 on smaller buckets): every decode / verify / commit / draft-chain replay gives the eager
    engine's tokens, and the spare rows leave every sequence's cache alone."""
    lengths = [N_TOKENS, 13, 27]
    want = generate(engine(target, None, graphs=False), PROMPTS, lengths)
    eng = engine(target, method, graphs=True)
    unread = []
    if method == "mtp":  # the chain's drafts reach the judge unread: it reads them with its tokens, one sync
        judge = eng.speculator.judge
        eng.speculator.judge = lambda seqs, drafts, *rest: unread.append(
            all(d.pending is not None for d in drafts if d.count)) or judge(seqs, drafts, *rest)
    assert generate(eng, PROMPTS, lengths) == want
    assert all(unread) and len(unread) > 10 or method != "mtp"
    keys = set(eng.graphs.graphs)
    assert {(4, 0, ()), (2, 0, ()), (1, 0, ())} & keys and FakeGraph.replays > 0
    if method is not None:
        assert any(width > 1 for _, width, _ in keys), keys  # verify graphs replayed
    if method == "mtp":
        mtp_graphs = eng.speculator.drafter.graphs
        kinds = {kind for kind, _, _ in mtp_graphs.captured}
        assert mtp_graphs.enabled and kinds == {"draft", "catch_up"}, mtp_graphs.captured


@pytest.mark.parametrize("method", [None, "mtp"])
def test_spare_rows_are_routed_dead(target, fake_graphs, monkeypatch, method):
    """3 sequences on the 4-row bucket: every decode and verify replay hands the MoE layers the graph's
    real tokens (`ForwardBatch.live_tokens`: 3 of the decode graph's 4 rows, 3 T of a verify graph's
    4 T), whose router kernel routes the rest dead; the 2- and 1-row buckets that follow are full;
    eager forwards (the prompts, the drafter's) pass none."""
    seen = []
    forward = SparseMoE.add_norm_forward

    def recording(self, x, residual, norm, route_rows=None, live=None):
        seen.append((x.shape[0] * x.shape[1], None if live is None else int(live)))  # read at replay time
        return forward(self, x, residual, norm, route_rows, live)

    monkeypatch.setattr(SparseMoE, "add_norm_forward", recording)
    generate(engine(target, method, graphs=True), PROMPTS, [N_TOKENS, 13, 27])
    graphed = [(tokens, live) for tokens, live in seen if live is not None]
    spare = [(tokens, live) for tokens, live in graphed if live != tokens]
    assert spare and len(spare) < len(graphed) and any(live is None for _, live in seen)
    assert all(live == tokens // 4 * 3 for tokens, live in spare), spare  # rows of T tokens, 3 of 4 real
    assert {tokens for tokens, _ in spare} == ({16} if method == "mtp" else {4})  # K = 3 verify rounds; decode


def test_mtp_graph_drafts_equal_eager_drafts(target, fake_graphs):
    """Every round's catch-up (normed output, logits) and drafts by graph equal the eager
    drafter's from the same state (drafts never change the output, so the token comparison
    above cannot see a wrong chain)."""
    eng = engine(target, "mtp", graphs=True)
    drafter = eng.speculator.drafter
    graphs, propose, observe = drafter.graphs, drafter.propose, drafter.observe
    rounds = []

    def both(seqs, counts, penalties=None):
        drafter.graphs = None
        eager = propose(seqs, counts, penalties)
        drafter.graphs = graphs
        graph = propose(seqs, counts, penalties)
        rounds.append(([d.tokens for d in graph], [d.tokens for d in eager]))
        return graph

    def observe_both(obs):
        drafter.graphs = None
        observe(obs)
        eager = {key: (last.hidden.clone(), last.logits.clone()) for key, last in drafter._last.items()}
        drafter.graphs = graphs
        observe(obs)
        for key, (hidden, logits) in eager.items():
            torch.testing.assert_close(drafter._last[key].hidden, hidden, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(drafter._last[key].logits, logits, atol=1e-5, rtol=1e-5)

    drafter.propose, drafter.observe = both, observe_both
    generate(eng, PROMPTS, [N_TOKENS, 13, 27])
    assert rounds and all(graph == eager for graph, eager in rounds)
    assert {kind for kind, _, _ in graphs.captured} == {"draft", "catch_up"}


def test_mtp_sampled_graph_drafts_equal_eager_drafts(target, fake_graphs):
    """Seeded sampled requests beside a greedy one: every round's drafts and their q by the sampling
    chain graph equal the eager drafter's from the same state and the same generator states (the
    graph's uniforms are the ones eager drafting draws, in its order), and the output is the engine's
    without graphs for the same seeds."""
    lengths = [N_TOKENS, 13, 27]
    want = run_sampled(engine(target, "mtp", graphs=False), lengths)
    eng = engine(target, "mtp", graphs=True)
    drafter = eng.speculator.drafter
    rounds: list = []
    drafter.propose = eager_then_graph(drafter, rounds)
    assert run_sampled(eng, lengths) == want
    assert "sampled" in {kind for kind, _, _ in drafter.graphs.captured}
    assert_same_drafts(rounds)


def test_mtp_sampled_graph_reloads_its_rows_parameters_for_a_new_batch(target, fake_graphs):
    """The sampling chain graph keeps its rows' sampling columns between replays while the batch keeps
    them; a second batch on the same graphs (same bucket, other temperatures / top-k / top-p / min-p
    and a greedy row moved) must load its own: its drafts and q equal eager drafting's again."""
    first = [replace(p, max_tokens=20) for p in SAMPLED]
    second = [replace(SAMPLED[2], temperature=0.5, top_k=3, max_tokens=20),
              replace(SAMPLED[0], top_p=0.5, seed=12, max_tokens=20), replace(SAMPLED[1], max_tokens=20)]
    eager = engine(target, "mtp", graphs=False)
    want = [run_with(eager, first), run_with(eager, second)]
    eng = engine(target, "mtp", graphs=True)
    drafter = eng.speculator.drafter
    rounds: list = []
    drafter.propose = eager_then_graph(drafter, rounds)
    assert [run_with(eng, first), run_with(eng, second)] == want
    assert_same_drafts(rounds)
    assert len([key for key in drafter.graphs.captured if key[0] == "sampled"]) < len(rounds)  # graphs reused


def test_mtp_graphs_take_greedy_penalties_and_leave_biased_rows(target, fake_graphs):
    """Greedy rows draft the raw argmax, penalised or not: the greedy chain graph serves them; a sampled
    row with a logit bias needs it in q, which no graph holds: that batch drafts eagerly. The tokens
    are the engine's without graphs either way."""
    for params, kinds in ((SamplingParams(temperature=0.0, repetition_penalty=1.3), {"draft"}),
                          (SamplingParams(temperature=0.9, logit_bias={5: 2.0}), set())):
        params = [replace(params, seed=5, max_tokens=24, ignore_eos=True)] * 2
        want = run_with(engine(target, "mtp", graphs=False), params)
        eng = engine(target, "mtp", graphs=True)
        assert run_with(eng, params) == want
        assert {kind for kind, _, _ in eng.speculator.drafter.graphs.captured} - {"catch_up"} == kinds


def test_mtp_penalised_graph_drafts_equal_eager_drafts(target, fake_graphs):
    """Sampled rows with repetition / presence / frequency penalties beside a greedy penalised one:
    every round's drafts and q by the penalised chain graph (reading the engine's tables, each draft
    joining the history within the chain) equal eager drafting's over the host histories, and the
    output is the engine's without graphs. At every judge the tables hold each penalised sequence's
    history (the first token recorded by the prefill's sample, each round's kept tokens added from
    the host). Run twice on one engine: the second batch's sequences take the first's slots."""
    params = [SamplingParams(temperature=0.8, top_p=0.9, presence_penalty=1.5, seed=3, max_tokens=N_TOKENS),
              SamplingParams(temperature=0.0, frequency_penalty=1.0, max_tokens=13),
              SamplingParams(temperature=1.1, repetition_penalty=1.4, frequency_penalty=0.5, seed=9, max_tokens=27)]
    params = [replace(p, ignore_eos=True) for p in params]
    want = run_with(engine(target, "mtp", graphs=False), params)
    eng = engine(target, "mtp", graphs=True)
    drafter = eng.speculator.drafter
    rounds: list = []
    drafter.propose = eager_then_graph(drafter, rounds)
    judge, checked = eng.speculator.judge, []

    def checking_judge(seqs, drafts, logits, penalties=None):
        for seq in seqs:
            seen, counts = penalties.rows([seq.cache.slot], Generated.of([0], [[]], penalties.counts.device))
            vocab = counts.shape[1]
            assert torch.equal(counts[0], torch.bincount(torch.tensor(seq.output_ids, dtype=torch.long),
                                                         minlength=vocab).to(torch.int32))
            assert seen[0].nonzero().flatten().tolist() == sorted(set(seq.prompt_ids + seq.output_ids))
            checked.append(len(seq.output_ids))
        return judge(seqs, drafts, logits, penalties)

    eng.speculator.judge = checking_judge
    for _ in range(2):
        assert run_with(eng, params) == want
    assert {kind for kind, _, _ in drafter.graphs.captured} - {"catch_up"} == {"penalised"}
    assert_same_drafts(rounds)
    assert len(checked) > 20 and max(checked) > 30


def test_chain_drafts_reach_the_judge_unread(target, fake_graphs):
    """Sampled, penalised and greedy rows together: the sampling chain's drafts go into the verify
    and through the judge's penalties and rejection sampling still on the device, read once with the
    verdicts of both kinds of rows (one read a round, the verdict's), and the output is the engine's
    without graphs."""
    params = [SamplingParams(temperature=0.8, top_p=0.9, presence_penalty=1.5, seed=3, max_tokens=40),
              SamplingParams(temperature=0.0, frequency_penalty=1.0, max_tokens=13),
              SamplingParams(temperature=1.1, top_k=5, seed=9, max_tokens=27)]
    params = [replace(p, ignore_eos=True) for p in params]
    want = run_with(engine(target, "mtp", graphs=False), params)
    eng = engine(target, "mtp", graphs=True)
    judge, unread, reads = eng.speculator.judge, [], []
    tolist = torch.Tensor.tolist

    def counting_judge(seqs, drafts, *rest):
        unread.append(all(d.pending is not None for d in drafts if d.count))
        calls = []
        torch.Tensor.tolist = lambda t: calls.append(1) or tolist(t)
        try:  # the verdict's read, which the engine waits for after launching the commit and catch-up
            verdict = judge(seqs, drafts, *rest)
            verdict.kept()
            return verdict
        finally:
            torch.Tensor.tolist = tolist
            reads.append(len(calls))

    eng.speculator.judge = counting_judge
    assert run_with(eng, params) == want
    assert len(unread) > 10 and all(unread)
    assert set(reads) == {1}, reads  # greedy and sampled rows, verdicts and drafts: one read a round
    # the penalised chain while the first sequence runs, the plain sampling chain after it ends
    assert {kind for kind, _, _ in eng.speculator.drafter.graphs.captured} - {"catch_up"} == {"penalised", "sampled"}


@pytest.mark.parametrize("chunk", [16, 4096])
def test_prefill_graph_replays_match_eager(target, fake_graphs, monkeypatch, chunk):
    """Prompt chunks padded to their bucket (continuations of a cached prefix too, with a small
    chunk budget): every replay gives the eager engine's tokens, and the padding touches only the
    scratch page and leaves the GDN state alone. (The tiny model's bf16-style experts would limit
    real graphs to 16 rows; the stand-in graphs have no such limit.)"""
    monkeypatch.setattr(prefill_graph, "graph_row_limit", lambda model: None)
    lengths = [12, 9, 20]
    want = generate(engine(target, None, graphs=False), PROMPTS, lengths)
    eng = engine(target, None, graphs=True)
    eng.prefill_graphs = PrefillGraphs(eng.model, eng.cache, 512, None)
    eng.prefill_graphs.capture_all()
    eng.scheduler.max_batched_tokens = chunk
    eng.overlap = True
    chunks = []
    forward = eng.prefill_graphs.forward
    eng.prefill_graphs.forward = lambda batch: chunks.append((int(batch.cache_lens[0]), batch.num_new_tokens)) \
        or forward(batch)
    got = []
    for prompt, n in zip(PROMPTS, lengths):  # one at a time: every prompt chunk is a lone part
        got += generate(eng, [prompt], [n])
    assert got == want
    assert len(chunks) >= len(PROMPTS) and (chunk > 16 or any(start > 0 for start, _ in chunks)), chunks


def test_prefill_graphs_fork_a_prompt_near_its_end(target, fake_graphs, monkeypatch):
    """With the prefix cache, a long prompt's checkpoint one token before its end is taken inside
    its one chunk by the bucket's fork graph: the tokens are the cache-off engine's, and the same
    prompt again starts from that checkpoint (all but its last token cached)."""
    monkeypatch.setattr(prefill_graph, "graph_row_limit", lambda model: None)
    prompt = [3 + i % 50 for i in range(300)]  # >= SPLIT_MIN
    want = generate(engine(target, None, graphs=False), [prompt], [8])
    llm = load(target)
    cache = CacheManager(llm.loaded.config, max_tokens=4096, max_seqs=4, dtype=torch.float32, scratch=True,
                         checkpoints=4)
    eng = LLMEngine(llm.loaded.model, llm.loaded.config, llm.loaded.tokenizer, cache, max_context=512)
    eng.prefill_graphs = PrefillGraphs(eng.model, eng.cache, 512, None)
    assert eng.prefill_graphs.capture_all() == (1 + len(FORK_KINDS)) * len(eng.prefill_graphs.buckets)
    replayed = []
    forward = eng.prefill_graphs.forward
    eng.prefill_graphs.forward = lambda batch: replayed.append(
        (batch.num_new_tokens, None if batch.fork is None else int(batch.fork.tokens[0]))) or forward(batch)
    assert generate(eng, [prompt], [8]) == want
    assert replayed == [(300, 299)]  # one chunk, forked before its last token
    outs = list(eng.generate([GenerationRequest(prompt, greedy(8))]))
    assert [t for o in outs for t in o.new_token_ids] == want[0]
    assert outs[-1].timings.cached_tokens == len(prompt) - 1


@pytest.mark.parametrize("last, kind", [(50, "chunked"), (27, "windows")])
def test_prefill_graphs_fork_a_prompt_anywhere(target, fake_graphs, monkeypatch, last, kind):
    """A checkpoint far from the prompt's end (a chat's last message start, `last` tokens before it)
    is a fork too, with a second checkpoint near the end (a chat's answer start) a second fork in the
    same chunk: 48 tokens apart the bucket's graph that runs the chunked rule twice, 25 apart the one
    whose fused steps run in windows after one chunked run (engine/fork_windows.py). The tokens are
    the cache-off engine's, and prompts that share the part before either fork resume there."""
    monkeypatch.setattr(prefill_graph, "graph_row_limit", lambda model: None)
    shared = [3 + i % 50 for i in range(100)]
    prompt = shared + [60 + i % 7 for i in range(last)]
    second = len(prompt) - 2
    prompts = [prompt, shared + [70 + i % 5 for i in range(20)], prompt[:second] + [9, 9, 9]]
    plain = engine(target, None, graphs=False)
    want = [generate(plain, [p], [8])[0] for p in prompts]
    llm = load(target)
    cache = CacheManager(llm.loaded.config, max_tokens=4096, max_seqs=4, dtype=torch.float32, scratch=True,
                         checkpoints=8)  # room for every checkpoint of the three requests
    eng = LLMEngine(llm.loaded.model, llm.loaded.config, llm.loaded.tokenizer, cache, max_context=512)
    eng.prefill_graphs = PrefillGraphs(eng.model, eng.cache, 512, None)
    eng.prefill_graphs.capture_all()
    replayed = []
    forward = eng.prefill_graphs.forward

    def record(batch):
        fork = batch.fork
        forks = [] if fork is None else [int(f.tokens[0]) for f in (fork, fork.then) if f is not None]
        replayed.append((batch.num_new_tokens, forks, fork_kind(fork)))
        return forward(batch)

    eng.prefill_graphs.forward = record
    got, cached = [], []
    for tokens in prompts:
        outs = list(eng.generate([GenerationRequest(tokens, greedy(8), checkpoints=(100, second))]))
        got.append([t for o in outs for t in o.new_token_ids])
        cached.append(outs[-1].timings.cached_tokens)
    assert got == want
    # one chunk, forked at 100 and near its end; then resumed at 100, at the second fork
    assert replayed == [(len(prompt), [100, second], kind), (20, [], None), (3, [], None)]
    assert cached == [0, 100, second]


def test_a_scored_prompt_runs_beside_graph_replays(target, fake_graphs, monkeypatch):
    """A prompt whose tokens are scored (logits at every row) is read eagerly, with the plain prompt
    read in the same step (a step replays graphs only when all its parts have one), the decodes of
    both by decode graphs: the scores and the tokens are the graph-less engine's."""
    monkeypatch.setattr(prefill_graph, "graph_row_limit", lambda model: None)

    def run(eng: LLMEngine) -> tuple[list, dict]:
        scored = GenerationRequest(PROMPTS[2], greedy(6, prompt_logprobs=2))
        plain = GenerationRequest(PROMPTS[0], greedy(6))
        tokens: dict[str, list[int]] = {scored.request_id: [], plain.request_id: []}
        entries = []
        for out in eng.generate([scored, plain]):
            tokens[out.request_id] += out.new_token_ids
            entries += out.prompt_logprobs or []
        return entries, list(tokens.values())

    want_entries, want_tokens = run(engine(target, None, graphs=False))
    eng = engine(target, None, graphs=True)
    eng.prefill_graphs = PrefillGraphs(eng.model, eng.cache, 512, None)
    eng.prefill_graphs.capture_all()
    replayed = []
    forward = eng.prefill_graphs.forward
    eng.prefill_graphs.forward = lambda batch: replayed.append(batch.num_new_tokens) or forward(batch)
    entries, tokens = run(eng)
    assert tokens == want_tokens and replayed == [] and FakeGraph.replays > 0
    assert len(entries) == len(PROMPTS[2]) - 1
    for got, want in zip(entries, want_entries):
        assert got.token_id == want.token_id and [t for t, _ in got.top] == [t for t, _ in want.top]
        assert got.logprob == pytest.approx(want.logprob, abs=1e-5)

"""The scheduler and the engine loop on a tiny Qwen3.5 MoE model (CPU, fp32): varlen steps (decode
rows + prompt chunks of several sequences in one forward), preemption and recompute, the
overlapped step (next step launched before the last one's tokens are read), per-row failures.

The reference is the same engine running each request alone: greedy tokens (and seeded samples)
must be identical whatever else shares the steps.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ninfer_core.engine.request import GenerationRequest
from ninfer_core.engine.sampling import SamplingParams
from ninfer_core.engine.scheduler import Scheduler, StepPlan
from ninfer_core.llm import LLM, EngineOptions, default_prefill_chunk
from ninfer_core.models.decoder import DecoderModel
from tiny_model_dir import write_tiny_model_dir

torch.set_num_threads(1)
PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11, 12, 13], list(range(20, 61)), list(range(100, 133)), [9] * 20]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_qwen_sched")
    write_tiny_model_dir(directory, moe=True)
    return directory


def make_llm(directory, overlap: bool = False, **overrides) -> LLM:
    options = dict(device="cpu", dtype="float32", max_seqs=4, max_context=256)
    llm = LLM.load(str(directory), EngineOptions(**{**options, **overrides}))
    llm.engine.overlap = overlap
    return llm


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def sampled(n: int, seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_p=0.9, seed=seed, max_tokens=n, ignore_eos=True)


def solo(llm: LLM, prompt: list[int], params: SamplingParams) -> list[int]:
    return [t for out in llm.engine.generate([GenerationRequest(prompt, params)]) for t in out.new_token_ids]


def staggered(llm: LLM, jobs: list[tuple[list[int], SamplingParams]], every: int = 3) -> dict[int, list[int]]:
    """Add job i after i * `every` steps, run all to the end; tokens per job index."""
    engine = llm.engine
    requests = [GenerationRequest(prompt, params) for prompt, params in jobs]
    index = {r.request_id: i for i, r in enumerate(requests)}
    tokens: dict[int, list[int]] = {i: [] for i in range(len(jobs))}
    step = 0
    while requests or engine.has_unfinished():
        while requests and step >= every * (len(jobs) - len(requests)):
            engine.add_request(requests.pop(0))
        for out in engine.step():
            tokens[index[out.request_id]] += out.new_token_ids
        step += 1
    return tokens


@pytest.fixture(scope="module")
def reference(model_dir):
    llm = make_llm(model_dir)
    jobs = [(p, greedy(12)) for p in PROMPTS] + [(PROMPTS[0], sampled(12, 7)), (PROMPTS[2], sampled(12, 8))]
    return jobs, [solo(llm, prompt, params) for prompt, params in jobs]


@pytest.mark.parametrize("overlap", [False, True])
def test_mixed_steps_equal_solo_runs(model_dir, reference, overlap):
    """A small token budget splits prompts into chunks that share steps with other sequences'
    decode rows; several prompts are read in one step."""
    jobs, expected = reference
    llm = make_llm(model_dir, overlap=overlap, prefill_chunk=16)
    plans: list[StepPlan] = []
    schedule = llm.engine.scheduler.schedule
    llm.engine.scheduler.schedule = lambda: plans.append(plan := schedule()) or plan
    out = staggered(llm, jobs, every=2)
    assert [out[i] for i in range(len(jobs))] == expected
    assert any(p.decodes and p.prefills for p in plans), "no step mixed decode rows with a prompt chunk"
    assert any(len(p.prefills) > 1 for p in plans), "no step read two prompts"
    assert llm.engine.cache.active_tokens == 0


def test_burst_starts_together(model_dir):
    """Four prompts submitted at once are all read in the first step (one forward)."""
    llm = make_llm(model_dir)
    for p in PROMPTS[:4]:
        llm.engine.add_request(GenerationRequest(p, greedy(4)))
    forwards = []
    forward = llm.engine.model.forward_parts
    llm.engine.model.forward_parts = lambda parts, cache: forwards.append(len(parts)) or forward(parts, cache)
    outputs = llm.engine.step()
    assert forwards == [4] and len(outputs) == 4 and all(len(o.new_token_ids) == 1 for o in outputs)


def test_prompts_past_the_graphs_are_read_in_graph_pieces(model_dir, reference):
    """A prompt longer than the prompt graphs hold (graph_piece) but at most pieces_up_to tokens
    is read in chunks of graph_piece tokens (graph replays, not an eager forward's host time); a
    longer one in one chunk; the tokens are those of the solo runs."""
    llm = make_llm(model_dir)
    llm.engine.scheduler.graph_piece, llm.engine.scheduler.pieces_up_to = 16, 40
    chunks = []
    forward = llm.engine._forward
    llm.engine._forward = lambda parts: chunks.extend(p.num_new_tokens for p in parts) or forward(parts)
    expected = reference[1]
    assert solo(llm, PROMPTS[2], greedy(12)) == expected[2]  # 41 tokens: past pieces_up_to
    assert chunks[:1] == [41]
    chunks.clear()
    assert solo(llm, PROMPTS[3], greedy(12)) == expected[3]  # 33 tokens
    assert chunks[:3] == [16, 16, 1]
    assert llm.engine.cache.active_tokens == 0


def test_graph_pieces_end_at_one_and_a_half_graphs(model_dir, reference):
    """The pieces' reach scales with the graphs: 2,048-token graphs read prompts up to 3,072 tokens
    in pieces (measured on the H200), 16-token ones (bf16 experts) only up to 24 tokens, so a long
    prompt is not read in hundreds of 16-token steps."""
    llm = make_llm(model_dir)
    old = llm.engine.scheduler
    assert Scheduler(old.cache, 8192, graph_piece=2048).pieces_up_to == 3072
    llm.engine.scheduler = Scheduler(old.cache, old.max_batched_tokens, old.forks, old.fork_tail, graph_piece=16)
    chunks = []
    forward = llm.engine._forward
    llm.engine._forward = lambda parts: chunks.extend(p.num_new_tokens for p in parts) or forward(parts)
    assert solo(llm, PROMPTS[3], greedy(12)) == reference[1][3]  # 33 tokens: past 24, one chunk
    assert chunks[:2] == [33, 1]



@pytest.mark.parametrize("overlap", [False, True])
def test_preemption_recomputes_and_loses_nothing(model_dir, reference, overlap):
    """A KV cache too small for every answer at once: the newest sequence is preempted, read again
    later (prompt + answer so far), and every request still gets exactly its solo tokens."""
    jobs, expected = reference
    llm = make_llm(model_dir, overlap=overlap, kv_capacity=96, prefill_chunk=64)
    out = staggered(llm, jobs, every=1)
    assert [out[i] for i in range(len(jobs))] == expected
    assert llm.engine.stats().preemptions > 0
    assert llm.engine.cache.active_tokens == 0
    assert llm.engine.cache.num_free_slots == llm.engine.cache.max_seqs


def test_forward_parts_equals_forward_per_part(model_dir):
    """The varlen forward (rows of all parts through one set of GEMMs, mixers per part) gives each
    part the logits and hidden states of its own forward."""
    llm = make_llm(model_dir, max_seqs=8)
    engine = llm.engine
    model = engine.model
    assert isinstance(model, DecoderModel)
    for p in PROMPTS[:3]:
        engine.add_request(GenerationRequest(p, greedy(6)))
    for _ in range(3):
        engine.step()
    for p in PROMPTS[3:]:
        engine.add_request(GenerationRequest(p, greedy(6)))
    plan = engine.scheduler.schedule()
    assert plan.decodes and len(plan.prefills) == 2
    parts = [engine._decode_batch(plan.decodes, None)] + [engine._prefill_batch(c) for c in plan.prefills]
    state = engine.cache.cache.state
    pools = [*state.conv.values(), *state.recurrent.values()]
    saved = [t.clone() for t in pools]
    with torch.inference_mode():
        separate = [model.forward(p, engine.cache.cache) for p in parts]
        for t, s in zip(pools, saved):
            t.copy_(s)
        mixed = model.forward_parts(parts, engine.cache.cache)
    for a, b in zip(separate, mixed):
        torch.testing.assert_close(b.hidden_states, a.hidden_states, rtol=1e-5, atol=1e-5)
        if a.logits is not None:
            torch.testing.assert_close(b.logits, a.logits, rtol=1e-5, atol=1e-5)
        else:
            assert b.logits is None


def test_a_bad_row_fails_its_request_alone(model_dir, reference):
    """Non-finite logits in one row end that request with an error; the others continue unchanged."""
    jobs, expected = reference
    llm = make_llm(model_dir)
    engine = llm.engine
    victim = GenerationRequest(PROMPTS[1], greedy(12))
    others = [GenerationRequest(PROMPTS[0], greedy(12)), GenerationRequest(PROMPTS[2], greedy(12))]
    sample = engine._sample

    def poisoned(seqs, logits):
        logits = logits.clone()
        for i, s in enumerate(seqs):
            if s.request_id == victim.request_id and len(s.output_ids) == 3:
                logits[i, 5] = float("nan")
        return sample(seqs, logits)

    engine._sample = poisoned
    outs = list(engine.generate([others[0], victim, others[1]]))
    failed = [o for o in outs if o.request_id == victim.request_id and o.finished]
    assert failed and failed[0].finish_reason == "error" and "NaN" in failed[0].error
    tokens = {r.request_id: [t for o in outs if o.request_id == r.request_id for t in o.new_token_ids] for r in others}
    assert tokens[others[0].request_id] == expected[0] and tokens[others[1].request_id] == expected[2]
    assert engine.cache.active_tokens == 0


def test_overlap_stops_exactly_and_aborts_free_the_cache(model_dir):
    """With steps in flight a stop string still ends the text exactly where the solo run does, and
    an abort while a step is in flight frees the sequence's cache once that step is done."""
    llm = make_llm(model_dir, overlap=True)
    engine = llm.engine
    a = GenerationRequest(PROMPTS[0], greedy(30))
    b = GenerationRequest(PROMPTS[2], greedy(30))
    engine.add_request(a)
    engine.add_request(b)
    for _ in range(4):
        engine.step()
    assert engine._launched is not None
    engine.abort(b.request_id)
    while engine.has_unfinished():
        engine.step()
    assert engine.cache.active_tokens == 0 and not engine.scheduler.running


def test_engine_bench_runs_through_the_loop(model_dir, monkeypatch):
    """`ninfer bench engine`'s measurements on the CPU: one TTFT per length (first, then repeats),
    loop decode per batch with the step-time ratio; the engine is idle and empty afterwards."""
    from ninfer_core import bench_engine
    from ninfer_core.bench import decode_step_bytes, prefill_limit_ms
    from ninfer_core.bench_engine import run_engine_bench

    monkeypatch.setattr(bench_engine, "SPLIT_MIN", 8)  # chat checkpoints from 8 tokens in (the policy's 256)

    llm = make_llm(model_dir, max_seqs=2, overlap=True)
    llm.engine.scheduler.graph_piece, llm.engine.scheduler.pieces_up_to = 32, 0  # as if graphs held 32 tokens
    forwards = []
    forward = llm.engine._forward
    llm.engine._forward = lambda parts: forwards.extend(p.num_new_tokens for p in parts) or forward(parts)
    # the card's limits from given ceilings (the CPU measures none): 2 GB/s, 0.05 TFLOP/s
    report = run_engine_bench(llm, lengths=(8, 40), batches=(1, 2), tokens=6, repeats=2, ceilings=(2e9, 5e10))
    engine = llm.engine
    assert (report.bandwidth_gb_s, report.matmul_tflop_s) == (2.0, 0.05)
    assert [t.limit_ms for t in report.ttft] == [
        prefill_limit_ms(engine.model, engine.config, engine.cache, n, 2e9, 5e10) for n in (8, 40)]
    assert [d.limit_ms for d in report.decode] == [  # the middle token's context: a 32-token prompt + 6 / 2
        1e3 * decode_step_bytes(engine.model, engine.config, engine.cache, b, 35) / 2e9 for b in (1, 2)]
    assert 0 < report.ttft[0].limit_ms < report.ttft[1].limit_ms
    assert 0 < report.decode[0].limit_ms < report.decode[1].limit_ms
    assert [t.tokens for t in report.ttft] == [8, 40]
    assert all(t.first_ms > 0 and t.repeat_ms > 0 for t in report.ttft)
    # past the graph's 32 tokens the 40-token prompt is also read in pieces (32 + 8) and in one chunk
    assert report.ttft[0].pieces_ms is None and report.ttft[1].pieces_ms and report.ttft[1].one_chunk_ms
    assert list(zip(forwards, forwards[1:])).count((32, 8)) == 2 and llm.engine.scheduler.pieces_up_to == 0
    # chat-shaped 40-token prompts (checkpoints 27 and 3 tokens before the end): one forward of 40 with
    # the forks, three (13 + 24 + 3) with the chunk ending at each; the 8-token prompt has none in
    # (from SPLIT_MIN): it is not timed as a chat
    chat, split = report.ttft[1].chat_ms, report.ttft[1].chat_split_ms
    assert chat is not None and chat > 0 and split is not None and split > 0
    assert report.ttft[0].chat_ms is None and report.ttft[0].chat_split_ms is None
    assert forwards.count(40) >= 2 + 2 + 2 + 1 and forwards.count(13) == 2 and forwards.count(24) == 2
    assert forwards.count(3) == 2
    # each length's prompts sent twice: both are under split_min (256), so the bench forced their split;
    # every second send resumed one token before its end (no other prompt repeats a cached prefix)
    prefix = engine.cache.prefix
    assert prefix.split_min == 256 and all(t.resent_ms > 0 and t.short_split_ms > 0 for t in report.ttft)
    assert prefix.hit_tokens == 2 * (7 + 39)
    assert [d.batch for d in report.decode] == [1, 2]
    assert all(d.tpot_ms > 0 and d.step_ms > 0 and d.overhead == pytest.approx(d.tpot_ms / d.step_ms)
               for d in report.decode)
    assert not llm.engine.has_unfinished() and llm.engine.cache.active_tokens == 0


@pytest.mark.cuda
def test_engine_bench_measures_the_cards_limits_on_cuda(model_dir):
    """On CUDA `ninfer bench engine` measures the copy bandwidth and a bf16 GEMM peak and sets each row
    against them: positive limits below the measured times (a limit is a lower bound), the decode one
    the step's bytes at the bandwidth."""
    from ninfer_core.bench import decode_step_bytes
    from ninfer_core.bench_engine import run_engine_bench

    # eager: this tiny model's shapes take torch references, which copy from the host (no graph capture)
    llm = make_llm(model_dir, device="cuda", dtype="bfloat16", max_seqs=2, cuda_graphs=False)
    report = run_engine_bench(llm, lengths=(16,), batches=(1,), tokens=4, repeats=1)
    assert report.bandwidth_gb_s > 50 and report.matmul_tflop_s > 1
    (ttft,), (decode,) = report.ttft, report.decode
    assert 0 < ttft.limit_ms < ttft.repeat_ms and 0 < decode.limit_ms < decode.tpot_ms
    engine = llm.engine
    assert decode.limit_ms == pytest.approx(
        1e3 * decode_step_bytes(engine.model, engine.config, engine.cache, 1, 34) / (report.bandwidth_gb_s * 1e9))


def test_penalty_tables_equal_the_host_reference():
    """Penalties from the device tables (filled from the prompt, then token by token as a step
    would record them) equal apply_penalties over the host histories, bit for bit."""
    from ninfer_core.engine.penalties import PenaltyTables
    from ninfer_core.engine.sampling import TokenHistory, apply_penalties

    gen = torch.Generator().manual_seed(3)
    vocab, rows = 97, 4
    params = [SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25),
              SamplingParams(presence_penalty=-1.0), SamplingParams(repetition_penalty=0.7),
              SamplingParams(frequency_penalty=2.0)]
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (5, 9, 1, 30)]
    outputs = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (0, 3, 12, 7)]
    tables = PenaltyTables(6, vocab, torch.device("cpu"))
    slots = torch.tensor([4, 0, 2, 5])
    for slot, prompt, out in zip(slots.tolist(), prompts, outputs):
        tables.reset(slot, prompt, out[:1])  # the first answer token known at reset, the rest recorded
    for t in range(1, 12):
        tokens = torch.tensor([out[t] if t < len(out) else -1 for out in outputs])
        tables.record(slots, tokens)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    expected = apply_penalties(logits, params, [TokenHistory(p, o) for p, o in zip(prompts, outputs)])
    assert torch.equal(tables.apply(logits, slots, params), expected)


def test_penalty_table_rows_with_drafts_equal_the_host_reference():
    """A verify's rows: each slot's history (filled at reset, then a round's kept tokens added from
    the host) with the drafts before the row counted as generated, bit for bit apply_penalties over
    the host histories; a slot appearing in several rows, tokens repeated in a row's drafts."""
    from ninfer_core.engine.penalties import Generated, PenaltyTables
    from ninfer_core.engine.sampling import TokenHistory, apply_penalties

    gen = torch.Generator().manual_seed(5)
    vocab = 61
    tables = PenaltyTables(4, vocab, torch.device("cpu"))
    prompts = {1: [3, 4, 5, 3], 3: [9]}
    outputs = {1: [7, 7, 2], 3: []}
    for slot in prompts:
        tables.reset(slot, prompts[slot], outputs[slot][:1])
    tables.add([1, 3], [outputs[1][1:], [8, 8]])
    outputs[3] = [8, 8]
    rows = [(1, []), (1, [2]), (1, [2, 9, 2]), (3, []), (3, [8, 60])]
    params = [SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25)] * 3 + [
        SamplingParams(frequency_penalty=2.0), SamplingParams(repetition_penalty=0.7, presence_penalty=-1.0)]
    logits = torch.randn(len(rows), vocab, generator=gen) * 3
    expected = apply_penalties(logits, params, [TokenHistory(prompts[s], outputs[s] + extra) for s, extra in rows])
    got = tables.apply_rows(logits, [s for s, _ in rows], Generated.of(range(len(rows)), [e for _, e in rows], "cpu"),
                            params)
    assert torch.equal(got, expected)


def test_warm_up_runs_a_whole_chunk_then_each_length_alone_then_mixed(model_dir, monkeypatch):
    """The prompts go in as batches run to completion one after another: one of a whole prefill
    chunk (capped by the context), each length alone, then all of them together, then all but the
    longest."""
    llm = make_llm(model_dir, prefill_chunk=100)
    engine = llm.engine
    batches: list[list[int]] = [[]]
    add, generate = engine.add_request, engine.generate

    def recording_add(request):
        batches[-1].append(len(request.prompt_token_ids))
        add(request)

    def recording_generate(requests):
        batches.append([])
        return generate(requests)

    monkeypatch.setattr(engine, "add_request", recording_add)
    monkeypatch.setattr(engine, "generate", recording_generate)
    engine.warm_up((5, 40, 300))
    capped = min(300, engine.max_context - 3)  # prompts leave room for their answers
    assert capped < 300
    assert batches[:-1] == [[100], [5], [40], [capped], [5, 40, capped], [5, 40]]


def test_default_prefill_chunk_follows_the_gpu_memory(monkeypatch):
    """8,192 tokens a forward on GPUs of 48 GiB or more, 4,096 below, 1,024 on the CPU."""
    assert default_prefill_chunk(torch.device("cpu")) == 1024
    for gib, chunk in ((24, 4096), (47, 4096), (48, 8192), (141, 8192)):
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda device, gib=gib: SimpleNamespace(total_memory=gib << 30))
        assert default_prefill_chunk(torch.device("cuda", 0)) == chunk


@pytest.mark.parametrize("spec", [None, "ngram"])
def test_warm_up_leaves_an_idle_engine_with_clean_counters(model_dir, spec):
    llm = make_llm(model_dir, spec=spec)
    llm.engine.warm_up((5, 40))
    stats = llm.engine.stats()
    assert stats.requests_finished == stats.generated_tokens == stats.decode_steps == 0 and not stats.running
    assert stats.kv_used_tokens == 0 and not llm.engine.has_unfinished()
    assert spec is None or stats.spec.rounds == 0
    assert stats.prefix_hit_tokens == stats.prefix_queried_tokens == stats.prefix_checkpoints == 0
    assert llm.engine.cache.free_pages == llm.engine.cache.num_pages
    a = GenerationRequest(PROMPTS[0], greedy(8))
    assert [t for o in llm.engine.generate([a]) for t in o.new_token_ids] == solo(make_llm(model_dir), PROMPTS[0],
                                                                                   greedy(8))

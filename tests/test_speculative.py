"""Speculative decoding in the engine (CPU, fp32, tiny random Qwen3.5 MoE): lossless and visible.

Reference: the same engine without a drafter (plain greedy decode), itself checked against
transformers in test_engine.py. Every backend must give token-identical greedy output over long
generations that cross many rejections, at batch 1 and in mixed batches (one request opts out).
The scripted drafter (true continuation, randomly corrupted) makes every acceptance length
0..K occur, so the rollback of KV and GDN state is exercised at each length.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch

from ninfer_core.engine.request import GenerationRequest
from ninfer_core.engine.sampling import Sampler, SamplingParams
from ninfer_core.engine.speculative import Draft, Speculator
from ninfer_core.engine.speculative.base import place_pending, read_with
from ninfer_core.errors import NinferError
from ninfer_core.llm import ChatRequest
from ninfer_core.server.openai_chat import chat_usage
from speculative_harness import PROMPTS, ScriptedDrafter, greedy, load, probes_only, run, write_drafter, write_target

torch.set_num_threads(1)
N_TOKENS = 120


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_target(tmp_path_factory)[0]


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, target):
    return write_drafter(tmp_path_factory, target)[0]


@pytest.fixture(scope="module")
def plain(target) -> list[list[int]]:
    """Plain greedy tokens of each prompt (N_TOKENS each)."""
    llm = load(target)
    return [next(iter(run(llm, [GenerationRequest(p, greedy(N_TOKENS))]).values())) for p in PROMPTS]


BACKENDS = {
    "ngram": dict(spec="ngram", draft_tokens=6),
    "mtp": dict(spec="mtp", draft_tokens=3),
    "dflash": dict(spec="dflash", draft_tokens=7),
}


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_greedy_identical_to_plain_decode_batched_with_an_opted_out_request(backend, target, drafter_dir, plain):
    options = dict(BACKENDS[backend], draft_model=drafter_dir if backend == "dflash" else None)
    llm = load(target, **options)
    requests = [GenerationRequest(p, greedy(N_TOKENS)) for p in PROMPTS]
    requests[1].draft_tokens = 0  # this one decodes plainly inside the speculative batches
    judge, unread = llm.engine.speculator.judge, []
    llm.engine.speculator.judge = lambda seqs, drafts, *rest: unread.append(
        [d.pending is not None for d in drafts if d.count]) or judge(seqs, drafts, *rest)
    out = run(llm, requests)
    assert list(out.values()) == plain
    # DFlash's greedy block reaches the judge on the device (read with its verdict: one sync a round)
    assert all(all(u) == (backend == "dflash") for u in unread if u), unread
    spec = llm.stats().spec
    assert spec is not None and spec.rejected > 10, spec  # rejections all along the way
    if backend == "ngram":
        assert spec.accepted > 0, spec
    assert llm.stats().max_decode_batch == 3 and llm.stats().running == 0 and llm.stats().kv_used_tokens == 0


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_greedy_identical_at_batch_one(backend, target, drafter_dir, plain):
    options = dict(BACKENDS[backend], draft_model=drafter_dir if backend == "dflash" else None)
    llm = load(target, **options, prefill_chunk=16)  # the 41-token prompt is observed in 3 chunks
    out = run(llm, [GenerationRequest(PROMPTS[2], greedy(N_TOKENS))])
    assert list(out.values()) == [plain[2]]


def scripted(llm, plain_tokens: dict[str, list[int]], k: int) -> ScriptedDrafter:
    drafter = ScriptedDrafter(plain_tokens, llm.loaded.config.vocab_size)
    llm.engine.speculator = Speculator(drafter, k, Sampler())
    return drafter


def test_rollback_at_every_acceptance_length(target, plain):
    """Mixed K per request (7, 3, 0); accepted counts 0..7 all occur; output equals plain decode."""
    llm = load(target)
    requests = [GenerationRequest(p, greedy(N_TOKENS)) for p in PROMPTS]
    for request, k in zip(requests, (7, 3, 0)):
        request.draft_tokens = k
    scripted(llm, {r.request_id: toks for r, toks in zip(requests, plain)}, k=7)
    accepted: Counter[int] = Counter()
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for out in llm.engine.generate(requests):
        tokens[out.request_id] += out.new_token_ids
        if out.drafted == 7:
            accepted[out.accepted] += 1
    assert list(tokens.values()) == plain
    assert set(accepted) == set(range(8)), accepted


def test_greedy_with_penalties_identical_to_plain_decode(target):
    """Greedy requests with repetition / presence / frequency penalties, drafts that are the plain
    continuation (corrupted at every acceptance length): each verify row is penalised by the
    engine's tables with the drafts before it counted, so the tokens are plain decode's (whose
    penalties come from the same tables, one sampled token at a time)."""
    penalties = [dict(repetition_penalty=1.3), dict(presence_penalty=0.8, frequency_penalty=0.4),
                 dict(repetition_penalty=0.9, frequency_penalty=1.5)]

    def requests() -> list[GenerationRequest]:
        return [GenerationRequest(p, SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True, **kw))
                for p, kw in zip(PROMPTS, penalties)]

    plain_requests = requests()
    want = run(load(target), plain_requests)
    assert [want[r.request_id] for r in plain_requests] != [next(iter(run(load(target), [GenerationRequest(
        r.prompt_token_ids, greedy(N_TOKENS))]).values())) for r in plain_requests]  # the penalties matter
    llm = load(target)
    spec_requests = requests()
    scripted(llm, {s.request_id: want[p.request_id] for s, p in zip(spec_requests, plain_requests)}, k=4)
    out = run(llm, spec_requests)
    assert [out[r.request_id] for r in spec_requests] == [want[r.request_id] for r in plain_requests]
    spec = llm.engine.speculator.totals
    assert spec.accepted > 50 and spec.rejected > 10, spec


def test_stops_inside_an_accepted_run(target, plain):
    """A stop token, stop string or max_tokens met among accepted drafts ends the output exactly as
    plain decode does: the rest of the round's tokens are dropped."""
    llm, base = load(target), load(target)
    decode = base.tokenizer.decode
    stop_text = decode(plain[0][:41], skip_special_tokens=True)[len(decode(plain[0][:39], skip_special_tokens=True)):]
    dropped = []
    for params in (greedy(N_TOKENS, stop_token_ids=[plain[0][40]]), greedy(N_TOKENS, stop=[stop_text]), greedy(37)):
        expected = list(base.engine.generate([GenerationRequest(PROMPTS[0], params)]))
        request = GenerationRequest(PROMPTS[0], params)
        scripted(llm, {request.request_id: plain[0]}, k=6)
        outs = list(llm.engine.generate([request]))
        assert sum((o.new_token_ids for o in outs), []) == sum((o.new_token_ids for o in expected), [])
        assert "".join(o.text_delta for o in outs) == "".join(o.text_delta for o in expected)
        assert (outs[-1].finish_reason, outs[-1].stop_reason) == (expected[-1].finish_reason, expected[-1].stop_reason)
        dropped.append(outs[-1].accepted + 1 - len(outs[-1].new_token_ids))
    assert dropped[0] > 0 and dropped[1] > 0, dropped  # the stops fell inside accepted runs
    assert dropped[2] == 0  # max_tokens caps K instead: nothing is drafted past the limit


def test_seeded_sampling_reproducible_with_drafts(target):
    llm = load(target, spec="ngram")
    params = dict(temperature=0.9, top_k=20, seed=5, max_tokens=40, ignore_eos=True)
    a, b = (GenerationRequest(PROMPTS[0], SamplingParams(**params)) for _ in range(2))
    c = GenerationRequest(PROMPTS[0], SamplingParams(**{**params, "seed": 6}))
    out = run(llm, [a, b, c])
    assert out[a.request_id] == out[b.request_id] != out[c.request_id]


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_non_finite_verify_logits_fail_that_request_alone(kind, target, plain):
    """A verify whose first row of logits for one sequence holds NaN (its third round) ends that
    request with an error and no token from the round, as a plain step's NaN row does; the other request's tokens
    are plain decode's. The judge reads no device value to find it (the sampled path used to raise
    for the whole batch after a host sync)."""
    llm = load(target, spec="mtp", draft_tokens=3)
    params = greedy(N_TOKENS) if kind == "greedy" else SamplingParams(temperature=0.8, top_k=20, seed=3,
                                                                      max_tokens=N_TOKENS, ignore_eos=True)
    bad, good = GenerationRequest(PROMPTS[0], params), GenerationRequest(PROMPTS[1], greedy(N_TOKENS))
    rounds = Counter()
    ban_ends = llm.engine._ban_ends

    def poison(seqs, logits):
        logits = ban_ends(seqs, logits)
        for b, seq in enumerate(seqs):
            if seq.request_id == bad.request_id:
                rounds[b] += 1
                if sum(rounds.values()) == 3:
                    logits = logits.clone()
                    logits[b, 0] = float("nan")
        return logits

    llm.engine._ban_ends = poison
    outputs = list(llm.engine.generate([bad, good]))
    ends = {o.request_id: o for o in outputs if o.finished}
    assert ends[bad.request_id].finish_reason == "error" and "NaN or infinite" in ends[bad.request_id].error
    assert ends[good.request_id].finish_reason == "length"
    assert [t for o in outputs if o.request_id == good.request_id for t in o.new_token_ids] == plain[1]
    assert all(t >= 0 for o in outputs for t in o.new_token_ids)
    assert llm.stats().running == 0 and llm.stats().kv_used_tokens == 0


def test_drafts_on_the_device_are_read_once_with_the_judges_tokens():
    """A draft handed over on the device is counted without a read, goes into a verify batch's ids
    unread, and `read_with` returns the judge's values and fills every pending draft in one copy;
    `tokens` reads a draft on its own where nothing did."""
    pending = [Draft(pending=torch.tensor([5, 6, 7])), Draft([9]), Draft(pending=torch.tensor([], dtype=torch.long)),
               Draft(pending=torch.tensor([3]))]
    assert [d.count for d in pending] == [3, 1, 0, 1]
    ids = torch.full((4, 4), -1)
    place_pending(ids, pending)
    assert ids.tolist() == [[-1, 5, 6, 7], [-1] * 4, [-1] * 4, [-1, 3, -1, -1]]
    copies = []
    tolist = torch.Tensor.tolist
    try:
        torch.Tensor.tolist = lambda t: copies.append(t.numel()) or tolist(t)
        assert read_with(pending[:3], torch.tensor([1, 2])) == [1, 2]
        assert copies == [5]  # the two values and the three pending tokens
        assert [d.tokens for d in pending[:3]] == [[5, 6, 7], [9], []] and len(copies) == 1
        assert pending[3].tokens == [3] and len(copies) == 2
    finally:
        torch.Tensor.tolist = tolist


def test_rounds_without_drafts_are_plain_decode_steps(target, plain):
    """A round where no sequence drafts (n-gram finds no match) runs the plain decode forward (its
    CUDA graph on a GPU) instead of a width-1 verify + commit; output still equals plain decode."""
    llm = load(target, spec="ngram", draft_tokens=4)
    forwards = []
    forward = llm.engine._forward
    llm.engine._forward = lambda parts: forwards.extend((b.num_new_tokens, b.verify) for b in parts) or forward(parts)
    assert next(iter(run(llm, [GenerationRequest(PROMPTS[0], greedy(N_TOKENS))]).values())) == plain[0]
    decode = [f for f in forwards if f[0] <= 5]
    assert (1, False) in decode and any(verify for _, verify in decode)
    assert (1, True) not in decode


@pytest.mark.parametrize("opted_out", ["draft_tokens", "min_tokens"])
def test_a_drafting_request_arrives_while_plain_steps_overlap(opted_out, target, plain):
    """With steps overlapped (as on a GPU), sequences that never draft (a request's draft_tokens 0;
    one with min_tokens or a grammar, whose rows are masked) run plain steps launched before the
    last one's tokens are read; a drafting request that arrives meanwhile needs those tokens on the
    host before its first speculative step (it crashed the engine's loop: `assert self._launched is
    None`). Both answers stay plain decode's."""
    llm = load(target, spec="mtp", draft_tokens=3)
    eng = llm.engine
    eng.overlap = True
    first = GenerationRequest(PROMPTS[0], greedy(N_TOKENS, min_tokens=2) if opted_out == "min_tokens"
                              else greedy(N_TOKENS))
    if opted_out == "draft_tokens":
        first.draft_tokens = 0
    second = GenerationRequest(PROMPTS[1], greedy(N_TOKENS))
    tokens: dict[str, list[int]] = {first.request_id: [], second.request_id: []}
    eng.add_request(first)
    steps = 0
    while eng.has_unfinished():
        for out in eng.step():
            tokens[out.request_id] += out.new_token_ids
        steps += 1
        if steps == 5:
            assert eng._launched is not None  # the plain steps do overlap
            eng.add_request(second)
    assert list(tokens.values()) == plain[:2]
    spec = llm.stats().spec
    assert spec is not None and spec.rounds > 0


def test_plain_steps_overlap_while_a_drafting_request_waits_for_a_slot(target, plain):
    """Every slot held by sequences that never draft (draft_tokens 0), a drafting request waits:
    their steps stay overlapped meanwhile (it cannot be admitted before one of them ends), and when
    a slot frees, its prompt's speculative step follows the read of the step in flight. The answers
    are plain decode's, and the drafting request drafts."""
    llm = load(target, spec="mtp", draft_tokens=3, max_seqs=2)
    eng = llm.engine
    eng.overlap = True
    opted_out = [GenerationRequest(p, greedy(N_TOKENS)) for p in PROMPTS[:2]]
    for request in opted_out:
        request.draft_tokens = 0
    drafting = GenerationRequest(PROMPTS[2], greedy(N_TOKENS))
    overlapped, launch = [], eng._launch_sampling
    eng._launch_sampling = lambda *args: overlapped.append(
        eng._launched is not None and bool(eng.scheduler.waiting)) or launch(*args)
    tokens = {r.request_id: [] for r in [*opted_out, drafting]}
    for out in eng.generate([*opted_out, drafting]):
        tokens[out.request_id] += out.new_token_ids
    assert list(tokens.values()) == plain
    assert sum(overlapped) > N_TOKENS // 2  # launched with one in flight while the request waited
    assert llm.stats().spec.drafted > 0


def test_metrics_per_request_and_aggregate(target):
    llm = load(target, spec="ngram", draft_tokens=5)
    result = llm.chat_result(ChatRequest(messages=[{"role": "user", "content": "hi hi hi hi"}],
                                         sampling=greedy(60)))
    spec = result.to_json()["spec"]
    assert spec["method"] == "ngram" and spec["draft_tokens"] == 5
    assert spec["drafted"] == spec["accepted"] + spec["rejected"] > 0
    # the first token comes from prefill; each round emits its accepted drafts plus one
    assert spec["rounds"] + spec["accepted"] == 59
    assert spec["tokens_per_round"] == pytest.approx(59 / spec["rounds"])
    assert spec["acceptance_rate"] == pytest.approx(spec["accepted"] / spec["drafted"])
    totals = llm.stats().spec
    assert (totals.drafted, totals.accepted, totals.rounds) == (spec["drafted"], spec["accepted"], spec["rounds"])
    usage = chat_usage([result])["completion_tokens_details"]
    assert (usage["accepted_prediction_tokens"], usage["rejected_prediction_tokens"]) == (
        spec["accepted"], spec["rejected"])
    plain = load(target).chat_result(ChatRequest(messages=[{"role": "user", "content": "hi"}], sampling=greedy(3)))
    assert plain.to_json()["spec"] is None


def test_bad_options_are_refused(target, tmp_path, drafter_dir):
    with pytest.raises(NinferError, match="unknown speculative method"):
        load(target, spec="eagle")
    with pytest.raises(NinferError, match="out of range for mtp"):
        load(target, spec="mtp", draft_tokens=6)
    with pytest.raises(NinferError, match="out of range for dflash"):
        load(target, spec="dflash", draft_model=drafter_dir, draft_tokens=8)  # block 8: at most 7
    with pytest.raises(NinferError, match="needs --draft-model"):
        load(target, spec="dflash")
    with pytest.raises(NinferError, match="need --spec"):
        load(target, draft_tokens=3)
    with pytest.raises(NinferError, match="not found"):
        load(target, spec="dflash", draft_model=tmp_path)
    llm = load(target, spec="ngram")
    with pytest.raises(NinferError, match="draft_tokens 16 is out of range"):
        llm.engine.add_request(GenerationRequest(PROMPTS[0], greedy(4), draft_tokens=16))


@pytest.mark.cuda
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_greedy_identical_on_cuda(backend, target, drafter_dir):
    """The same losslessness on the GPU: speculative greedy = plain greedy, both on CUDA in fp32."""
    options = dict(BACKENDS[backend], draft_model=drafter_dir if backend == "dflash" else None)
    plain_cuda = list(run(load(target, device="cuda"), [GenerationRequest(p, greedy(N_TOKENS)) for p in PROMPTS]).values())
    llm = load(target, device="cuda", **options)
    assert list(run(llm, [GenerationRequest(p, greedy(N_TOKENS)) for p in PROMPTS]).values()) == plain_cuda
    assert llm.stats().spec.rejected > 10


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["mtp", "ngram"])
def test_adaptive_rounds_without_drafts_on_cuda(backend, target):
    """The adaptive policy's rounds without drafts are plain decode steps on the GPU (graphs, steps
    overlapped), the drafter catching up from their tokens on the device between its probes:
    speculative greedy = plain greedy, some drafts made and kept."""
    requests = lambda: [GenerationRequest(p, greedy(N_TOKENS)) for p in PROMPTS]  # noqa: E731
    plain_cuda = list(run(load(target, device="cuda"), requests()).values())
    llm = load(target, device="cuda", **BACKENDS[backend])
    assert llm.engine.overlap
    llm.engine.speculator.adaptive = probes_only()
    overlapped, launch = [], llm.engine._launch_sampling
    llm.engine._launch_sampling = lambda *args: overlapped.append(llm.engine._launched is not None) or launch(*args)
    assert list(run(llm, requests()).values()) == plain_cuda
    spec = llm.stats().spec
    assert sum(overlapped) > 5 and spec.drafted > 0 and spec.rounds >= N_TOKENS, spec


@pytest.mark.parametrize("backend", ["mtp", "ngram"])
def test_device_verdict_is_the_verdict_read(backend, target):
    """A round's verdict on the device (kept counts, the tokens following each row), from which the
    GDN commit and the drafter's catch-up run before the host reads it, is the verdict the host reads:
    greedy and sampled sequences in one batch, with different draft counts (one asks for 1 draft),
    so both groups and the gathers of unequal rows are taken."""
    from speculative_harness import SAMPLED

    llm = load(target, **BACKENDS[backend])
    judge, rounds = llm.engine.speculator.judge, []

    def checking(seqs, drafts, *rest):
        verdict = judge(seqs, drafts, *rest)
        device = (verdict.counts.tolist(), verdict.following.tolist())
        rounds.append(([d.count for d in drafts], *device, verdict.kept()))
        return verdict

    llm.engine.speculator.judge = checking
    params = [greedy(40), *[replace(s, max_tokens=40) for s in SAMPLED]]
    requests = [GenerationRequest(p, s) for p, s in zip(PROMPTS, params)]
    requests[0].draft_tokens = 1
    run(llm, requests)
    assert len(rounds) > 10
    mixed = 0
    for drafted, counts, following, kept in rounds:
        assert counts == [len(k) for k in kept]
        assert [f[: len(k)] for f, k in zip(following, kept)] == [[max(t, 0) for t in k] for k in kept]
        mixed += len(set(drafted)) > 1
    assert mixed > 5

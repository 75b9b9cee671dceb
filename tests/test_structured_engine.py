"""Constrained rows (grammars, min_tokens) and logprobs inside the engine loop: with overlapped steps
(constrained rows keep them: their masks follow the previous step's tokens; every row gets the
tokens of steps run one at a time), and with speculative decoding
(constrained rows never draft and are masked in the verify; logprobs of accepted drafts equal those
of plain decoding)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from ninfer_core.chat.constraints import JsonOutput
from ninfer_core.engine.request import GenerationRequest
from ninfer_core.engine.sampling import Sampler, SamplingParamError, SamplingParams
from ninfer_core.engine.speculative import Speculator
from speculative_harness import PROMPTS, ScriptedDrafter, greedy, load, run, write_target

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tag": {"enum": ["x", "y"]}}, "required": ["n", "tag"]}
N = 10


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_target(tmp_path_factory)[0]


def constrained(llm, seed: int) -> GenerationRequest:
    grammar = llm.compile_constraint(JsonOutput(SCHEMA), reasoning=False)
    return GenerationRequest(PROMPTS[0], SamplingParams(temperature=1.0, seed=seed, max_tokens=200), grammar=grammar)


def assert_valid(llm, tokens: list[int]) -> None:
    assert tokens[-1] in llm.engine.eos_ids
    jsonschema.validate(json.loads(llm.tokenizer.decode(tokens[:-1])), SCHEMA)


def test_constrained_rows_keep_overlapped_steps(target):
    def generate(overlap: bool) -> tuple[list[list[int]], int]:
        """Tokens of a free and a constrained request decoded together, and the steps that
        returned with the next one in flight while the constrained one ran."""
        llm = load(target)
        llm.engine.overlap = overlap  # the GPU's overlapped steps, on the CPU
        free = GenerationRequest(PROMPTS[1], greedy(N))
        llm.engine.add_request(free)
        first = llm.engine.step()
        request = constrained(llm, seed=1)
        llm.engine.add_request(request)
        tokens: dict[str, list[int]] = {free.request_id: [t for out in first for t in out.new_token_ids],
                                        request.request_id: []}
        overlapped, done = 0, False
        while llm.engine.has_unfinished():
            for out in llm.engine.step():
                tokens[out.request_id] += out.new_token_ids
                done = done or (out.request_id == request.request_id and out.finished)
            overlapped += not done and llm.engine._launched is not None
        assert_valid(llm, tokens[request.request_id])
        return list(tokens.values()), overlapped

    plain = run(load(target), [GenerationRequest(PROMPTS[1], greedy(N))])
    serial, none = generate(overlap=False)
    overlapped, count = generate(overlap=True)
    assert none == 0 and count > N
    assert overlapped == serial and overlapped[0] == list(plain.values())[0]


def test_speculation_skips_constrained_rows_and_keeps_logprobs(target):
    plain_llm = load(target)
    asking = GenerationRequest(PROMPTS[2], greedy(N, logprobs=4))
    plain_logprobs = [lp for out in plain_llm.engine.generate([asking]) for lp in out.logprobs or []]
    llm = load(target)
    asking = GenerationRequest(PROMPTS[2], greedy(N, logprobs=4), draft_tokens=3)
    drafter = ScriptedDrafter({asking.request_id: [lp.token_id for lp in plain_logprobs]}, llm.loaded.config.vocab_size)
    llm.engine.speculator = Speculator(drafter, 3, Sampler())
    forced = [constrained(llm, seed) for seed in (2, 3)]
    logprobs, tokens, drafted = [], {r.request_id: [] for r in forced}, 0
    for out in llm.engine.generate([asking, *forced]):
        if out.request_id == asking.request_id:
            logprobs += out.logprobs or []
            drafted += out.drafted
        else:
            tokens[out.request_id] += out.new_token_ids
            assert out.drafted == 0
    assert drafted > 0 and len(logprobs) == len(plain_logprobs) == N
    for spec, plain in zip(logprobs, plain_logprobs):
        assert spec.token_id == plain.token_id and spec.logprob == pytest.approx(plain.logprob, abs=1e-5)
        assert [t for t, _ in spec.top] == [t for t, _ in plain.top]
    for ids in tokens.values():
        assert_valid(llm, ids)


def test_min_tokens_hold_back_the_end_of_the_answer(target):
    """An answer pushed to end at once (the end-of-answer id biased +100) runs min_tokens tokens first:
    those are the greedy tokens with that id banned, then it ends; with overlapped steps, beside a
    drafting request (min_tokens rows never draft), and with the stop ids banned too."""
    llm = load(target)
    eos = sorted(llm.engine.eos_ids)[0]
    banned = greedy(5, logit_bias={eos: -100.0})
    expected = [t for out in llm.engine.generate([GenerationRequest(PROMPTS[0], banned)]) for t in out.new_token_ids]
    assert eos not in expected
    for overlap in (False, True):
        llm.engine.overlap = overlap
        pushed = SamplingParams(temperature=0, max_tokens=20, min_tokens=5, logit_bias={eos: 100.0})
        outs = list(llm.engine.generate([GenerationRequest(PROMPTS[0], pushed)]))
        tokens = [t for out in outs for t in out.new_token_ids]
        assert tokens == expected + [eos] and outs[-1].finish_reason == "stop"
    drafting = GenerationRequest(PROMPTS[1], greedy(12), draft_tokens=3)  # its steps are speculative ones
    script = [t for out in load(target).engine.generate([GenerationRequest(PROMPTS[1], greedy(12))])
              for t in out.new_token_ids]
    llm.engine.speculator = Speculator(ScriptedDrafter({drafting.request_id: script}, llm.loaded.config.vocab_size),
                                       3, Sampler())
    pushed = GenerationRequest(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, min_tokens=5,
                                                          logit_bias={eos: 100.0}))
    outs = list(llm.engine.generate([drafting, pushed]))
    assert [t for o in outs if o.request_id == pushed.request_id for t in o.new_token_ids] == expected + [eos]
    assert any(o.drafted for o in outs) and not any(o.drafted for o in outs if o.request_id == pushed.request_id)
    llm.engine.speculator = None
    stop_id = expected[0]  # a stop id that the greedy answer would write first
    held = SamplingParams(temperature=0, max_tokens=3, min_tokens=3, stop_token_ids=[stop_id], logit_bias={eos: -100.0})
    tokens = [t for out in llm.engine.generate([GenerationRequest(PROMPTS[0], held)]) for t in out.new_token_ids]
    assert len(tokens) == 3 and stop_id not in tokens
    with pytest.raises(SamplingParamError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)

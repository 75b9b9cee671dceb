"""Constrained rows and logprobs inside the engine loop: with overlapped steps (a constrained row
turns overlap off while it runs; free rows keep their tokens), and with speculative decoding
(constrained rows never draft and are masked in the verify; logprobs of accepted drafts equal those
of plain decoding)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from ninfer_core.chat.constraints import JsonOutput
from ninfer_core.engine.request import GenerationRequest
from ninfer_core.engine.sampling import Sampler, SamplingParams
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


def test_constrained_rows_turn_overlap_off_and_free_rows_keep_their_tokens(target):
    plain = run(load(target), [GenerationRequest(PROMPTS[1], greedy(N))])
    llm = load(target)
    llm.engine.overlap = True  # the GPU's overlapped steps, on the CPU
    free = GenerationRequest(PROMPTS[1], greedy(N))
    llm.engine.add_request(free)
    llm.engine.step()
    assert llm.engine._may_overlap()
    request = constrained(llm, seed=1)
    llm.engine.add_request(request)
    tokens: dict[str, list[int]] = {free.request_id: [], request.request_id: []}
    for out in llm.engine.generate([]):
        tokens[out.request_id] += out.new_token_ids
        if not out.finished and out.request_id == request.request_id:
            assert not llm.engine._may_overlap()
    assert [tokens[free.request_id]] == list(plain.values())
    assert_valid(llm, tokens[request.request_id])


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

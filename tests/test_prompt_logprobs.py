"""The logprobs of a prompt's own tokens (SamplingParams.prompt_logprobs) inside the engine, against
transformers' log-softmax of the whole prompt (tiny random Qwen3.5 MoE, CPU, float32): read in one
chunk or many, beside other requests, after the same prompt was cached, and in a speculative step."""

from __future__ import annotations

import pytest
import torch

from ninfer_core.engine.prompt_logprobs import scored_chunk
from ninfer_core.engine.request import GenerationRequest
from ninfer_core.engine.sampling import Sampler, SamplingParamError, SamplingParams
from ninfer_core.engine.speculative import Speculator
from speculative_harness import PROMPTS, ScriptedDrafter, greedy, load, write_target

PROMPT = list(range(20, 61))  # 41 tokens: several chunks of 8
TOP = 3


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_target(tmp_path_factory)


def reference(hf, prompt: list[int]) -> list[tuple[float, list[int], list[float]]]:
    """(logprob of token i, top ids, top logprobs) for prompt tokens 1.., from one transformers forward."""
    with torch.no_grad():
        scores = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, :-1].double(), dim=-1)
    top = torch.topk(scores, TOP, dim=-1)
    return [(scores[i, t].item(), top.indices[i].tolist(), top.values[i].tolist()) for i, t in enumerate(prompt[1:])]


def scored(llm, requests: list[GenerationRequest], asking: GenerationRequest) -> tuple[list, list]:
    """The asking request's prompt logprobs and the outputs that carried any."""
    carriers = [out for out in llm.engine.generate(requests) if out.prompt_logprobs is not None]
    mine = [out for out in carriers if out.request_id == asking.request_id]
    assert len(mine) == 1 and mine[0].new_token_ids, "handed out once, with the first token"
    return mine[0].prompt_logprobs, carriers


def assert_matches(entries, expected, prompt: list[int]) -> None:
    assert [e.token_id for e in entries] == prompt[1:]
    for entry, (logprob, ids, values) in zip(entries, expected):
        assert entry.logprob == pytest.approx(logprob, abs=1e-4)
        assert [t for t, _ in entry.top] == ids
        assert [v for _, v in entry.top] == pytest.approx(values, abs=1e-4)


@pytest.mark.parametrize("chunk", [0, 8])
def test_prompt_logprobs_match_transformers_in_one_chunk_or_many(target, chunk):
    llm = load(target[0])
    if chunk:
        llm.engine.scheduler.scored_chunk = chunk  # 41 tokens in chunks of 8: every row boundary crossed
    asking = GenerationRequest(PROMPT, greedy(4, prompt_logprobs=TOP))
    entries, _ = scored(llm, [asking], asking)
    assert_matches(entries, reference(target[1], PROMPT), PROMPT)


def test_scored_prompts_beside_others_and_after_the_prompt_was_cached(target):
    """The same prompt read before without scores is in the prefix cache: a scored request still
    reads all of it (cached_tokens 0), beside a plain request that does hit the cache; only the
    asking request carries prompt logprobs."""
    llm = load(target[0])
    list(llm.engine.generate([GenerationRequest(PROMPT, greedy(2))]))  # its state at the end is kept
    longer = PROMPT + [5, 6]  # continues the cached prompt: a plain request starts at token 41
    asking = GenerationRequest(longer, greedy(3, prompt_logprobs=TOP))
    plain = GenerationRequest(longer, greedy(3))
    other = GenerationRequest(PROMPTS[0], greedy(3, prompt_logprobs=0))
    outs = list(llm.engine.generate([asking, plain, other]))
    by_id = {r.request_id: [o for o in outs if o.request_id == r.request_id] for r in (asking, plain, other)}
    first = [o for o in by_id[asking.request_id] if o.prompt_logprobs is not None]
    assert len(first) == 1
    assert_matches(first[0].prompt_logprobs, reference(target[1], longer), longer)
    assert by_id[asking.request_id][-1].timings.cached_tokens == 0
    assert by_id[plain.request_id][-1].timings.cached_tokens > 0
    assert all(o.prompt_logprobs is None for o in by_id[plain.request_id])
    (small,) = [o.prompt_logprobs for o in by_id[other.request_id] if o.prompt_logprobs is not None]
    assert [e.token_id for e in small] == PROMPTS[0][1:] and all(e.top == () for e in small)
    expected = reference(target[1], PROMPTS[0])
    assert [e.logprob for e in small] == pytest.approx([x[0] for x in expected], abs=1e-4)


def test_prompt_logprobs_in_a_speculative_step(target):
    """A scored prompt read while another request drafts (the speculative step's prefill path)."""
    llm = load(target[0])
    drafting = GenerationRequest(PROMPTS[1], greedy(12), draft_tokens=3)
    tokens = [t for out in load(target[0]).engine.generate([GenerationRequest(PROMPTS[1], greedy(12))])
              for t in out.new_token_ids]
    llm.engine.speculator = Speculator(ScriptedDrafter({drafting.request_id: tokens}, llm.loaded.config.vocab_size),
                                       3, Sampler())
    llm.engine.scheduler.scored_chunk = 8  # six chunks, read while the other request drafts
    asking = GenerationRequest(PROMPT, greedy(3, prompt_logprobs=TOP), draft_tokens=0)
    outs = list(llm.engine.generate([drafting, asking]))
    first = next(i for i, o in enumerate(outs) if o.request_id == asking.request_id)
    assert any(o.drafted for o in outs[:first]), "the scored prompt was read in speculative steps"
    assert_matches(outs[first].prompt_logprobs, reference(target[1], PROMPT), PROMPT)
    assert [t for o in outs if o.request_id == drafting.request_id for t in o.new_token_ids] == tokens


def test_scored_chunk_sizes_and_bad_counts_are_refused():
    assert scored_chunk(248_320) == 270 and scored_chunk(10**9) == 16
    with pytest.raises(SamplingParamError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


def test_a_one_token_prompt_has_no_prompt_logprobs(target):
    llm = load(target[0])
    asking = GenerationRequest([7], greedy(2, prompt_logprobs=1))
    entries, _ = scored(llm, [asking], asking)
    assert entries == []



@pytest.mark.cuda
def test_prompt_logprobs_on_cuda_match_transformers(target):
    """On the GPU (fp32, decode graphs on, steps overlapped): the scores come back through the pinned
    copy the step's event guards, also for a chunk step that samples nothing."""
    llm = load(target[0], device="cuda")
    llm.engine.scheduler.scored_chunk = 8
    asking = GenerationRequest(PROMPT, greedy(4, prompt_logprobs=TOP))
    beside = GenerationRequest(PROMPTS[1], greedy(12))
    entries, _ = scored(llm, [beside, asking], asking)
    assert_matches(entries, reference(target[1], PROMPT), PROMPT)

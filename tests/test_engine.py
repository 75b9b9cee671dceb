"""The token engine and the public LLM API on a tiny Qwen3.5 MoE directory (CPU, fp32).

References: transformers' own `generate` for greedy tokens; the same engine run one request at
a time for batching; the detokenizer's full decode for stop strings.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ninfer_core.engine.request import GenerationRequest
from ninfer_core.engine.sampling import SamplingParams
from ninfer_core.errors import ContextLengthError, NinferError
from ninfer_core.llm import LLM, ChatRequest, EngineOptions
from tiny_model_dir import write_tiny_model_dir

PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11, 12, 13], list(range(20, 61))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    directory = tmp_path_factory.mktemp("tiny_qwen")
    hf_model, _ = write_tiny_model_dir(directory, moe=True)
    return directory, hf_model.eval()


def make_llm(directory: Path, **overrides) -> LLM:
    options = EngineOptions(device="cpu", dtype="float32", max_seqs=4, max_context=256, **overrides)
    return LLM.load(str(directory), options)


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return make_llm(model_dir[0])


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run(llm: LLM, requests: list[GenerationRequest]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for out in llm.engine.generate(requests):
        tokens[out.request_id] += out.new_token_ids
    return tokens


def test_greedy_matches_transformers_generate(llm, model_dir):
    assert_greedy_matches_transformers(llm, model_dir[1])


@pytest.mark.cuda
def test_greedy_on_cuda_matches_transformers(model_dir):
    llm = LLM.load(str(model_dir[0]), EngineOptions(device="cuda", dtype="float32", max_context=256))
    assert_greedy_matches_transformers(llm, model_dir[1])


def assert_greedy_matches_transformers(llm: LLM, hf: torch.nn.Module) -> None:
    for prompt in PROMPTS:
        req = GenerationRequest(prompt, greedy(24))
        ours = run(llm, [req])[req.request_id]
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                              min_new_tokens=24)
        assert ours == ref[0, len(prompt):].tolist()


def test_batched_decode_equals_serial_and_really_batches(llm):
    def requests():
        return [
            GenerationRequest(PROMPTS[0], greedy(16)),
            GenerationRequest(PROMPTS[1], SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=16,
                                                         ignore_eos=True)),
            GenerationRequest(PROMPTS[2], SamplingParams(temperature=1.1, top_k=20, seed=3, max_tokens=16,
                                                         ignore_eos=True, repetition_penalty=1.3)),
        ]

    serial = [next(iter(run(llm, [r]).values())) for r in requests()]
    before = llm.stats()
    together = list(run(llm, requests()).values())
    after = llm.stats()
    assert together == serial
    assert after.max_decode_batch == 3
    # 3 x 15 decode rows (the first token of each comes from prefill) in fewer steps than rows
    assert after.decode_rows - before.decode_rows == 45
    assert after.decode_steps - before.decode_steps < 45
    assert after.kv_used_tokens == 0 and after.running == 0


def test_chunked_prefill_in_engine_equals_one_shot(model_dir, llm):
    small_chunks = make_llm(model_dir[0], prefill_chunk=5)
    req_a, req_b = GenerationRequest(PROMPTS[2], greedy(12)), GenerationRequest(PROMPTS[2], greedy(12))
    assert run(small_chunks, [req_a])[req_a.request_id] == run(llm, [req_b])[req_b.request_id]
    assert small_chunks.stats().prefill_chunks == 9  # 41 prompt tokens in chunks of 5


def test_seeded_sampling_is_reproducible(llm):
    params = dict(temperature=1.0, seed=1234, max_tokens=20, ignore_eos=True)
    a = GenerationRequest(PROMPTS[0], SamplingParams(**params))
    b = GenerationRequest(PROMPTS[0], SamplingParams(**params))
    c = GenerationRequest(PROMPTS[0], SamplingParams(**{**params, "seed": 99}))
    out = run(llm, [a, b, c])
    assert out[a.request_id] == out[b.request_id]
    assert out[a.request_id] != out[c.request_id]


def test_max_tokens_and_stop_strings(llm):
    req = GenerationRequest(PROMPTS[0], greedy(30))
    outs = list(llm.engine.generate([req]))
    full_text = "".join(o.text_delta for o in outs)
    assert outs[-1].finish_reason == "length" and len(outs) == 30
    assert full_text == llm.tokenizer.decode(sum((o.new_token_ids for o in outs), []), skip_special_tokens=True)
    # a stop string from the middle of that text: output is cut right before it
    stop = full_text[len(full_text) // 2 : len(full_text) // 2 + 3]
    assert stop.strip(), f"degenerate stop string {stop!r}"
    req = GenerationRequest(PROMPTS[0], greedy(30, stop=[stop]))
    outs = list(llm.engine.generate([req]))
    text = "".join(o.text_delta for o in outs)
    assert text == full_text[: full_text.index(stop)]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop


def test_stop_token_ids(llm):
    req = GenerationRequest(PROMPTS[1], greedy(20))
    tokens = run(llm, [req])[req.request_id]
    stop_id = tokens[5]
    first = tokens.index(stop_id)
    req = GenerationRequest(PROMPTS[1], greedy(20, stop_token_ids=[stop_id]))
    outs = list(llm.engine.generate([req]))
    assert sum((o.new_token_ids for o in outs), []) == tokens[: first + 1]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop_id


def test_eos_ends_generation_unless_ignored(model_dir):
    llm = make_llm(model_dir[0])
    eos = llm.tokenizer.token_to_id("<|im_end|>")
    assert llm.engine.eos_ids == {eos}  # from the checkpoint's config / generation_config
    req = GenerationRequest(PROMPTS[0], greedy(20))
    tokens = run(llm, [req])[req.request_id]
    llm.engine.eos_ids = frozenset({tokens[4]})  # pretend the model's eos is its 5th token
    stopped = GenerationRequest(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20))
    assert run(llm, [stopped])[stopped.request_id] == tokens[: tokens.index(tokens[4]) + 1]
    ignored = GenerationRequest(PROMPTS[0], greedy(20))
    assert run(llm, [ignored])[ignored.request_id] == tokens


def test_context_overflow_is_rejected_and_leaks_nothing(llm):
    with pytest.raises(ContextLengthError) as err:
        llm.engine.add_request(GenerationRequest(list(range(300)), greedy(4)))
    assert err.value.prompt_tokens == 300 and err.value.limit == 256
    with pytest.raises(NinferError, match="outside the vocabulary"):
        llm.engine.add_request(GenerationRequest([1, 2, 10**6], greedy(4)))
    stats = llm.stats()
    assert stats.running == 0 and stats.kv_used_tokens == 0
    req = GenerationRequest(PROMPTS[1], greedy(3))
    assert len(run(llm, [req])[req.request_id]) == 3


def test_answer_capped_by_context(model_dir):
    small = make_llm(model_dir[0], kv_capacity=None)
    small.engine.max_context = 50
    req = GenerationRequest(PROMPTS[2], greedy(100))  # 41 prompt tokens: room for 9
    outs = list(small.engine.generate([req]))
    assert len(outs) == 9 and outs[-1].finish_reason == "length"


def test_abort_frees_the_cache(llm):
    req = GenerationRequest(PROMPTS[2], greedy(50))
    llm.engine.add_request(req)
    llm.engine.step()
    assert llm.stats().kv_used_tokens > 0
    llm.engine.abort(req.request_id)
    stats = llm.stats()
    assert stats.running == 0 and stats.kv_used_tokens == 0


def test_chat_api_renders_template_and_reports(llm):
    request = ChatRequest(messages=[{"role": "user", "content": "hi"}], sampling=greedy(10))
    prompt = llm.render_prompt(request)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    result = llm.chat_result(request)
    assert result.prompt_token_ids == llm.tokenizer.encode(prompt)
    assert len(result.token_ids) == 10 and result.finish_reason == "length"
    # the prompt opened <think>: without a </think> in the output, everything is reasoning
    decoded = llm.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    if "</think>" not in decoded:
        assert result.text == "" and result.reasoning.strip() == decoded.strip()
    payload = result.to_json()
    assert payload["usage"] == {"prompt_tokens": len(result.prompt_token_ids), "completion_tokens": 10}
    assert payload["timings"]["prefill_tok_s"] > 0 and payload["timings"]["decode_tok_s"] > 0
    no_think = ChatRequest(messages=[{"role": "user", "content": "hi"}], sampling=greedy(4), enable_thinking=False)
    assert llm.render_prompt(no_think).endswith("<think>\n\n</think>\n\n")

"""Scoring and counting text on the real server (tiny random Qwen3.5 MoE, CPU, float32), through the
openai client and raw HTTP: /v1/completions as evaluation harnesses use it (lm-eval's
`local-completions`: a list of prompts, `echo`, `logprobs`, one answer token), the prompt tokens'
logprobs against transformers' log-softmax of the same ids; /tokenize and /detokenize against the
tokenizer and the chat endpoint's own prompt count."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from ninfer_core.llm import ChatRequest
from server_harness import serve, sse_json, write_model

PROMPTS = ["The capital of France is Paris", "Two plus two is four"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory, "tiny_scoring")


@pytest.fixture(scope="module")
def server(model):
    yield from serve(model[0])


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def reference(hf, ids: list[int]) -> list[float]:
    """log p(token i | tokens < i) for i >= 1."""
    with torch.no_grad():
        scores = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].double(), dim=-1)
    return [scores[i, t].item() for i, t in enumerate(ids[1:])]


def test_echo_with_logprobs_scores_every_prompt_token(server, client, model):
    tokenizer = server.service.llm.tokenizer
    r = client.completions.create(model="m", prompt=PROMPTS, max_tokens=1, temperature=0, logprobs=2, echo=True,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    for prompt, choice in zip(PROMPTS, r.choices):
        ids = tokenizer.encode(prompt, add_special_tokens=True)
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
        assert lp.token_logprobs[1:len(ids)] == pytest.approx(reference(model[1], ids), abs=1e-4)
        assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:])  # keyed by text: two byte tokens may share one
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
        assert lp.text_offset[len(ids)] == len(prompt)  # the answer's first token starts after the echo
        assert choice.text.startswith(prompt)
    assert r.usage.prompt_tokens == sum(len(tokenizer.encode(p, add_special_tokens=True)) for p in PROMPTS)
    assert r.usage.completion_tokens == 2


def test_lm_eval_loglikelihood_requests(server, model):
    """lm-eval's `local-completions` loglikelihood: token-id prompts (context + continuation) in one
    request, temperature 0, max_tokens 1, logprobs 1, echo; it sums token_logprobs[ctxlen:-1] and calls
    the continuation greedy when each of its tokens is the top alternative."""
    contexts = [[5, 17, 42, 99], [3, 250, 7]]
    with torch.no_grad():  # the second continuation is the model's own greedy one
        greedy_ids = model[1].generate(torch.tensor([contexts[1]]), max_new_tokens=3, min_new_tokens=3,
                                       do_sample=False, eos_token_id=None)[0, 3:].tolist()
    continuations = [[11, 12], greedy_ids]
    verdicts = []
    body = {"model": "m", "prompt": [c + x for c, x in zip(contexts, continuations)], "temperature": 0,
            "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}
    out = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    for choice, context, continuation in zip(sorted(out["choices"], key=lambda c: c["index"]), contexts, continuations):
        ids = context + continuation
        with torch.no_grad():
            scores = torch.log_softmax(model[1](torch.tensor([ids])).logits[0].double(), dim=-1)
        rows = range(len(context) - 1, len(ids) - 1)  # row i predicts token i + 1
        logprobs = choice["logprobs"]["token_logprobs"][len(context):-1]
        assert sum(logprobs) == pytest.approx(sum(scores[i, ids[i + 1]].item() for i in rows), abs=1e-4)
        tops = choice["logprobs"]["top_logprobs"][len(context):-1]
        greedy = all(lp == max(top.values()) for lp, top in zip(logprobs, tops))
        assert greedy == all(int(scores[i].argmax()) == ids[i + 1] for i in rows)
        verdicts.append(greedy)
    assert verdicts[1], "the model's own greedy continuation is greedy"


def test_streamed_scores_equal_the_whole(server):
    body = {"model": "m", "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "logprobs": 1, "echo": True,
            "ignore_eos": True}
    whole = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        frames = sse_json(r)
    assert frames[-1] == "[DONE]"
    chunks = [f["choices"][0] for f in frames[:-1]]
    assert chunks[0]["text"] == PROMPTS[0]  # the echo comes first, with the prompt's logprobs
    assert "".join(c["text"] for c in chunks) == whole["text"]
    joined = {key: [v for c in chunks if c["logprobs"] for v in c["logprobs"][key]] for key in whole["logprobs"]}
    assert joined == whole["logprobs"]


def test_a_scored_prompt_is_read_whole_and_a_repeat_scores_the_same(server, client):
    """The prefix cache holds the prompt after the first request: a scored repeat reads it again
    (its logits are needed), so it reports no cached tokens and the same logprobs."""
    args = dict(model="m", prompt=PROMPTS[1] + " again and again", max_tokens=1, temperature=0, logprobs=0,
                echo=True, extra_body={"ignore_eos": True})
    first, second = client.completions.create(**args), client.completions.create(**args)
    assert second.usage.prompt_tokens_details.cached_tokens == 0
    assert second.choices[0].logprobs.token_logprobs == first.choices[0].logprobs.token_logprobs


def test_several_prompts_with_several_answers(server):
    body = {"model": "m", "prompt": [[5, 17, 42], [99, 3, 250, 7]], "n": 2, "max_tokens": 3, "seed": 1,
            "temperature": 1.0, "ignore_eos": True, "echo": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    tokenizer = server.service.llm.tokenizer
    texts = [tokenizer.decode(p, skip_special_tokens=True) for p in body["prompt"]]
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert all(c["text"].startswith(texts[c["index"] // 2]) for c in choices)
    assert r.json()["usage"]["prompt_tokens"] == 7 and r.json()["usage"]["completion_tokens"] == 12
    single = httpx.post(server.url + "/v1/completions", json={**body, "prompt": body["prompt"][1], "n": 1,
                                                               "seed": 2}, timeout=60).json()
    assert single["choices"][0]["text"] == choices[3]["text"]  # prompt 1's second answer: seed 1 + 1


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": ["ok", ""]}, "prompt[1]"),
    ({"prompt": ["x"] * 65, "n": 2}, "n"),
    ({"prompt": [[1, 2], [10**6]]}, "prompt[1]"),
])
def test_bad_prompt_lists_are_400_naming_the_prompt(server, body, param):
    r = httpx.post(server.url + "/v1/completions", json={"model": "m", "max_tokens": 1, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    stats = server.service.stats()
    assert stats.engine.running == 0 and stats.waiting == 0


# -- /tokenize, /detokenize ----------------------------------------------------------------------------

def call(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": "m", **body}, timeout=60)


def test_tokenize_text_in_vllm_and_llama_cpp_shapes(server):
    tokenizer = server.service.llm.tokenizer
    text = PROMPTS[0]
    r = call(server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    ids = tokenizer.encode(text, add_special_tokens=True)
    assert r["tokens"] == ids and r["count"] == len(ids) and r["max_model_len"] == server.service.context_limit
    assert r["token_strs"] == ["The", " capital", " of", " France", " is", " Paris"]  # no BOS in this tokenizer
    bare = call(server, "/tokenize", {"content": text, "add_special": False}).json()  # llama.cpp's names
    assert bare["tokens"] == tokenizer.encode(text, add_special_tokens=False) and bare["token_strs"] is None
    back = call(server, "/detokenize", {"tokens": ids}).json()
    assert back["prompt"] == back["content"] == tokenizer.decode(ids, skip_special_tokens=False)


def test_tokenize_a_chat_counts_what_the_chat_endpoint_reads(server, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    r = call(server, "/tokenize", {"messages": messages}).json()
    expected = server.service.llm.prepare_chat(ChatRequest(messages=messages)).prompt_token_ids
    assert r["tokens"] == expected
    answer = client.chat.completions.create(model="m", messages=messages, max_tokens=1)
    assert answer.usage.prompt_tokens == r["count"]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {"prompt": "a", "content": "b"}, "content"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
])
def test_bad_tokenizer_requests_are_400(server, path, body, param):
    r = call(server, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_tokenizer_info_names_the_special_tokens_and_the_template(server):
    """What lm-eval's remote tokenizer reads (GET /tokenizer_info, then /tokenize with prompt and
    add_special_tokens false, /detokenize answering `prompt`)."""
    llm = server.service.llm
    info = httpx.get(server.url + "/tokenizer_info", timeout=60).json()
    assert info["eos_token"] == llm.tokenizer.eos_token and info["bos_token"] == llm.tokenizer.bos_token
    assert info["chat_template"] == llm.template.templates["default"]
    assert info["model_max_length"] == server.service.context_limit
    tokens = call(server, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert tokens == [llm.tokenizer.token_to_id(info["eos_token"])]
    assert httpx.get(server.url + "/tokenizer_info?model=nope", timeout=60).status_code == 404

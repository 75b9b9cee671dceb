"""`n` answers to one request (OpenAI's `n`, chat and completions) on the real server and engine
(tiny random Qwen3.5 MoE, CPU), through the openai client and raw HTTP.

The reference for choice i of a request seeded s is the same request with n = 1 seeded s + i: a
choice is an ordinary request of its own, batched with its siblings.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import httpx
import openai
import pytest

from ninfer_core.server.app import ServerHandle
from server_harness import load_tiny_llm, serve, sse_json, wait_for, write_model

HI = [{"role": "user", "content": "Say hi"}]
SAMPLED = {"temperature": 1.0, "top_p": 0.95, "max_tokens": 10, "ignore_eos": True}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory, "tiny_choices")


@pytest.fixture(scope="module")
def server(model):
    yield from serve(model[0])


def post(server, path: str, body) -> httpx.Response:
    response = httpx.post(server.url + path, json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def stream(server, path: str, body) -> list:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True,
                                                        "stream_options": {"include_usage": True}}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        frames = sse_json(r)
    assert frames[-1] == "[DONE]"
    return frames[:-1]


def idle(server) -> bool:
    s = server.service.stats()
    return s.engine.running == 0 and s.waiting == 0 and s.engine.kv_used_tokens == 0 and s.kv_reserved_tokens == 0


def test_chat_choices_are_the_requests_seeded_seed_plus_index(server):
    body = {"model": "m", "messages": HI, "seed": 40, **SAMPLED}
    whole = post(server, "/v1/chat/completions", {**body, "n": 3})
    singles = [post(server, "/v1/chat/completions", {**body, "seed": 40 + i}) for i in range(3)]
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
    for choice, single in zip(whole["choices"], singles):
        assert choice["message"] == single["choices"][0]["message"]
        assert choice["finish_reason"] == single["choices"][0]["finish_reason"] == "length"
    assert len({c["message"]["content"] + (c["message"].get("reasoning_content") or "")
                for c in whole["choices"]}) > 1, "the choices should differ"
    usage = whole["usage"]  # the prompt once, the answers summed
    assert usage["prompt_tokens"] == singles[0]["usage"]["prompt_tokens"]
    assert usage["completion_tokens"] == 30 and usage["total_tokens"] == usage["prompt_tokens"] + 30
    assert usage["completion_tokens_details"]["reasoning_tokens"] == sum(
        s["usage"]["completion_tokens_details"]["reasoning_tokens"] for s in singles)
    assert idle(server)


def test_chat_choices_stream_under_their_index_and_equal_the_whole(server):
    body = {"model": "m", "messages": HI, "seed": 7, "n": 3, **SAMPLED}
    whole = post(server, "/v1/chat/completions", body)
    chunks = stream(server, "/v1/chat/completions", body)
    assert len({(c["id"], c["created"]) for c in chunks}) == 1
    deltas, finish, first = defaultdict(list), {}, {}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        i = choice["index"]
        first.setdefault(i, choice["delta"])
        assert "role" not in choice["delta"] or choice["delta"] is first[i], "role only in a choice's first delta"
        deltas[i].append(choice["delta"])
        if choice["finish_reason"] is not None:
            assert i not in finish, "one finish_reason a choice"
            finish[i] = choice["finish_reason"]
    assert sorted(deltas) == [0, 1, 2] and all(d["role"] == "assistant" for d in first.values())
    for i, choice in enumerate(whole["choices"]):
        message = choice["message"]
        assert "".join(d.get("content", "") for d in deltas[i]) == (message["content"] or "")
        assert "".join(d.get("reasoning_content", "") for d in deltas[i]) == message.get("reasoning_content", "")
        assert finish[i] == choice["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert idle(server)


def test_greedy_choices_are_equal_and_equal_one_answer(server):
    body = {"model": "m", "messages": HI, "temperature": 0, "max_tokens": 8, "ignore_eos": True}
    one = post(server, "/v1/chat/completions", body)["choices"][0]["message"]
    many = post(server, "/v1/chat/completions", {**body, "n": 4})["choices"]
    assert [c["message"] for c in many] == [one] * 4


def test_openai_client_gets_n_choices_with_logprobs(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model="m", messages=HI, n=2, seed=3, max_tokens=5, logprobs=True,
                                       top_logprobs=2, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert len(c.logprobs.content) == 5 and all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
    streamed = defaultdict(list)
    for chunk in client.chat.completions.create(model="m", messages=HI, n=2, seed=3, max_tokens=5, logprobs=True,
                                                top_logprobs=2, stream=True, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            streamed[c.index] += c.logprobs.content if c.logprobs else []
    for c in r.choices:
        assert [t.model_dump() for t in streamed[c.index]] == [t.model_dump() for t in c.logprobs.content]


def test_completion_choices_with_echo_and_logprobs(server):
    body = {"model": "m", "prompt": "Paris is", "seed": 5, "echo": True, **SAMPLED}
    whole = post(server, "/v1/completions", {**body, "n": 2, "best_of": 2})
    singles = [post(server, "/v1/completions", {**body, "seed": 5 + i}) for i in range(2)]
    assert [c["text"] for c in whole["choices"]] == [s["choices"][0]["text"] for s in singles]
    assert all(c["text"].startswith("Paris is") for c in whole["choices"])
    assert whole["usage"]["completion_tokens"] == 20
    chunks = stream(server, "/v1/completions", {**body, "n": 2})
    texts = defaultdict(str)
    for c in chunks[:-1]:
        texts[c["choices"][0]["index"]] += c["choices"][0]["text"]
    assert [texts[0], texts[1]] == [c["text"] for c in whole["choices"]]
    assert chunks[-1]["usage"] == whole["usage"]
    logged = post(server, "/v1/completions", {**body, "echo": False, "n": 2, "logprobs": 1})
    for c, single in zip(logged["choices"], singles):
        assert c["text"] == single["choices"][0]["text"][len("Paris is"):]
        assert len(c["logprobs"]["tokens"]) == len(c["logprobs"]["token_logprobs"]) == 10
        assert c["logprobs"]["text_offset"][0] == 0


def test_bad_choice_counts_are_400(server):
    for path, extra, param in (("/v1/chat/completions", {"messages": HI, "n": 0}, "n"),
                               ("/v1/chat/completions", {"messages": HI, "n": 129}, "n"),
                               ("/v1/completions", {"prompt": "x", "n": 2, "best_of": 3}, "best_of"),
                               ("/v1/completions", {"prompt": "x", "best_of": 2}, "best_of")):
        r = httpx.post(server.url + path, json={"model": "m", **extra}, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
    assert idle(server)


def test_a_disconnect_cancels_every_choice(server):
    body = {"model": "m", "messages": HI, "n": 3, "max_tokens": 200, "ignore_eos": True, "stream": True}
    generated = server.service.stats().engine.generated_tokens
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(12):
            next(lines)
        assert server.service.stats().engine.running == 3
    wait_for(lambda: idle(server), what="the three choices to be dropped")
    assert server.service.stats().engine.generated_tokens - generated < 3 * 200


def test_a_refused_choice_refuses_the_request_and_leaves_nothing(model):
    """max_queue 2: the third choice is refused, so the request is a 429 and its first two choices
    are cancelled (none of them runs to its end); the server then serves as before."""
    handle = ServerHandle.start(load_tiny_llm(model[0]), port=0, max_concurrency=1, max_queue=2, model_id="m")
    try:
        r = httpx.post(handle.url + "/v1/chat/completions",
                       json={"model": "m", "messages": HI, "n": 3, "max_tokens": 200, "ignore_eos": True}, timeout=60)
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", r.text
        wait_for(lambda: idle(handle), what="the refused request's choices to be dropped")
        assert handle.service.stats().engine.generated_tokens < 200
        ok = httpx.post(handle.url + "/v1/chat/completions",
                        json={"model": "m", "messages": HI, "n": 2, "max_tokens": 3, "ignore_eos": True}, timeout=60)
        assert ok.status_code == 200 and [c["finish_reason"] for c in ok.json()["choices"]] == ["length"] * 2
    finally:
        handle.stop()


def test_choices_run_as_one_batch(server):
    """The n requests decode together (the engine's batch), not one after another."""
    seen = []
    stop = threading.Event()

    def watch():
        while not stop.wait(0.005):  # a busy loop on stats() would starve the engine thread
            seen.append(server.service.stats().engine.running)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        post(server, "/v1/chat/completions", {"model": "m", "messages": HI, "n": 4, "max_tokens": 40,
                                              "ignore_eos": True})
    finally:
        stop.set()
        watcher.join()
    assert max(seen) == 4

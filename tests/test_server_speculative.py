"""`ninfer serve` with speculative decoding (MTP on the tiny model), its steps overlapped as on a GPU:
requests that never draft (a JSON schema's grammar, min_tokens) stream while drafting requests arrive
and one client leaves mid-stream. Every greedy answer equals the plain server's, the
drafts were made, and the server ends idle with its cache free."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from ninfer_core.server.app import ServerHandle
from server_harness import load_tiny_llm, sse_events, wait_for, write_model

# thinking off: the answer is the content (the JSON under its grammar)
GREEDY = {"temperature": 0, "max_tokens": 40, "ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "n", "schema": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a", "b"]}}}
NEVER_DRAFT = {  # rows the engine runs as plain, overlapped steps
    "schema": {"messages": [{"role": "user", "content": "Give me JSON"}], "response_format": SCHEMA},
    "min_tokens": {"messages": [{"role": "user", "content": "Count to ten"}], "min_tokens": 6},
}
DRAFTING = {
    "story": {"messages": [{"role": "user", "content": "Tell me a story about a fox"}]},
    "list": {"messages": [{"role": "user", "content": "List three fruits"}]},
}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    directory, _ = write_model(tmp_path_factory, "tiny_spec_server")
    plain = ServerHandle.start(load_tiny_llm(directory), port=0, model_id="m")
    llm = load_tiny_llm(directory, spec="mtp", draft_tokens=3)
    llm.engine.overlap = True  # as on a GPU: a plain step is launched before the last one's tokens are read
    spec = ServerHandle.start(llm, port=0, model_id="m")
    yield plain, spec
    spec.stop()
    plain.stop()


def _stream(url: str, body: dict, out: dict, name: str, started: threading.Event | None = None,
            leave_after: int | None = None) -> None:
    """One streamed chat: its text into out[name] (set `started` at its first chunk; after `leave_after`
    chunks, None, and the connection closed)."""
    text = []
    with httpx.stream("POST", url + "/v1/chat/completions", json={**GREEDY, **body, "stream": True},
                      timeout=120) as response:
        assert response.status_code == 200, response.read()
        for _, data in sse_events(response):
            if data == "[DONE]":
                continue
            if started is not None:
                started.set()
            if leave_after is not None and len(text) + 1 >= leave_after:
                out[name] = None
                return
            choices = json.loads(data)["choices"]
            text.append(choices[0]["delta"].get("content") or "" if choices else "")
    out[name] = "".join(text)


def test_drafting_requests_join_plain_rows_in_flight(servers):
    plain, spec = servers
    want = {}
    for name, body in {**NEVER_DRAFT, **DRAFTING}.items():
        reply = httpx.post(plain.url + "/v1/chat/completions", json={**GREEDY, **body}, timeout=120)
        assert reply.status_code == 200, reply.text
        want[name] = reply.json()["choices"][0]["message"]["content"]
        assert want[name], name  # 40 tokens of text
    got: dict = {}
    started = {name: threading.Event() for name in NEVER_DRAFT}
    threads = [threading.Thread(target=_stream, args=(spec.url, body, got, name, started[name]))
               for name, body in NEVER_DRAFT.items()]
    for thread in threads:
        thread.start()
    for event in started.values():  # the plain rows stream (their steps overlap) before the drafting ones come
        assert event.wait(60)
    threads += [threading.Thread(target=_stream, args=(spec.url, body, got, name)) for name, body in DRAFTING.items()]
    threads.append(threading.Thread(target=_stream, args=(spec.url, DRAFTING["story"], got, "leaves", None, 3)))
    for thread in threads[len(NEVER_DRAFT):]:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert {name: got.get(name) for name in want} == want
    assert got["leaves"] is None
    engine = spec.service.stats().engine
    assert engine.spec is not None and engine.spec.drafted > 0
    wait_for(lambda: spec.service.stats().engine.running == 0, what="the server to go idle")
    assert spec.service.stats().engine.kv_used_tokens == 0
    assert httpx.get(spec.url + "/health").status_code == 200

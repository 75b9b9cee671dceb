"""Ollama's native API on the real server (tiny random Qwen3.5 MoE, CPU), driven by the official
`ollama` client and raw HTTP: answers equal the Chat Completions endpoint's for the same request
(itself checked against transformers in test_server.py), streams equal the whole answer, options
and `format` reach the sampler and the grammar, tool calls come back as Ollama's, errors keep the
server's error object. Tool calls are injected at the engine boundary (server_harness.ScriptedEngine),
as in test_server_format.py."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import ollama
import pytest

from ninfer_core.server.app import ServerHandle
from server_harness import ScriptedEngine, load_tiny_llm, pieces_of, serve_tiny, write_model

HI = [{"role": "user", "content": "Say hi"}]
GREEDY = {"temperature": 0, "num_predict": 8, "num_ctx": 4096}  # num_ctx: accepted, ignored
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve_tiny(tmp_path_factory, "tiny_ollama", 2048)


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url)


def openai_chat(server, messages, **extra) -> dict:
    body = {"model": "m", "messages": messages, "max_tokens": 8, "temperature": 0, **extra}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]


@pytest.mark.parametrize("think", [None, False, "low"])  # a level (gpt-oss's) switches thinking on
def test_chat_equals_chat_completions_whole_and_streamed(server, client, think):
    expected = openai_chat(server, HI, **({} if think is None else
                                          {"chat_template_kwargs": {"enable_thinking": think is not False}}))
    whole = client.chat(model="m", messages=HI, options=GREEDY, think=think)
    assert whole.message.content == (expected["content"] or "")
    assert (whole.message.thinking or "") == expected.get("reasoning_content", "")
    assert whole.done and whole.done_reason == "length" and whole.eval_count == 8 and whole.prompt_eval_count > 0
    parts = list(client.chat(model="m", messages=HI, options=GREEDY, think=think, stream=True))
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert "".join(p.message.thinking or "" for p in parts) == (whole.message.thinking or "")
    assert [p.done for p in parts].count(True) == 1 and parts[-1].done and parts[-1].eval_count == 8


def test_generate_and_raw_generate(server, client):
    expected = openai_chat(server, [{"role": "system", "content": "Be brief."}, *HI],
                           chat_template_kwargs={"enable_thinking": False})
    r = client.generate(model="m", prompt="Say hi", system="Be brief.", options=GREEDY, think=False)
    assert r.response == expected["content"] and r.done_reason == "length"
    streamed = "".join(p.response for p in client.generate(model="m", prompt="Say hi", system="Be brief.",
                                                           options=GREEDY, think=False, stream=True))
    assert streamed == r.response
    body = {"model": "m", "prompt": "The quick", "max_tokens": 8, "temperature": 0}
    completion = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    raw = client.generate(model="m", prompt="The quick", raw=True, options=GREEDY)
    assert raw.response == completion and raw.eval_count == 8


def test_format_and_options_reach_the_grammar_and_the_sampler(server, client):
    for fmt in ("json", SCHEMA):
        r = client.chat(model="m", messages=HI, format=fmt, think=False,
                        options={"temperature": 1.0, "seed": 3, "num_predict": 300})
        value = json.loads(r.message.content)
        assert isinstance(value, dict)
        if fmt is SCHEMA:
            jsonschema.validate(value, SCHEMA)
    sampled = {"temperature": 1.0, "top_k": 20, "top_p": 0.9, "seed": 11, "num_predict": 10, "repeat_penalty": 1.2}
    a = client.chat(model="m", messages=HI, options=sampled).message
    b = client.chat(model="m", messages=HI, options=sampled).message
    assert (a.content, a.thinking) == (b.content, b.thinking)  # the seed reached the sampler
    full = client.chat(model="m", messages=HI, think=False, options=GREEDY).message.content
    stop = full[3:5]
    assert stop.strip() and stop not in full[:3], f"degenerate stop string {stop!r}"
    stopped = client.chat(model="m", messages=HI, think=False, options={**GREEDY, "stop": [stop]})
    assert stopped.message.content == full[:3] and stopped.done_reason == "stop"


def test_listing_show_version_and_load_requests(server, client):
    assert [m.model for m in client.list().models] == ["m"]
    (running,) = client.ps().models  # ninfer's /api/ps, read by Ollama's client
    assert running.model == "m" and running.size > 0 and running.size_vram == 0
    shown = client.show("m")
    assert "completion" in shown.capabilities and shown.modelinfo["general.architecture"] == "qwen3_5_moe"
    assert shown.modelinfo["qwen3_5_moe.context_length"] == server.service.context_limit
    assert httpx.get(server.url + "/api/version").json()["version"]
    loaded = httpx.post(server.url + "/api/chat", json={"model": "m"}, timeout=60).json()
    assert loaded["done"] and loaded["done_reason"] == "load"


@pytest.mark.parametrize(("body", "param"), [
    ({"model": None, "messages": HI}, "model"),  # Ollama requires it
    ({"messages": HI, "options": {"num_predict": 0}}, "options.num_predict"),
    ({"messages": HI, "options": {"temperature": -1}}, "temperature"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": HI, "format": {"type": "nope"}}, "format"),
])
def test_bad_requests_are_400_with_the_error_object(server, body, param):
    r = httpx.post(server.url + "/api/chat", json={k: v for k, v in {"model": "m", **body}.items() if v is not None},
                   timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    with pytest.raises(ollama.ResponseError) as err:
        ollama.Client(host=server.url).chat(model="nope", messages=HI)
    assert err.value.status_code == 404


def test_tool_calls_come_back_as_ollama_calls(tmp_path_factory):
    directory, _ = write_model(tmp_path_factory, "tiny_ollama_tools", max_positions=4096)
    llm = load_tiny_llm(directory, max_context=4096)
    script = ("Checking.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
              "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
    llm.engine = ScriptedEngine(llm, pieces_of(script))
    handle = ServerHandle.start(llm, port=0, model_id="m")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
    try:
        client = ollama.Client(host=handle.url)
        whole = client.chat(model="m", messages=HI, tools=tools)
        assert [(c.function.name, dict(c.function.arguments)) for c in whole.message.tool_calls] == [
            ("get_weather", {"city": "Paris", "days": 3})]
        assert whole.message.thinking == "Checking."
        streamed = [c for p in client.chat(model="m", messages=HI, tools=tools, stream=True)
                    for c in p.message.tool_calls or []]
        assert [c.function.name for c in streamed] == ["get_weather"]
        history = [*HI, {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}]},
                   {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]
        client.chat(model="m", messages=history, tools=tools)
        prompt = llm.tokenizer.decode(handle.service.engine.prompts[-1])
        assert "<parameter=city>\nParis\n</parameter>" in prompt and "<tool_response>\nsunny\n</tool_response>" in prompt
    finally:
        handle.stop()


def test_keep_alive_never_unloads_a_model_this_server_could_not_load_again(server, client):
    """This server was given one model and has no loader: a request's keep_alive 0 is ignored (the
    next request must still find the model) and an unload request is refused."""
    assert client.chat(model="m", messages=HI, options=GREEDY, keep_alive=0).done
    time.sleep(1.5)  # the keep-alive reaper looks every second
    assert [m["name"] for m in httpx.get(server.url + "/api/ps").json()["models"]] == ["m"]
    with pytest.raises(ollama.ResponseError) as caught:
        client.generate(model="m", keep_alive=0)
    assert caught.value.status_code == 409 and "stays loaded" in str(caught.value)
    assert client.generate(model="m", prompt="Hi", options=GREEDY).done

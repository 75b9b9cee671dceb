"""Structured output and logprobs through the real server (tiny random Qwen3.5 MoE on the CPU, real
uvicorn on loopback) with the official openai / anthropic clients: JSON Schema answers validate
(jsonschema), JSON mode answers parse, forced tool choices are valid calls, logprobs agree with a
float64 log-softmax of transformers' logits. The weights are random: only the grammar makes these
answers valid."""

from __future__ import annotations

import json
import re
import threading

import anthropic
import httpx
import jsonschema
import openai
import pytest
import torch

from ninfer_core.llm import ChatRequest
from ninfer_core.server.app import ServerHandle
from server_harness import load_tiny_llm, sse_json, write_model

CONTEXT = 2048
HI = [{"role": "user", "content": "Say hi"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
    "ok": {"type": "boolean"}}, "required": ["name", "age", "ok"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory, "tiny_structured", max_positions=CONTEXT)


@pytest.fixture(scope="module")
def server(model):
    handle = ServerHandle.start(load_tiny_llm(model[0], max_context=CONTEXT), port=0, model_id="m")
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def token_id(server, text: str) -> int:
    return server.service.llm.tokenizer.token_to_id(text)


def assert_valid_calls(calls, single: bool = False) -> None:
    assert calls and (len(calls) == 1 or not single)
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# -- JSON ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("temperature", "seed"), [(0, None), (1.0, 1), (1.0, 2), (0.7, 3)])
def test_json_schema_answers_validate(client, temperature, seed):
    r = client.chat.completions.create(
        model="m", messages=HI, temperature=temperature, seed=seed, max_tokens=400, extra_body=NO_THINKING,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_schema_stream_validates(client):
    stream = client.chat.completions.create(
        model="m", messages=HI, temperature=1.0, seed=7, max_tokens=400, stream=True, extra_body=NO_THINKING,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("seed", range(4))
def test_json_mode_answers_parse(client, server, seed):
    """logit_bias pushes '"' and '}' (alone they would make `}}}}`): objects of varied size."""
    bias = {str(token_id(server, '"')): 4, str(token_id(server, "}")): 4}
    r = client.chat.completions.create(model="m", messages=HI, temperature=1.0, seed=seed, max_tokens=400,
                                       logit_bias=bias, response_format={"type": "json_object"}, extra_body=NO_THINKING)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_thinking_comes_before_the_json(client, server):
    """With thinking on the template opens <think>: free reasoning, </think>, then the JSON."""
    r = client.chat.completions.create(
        model="m", messages=HI, temperature=1.0, seed=4, max_tokens=600,
        logit_bias={str(token_id(server, "</think>")): 3},
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and message.reasoning_content
    assert r.usage.completion_tokens_details.reasoning_tokens > 0
    jsonschema.validate(json.loads(message.content), PERSON)


def test_responses_text_format(client):
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    r = client.responses.create(model="m", input="Say hi", temperature=1.0, max_output_tokens=400, text={"format": fmt},
                                extra_body={"seed": 5, **NO_THINKING})
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), PERSON)


# -- tool calls ----------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [1, 2, 3])
def test_tool_choice_required_always_calls(client, seed):
    r = client.chat.completions.create(model="m", messages=HI, tools=[WEATHER, TIME], tool_choice="required",
                                       temperature=1.0, seed=seed, max_tokens=800, extra_body=NO_THINKING)
    assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
    assert_valid_calls(r.choices[0].message.tool_calls)


def test_tool_choice_named_and_single(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(model="m", messages=HI, tools=[WEATHER, TIME], tool_choice=named,
                                       temperature=0, max_tokens=300, extra_body=NO_THINKING)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and [c.function.name for c in calls] == ["get_time"]
    assert_valid_calls(calls, single=True)
    r = client.chat.completions.create(model="m", messages=HI, tools=[WEATHER, TIME], tool_choice="required",
                                       parallel_tool_calls=False, temperature=1.0, seed=9, max_tokens=300,
                                       extra_body=NO_THINKING)
    assert_valid_calls(r.choices[0].message.tool_calls, single=True)


def test_tool_choice_required_streams_valid_calls(client):
    stream = client.chat.completions.create(model="m", messages=HI, tools=[WEATHER], tool_choice="required",
                                            temperature=1.0, seed=11, max_tokens=600, stream=True,
                                            extra_body=NO_THINKING)
    args: dict[int, str] = {}
    finish = None
    for chunk in stream:
        for delta in chunk.choices[0].delta.tool_calls or []:
            args[delta.index] = args.get(delta.index, "") + (delta.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and args
    for text in args.values():
        jsonschema.validate(json.loads(text), SCHEMAS["get_weather"])


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"},
                                    {"type": "any", "disable_parallel_tool_use": True}])
def test_anthropic_forced_tool_use(server, choice):
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in (WEATHER, TIME)]
    message = client.messages.create(model="m", max_tokens=600, messages=HI, tools=tools, tool_choice=choice,
                                     extra_body={"seed": 3, "temperature": 1.0})
    uses = [b for b in message.content if b.type == "tool_use"]
    assert message.stop_reason == "tool_use" and uses and all(b.type == "tool_use" for b in message.content)
    assert len(uses) == 1 or choice["type"] == "any" and not choice.get("disable_parallel_tool_use")
    if choice["type"] == "tool":
        assert {b.name for b in uses} == {"get_weather"}
    for block in uses:
        jsonschema.validate(block.input, SCHEMAS[block.name])


# -- batching --------------------------------------------------------------------------------------

def test_constrained_rows_leave_the_others_alone(client):
    """Constrained and free requests decode together; the free ones get the tokens they get alone."""
    free = {"model": "m", "prompt": [5, 17, 42, 99], "max_tokens": 24, "temperature": 0, "extra_body": {"ignore_eos": True}}
    alone = client.completions.create(**free).choices[0].text
    results: dict[str, object] = {}

    def run(name: str, call) -> None:
        results[name] = call()

    calls = {
        "free": lambda: client.completions.create(**free).choices[0].text,
        "json": lambda: client.chat.completions.create(
            model="m", messages=HI, temperature=1.0, seed=2, max_tokens=400, extra_body=NO_THINKING,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}),
        "tools": lambda: client.chat.completions.create(
            model="m", messages=HI, tools=[TIME], tool_choice="required", temperature=0, max_tokens=300,
            extra_body=NO_THINKING),
    }
    threads = [threading.Thread(target=run, args=item) for item in calls.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results["free"] == alone
    jsonschema.validate(json.loads(results["json"].choices[0].message.content), PERSON)
    assert_valid_calls(results["tools"].choices[0].message.tool_calls)


# -- vLLM's guided decoding: regex, choice, EBNF grammar, JSON on completions ------------------------

@pytest.mark.parametrize("seed", [1, 2, 3])
def test_guided_choice_and_regex_answers_match(server, seed):
    base = {"model": "m", "messages": HI, "temperature": 1.0, "seed": seed, "max_tokens": 60, **NO_THINKING}
    chosen = post(server, "/v1/chat/completions", {**base, "n": 3, "guided_choice": ["yes", "no", "maybe later"]})
    assert chosen.status_code == 200, chosen.text
    assert all(c["message"]["content"] in ("yes", "no", "maybe later") for c in chosen.json()["choices"])
    pattern = "[0-9]{3}-[a-z]{2,4}"
    matched = post(server, "/v1/chat/completions", {**base, "structured_outputs": {"regex": pattern}}).json()
    assert re.fullmatch(pattern, matched["choices"][0]["message"]["content"])


def test_guided_grammar_and_json_on_completions(server):
    """A raw prompt opens no reasoning: the constraint holds from the first token (streamed too)."""
    ebnf = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | "x" [0-9]'
    body = {"model": "m", "prompt": "List:", "max_tokens": 40, "temperature": 1.0, "seed": 4, "guided_grammar": ebnf}
    whole = post(server, "/v1/completions", body).json()["choices"][0]
    assert whole["finish_reason"] == "stop" and re.fullmatch(r"\((?:[a-c]|x[0-9])(?:,(?:[a-c]|x[0-9]))*\)", whole["text"])
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        streamed = "".join(f["choices"][0]["text"] for f in sse_json(r)[:-1])
    assert streamed == whole["text"]
    for extra in ({"guided_json": json.dumps(PERSON)},
                  {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}}):
        r = post(server, "/v1/completions", {"model": "m", "prompt": "Person:", "max_tokens": 400, "seed": 5, **extra})
        assert r.status_code == 200, r.text
        jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), PERSON)


@pytest.mark.parametrize(("path", "extra", "param"), [
    ("/v1/chat/completions", {"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs.regex"),
    ("/v1/chat/completions", {"guided_regex": "(("}, "guided_regex"),
    ("/v1/chat/completions", {"guided_choice": []}, "guided_choice"),
    ("/v1/completions", {"guided_grammar": "root ::= "}, "guided_grammar"),
    ("/v1/completions", {"guided_json": "{not json"}, "guided_json"),
    ("/v1/completions", {"structured_outputs": {"json": {"type": "nope"}}}, "structured_outputs.json"),
])
def test_bad_guided_constraints_are_400s_naming_the_field(server, path, extra, param):
    base = {"model": "m", "max_tokens": 2} | ({"messages": HI} if path == "/v1/chat/completions" else {"prompt": "x"})
    r = post(server, path, base | extra)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert server.service.stats().engine.running == 0


# -- logprobs -------------------------------------------------------------------------------------

def reference_logprobs(hf, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the float64 log-softmax of transformers' logits before each."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        logits = hf(torch.tensor([ids])).logits[0, len(prompt) - 1 : -1].double()
    return ids[len(prompt):], torch.log_softmax(logits, dim=-1)


def assert_entries_match(entries, tokens, scores, tokenizer, top: int) -> None:
    assert len(entries) == len(tokens)
    for entry, token, row in zip(entries, tokens, scores):
        assert entry["bytes"] == list(tokenizer.token_bytes(token))
        assert entry["logprob"] == pytest.approx(float(row[token]), abs=1e-4)
        best = torch.topk(row, top)
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(best.values.tolist(), abs=1e-4)
        assert [t["bytes"] for t in entry["top_logprobs"]] == [list(tokenizer.token_bytes(int(i))) for i in best.indices]


def test_chat_logprobs_agree_with_log_softmax(server, client, model):
    llm = server.service.llm
    prompt = llm.prepare_chat(ChatRequest(HI, enable_thinking=False)).prompt_token_ids
    tokens, scores = reference_logprobs(model[1], prompt, 6)
    body = dict(model="m", messages=HI, max_tokens=6, temperature=0, logprobs=True, top_logprobs=5,
                extra_body={"ignore_eos": True, **NO_THINKING})
    whole = client.chat.completions.create(**body).choices[0].logprobs.model_dump()
    assert whole["refusal"] is None
    assert_entries_match(whole["content"], tokens, scores, llm.tokenizer, 5)
    streamed = [e for c in client.chat.completions.create(**body, stream=True) if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.model_dump()["content"]]
    assert streamed == whole["content"]


def test_completion_logprobs_agree_with_log_softmax(server, client, model):
    prompt = [5, 17, 42, 99, 3]
    tokens, scores = reference_logprobs(model[1], prompt, 5)
    body = {"model": "m", "prompt": prompt, "max_tokens": 5, "temperature": 0, "logprobs": 3, "ignore_eos": True}
    lp = post(server, "/v1/completions", body).json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == pytest.approx([float(scores[i, t]) for i, t in enumerate(tokens)], abs=1e-4)
    assert [len(top) for top in lp["top_logprobs"]] == [3] * 5 or all(len(top) <= 3 for top in lp["top_logprobs"])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    frames = sse_json(httpx.post(server.url + "/v1/completions", json={**body, "stream": True}, timeout=60))
    streamed = [v for f in frames if f != "[DONE]" and f["choices"] and f["choices"][0]["logprobs"]
                for v in f["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == lp["token_logprobs"]


# -- errors ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format.type"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21, "echo": True}, "logprobs"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 3}}}},
     "text.format"),
])
def test_bad_constraints_are_400s(server, path, body, param):
    base = {"model": "m"} | ({"messages": HI} if path == "/v1/chat/completions" else {})
    r = post(server, path, base | body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param

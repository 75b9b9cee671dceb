"""API formatting of reasoning and tool calls, through the official openai and anthropic clients.

A random tiny model never writes a tool call, so these tests INJECT THE MODEL OUTPUT at the
engine boundary: tests/server_harness.ScriptedEngine replaces the LLMEngine and emits a fixed
Qwen-format text (reasoning, content, two XML tool calls) in 3-character pieces. The template,
tokenizer, service, parser, server and clients are the real code. Everything else about the
server runs on the real engine in test_server.py.
"""

from __future__ import annotations

import asyncio
import json
import math

import anthropic
import httpx
import openai
import pytest

from ninfer_core.server.app import ServerHandle
from server_harness import ScriptedEngine, load_tiny_llm, pieces_of, sse_json, write_model

REASONING = "The user wants the weather and the time.\nTwo tools are needed."
CONTENT = "Let me check."
SCRIPT = (
    f"{REASONING}\n</think>\n\n{CONTENT}\n\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>"
)
PIECES = pieces_of(SCRIPT)
REASONING_TOKENS = math.ceil((SCRIPT.index("</think>") + len("</think>")) / 3)  # one token per piece
EXPECTED_CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "CET"})]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}}},
]
MESSAGES = [{"role": "user", "content": "Weather in Paris and the time in CET?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory, _ = write_model(tmp_path_factory, "tiny_format", max_positions=4096)
    llm = load_tiny_llm(directory, max_context=4096)  # the tiny BPE spends ~700 tokens on the tool prompt
    engine = ScriptedEngine(llm, PIECES)
    llm.engine = engine  # the injection point (see the module docstring)
    handle = ServerHandle.start(llm, port=0, model_id="m")
    yield handle, engine, llm
    handle.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0].url + "/v1", api_key="unused", max_retries=0)


def last_prompt(server) -> str:
    _, engine, llm = server
    return llm.tokenizer.decode(engine.prompts[-1])


def calls_of(tool_calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls]


def test_chat_non_stream_tool_calls_and_reasoning(client):
    r = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == CONTENT
    assert choice.message.reasoning_content == REASONING and choice.message.reasoning == REASONING
    assert calls_of(choice.message.tool_calls) == EXPECTED_CALLS
    ids = [c.id for c in choice.message.tool_calls]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)
    assert r.usage.completion_tokens == len(PIECES)
    assert r.usage.completion_tokens_details.reasoning_tokens == REASONING_TOKENS


def test_chat_stream_deltas_have_the_exact_openai_shape(server):
    body = {"model": "m", "messages": MESSAGES, "tools": TOOLS, "stream": True}
    with httpx.stream("POST", server[0].url + "/v1/chat/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        frames = sse_json(response)
    assert frames[-1] == "[DONE]"
    chunks = frames[:-1]
    assert len({(c["id"], c["created"]) for c in chunks}) == 1
    assert [c for c in chunks if "role" in c["choices"][0]["delta"]] == [chunks[0]]
    assert all("usage" not in c for c in chunks)  # no include_usage: no usage key at all
    fragments = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    seen: set[int] = set()
    for fragment in fragments:
        if fragment["index"] not in seen:  # first fragment of a call
            seen.add(fragment["index"])
            assert fragment["type"] == "function" and fragment["id"].startswith("call_")
            assert fragment["function"]["arguments"] == "" and fragment["function"]["name"]
        else:
            assert set(fragment) == {"index", "function"} and set(fragment["function"]) == {"arguments"}
    assert seen == {0, 1}
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in chunks)
    assert reasoning == REASONING == "".join(c["choices"][0]["delta"].get("reasoning", "") for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_chat_stream_accumulates_in_the_openai_helper(client):
    with client.chat.completions.stream(model="m", messages=MESSAGES, tools=TOOLS,
                                        stream_options={"include_usage": True}) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    message = final.choices[0].message
    assert calls_of(message.tool_calls) == EXPECTED_CALLS
    assert message.content == CONTENT
    assert final.choices[0].finish_reason == "tool_calls"
    assert final.usage.completion_tokens_details.reasoning_tokens == REASONING_TOKENS


def test_tool_calls_of_each_choice_whole_and_in_the_stream_helper(client):
    """n = 2: each choice carries its own calls (ids unique across the response), and the openai
    helper assembles the interleaved stream into the same choices."""
    whole = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, n=2)
    with client.chat.completions.stream(model="m", messages=MESSAGES, tools=TOOLS, n=2,
                                        stream_options={"include_usage": True}) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion()
    for r in (whole, streamed):
        assert [c.index for c in r.choices] == [0, 1]
        assert all(calls_of(c.message.tool_calls) == EXPECTED_CALLS and c.message.content == CONTENT
                   and c.finish_reason == "tool_calls" for c in r.choices)
        assert len({call.id for c in r.choices for call in c.message.tool_calls}) == 4
        assert r.usage.completion_tokens == 2 * len(PIECES)
        assert r.usage.completion_tokens_details.reasoning_tokens == 2 * REASONING_TOKENS


def test_async_client_stream_accumulation(server):
    async def run() -> tuple[str, str, dict[int, dict], str | None]:
        client = openai.AsyncOpenAI(base_url=server[0].url + "/v1", api_key="unused", max_retries=0)
        reasoning, content, calls, finish = "", "", {}, None
        async for chunk in await client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS,
                                                                stream=True):
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                call["name"] += tc.function.name or ""
                call["arguments"] += tc.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        await client.close()
        return reasoning, content, calls, finish

    reasoning, content, calls, finish = asyncio.run(run())
    assert (reasoning, content, finish) == (REASONING, CONTENT, "tool_calls")
    assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] == EXPECTED_CALLS


def test_tool_choice_and_thinking_switches_reach_the_template(client, server):
    client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS)
    assert "get_weather" in last_prompt(server) and "get_time" in last_prompt(server)
    client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice="none")
    assert "<tools>" not in last_prompt(server)
    client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS,
                                   tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert "get_time" in last_prompt(server) and "get_weather" not in last_prompt(server)
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    for extra in ({"reasoning_effort": "none"}, {"reasoning_effort": "minimal"},
                  {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}):
        client.chat.completions.create(model="m", messages=MESSAGES, **extra)
        assert last_prompt(server).endswith("<think>\n\n</think>\n\n"), extra
    client.chat.completions.create(model="m", messages=MESSAGES, reasoning_effort="high")
    assert last_prompt(server).endswith("<think>\n")


def test_multi_turn_reasoning_and_tool_results_are_accepted(client, server):
    history = MESSAGES + [
        {"role": "assistant", "content": "", "reasoning": "earlier thoughts",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_time", "arguments": "{\"zone\": \"CET\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    client.chat.completions.create(model="m", messages=history, tools=TOOLS,
                                   extra_body={"chat_template_kwargs": {"preserve_thinking": True}})
    prompt = last_prompt(server)
    assert "earlier thoughts" in prompt and "<function=get_time>" in prompt and "12:00" in prompt


def test_responses_items_whole_and_streamed(client):
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    whole = client.responses.create(model="m", input="Weather in Paris?", tools=tools)
    with client.responses.stream(model="m", input="Weather in Paris?", tools=tools) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    for response in (whole, streamed):
        assert response.status == "completed"
        assert [item.type for item in response.output] == ["reasoning", "message", "function_call",
                                                           "function_call"]
        assert response.output[0].content[0].text == REASONING
        assert response.output_text == CONTENT
        calls = [(item.name, json.loads(item.arguments)) for item in response.output[2:]]
        assert calls == EXPECTED_CALLS
        assert response.usage.output_tokens_details.reasoning_tokens == REASONING_TOKENS
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert {"response.reasoning_text.delta", "response.output_text.delta",
            "response.function_call_arguments.delta"} <= set(kinds)


def test_responses_function_call_round_trip(client, server):
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    first = client.responses.create(model="m", input="Weather in Paris?", tools=tools)
    call = first.output[2]
    client.responses.create(model="m", previous_response_id=first.id, tools=tools,
                            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    prompt = last_prompt(server)
    assert "Weather in Paris?" in prompt and "<function=get_weather>" in prompt and "sunny" in prompt


def test_anthropic_messages_blocks_whole_and_streamed(server):
    client = anthropic.Anthropic(base_url=server[0].url, api_key="unused", max_retries=0)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    args = dict(model="m", max_tokens=500, tools=tools, messages=MESSAGES,
                thinking={"type": "enabled", "budget_tokens": 200})
    whole = client.messages.create(**args)
    with client.messages.stream(**args) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_message()
    for message in (whole, streamed):
        assert [b.type for b in message.content] == ["thinking", "text", "tool_use", "tool_use"]
        assert message.content[0].thinking == REASONING and message.content[1].text == CONTENT
        assert [(b.name, b.input) for b in message.content[2:]] == EXPECTED_CALLS
        assert message.stop_reason == "tool_use"
        assert message.usage.output_tokens == len(PIECES)
    # thinking follows Anthropic's default (off) when the request does not ask for it
    client.messages.create(model="m", max_tokens=50, messages=MESSAGES)
    assert last_prompt(server).endswith("<think>\n\n</think>\n\n")


def test_anthropic_tool_results_reach_the_prompt(server):
    client = anthropic.Anthropic(base_url=server[0].url, api_key="unused", max_retries=0)
    tools = [{"name": "get_time", "input_schema": TOOLS[1]["function"]["parameters"]}]
    messages = [
        {"role": "user", "content": "What time is it in CET?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I need the clock.", "signature": ""},
            {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"zone": "CET"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "12:00"},
                                     {"type": "text", "text": "Thanks."}]},
    ]
    client.messages.create(model="m", max_tokens=50, tools=tools, messages=messages,
                           thinking={"type": "enabled", "budget_tokens": 100})
    prompt = last_prompt(server)
    assert "<function=get_time>\n<parameter=zone>\nCET" in prompt
    assert prompt.index("<tool_response>\n12:00") < prompt.index("Thanks.")
    assert "I need the clock." not in prompt  # the template drops reasoning before the last user turn...
    client.messages.create(model="m", max_tokens=50, tools=tools, messages=messages,
                           extra_body={"chat_template_kwargs": {"preserve_thinking": True}})
    assert "I need the clock." in last_prompt(server)  # ...unless asked to keep it
    with pytest.raises(anthropic.BadRequestError, match="no vision tower"):
        client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])

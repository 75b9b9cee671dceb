"""The HTTP server on the real engine (tiny random Qwen3.5 MoE, CPU): real uvicorn on loopback,
driven by the official openai / anthropic clients and by raw HTTP where the wire matters.

References: transformers' `generate` for greedy tokens; the same server run one request at a
time for batching; the engine's own stats for batching and for freed KV.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import anthropic
import httpx
import openai
import pytest
import torch

from ninfer_core.chat.output_parser import parse_output
from ninfer_core.llm import ChatRequest
from ninfer_core.server import body
from ninfer_core.server.app import WARM_ROUTES, ServerHandle
from server_harness import MAX_CONTEXT, load_tiny_llm, sse_json, wait_for, write_model

HI = [{"role": "user", "content": "Say hi"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory)


@pytest.fixture(scope="module")
def server(model):
    llm = load_tiny_llm(model[0])
    handle = ServerHandle.start(llm, port=0, model_id="m")
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="anything", max_retries=0)


def post(server, path: str, body, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60, **kw)


def stats(server):
    return server.service.stats()


def reference_tokens(hf, prompt_ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          eos_token_id=None)
    return out[0, len(prompt_ids):].tolist()


def assert_error(response: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert {"message", "type", "param", "code"} <= error.keys() and error["message"]
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


# -- the wire ---------------------------------------------------------------------------------------


def test_connections_send_small_writes_at_once(server):
    """Every accepted connection has Nagle's algorithm off (TCP_NODELAY), so a streamed token is
    not held back waiting for the client's delayed ACK of the previous write (~40 ms each time on
    a keep-alive connection). Checked on the server's own sockets while a stream is open, on the
    second request of one connection."""
    with httpx.Client(base_url=server.url, timeout=60) as http:
        body = {"model": "m", "prompt": "hi", "max_tokens": 4, "stream": True}
        for _ in range(2):
            with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                assert next(lines).startswith("data: ")
                state = server._server.server_state  # uvicorn's open connections (its protocol objects)
                wait_for(lambda: bool(state.connections), timeout=5, what="an open connection")
                flags = [c.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                         for c in list(state.connections)]
                assert flags and all(flags), flags
                assert list(lines)[-2:] == ["data: [DONE]", ""]


# -- endpoints ------------------------------------------------------------------------------------

def test_health_and_models(server, client):
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    models = client.models.list().data
    assert len(models) == 1 and models[0].id == server.model_id
    card = client.models.retrieve(models[0].id)
    assert card.max_model_len == MAX_CONTEXT == card.context_length
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_start_sends_each_generation_route_an_uncounted_request(model, monkeypatch):
    """Before the server takes connections it answers one throw-away request per generation route,
    so that the first client's does not build the routes; /metrics does not count them."""
    seen: list[str] = []
    read_json = body.read_json

    async def spy(request, limit):
        seen.append(request.url.path)
        return await read_json(request, limit)

    monkeypatch.setattr(body, "read_json", spy)
    handle = ServerHandle.start(load_tiny_llm(model[0]), port=0, api_key="k")
    try:
        assert sorted(seen) == sorted(WARM_ROUTES)  # past the API key check too
        metrics = httpx.get(handle.url + "/metrics", headers={"Authorization": "Bearer k"}).text
        assert "ninfer_http_requests_total{" not in metrics
    finally:
        handle.stop()


def test_health_is_503_until_the_model_is_loaded(model):
    release = threading.Event()

    def loader():
        release.wait(30)
        return load_tiny_llm(model[0])

    handle = ServerHandle.start(loader, port=0)
    try:
        assert_error(httpx.get(handle.url + "/health"), 503, "model_loading")
        assert_error(post(handle, "/v1/chat/completions", {"messages": HI}), 503, "model_loading")
        release.set()
        wait_for(lambda: httpx.get(handle.url + "/health").status_code == 200, what="model load")
    finally:
        handle.stop()
    failing = ServerHandle.start(lambda: (_ for _ in ()).throw(RuntimeError("disk on fire")), port=0)
    try:
        wait_for(lambda: failing.error is not None, what="load failure")
        assert "disk on fire" in assert_error(httpx.get(failing.url + "/health"), 503, "model_load_failed")["message"]
    finally:
        failing.stop()


def test_completions_match_transformers(server, client, model):
    hf = model[1]
    prompt = [5, 17, 42, 99, 3, 250, 7]
    expected = reference_tokens(hf, prompt, 12)
    tokenizer = server.service.llm.tokenizer
    r = client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), 12)
    chunks = list(client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    echoed = client.completions.create(model="m", prompt="Paris is", max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith("Paris is")


def test_completions_echo_a_prompt_of_token_ids_as_its_text(server, client):
    """A prompt of ids comes back decoded with echo (whole and streamed, before the answer); without
    echo the answer alone (the ids are then never decoded)."""
    prompt = [5, 17, 42, 99, 3, 250, 7]
    text = server.service.llm.tokenizer.decode(prompt, skip_special_tokens=True)
    assert text
    args = dict(model="m", prompt=prompt, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(**args).choices[0].text
    echoed = client.completions.create(**args, echo=True).choices[0].text
    assert echoed == text + plain
    chunks = [c.choices[0].text for c in client.completions.create(**args, echo=True, stream=True) if c.choices]
    assert chunks[0] == text and "".join(chunks) == echoed
    assert "".join(c.choices[0].text for c in client.completions.create(**args, stream=True) if c.choices) == plain


def test_chat_matches_transformers_and_stream_matches_whole(server, client, model):
    llm = server.service.llm
    prompt_ids = llm.prepare_chat(ChatRequest(messages=HI)).prompt_token_ids
    expected = parse_output(llm.tokenizer.decode(reference_tokens(model[1], prompt_ids, 16), skip_special_tokens=True),
                            starts_in_reasoning=True)
    whole = client.chat.completions.create(model="m", messages=HI, max_completion_tokens=16, temperature=0,
                                           extra_body={"ignore_eos": True})
    message = whole.choices[0].message
    assert (message.content or "", message.reasoning_content or "") == (expected.content, expected.reasoning)
    assert whole.usage.prompt_tokens == len(prompt_ids) and whole.usage.completion_tokens == 16
    assert whole.choices[0].finish_reason == "length"
    body = {"model": "m", "messages": HI, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as response:
        frames = sse_json(response)
    assert frames[-1] == "[DONE]"
    chunks = frames[:-1]
    assert len({(c["id"], c["created"]) for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert not any("role" in c["choices"][0]["delta"] for c in chunks[1:-1])
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole.usage.model_dump(exclude_none=True)
    deltas = [c["choices"][0]["delta"] for c in chunks[:-1]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == expected.reasoning
    assert "".join(d.get("content", "") for d in deltas) == expected.content
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_sampling_knobs_and_stop(server, client):
    args = dict(model="m", messages=HI, max_tokens=12, extra_body={"ignore_eos": True, "top_k": 20, "min_p": 0.05,
                                                                    "repetition_penalty": 1.2})
    a = client.chat.completions.create(temperature=1.0, top_p=0.9, seed=11, presence_penalty=0.5,
                                       frequency_penalty=0.5, **args)
    b = client.chat.completions.create(temperature=1.0, top_p=0.9, seed=11, presence_penalty=0.5,
                                       frequency_penalty=0.5, **args)
    assert a.choices[0].message.model_dump() == b.choices[0].message.model_dump()  # same seed, same answer
    full = client.completions.create(model="m", prompt="The quick", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[4:7]
    assert stop.strip(), f"degenerate stop string {stop!r}"
    cut = client.completions.create(model="m", prompt="The quick", max_tokens=12, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.text == full[: full.index(stop)] and cut.finish_reason == "stop"


def test_min_tokens_holds_back_the_end(server):
    """vLLM's min_tokens: an answer pushed to end at once (its end id biased +100) runs 4 tokens first."""
    eos = sorted(server.service.engine.eos_ids)[0]
    body = {"model": "m", "prompt": "The quick", "max_tokens": 10, "temperature": 0, "logit_bias": {str(eos): 100}}
    at_once = post(server, "/v1/completions", body).json()
    held = post(server, "/v1/completions", {**body, "min_tokens": 4}).json()
    assert at_once["usage"]["completion_tokens"] == 1 and at_once["choices"][0]["finish_reason"] == "stop"
    assert held["usage"]["completion_tokens"] == 5 and held["choices"][0]["finish_reason"] == "stop"
    assert_error(post(server, "/v1/completions", {**body, "min_tokens": 11}), 400, "invalid_value", "min_tokens")


def test_responses_and_previous_response_id(server, client):
    llm = server.service.llm
    first = client.responses.create(model="m", input="Say hi", max_output_tokens=6, temperature=0)
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    assert first.usage.input_tokens == len(llm.prepare_chat(ChatRequest(messages=HI)).prompt_token_ids)
    reasoning = first.output[0].content[0].text if first.output[0].type == "reasoning" else ""
    second = client.responses.create(model="m", input="And again", previous_response_id=first.id,
                                     max_output_tokens=4, temperature=0, instructions="Be brief.")
    history = [{"role": "system", "content": "Be brief."}, *HI,
               {"role": "assistant", "content": first.output_text, "reasoning_content": reasoning},
               {"role": "user", "content": "And again"}]
    assert second.usage.input_tokens == len(llm.prepare_chat(ChatRequest(messages=history)).prompt_token_ids)
    assert client.responses.retrieve(second.id).id == second.id
    # the SDK's stream helper insists on response.completed; a max_output_tokens cut ends with
    # response.incomplete (as on OpenAI), so read the raw events
    events = list(client.responses.create(model="m", input="Say hi", max_output_tokens=6, temperature=0, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = events[-1].response
    assert [i.model_dump(exclude={"id"}) for i in streamed.output] == [i.model_dump(exclude={"id"})
                                                                       for i in first.output]
    with pytest.raises(openai.BadRequestError, match="not found"):
        client.responses.create(model="m", input="x", previous_response_id="resp_missing")


def test_anthropic_messages(server, model):
    client = anthropic.Anthropic(base_url=server.url, api_key="anything", max_retries=0)
    # this SDK version has no `temperature` argument: sent as an extra field
    args = dict(model="m", max_tokens=10, messages=HI, system="Be nice.", extra_body={"temperature": 0})
    whole = client.messages.create(**args)
    with client.messages.stream(**args) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert [b.type for b in whole.content] == [b.type for b in final.content]
    assert "".join(b.text for b in whole.content if b.type == "text") == text
    assert whole.stop_reason in ("max_tokens", "end_turn") and whole.usage.output_tokens <= 10
    count = client.messages.count_tokens(model="m", messages=HI, system="Be nice.")
    assert count.input_tokens == whole.usage.input_tokens


def test_an_assistant_prefill_is_continued(server, client, model):
    """vLLM's continue_final_message and Anthropic's trailing assistant turn: the prompt ends with the
    prefill's text (the template's answer header with an empty reasoning block, then the text), and
    the answer is transformers' greedy continuation of those ids."""
    llm = server.service.llm
    messages = [*HI, {"role": "assistant", "content": "Hello"}]
    prompt_ids = llm.tokenizer.encode_prompt(llm.template.render(HI, enable_thinking=False) + "Hello")
    assert llm.prepare_chat(ChatRequest(messages=messages, continue_final=True)).prompt_token_ids == prompt_ids
    expected = parse_output(llm.tokenizer.decode(reference_tokens(model[1], prompt_ids, 8), skip_special_tokens=True),
                            starts_in_reasoning=False)
    chat = client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0,
                                          extra_body={"continue_final_message": True, "ignore_eos": True})
    assert (chat.choices[0].message.content or "") == expected.content and chat.usage.prompt_tokens == len(prompt_ids)
    anthropic_client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    message = anthropic_client.messages.create(model="m", max_tokens=8, messages=messages,
                                               extra_body={"temperature": 0, "ignore_eos": True})
    assert "".join(b.text for b in message.content if b.type == "text") == expected.content
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == len(prompt_ids)  # Anthropic's split
    for extra, param in (({}, "messages"), ({"response_format": {"type": "json_object"}}, "response_format")):
        asking = messages if extra else HI  # a user turn last: nothing to continue
        assert_error(post(server, "/v1/chat/completions", {"messages": asking, "continue_final_message": True,
                                                           **extra}), 400, param=param)


def test_async_clients_on_every_endpoint(server):
    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        greedy = dict(temperature=0, extra_body={"ignore_eos": True})
        models = await client.models.list()
        chat = await client.chat.completions.create(model="m", messages=HI, max_tokens=5, **greedy)
        text = await client.completions.create(model="m", prompt="Paris is", max_tokens=5, **greedy)
        response = await client.responses.create(model="m", input="Say hi", max_output_tokens=5, **greedy)
        events = [e.type async for e in await client.responses.create(model="m", input="Say hi", max_output_tokens=5,
                                                                       stream=True, **greedy)]
        await client.close()
        anthropic_client = anthropic.AsyncAnthropic(base_url=server.url, api_key="x", max_retries=0)
        message = await anthropic_client.messages.create(model="m", max_tokens=5, messages=HI)
        await anthropic_client.close()
        return models, chat, text, response, events, message

    models, chat, text, response, events, message = asyncio.run(run())
    assert models.data[0].id == server.model_id
    assert chat.usage.completion_tokens == text.usage.completion_tokens == response.usage.output_tokens == 5
    assert events[0] == "response.created" and events[-1] == "response.incomplete"
    assert message.type == "message" and message.usage.output_tokens <= 5


def test_metrics(server, client):
    client.chat.completions.create(model="m", messages=HI, max_tokens=3)
    text = httpx.get(server.url + "/metrics").text
    assert re.search(r'ninfer_http_requests_total\{route="/v1/chat/completions",status="200"\} [1-9]', text)
    for name in ("ninfer_time_to_first_token_seconds_count", "ninfer_inter_token_latency_seconds_count",
                 "ninfer_generation_tokens_total", "ninfer_prompt_tokens_total"):
        assert float(re.search(rf"^{name} (\S+)$", text, re.M).group(1)) > 0, name
    for name in ("ninfer_kv_cache_usage_ratio", "ninfer_requests_waiting", "ninfer_requests_running",
                 "ninfer_spec_decode_accepted_tokens_total"):
        assert re.search(rf"^{name} ", text, re.M), name


# -- batching ------------------------------------------------------------------------------------

def test_eight_simultaneous_streams_equal_serial_and_batch(model):
    llm = load_tiny_llm(model[0])
    handle = ServerHandle.start(llm, port=0, model_id="m")
    n_tokens = 12
    questions = [[{"role": "user", "content": f"Question {i}: what is {i} + {i}?"}] for i in range(8)]
    args = dict(model="m", max_tokens=n_tokens, temperature=0, extra_body={"ignore_eos": True})

    async def one(client: openai.AsyncOpenAI, messages) -> str:
        text = ""
        async for chunk in await client.chat.completions.create(messages=messages, stream=True, **args):
            if chunk.choices:
                delta = chunk.choices[0].delta
                text += (getattr(delta, "reasoning_content", None) or "") + "|" + (delta.content or "")
        return text

    async def run(concurrent: bool) -> list[str]:
        client = openai.AsyncOpenAI(base_url=handle.url + "/v1", api_key="x", max_retries=0)
        if concurrent:
            out = await asyncio.gather(*(one(client, q) for q in questions))
        else:
            out = [await one(client, q) for q in questions]
        await client.close()
        return list(out)

    try:
        serial = asyncio.run(run(False))
        before = handle.service.stats().engine
        assert before.max_decode_batch == 1
        together = asyncio.run(run(True))
        after = handle.service.stats().engine
    finally:
        handle.stop()
    assert together == serial
    assert len(set(serial)) > 1  # the prompts really differ
    rows = after.decode_rows - before.decode_rows
    assert rows == 8 * (n_tokens - 1)  # the first token of each comes from its prefill
    assert after.max_decode_batch > 1 and after.decode_steps - before.decode_steps < rows
    assert after.kv_used_tokens == 0 and after.running == 0


# -- errors ----------------------------------------------------------------------------------------

def test_bad_requests_get_openai_error_bodies(server):
    url = "/v1/chat/completions"
    assert_error(httpx.post(server.url + url, content=b'{"messages": [', headers={"content-type": "application/json"}),
                 400, "invalid_json")
    assert_error(httpx.post(server.url + url, content=b""), 400, "invalid_json")
    assert_error(post(server, url, [1, 2]), 400, "invalid_json")
    assert_error(post(server, url, {"messages": HI, "temperature": "hot"}), 400, "invalid_type", "temperature")
    assert_error(post(server, url, {"messages": HI, "max_tokens": "5"}), 400, "invalid_type", "max_tokens")
    assert_error(post(server, url, {"messages": "hi"}), 400, param="messages")
    assert_error(post(server, url, {"messages": [{"role": "robot", "content": "x"}]}), 400, param="messages[0].role")
    assert_error(post(server, url, {"model": "m"}), 400, param="messages")
    assert_error(post(server, url, {"messages": HI, "temperature": -1}), 400)
    assert_error(post(server, url, {"messages": HI, "n": 0}), 400, param="n")
    assert_error(post(server, url, {"messages": HI, "top_logprobs": 2}), 400, param="top_logprobs")
    assert_error(post(server, url, {"messages": HI, "response_format": {"type": "yaml"}}), 400,
                 param="response_format.type")
    image = [{"role": "user", "content": [{"type": "text", "text": "what is it?"},
                                          {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]
    assert_error(post(server, url, {"messages": image}), 400, "unsupported_content")
    assert "vocabulary" in assert_error(post(server, "/v1/completions", {"prompt": [1, 10**6]}), 400)["message"]
    assert_error(httpx.get(server.url + "/v1/nothing-here"), 404, "not_found")
    assert_error(httpx.get(server.url + url), 405, "method_not_allowed")
    # accepted and ignored: n=1, user, unknown fields (logit_bias and parallel_tool_calls are honoured), text parts
    ok = post(server, url, {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                            "max_tokens": 2, "n": 1, "user": "u", "logit_bias": {"5": 1}, "parallel_tool_calls": True,
                            "prompt_cache_key": "k", "some_vendor_extra": {"x": 1}})
    assert ok.status_code == 200, ok.text
    assert stats(server).engine.running == 0 and stats(server).engine.kv_used_tokens == 0


def test_context_overflow_is_400_with_the_numbers(server, client):
    long_prompt = [{"role": "user", "content": "fox " * 400}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=long_prompt)
    body = err.value.body
    assert body["code"] == "context_length_exceeded" and body["context_limit"] == MAX_CONTEXT
    assert body["prompt_tokens"] > MAX_CONTEXT and str(body["prompt_tokens"]) in body["message"]
    stream = post(server, "/v1/chat/completions", {"messages": long_prompt, "stream": True})
    assert_error(stream, 400, "context_length_exceeded")  # refused before the stream starts
    assert stats(server).engine.kv_used_tokens == 0


def _raw_request(server, head: bytes, body_chunks) -> bytes:
    """Send a request by hand (the client may stop sending when the server answers) and read the reply."""
    with socket.create_connection((server.host, server.port), timeout=30) as sock:
        sock.sendall(head)
        try:
            for chunk in body_chunks:
                sock.sendall(chunk)
        except OSError:  # the server answered and closed: it did not read the rest
            pass
        reply = b""
        while b"\r\n\r\n" not in reply or len(reply) < reply.index(b"\r\n\r\n") + 60:
            data = sock.recv(65536)
            if not data:
                break
            reply += data
        return reply


def test_oversized_bodies_are_413_without_being_read(server):
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: 52428800\r\n\r\n")
    started = time.monotonic()
    reply = _raw_request(server, head, [b"x" * 65536])  # 64 KB of the announced 50 MB
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b'"code":"request_too_large"' in reply and time.monotonic() - started < 10
    chunked = b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n"
    mb = b"y" * (1 << 20)
    reply = _raw_request(server, chunked, (b"100000\r\n" + mb + b"\r\n" for _ in range(50)))
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert httpx.get(server.url + "/health").status_code == 200


def test_api_key_and_cors(model):
    llm = load_tiny_llm(model[0])
    handle = ServerHandle.start(llm, port=0, api_key="s3cret", model_id="m")
    try:
        url = handle.url
        assert httpx.get(url + "/health").status_code == 200  # public
        assert_error(httpx.get(url + "/v1/models"), 401, "invalid_api_key")
        assert_error(httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}), 401, "invalid_api_key")
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(url + "/v1/models", headers={"x-api-key": "s3cret"}).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        preflight = {"Origin": "http://localhost:5173", "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization,content-type"}
        ok = httpx.options(url + "/v1/chat/completions", headers=preflight)
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://localhost:5173"
        assert "authorization" in ok.headers["access-control-allow-headers"].lower()
        evil = httpx.options(url + "/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"})
        assert evil.status_code == 400 and "access-control-allow-origin" not in evil.headers
        simple = httpx.get(url + "/v1/models", headers={"Origin": "http://127.0.0.1:3000", "x-api-key": "s3cret"})
        assert simple.headers["access-control-allow-origin"] == "http://127.0.0.1:3000"
    finally:
        handle.stop()


def test_disconnects_free_the_kv_and_the_server_keeps_serving(server, client):
    body = {"messages": HI, "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    generated = stats(server).engine.generated_tokens
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(6):  # a few chunks, then hang up
            next(lines)
        assert stats(server).engine.kv_used_tokens > 0
    wait_for(lambda: stats(server).engine.running == 0, what="the stream's request to be dropped")
    assert stats(server).engine.generated_tokens - generated < 200  # dropped, not run to the end
    generated = stats(server).engine.generated_tokens
    # a non-streaming client that gives up: 400 tokens take the tiny model well over the 50 ms it waits
    # (~1 ms a token here; 200 tokens and 0.5 s passed once its CPU decode step fell under 2.5 ms)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json={**body, "max_tokens": 400},
                   timeout=httpx.Timeout(60, read=0.05))
    wait_for(lambda: stats(server).engine.running == 0, what="the non-stream request to be dropped")
    assert stats(server).engine.generated_tokens - generated < 400
    after = stats(server)
    assert after.engine.kv_used_tokens == 0 and after.kv_reserved_tokens == 0 and after.waiting == 0
    r = client.chat.completions.create(model="m", messages=HI, max_tokens=3, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3


def test_queue_full_is_429_with_retry_after(model):
    llm = load_tiny_llm(model[0])
    handle = ServerHandle.start(llm, port=0, max_concurrency=1, max_queue=1, model_id="m")
    body = {"messages": HI, "max_tokens": 200, "ignore_eos": True, "stream": True}
    hang_up = threading.Event()

    def hold():
        with httpx.stream("POST", handle.url + "/v1/chat/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()  # kept: dropping the iterator would close the connection
            next(lines)
            hang_up.wait(30)

    holders = [threading.Thread(target=hold) for _ in range(2)]
    try:
        holders[0].start()
        wait_for(lambda: handle.service.stats().engine.running == 1, what="the first request to run")
        holders[1].start()
        wait_for(lambda: handle.service.stats().waiting == 1, what="the second request to queue")
        refused = post(handle, "/v1/chat/completions", {"messages": HI, "max_tokens": 2})
        assert_error(refused, 429, "queue_full")
        assert refused.headers["retry-after"].isdigit()
    finally:
        hang_up.set()
        for t in holders:
            if t.is_alive():
                t.join(30)
        wait_for(lambda: handle.service.stats().engine.running == 0, what="the holders to be dropped")
        handle.stop()


def test_error_inside_a_stream_is_an_error_event(model):
    llm = load_tiny_llm(model[0])
    handle = ServerHandle.start(llm, port=0, model_id="m")
    body = {"messages": HI, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", handle.url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        stopper = threading.Thread(target=handle.stop)
        stopper.start()  # the engine stops under the stream
        frames = [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
                  for line in lines if line.startswith("data: ")]
    stopper.join(30)
    assert frames[-1] == "[DONE]"
    error = frames[-2]["error"]
    assert "stopped" in error["message"] and error["code"] == "unavailable"


# -- the command line ------------------------------------------------------------------------------

def test_ninfer_serve_command(model, tmp_path):
    env = {**os.environ, "NINFER_PORT": "0", "NINFER_DEVICE": "cpu", "NINFER_MAX_CONTEXT": "128",
           "NINFER_API_KEY": "k", "NINFER_WEIGHTS": "bf16", "NINFER_HOME": str(tmp_path), "NINFER_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "ninfer_app", "serve", str(model[0])], env=env,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        url = re.search(r"listening on (http://\S+) ", line).group(1)
        wait_for(lambda: httpx.get(url + "/health").status_code == 200, timeout=60, what="ninfer serve")
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        served = client.models.list().data[0]
        assert served.id == model[0].name and served.max_model_len == 128  # NINFER_MAX_CONTEXT reached the engine
        r = client.chat.completions.create(model=served.id, messages=HI, max_tokens=2, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 2
        ps = httpx.get(url + "/api/ps", headers={"Authorization": "Bearer k"}).json()
        assert ps["threads"] == 1 and [m["name"] for m in ps["models"]] == [served.id]  # NINFER_THREADS applied
        ready = proc.stderr.readline()  # the startup report: capacity, formats
        assert "ready (context 128 tokens" in ready and "weights float32" in ready and "KV fp16 1,024 tokens" in ready, ready
        assert "CUDA graphs off" in ready
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        proc.stderr.close()

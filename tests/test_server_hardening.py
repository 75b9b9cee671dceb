"""Regression tests of the server-hardening issue, each through a real server on loopback (tiny
random Qwen3.5 MoE, CPU) and the real clients: a bad request fails alone, malformed input is a
400 in the endpoint's shape (never a 500 with exception text), a client that leaves while queued
gives its place back, every status is counted, foreign Host names and cross-site web pages are
refused, Anthropic errors carry Anthropic's type names, logit_bias is honoured, an abandoned upload
is no server error, and Ctrl-C / SIGTERM end every stream properly.
The image-cost test lives with the media server tests (test_server_media.py), the checkpoint
tests with their loaders (test_config.py, test_gguf.py), the fuzzing in test_server_fuzz.py.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from ninfer_core.server.app import ServerHandle
from ninfer_core.server.body import BadJson, parse_json
from ninfer_core.server.hosts import HostPolicy, OriginPolicy
from ninfer_core.server.stop_signals import StopSignals
from server_harness import MAX_CONTEXT, load_tiny_llm, serve, sse_json, wait_for, write_model

HI = [{"role": "user", "content": "Say hi"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory, "tiny_hardening")


@pytest.fixture(scope="module")
def server(model):
    yield from serve(model[0])


def raw_post(handle: ServerHandle, path: str, body: bytes | str, **headers: str) -> httpx.Response:
    data = body.encode() if isinstance(body, str) else body
    return httpx.post(handle.url + path, content=data, headers={"content-type": "application/json", **headers},
                      timeout=60)


def assert_400(response: httpx.Response, param: str | None = None, *texts: str) -> dict:
    """A 400 in OpenAI's shape (also Anthropic's: the top-level type), with no exception text."""
    assert response.status_code == 400, response.text
    body = response.json()
    error = body["error"]
    assert body["type"] == "error" and error["type"] == "invalid_request_error"
    assert {"message", "type", "param", "code"} <= error.keys() and error["message"]
    assert not re.search(r"Traceback|Error:|Exception", error["message"]), error
    if param is not None:
        assert error["param"] == param, error
    for text in texts:
        assert text in error["message"], (text, error["message"])
    return error


def metric(handle: ServerHandle, route: str, status: int) -> float:
    text = httpx.get(handle.url + "/metrics").text
    found = re.search(rf'ninfer_http_requests_total\{{route="{re.escape(route)}",status="{status}"\}} (\S+)', text)
    return float(found.group(1)) if found else 0.0


def stream_text(response: httpx.Response) -> Iterator[str]:
    for frame in sse_json(response):
        if frame != "[DONE]" and frame.get("choices"):
            yield frame["choices"][0]["delta"].get("content") or frame["choices"][0]["delta"].get("reasoning") or ""


# -- 1. a bad row never reaches the batch -----------------------------------------------------------

def test_out_of_range_sampling_fails_that_request_alone(server):
    body = {"messages": HI, "max_tokens": 60, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as alone:
        reference = "".join(stream_text(alone))
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        frames = stream_text(r)
        text = next(frames) + next(frames)  # it is running: the bad requests arrive beside it
        bad = {"top_k": 2**63, "seed": 2**64, "repetition_penalty": 1e-300, "max_tokens": 2**63,
               "logit_bias": {str(server.service.llm.loaded.config.vocab_size): 5}}
        for name, value in bad.items():
            assert_400(httpx.post(server.url + "/v1/chat/completions", json={"messages": HI, name: value}),
                       name)
        text += "".join(frames)
    assert text == reference  # bit-identical: the bad requests never touched its batch
    ok = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                    json={"messages": HI, "max_tokens": 2, "top_k": 2**63 - 1, "seed": 2**64 - 1})
    assert ok.status_code == 200, ok.text  # the largest values the engine holds are accepted


# -- 2. malformed input is a 400 -----------------------------------------------------------------------

CHAT, COMPLETIONS, RESPONSES, MESSAGES = "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"


def test_the_depth_limit_holds_for_numbers_too():
    """check_document skips the numbers it has nothing to check in, but not past the depth limit."""
    assert parse_json("[" * 100 + "1" + "]" * 100)  # the number is 100 levels deep: the limit
    for text in ("[" * 101 + "1" + "]" * 101, '{"a":' * 101 + "null" + "}" * 101):
        with pytest.raises(BadJson, match="nested more than 100 levels"):
            parse_json(text)


def test_malformed_requests_are_400_naming_the_field(server):
    deep = "[" * 100_000 + "]" * 100_000
    assert_400(raw_post(server, CHAT, deep), None, "nested more than 100 levels")
    for path, body, param in [
        (CHAT, '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
        (CHAT, '{"messages": [{"role": "robot\\udfff", "content": "x"}]}', "messages[0].role"),
        (COMPLETIONS, '{"prompt": "a\\udbff"}', "prompt"),
        (RESPONSES, '{"input": [{"role": "user", "content": [{"type": "input_text", "text": "\\ud800"}]}]}',
         "input[0].content[0].text"),
        (MESSAGES, '{"messages": [{"role": "user", "content": "x"}], "system": "\\ud800"}', "system"),
    ]:
        assert_400(raw_post(server, path, body), param, "surrogate")
    vocab = server.service.llm.loaded.config.vocab_size
    assert_400(httpx.post(server.url + COMPLETIONS, json={"prompt": [1, vocab]}), "prompt", "vocabulary")
    assert_400(httpx.post(server.url + COMPLETIONS, json={"prompt": [2**70]}), "prompt[0]")
    assert_400(httpx.post(server.url + COMPLETIONS, json={"prompt": [-1]}), "prompt[0]")
    assert_400(raw_post(server, CHAT, '{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}'),
               None, "NaN")
    assert_400(raw_post(server, CHAT, '{"messages": [{"role": "user", "content": "x"}], "top_p": 1e400}'),
               None, "out of range")
    assert_400(raw_post(server, CHAT, '{"messages": [{"role": "user", "content": "x"}], "seed": 1' + "0" * 5000 + "}"))
    nested_args = '{"a": ' * 500 + "1" + "}" * 500
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": nested_args}}]}
    assert_400(httpx.post(server.url + CHAT, json={"messages": [*HI, call]}),
               "messages[1].tool_calls[0].function.arguments", "nested")
    for body, param in [
        ({"input": "hi", "text": {"format": "json"}}, "text.format"),
        ({"input": [{"type": "reasoning", "summary": 5}, {"role": "user", "content": "x"}]}, "input[0].summary"),
        ({"input": [{"type": "function_call", "name": "f", "call_id": "c", "arguments": "[1]"}]}, "input[0].arguments"),
        ({"input": [5]}, "input[0]"),
    ]:
        assert_400(httpx.post(server.url + RESPONSES, json=body), param)
    for body, param in [
        ({"messages": [{"role": "user", "content": [5]}]}, "messages[0].content[0]"),
        ({"messages": HI, "tools": [{"type": "function", "function": {"name": "f", "parameters": 5}}]},
         "tools[0].function.parameters"),
        ({"messages": [{"role": "assistant", "content": "x", "tool_calls": [5]}]}, "messages[0].tool_calls[0]"),
    ]:
        assert_400(httpx.post(server.url + CHAT, json=body), param)
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    for choice, param in [({"type": "tool"}, "tool_choice.name"), ({"type": 5}, "tool_choice.type")]:
        with pytest.raises(anthropic.BadRequestError) as err:
            client.messages.create(model="m", max_tokens=2, messages=HI, tool_choice=choice)  # type: ignore[arg-type]
        assert err.value.body["error"]["param"] == param and err.value.body["type"] == "error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="m", max_tokens=2, messages=[
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": 5}]}])  # type: ignore
    assert metric(server, CHAT, 500) == metric(server, RESPONSES, 500) == metric(server, MESSAGES, 500) == 0
    assert server.service.stats().engine.running == 0


# -- 3. a client that leaves while queued gives its place back ---------------------------------------

def _send_and_hold(handle: ServerHandle, body: dict) -> socket.socket:
    sock = socket.create_connection((handle.host, handle.port), timeout=30)
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def test_requests_whose_client_left_while_queued_are_never_run(model):
    llm = load_tiny_llm(model[0])
    paused, release = threading.Event(), threading.Event()
    step, add_request, added = llm.engine.step, llm.engine.add_request, []

    def gated_step():  # the first step waits: the first request holds the engine thread, the rest queue
        paused.set()
        release.wait(60)
        return step()

    def counted_add_request(request):
        added.append(request.request_id)
        add_request(request)

    handle = ServerHandle.start(llm, port=0, max_concurrency=1, max_queue=2, model_id="m")
    # after the start: its throw-away request in the engine thread (EngineService.start) is not counted
    llm.engine.step, llm.engine.add_request = gated_step, counted_add_request
    body = {"messages": HI, "max_tokens": 3, "ignore_eos": True}
    try:
        holder = threading.Thread(target=httpx.post, args=(handle.url + CHAT,), kwargs={"json": body, "timeout": 60})
        holder.start()
        paused.wait(60)
        leavers = [_send_and_hold(handle, body) for _ in range(2)]
        wait_for(lambda: handle.service.stats().waiting == 2, what="two queued requests")
        full = httpx.post(handle.url + CHAT, json=body, timeout=60)
        assert full.status_code == 429  # the queue is full of them
        for sock in leavers:
            sock.close()
        wait_for(lambda: metric(handle, CHAT, 499) == 2, what="the disconnects to be noticed")
        release.set()
        holder.join(60)
        results: list[httpx.Response] = []
        live = [threading.Thread(target=lambda: results.append(httpx.post(handle.url + CHAT, json=body, timeout=60)))
                for _ in range(2)]
        for t in live:
            t.start()
        for t in live:
            t.join(60)
        assert [r.status_code for r in results] == [200, 200]
        assert len(added) == 3  # the holder and the two live ones: the two that left never reached the engine
    finally:
        release.set()
        handle.stop()


# -- 4. every response is counted, a 500 carries no exception text --------------------------------------

def test_an_unexpected_error_is_a_counted_500_without_its_text(server, monkeypatch, caplog):
    def broken(request, n):
        raise RuntimeError("secret detail /home/someone/.cache")

    monkeypatch.setattr(server.service, "submit_chat_choices", broken)
    before = metric(server, CHAT, 500)
    with caplog.at_level(logging.ERROR):
        with pytest.raises(openai.InternalServerError) as err:
            openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0).chat.completions.create(
                model="m", messages=HI)
    error = err.value.body
    assert error["type"] == "server_error" and error["code"] == "internal_error"
    assert "secret" not in error["message"] and "RuntimeError" not in error["message"]
    error_id = re.search(r"err_\w+", error["message"]).group(0)
    logged = [r for r in caplog.records if error_id in r.getMessage()]
    assert logged and "secret detail" in str(logged[0].exc_info[1])  # the traceback is in the log
    assert metric(server, CHAT, 500) == before + 1


# -- 5. DNS rebinding ------------------------------------------------------------------------------------

def test_foreign_host_names_are_refused(server, model):
    url = server.url + "/v1/models"
    counted = metric(server, "/v1/models", 403)
    refused = httpx.get(url, headers={"Host": "attacker.example", "Origin": "http://attacker.example"})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "host_not_allowed"
    assert metric(server, "/v1/models", 403) == counted + 1  # refusals show in /metrics
    assert "--allowed-hosts attacker.example" in refused.json()["error"]["message"]
    for host in (f"localhost:{server.port}", f"127.0.0.1:{server.port}", "app.localhost", "[::1]", "192.168.1.7"):
        assert httpx.get(url, headers={"Host": host}).status_code == 200, host
    named = ServerHandle.start(load_tiny_llm(model[0]), port=0, allowed_hosts=["llm.example"], model_id="m")
    try:
        assert httpx.get(named.url + "/v1/models", headers={"Host": "LLM.example:8080"}).status_code == 200
        assert httpx.get(named.url + "/v1/models", headers={"Host": "attacker.example"}).status_code == 403
    finally:
        named.stop()
    assert HostPolicy.for_server("0.0.0.0", None).allows("attacker.example")  # public on purpose
    assert not HostPolicy.for_server("0.0.0.0", ["llm.example"]).allows("attacker.example")
    assert HostPolicy.for_server("127.0.0.1", ["*"]).allows("attacker.example")


# -- 5b. cross-site requests -------------------------------------------------------------------------------

def simple_post(handle: ServerHandle, path: str, origin: str | None, **headers: str) -> httpx.Response:
    """What a web page's fetch(url, {method: "POST", body}) sends: a text/plain body, which needs no
    preflight, with the page's Origin (None: a client outside a browser, like curl -d)."""
    body = json.dumps({"model": "m", "messages": HI, "max_tokens": 2})
    origin_header = {} if origin is None else {"origin": origin}
    return httpx.post(handle.url + path, content=body, timeout=60,
                      headers={"content-type": "text/plain;charset=UTF-8", **origin_header, **headers})


def assert_origin_refused(response: httpx.Response, origin: str) -> dict:
    assert response.status_code == 403, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["code"] == "origin_not_allowed"
    assert f"--cors-origin {origin}" in body["error"]["message"]
    return body["error"]


def test_cross_site_requests_are_refused_before_any_work(server, monkeypatch):
    engine, added = server.service.llm.engine, []
    add_request = engine.add_request

    def counted_add_request(request):
        added.append(request.request_id)
        add_request(request)

    monkeypatch.setattr(engine, "add_request", counted_add_request)
    served, refused = metric(server, CHAT, 200), metric(server, CHAT, 403)
    for origin in ("https://evil.example", "null", f"http://localhost.evil.example:{server.port}"):
        assert_origin_refused(simple_post(server, CHAT, origin), origin)
    assert metric(server, CHAT, 403) == refused + 3
    assert_origin_refused(simple_post(server, MESSAGES, "https://evil.example"), "https://evil.example")
    assert_origin_refused(httpx.get(server.url + "/v1/models", headers={"origin": "null"}), "null")  # every method
    with socket.create_connection((server.host, server.port), timeout=10) as sock:  # refused unread
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nOrigin: https://evil.example\r\n"
                     b"Content-Type: text/plain\r\nContent-Length: 100000\r\n\r\n{")
        assert sock.recv(65536).startswith(b"HTTP/1.1 403")
    assert added == [] and metric(server, CHAT, 200) == served  # no generation ever started

    for origin in (f"http://localhost:{server.port}", f"http://127.0.0.1:{server.port}", "http://[::1]:5173", None):
        response = simple_post(server, CHAT, origin)
        assert response.status_code == 200, (origin, response.text)
    assert len(added) == 4
    preflight = {"Origin": "http://localhost:5173", "Access-Control-Request-Method": "POST"}
    ok = httpx.options(server.url + CHAT, headers=preflight)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://localhost:5173"


def test_cors_origins_are_served_and_a_key_does_not_admit_others(model):
    app = "https://app.example"
    handle = ServerHandle.start(load_tiny_llm(model[0]), port=0, model_id="m", api_key="k", cors_origins=[app])
    try:
        key = {"authorization": "Bearer k"}
        assert simple_post(handle, CHAT, app, **key).status_code == 200
        assert simple_post(handle, CHAT, f"http://127.0.0.1:{handle.port}", **key).status_code == 200
        assert simple_post(handle, CHAT, None, **key).status_code == 200
        assert_origin_refused(simple_post(handle, CHAT, "https://evil.example", **key), "https://evil.example")
        preflight = {"Origin": app, "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization,content-type"}
        ok = httpx.options(handle.url + CHAT, headers=preflight)
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == app
        local = httpx.options(handle.url + CHAT, headers={**preflight, "Origin": "http://localhost:5173"})
        assert local.status_code == 200 and local.headers["access-control-allow-origin"] == "http://localhost:5173"
        foreign = httpx.options(handle.url + CHAT, headers={**preflight, "Origin": "https://evil.example"})
        assert foreign.status_code == 400 and "access-control-allow-origin" not in foreign.headers  # CORS's refusal
    finally:
        handle.stop()
    assert OriginPolicy.for_server(["*"]).allows("https://evil.example")
    assert not OriginPolicy.for_server(None).allows("http://localhost.evil.example")


# -- 5c. Anthropic's error types ----------------------------------------------------------------------------

def test_anthropic_errors_carry_anthropics_type_names(model):
    handle = ServerHandle.start(load_tiny_llm(model[0]), port=0, model_id="m", api_key="k", max_body_bytes=65536)
    try:
        def client(key: str = "k", **headers: str) -> anthropic.Anthropic:
            return anthropic.Anthropic(base_url=handle.url, api_key=key, max_retries=0, default_headers=headers)

        huge = [{"role": "user", "content": "x" * 100_000}]
        calls = [(anthropic.AuthenticationError, client("wrong"), "m", HI, "authentication_error"),
                 (anthropic.PermissionDeniedError, client(origin="https://evil.example"), "m", HI, "permission_error"),
                 (anthropic.NotFoundError, client(), "claude-sonnet-4", HI, "not_found_error"),
                 (anthropic.ContentTooLargeError, client(), "m", huge, "request_too_large"),
                 (anthropic.BadRequestError, client(), "m", [], "invalid_request_error")]
        for error_class, sdk, name, messages, kind in calls:
            with pytest.raises(error_class) as err:
                sdk.messages.create(model=name, max_tokens=2, messages=messages)
            assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == kind, err.value.body

        ok = {"model": "m", "max_tokens": 2, "messages": HI}
        key = {"x-api-key": "k"}
        raw = [("POST", MESSAGES, {"x-api-key": "wrong"}, ok, 401, "authentication_error"),
               ("POST", MESSAGES, {**key, "origin": "null"}, ok, 403, "permission_error"),
               ("POST", MESSAGES, {**key, "host": "attacker.example"}, ok, 403, "permission_error"),
               ("POST", MESSAGES, key, {**ok, "model": "nope"}, 404, "not_found_error"),
               ("POST", MESSAGES + "/nope", key, ok, 404, "not_found_error"),
               ("GET", MESSAGES, key, None, 405, "invalid_request_error"),
               ("POST", MESSAGES, key, {**ok, "messages": huge}, 413, "request_too_large"),
               ("POST", MESSAGES + "/count_tokens", key, {**ok, "messages": huge}, 413, "request_too_large"),
               ("POST", CHAT, {"x-api-key": "wrong"}, ok, 401, "invalid_request_error"),  # OpenAI's names stay
               ("POST", CHAT, key, {**ok, "model": "nope"}, 404, "invalid_request_error")]
        for method, path, headers, body, status, kind in raw:
            response = httpx.request(method, handle.url + path, json=body, headers=headers, timeout=60)
            assert response.status_code == status, (path, headers, response.text)
            assert response.json()["type"] == "error" and response.json()["error"]["type"] == kind, response.text
    finally:
        handle.stop()


# -- 6. logit_bias ----------------------------------------------------------------------------------------

def test_logit_bias_is_honoured(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    tokenizer = server.service.llm.tokenizer
    prompt = [5, 17, 42, 99]

    def first_token(**kw) -> str:
        return client.completions.create(model="m", prompt=prompt, max_tokens=1, temperature=0, **kw).choices[0].text

    greedy = first_token()
    wanted = next(t for t in tokenizer.encode("hello world") if tokenizer.decode([t]) != greedy)
    assert first_token(logit_bias={str(wanted): 100}) == tokenizer.decode([wanted]) != greedy
    banned = [t for t in range(server.service.llm.loaded.config.vocab_size) if tokenizer.decode([t]) == greedy]
    assert first_token(logit_bias={str(t): -100 for t in banned}) != greedy
    for bias, text in [({"abc": 1}, "decimal"), ({"5": 101}, "[-100, 100]"), ({"99999": 1}, "vocabulary")]:
        with pytest.raises(openai.BadRequestError, match=re.escape(text)) as err:
            client.chat.completions.create(model="m", messages=HI, max_tokens=1, logit_bias=bias)
        assert err.value.body["param"] == "logit_bias"


# -- 8. an abandoned upload -----------------------------------------------------------------------------------

def test_an_abandoned_upload_is_a_logged_disconnect_not_a_crash(server, caplog):
    before = metric(server, CHAT, 499)
    with caplog.at_level(logging.DEBUG):
        with socket.create_connection((server.host, server.port), timeout=30) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json"
                         b"\r\nContent-Length: 1000\r\n\r\n{\"messages\": ")  # ... and hang up
        wait_for(lambda: metric(server, CHAT, 499) == before + 1, what="the disconnect to be counted")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r for r in caplog.records if r.levelno == logging.DEBUG and "client disconnected" in r.getMessage()]


# -- 10. stopping --------------------------------------------------------------------------------------------

def test_a_keyboard_interrupt_in_wait_does_not_lose_the_server(model):
    """Thread.join interrupted by Ctrl-C marks a live thread finished (CPython gh-90882): a
    process that trusted it exited under its streams. The handle waits on its own event instead."""
    handle = ServerHandle.start(load_tiny_llm(model[0]), port=0, model_id="m")
    armed = threading.Event()

    def interrupt(signum, frame):  # only inside the `raises` block below: never into pytest itself
        if armed.is_set():
            raise KeyboardInterrupt

    def fire() -> None:
        armed.wait(30)
        time.sleep(0.2)  # very likely inside handle.wait() by now (if not, the test proves less)
        os.kill(os.getpid(), signal.SIGINT)

    previous = signal.signal(signal.SIGINT, interrupt)
    try:
        threading.Thread(target=fire).start()
        with pytest.raises(KeyboardInterrupt):
            armed.set()
            handle.wait()
        assert not handle.wait(0) and httpx.get(handle.url + "/health").status_code == 200
    finally:
        signal.signal(signal.SIGINT, previous)
        handle.stop()
    assert handle.wait(0)


def test_stop_signals_turn_sigterm_into_a_request():
    before = signal.getsignal(signal.SIGTERM)
    with StopSignals() as signals:
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.requested.wait(30) and signals.received == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_ninfer_serve_stops_on_a_signal_with_every_stream_ended(model, sig):
    env = {**os.environ, "NINFER_PORT": "0", "NINFER_DEVICE": "cpu", "NINFER_MAX_CONTEXT": str(MAX_CONTEXT),
           "NINFER_ALLOWED_HOSTS": "llm.example"}
    proc = subprocess.Popen([sys.executable, "-m", "ninfer_app", "serve", str(model[0])], env=env,
                            stderr=subprocess.PIPE, text=True)
    try:
        url = re.search(r"listening on (http://\S+) ", proc.stderr.readline()).group(1)
        wait_for(lambda: httpx.get(url + "/health").status_code == 200, timeout=60, what="ninfer serve")
        assert httpx.get(url + "/health", headers={"Host": "llm.example"}).status_code == 200  # --allowed-hosts
        assert httpx.get(url + "/health", headers={"Host": "other.example"}).status_code == 403
        reading, ends = threading.Barrier(4), []

        def stream() -> None:
            body = {"messages": HI, "max_tokens": 240, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
                lines = (line for line in r.iter_lines() if line.startswith("data: "))
                frames = [next(lines)]
                reading.wait(30)
                frames += list(lines)
            ends.append(frames[-2:])

        streams = [threading.Thread(target=stream) for _ in range(3)]
        for t in streams:
            t.start()
        reading.wait(30)
        proc.send_signal(sig)
        for t in streams:
            t.join(60)
        assert proc.wait(60) == 0
        log = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()
    assert len(ends) == 3
    for last, done in ends:  # each stream ended properly: a finish or an error event, then [DONE]
        assert done == "data: [DONE]"
        frame = json.loads(last[6:])
        assert "error" in frame or frame["choices"][0]["finish_reason"] == "length", frame
    assert f"ninfer: {sig.name}: stopping" in log and "ninfer: stopped" in log
    assert "Traceback" not in log and "Invalid file descriptor" not in log

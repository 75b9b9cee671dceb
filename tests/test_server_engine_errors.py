"""The engine failing a request it accepted is the server's fault: a 500 `server_error` (Anthropic:
`api_error`), or in a stream an error event, then the end; the request's own faults stay 400s. One
request's failure fails it alone: a request decoding beside it gets its tokens, and the engine
thread goes on. Real server on loopback (tiny random Qwen3.5 MoE, CPU), httpx and the official
openai / anthropic clients; the failure is planted by patching one engine method."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from ninfer_core.server.app import ServerHandle
from server_harness import load_tiny_llm, sse_events, wait_for, write_model

FAIL = "@@fail@@"  # a stop string that marks the requests the patched engine fails
HI = [{"role": "user", "content": "Say hi"}]
GREEDY = {"temperature": 0}  # the failing requests: deterministic answers that reach their third token
FREE = {"model": "m", "prompt": [5, 17, 42, 99], "max_tokens": 160, "temperature": 0,
        "extra_body": {"ignore_eos": True}}  # decodes beside the failing requests


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerHandle]:
    handle = ServerHandle.start(load_tiny_llm(write_model(tmp_path_factory, "tiny_engine_errors")[0]), port=0,
                                model_id="m")
    yield handle
    handle.stop()


@pytest.fixture
def client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


@pytest.fixture
def running_at_failures(server: ServerHandle, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A bug in the engine's token handling of the marked requests, at their third token; the list
    gets the number of sequences running at each failure."""
    engine = server.service.engine
    push, seen = engine._push, []

    def broken_push(seq, token):
        if FAIL in seq.request.sampling.stop and len(seq.output_ids) >= 2:
            seen.append(len(engine.running))
            raise RuntimeError("secret detail /home/someone/.cache")
        return push(seq, token)

    monkeypatch.setattr(engine, "_push", broken_push)
    return seen


def post(server: ServerHandle, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def stream_frames(server: ServerHandle, path: str, body: dict) -> list[tuple[str | None, str]]:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        return list(sse_events(response))


def assert_server_error(error: dict, kind: str = "server_error") -> None:
    assert error["type"] == kind and error["code"] == "internal_error", error
    assert "secret" not in error["message"] and "RuntimeError" not in error["message"], error


def test_a_failed_request_is_a_500_and_the_one_beside_it_completes(server, client, running_at_failures, caplog):
    alone = client.completions.create(**FREE).choices[0].text
    beside: dict[str, str] = {}
    thread = threading.Thread(target=lambda: beside.update(text=client.completions.create(**FREE).choices[0].text))
    thread.start()
    wait_for(lambda: server.service.stats().engine.running >= 1, what="the free request in the engine")

    frames = stream_frames(server, "/v1/chat/completions", {"model": "m", "messages": HI, "stop": [FAIL], **GREEDY})
    assert frames[-1] == (None, "[DONE]")
    assert_server_error(json.loads(frames[-2][1])["error"])
    assert any(json.loads(data).get("choices") for _, data in frames[:-2])  # it had streamed its first tokens

    with pytest.raises(openai.InternalServerError) as err:
        client.chat.completions.create(model="m", messages=HI, stop=[FAIL], **GREEDY)
    assert err.value.status_code == 500
    assert_server_error(err.value.body)

    response = post(server, "/v1/messages",
                    {"model": "m", "max_tokens": 64, "messages": HI, "stop_sequences": [FAIL], **GREEDY})
    assert response.status_code == 500 and response.json()["type"] == "error"
    assert_server_error(response.json()["error"], "api_error")
    with pytest.raises(anthropic.InternalServerError):
        anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0).messages.create(
            model="m", max_tokens=64, messages=HI, stop_sequences=[FAIL], extra_body=GREEDY)
    events = stream_frames(server, "/v1/messages", {"model": "m", "max_tokens": 64, "messages": HI,
                                                    "stop_sequences": [FAIL], **GREEDY})
    assert events[-1][0] == "error"
    assert_server_error(json.loads(events[-1][1])["error"], "api_error")

    thread.join(60)
    assert beside["text"] == alone  # decoded in the same steps as the failures, untouched
    assert len(running_at_failures) == 5 and min(running_at_failures) >= 2
    failures = [r for r in caplog.records if "failed in the engine" in r.getMessage()]
    assert len(failures) == 5 and all(r.exc_info for r in failures)  # each once, with its traceback


def test_a_request_the_engine_cannot_take_is_a_500_and_user_errors_stay_400(server, client, monkeypatch):
    engine = server.service.engine
    add = engine.add_request

    def broken_add(request):
        if FAIL in request.sampling.stop:
            raise RuntimeError("secret detail /home/someone/.cache")
        add(request)

    monkeypatch.setattr(engine, "add_request", broken_add)
    response = post(server, "/v1/chat/completions",
                    {"model": "m", "messages": HI, "stop": [FAIL], "stream": True, **GREEDY})
    assert response.status_code == 500
    assert_server_error(response.json()["error"])

    with pytest.raises(openai.BadRequestError) as err:  # a prompt over the context: the request's fault
        client.completions.create(model="m", prompt=[5] * 300, max_tokens=4)
    assert err.value.body["type"] == "invalid_request_error" and err.value.body["code"] == "context_length_exceeded"
    after = client.completions.create(model="m", prompt=[5, 17], max_tokens=4, extra_body={"ignore_eos": True})
    assert after.choices[0].finish_reason == "length"  # the engine thread goes on


def test_in_process_callers_get_the_engine_error_and_the_cli_says_it(tmp_path_factory, monkeypatch):
    """LLM.chat (the TUI's and `ninfer run`'s path, without the service) raises EngineError for a
    failed request, the engine serves the next one, and `ninfer run` prints the error and exits 1."""
    from typer.testing import CliRunner

    from ninfer_app.cli import cli
    from ninfer_core.engine.sampling import SamplingParams
    from ninfer_core.errors import EngineError
    from ninfer_core.llm import LLM, ChatRequest

    llm = load_tiny_llm(write_model(tmp_path_factory, "tiny_engine_errors_llm")[0])
    push = llm.engine._push

    def broken_push(seq, token):
        if FAIL in seq.request.sampling.stop:
            raise RuntimeError("secret detail")
        return push(seq, token)

    monkeypatch.setattr(llm.engine, "_push", broken_push)
    failing = ChatRequest(messages=HI, sampling=SamplingParams(temperature=0, max_tokens=8, stop=[FAIL]))
    with pytest.raises(EngineError, match=r"internal engine error \(logged as err_[0-9a-f]+\)") as caught:
        llm.chat_result(failing)
    assert "secret" not in str(caught.value)
    fine = llm.chat_result(ChatRequest(messages=HI, sampling=SamplingParams(temperature=0, max_tokens=8)))
    assert fine.finish_reason in ("stop", "length") and fine.token_ids
    monkeypatch.setattr(LLM, "load", classmethod(lambda cls, *args, **kwargs: llm))
    result = CliRunner().invoke(cli, ["run", "--prompt", "Say hi", "--stop", FAIL, "--device", "cpu"])
    assert result.exit_code == 1
    assert "error: internal engine error (logged as err_" in result.output

"""Ollama's native API, for the clients written against it (the `ollama` libraries, Open WebUI's
Ollama connection, editor plugins): POST /api/chat and /api/generate (newline-delimited JSON
streams by default, `stream: false` for one object). The model management endpoints are in
ollama_models.py; `/api/ps` and `/api/stop` are ninfer's own, in models.py.

A chat runs the same path as Chat Completions (chat_input.chat_request: template, tools, thinking,
media); `options` map to the sampling parameters (num_predict -> max_tokens, repeat_penalty ->
repetition_penalty; num_ctx and other runtime options are ignored: the server's own limits apply),
`format` ("json" or a JSON Schema) is enforced by a grammar, `think` switches thinking, whose text
comes as `message.thinking` (`thinking` with generate). Tool calls arrive whole, with arguments as
an object. The final line carries Ollama's counters (durations in nanoseconds). Errors keep the
server's error object under `error`. `keep_alive` (seconds, or a duration such as "10m"; negative:
forever) sets how long the model stays after this request; a load request (no messages / prompt)
with keep_alive 0 unloads it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from ..chat.constraints import JsonOutput
from ..chat.output_parser import ContentDelta, ReasoningDelta
from ..engine.request import StepOutput, Timings
from ..engine.sampling import SamplingParams
from ..engine.service import EngineService, TokenStream
from ..llm import ChatFinished, ChatRequest, ChatResult
from .body import read_model
from .chat_input import chat_content, chat_request, select_tools
from .errors import ApiError
from .generation import Started, collect, lease, pool_of, start, stream_response
from .schemas import (
    OllamaBody,
    OllamaChatRequest,
    OllamaGenerateRequest,
    OllamaMessage,
    OllamaOptions,
    plain,
)

router = APIRouter()
NDJSON = "application/x-ndjson"
# the first bytes of a base64 image file -> its type (Ollama's images carry none)
_IMAGE_TYPES = {"iVBOR": "image/png", "/9j/": "image/jpeg", "R0lG": "image/gif", "UklG": "image/webp"}


def _line(data: dict[str, Any]) -> bytes:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def _error_line(error: ApiError) -> bytes:
    return _line({"error": error.error_object()})


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _head(model: str) -> dict[str, Any]:
    return {"model": model, "created_at": _now()}


def _sampling(options: OllamaOptions | None) -> SamplingParams:
    o = options or OllamaOptions()
    if o.num_predict == 0:
        raise ApiError(400, "options.num_predict must be at least 1 (or -1: until the context is full)",
                       param="options.num_predict")
    return SamplingParams(temperature=o.temperature, top_p=o.top_p, top_k=o.top_k, min_p=o.min_p,
                          repetition_penalty=o.repeat_penalty, presence_penalty=o.presence_penalty,
                          frequency_penalty=o.frequency_penalty, seed=o.seed,
                          max_tokens=o.num_predict if o.num_predict is not None and o.num_predict > 0 else None,
                          stop=list(o.stop or []))


def _constraint(body: OllamaBody) -> JsonOutput | None:
    if not body.format:
        return None
    return JsonOutput(source="format") if body.format == "json" else JsonOutput(body.format, source="format")


def _content(text: str, images: list[str] | None, where: str) -> Any:
    """A message's text and base64 images as the chat path reads them (data: URLs)."""
    if not images:
        return text
    parts = [{"type": "text", "text": text}] + [
        {"type": "image_url", "image_url": {"url": "data:" + next((t for p, t in _IMAGE_TYPES.items()
                                                                    if image.startswith(p)), "image/png")
                                            + ";base64," + image}} for image in images]
    return chat_content(parts, where)


def _message(message: OllamaMessage, where: str) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": _content(message.content, message.images, where)}
    if message.thinking:
        out["reasoning_content"] = message.thinking
    if message.tool_calls:
        out["tool_calls"] = [{"type": "function", "function": {"name": c.function.name,
                                                               "arguments": json.dumps(c.function.arguments)}}
                             for c in message.tool_calls]
    if message.tool_name:
        out["name"] = message.tool_name
    return out


def _tool_calls(result: ChatResult) -> list[dict[str, Any]]:
    """OpenAI-shaped calls -> Ollama's (arguments an object; a call cut off at max_tokens: {})."""
    calls = []
    for call in result.tool_calls:
        try:
            arguments = json.loads(call["function"]["arguments"])
        except ValueError:
            arguments = {}
        calls.append({"function": {"name": call["function"]["name"], "arguments": arguments}})
    return calls


def _counters(prompt_tokens: int, completion_tokens: int, timings: Timings | None, finish_reason: str | None
              ) -> dict[str, Any]:
    t = timings or Timings()
    return {"done": True, "done_reason": "length" if finish_reason == "length" else "stop",
            "total_duration": int((t.prefill_s + t.decode_s) * 1e9), "load_duration": 0,
            "prompt_eval_count": prompt_tokens, "prompt_eval_duration": int(t.prefill_s * 1e9),
            "eval_count": completion_tokens, "eval_duration": int(t.decode_s * 1e9)}


def _result_counters(result: ChatResult) -> dict[str, Any]:
    return _counters(len(result.prompt_token_ids), len(result.token_ids), result.timings, result.finish_reason)


def _started(started: Started, body: OllamaBody) -> Started:
    """The started request, its model kept for the request's keep_alive (seconds, read by the schema)."""
    if body.keep_alive is not None:
        started.lease.keep_alive(body.keep_alive)
    return started


async def _loaded(request: Request, body: OllamaBody, key: str) -> JSONResponse:
    """Ollama's load request (no messages / prompt): the model is loaded, nothing generated; with
    keep_alive 0 it is unloaded instead (if it is loaded)."""
    keep = body.keep_alive
    empty = {"role": "assistant", "content": ""} if key == "message" else ""
    if keep == 0:
        pool = pool_of(request)
        name, _ = pool.resolve(body.model)
        if not pool.reloads:
            raise ApiError(409, f"'{name}' stays loaded: this server could not load it again", param="keep_alive",
                           code="model_pinned")
        await run_in_threadpool(pool.unload, name)  # joins the engine thread
        return JSONResponse({**_head(name), key: empty, "done": True, "done_reason": "unload"})
    held = await lease(request, body.model)
    name = held.name
    if keep is not None:
        held.keep_alive(keep)
    held.release()
    return JSONResponse({**_head(name), key: empty, "done": True, "done_reason": "load"})


def _chat(messages: list[dict[str, Any]], body: OllamaBody, tools: list[dict[str, Any]] | None = None) -> ChatRequest:
    return chat_request(messages, _sampling(body.options), tools=select_tools(tools, None),
                        enable_thinking=body.think, constraint=_constraint(body))


@router.post("/api/chat", response_model=None)
async def chat(request: Request) -> Response:
    body = await read_model(request, OllamaChatRequest)
    if not body.messages:
        return await _loaded(request, body, "message")
    request_chat = _chat([_message(m, f"messages[{i}].content") for i, m in enumerate(body.messages)], body,
                         plain(body.tools) if body.tools else None)
    started = _started(await start(request, body.model, lambda service: service.submit_chat(request_chat),
                                   chat=request_chat), body)
    if body.stream:
        return stream_response(started, _chat_lines(started, "message"), _error_line, media_type=NDJSON)
    result: ChatResult = (await collect(request, started))[-1].result
    message: dict[str, Any] = {"role": "assistant", "content": result.text}
    if result.reasoning:
        message["thinking"] = result.reasoning
    if result.tool_calls:
        message["tool_calls"] = _tool_calls(result)
    return JSONResponse({**_head(started.model), "message": message, **_result_counters(result)})


async def _chat_lines(started: Started, key: str) -> AsyncIterator[bytes]:
    """A chat's stream: key "message" (chat) holds {role, content / thinking / tool_calls}; key
    "response" (generate) holds the text, with `thinking` beside it."""

    def piece(text: str = "", thinking: str = "", calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        if key == "response":
            return {"response": text, **({"thinking": thinking} if thinking else {})}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = calls
        return {"message": message}

    async for event in started.events:
        if isinstance(event, ReasoningDelta):
            yield _line({**_head(started.model), **piece(thinking=event.text), "done": False})
        elif isinstance(event, ContentDelta):
            yield _line({**_head(started.model), **piece(event.text), "done": False})
        elif isinstance(event, ChatFinished):
            if event.result.tool_calls and key == "message":
                yield _line({**_head(started.model), **piece(calls=_tool_calls(event.result)), "done": False})
            yield _line({**_head(started.model), **piece(), **_result_counters(event.result)})


@router.post("/api/generate", response_model=None)
async def generate(request: Request) -> Response:
    body = await read_model(request, OllamaGenerateRequest)
    if body.suffix:
        raise ApiError(400, "suffix (fill-in-the-middle) is not supported", param="suffix")
    if not body.prompt and not body.images:
        return await _loaded(request, body, "response")
    if body.raw:
        if body.images:
            raise ApiError(400, "images need the chat template: leave out raw", param="images")
        return await _raw(request, body)
    system = [{"role": "system", "content": body.system}] if body.system else []
    request_chat = _chat([*system, {"role": "user", "content": _content(body.prompt, body.images, "prompt")}], body)
    started = _started(await start(request, body.model, lambda service: service.submit_chat(request_chat),
                                   chat=request_chat), body)
    if body.stream:
        return stream_response(started, _chat_lines(started, "response"), _error_line, media_type=NDJSON)
    result: ChatResult = (await collect(request, started))[-1].result
    return JSONResponse({**_head(started.model), "response": result.text,
                         **({"thinking": result.reasoning} if result.reasoning else {}), **_result_counters(result)})


async def _raw(request: Request, body: OllamaGenerateRequest) -> Response:
    """`raw`: the prompt as written (special tokens in it read as such), no template, no parsing."""
    sampling, constraint = _sampling(body.options), _constraint(body)
    prompt_tokens = 0

    def submit(service: EngineService) -> TokenStream:
        nonlocal prompt_tokens
        llm = service.llm
        ids = llm.tokenizer.encode_prompt(body.prompt)
        prompt_tokens = len(ids)
        grammar = None if constraint is None else llm.compile_constraint(constraint, reasoning=False)
        return service.submit(ids, sampling, grammar=grammar)

    started = _started(await start(request, body.model, submit), body)
    if body.stream:
        return stream_response(started, _raw_lines(started, prompt_tokens), _error_line, media_type=NDJSON)
    outputs: list[StepOutput] = await collect(request, started)
    last = outputs[-1]
    return JSONResponse({**_head(started.model), "response": "".join(o.text_delta for o in outputs),
                         **_counters(prompt_tokens, sum(len(o.new_token_ids) for o in outputs), last.timings,
                                     last.finish_reason)})


async def _raw_lines(started: Started, prompt_tokens: int) -> AsyncIterator[bytes]:
    generated = 0
    async for out in started.events:
        generated += len(out.new_token_ids)
        if out.text_delta:
            yield _line({**_head(started.model), "response": out.text_delta, "done": False})
        if out.finished:
            yield _line({**_head(started.model), "response": "",
                         **_counters(prompt_tokens, generated, out.timings, out.finish_reason)})

"""POST /v1/chat/completions: OpenAI Chat Completions, whole or streamed as SSE chunks.

Stream shape (what clients rely on): one `id` / `created` for every chunk, `role` only in the
first delta, reasoning in both `reasoning_content` (DeepSeek, llama.cpp) and `reasoning` (vLLM,
Ollama), tool calls as deltas whose first fragment carries index, id, type and name with empty
arguments and whose later fragments carry only the index and argument text, `finish_reason`
`tool_calls` once a call was made, and with `stream_options.include_usage` a null `usage` on
every chunk plus one final chunk with empty `choices` and the usage.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..chat.output_parser import ContentDelta, ReasoningDelta, ToolCallArgsDelta, ToolCallStart
from ..llm import ChatFinished, ChatRequest, ChatResult
from .body import read_model
from .chat_input import chat_content, chat_request, sampling_params, select_tools
from .errors import ApiError
from .generation import Started, collect, start, stream_response
from .ids import new_id
from .schemas import ChatCompletionRequest, plain
from .sse import DONE, sse

router = APIRouter()
SYSTEM_FINGERPRINT = "ninfer"


def build_chat_request(body: ChatCompletionRequest) -> ChatRequest:
    if body.n not in (None, 1):
        raise ApiError(400, f"n={body.n} is not supported; this server returns one choice (n=1)", param="n")
    if body.logprobs or body.top_logprobs:
        raise ApiError(400, "logprobs are not supported", param="logprobs")
    format_type = body.response_format.type if body.response_format else "text"
    if format_type != "text":
        raise ApiError(400, f"response_format '{format_type}' is not supported (no constrained decoding yet)",
                       param="response_format")
    messages = []
    for i, message in enumerate(body.messages):
        m = plain(message)
        m["content"] = chat_content(m.get("content"), f"messages[{i}].content")
        messages.append(m)
    tools = plain(body.tools or [])
    choice = body.tool_choice.function.name if hasattr(body.tool_choice, "function") else body.tool_choice
    sampling = sampling_params(body, body.max_completion_tokens or body.max_tokens, body.stop)
    return chat_request(messages, sampling, tools=select_tools(tools, choice),  # type: ignore[arg-type]
                        template_kwargs=body.chat_template_kwargs, reasoning_effort=body.reasoning_effort)


def chat_usage(result: ChatResult) -> dict[str, Any]:
    prompt, completion = len(result.prompt_token_ids), len(result.token_ids)
    spec = result.spec
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": result.timings.cached_tokens},
        # accepted / rejected prediction tokens: the speculative decoder's draft counters
        "completion_tokens_details": {"reasoning_tokens": result.reasoning_tokens,
                                      "accepted_prediction_tokens": spec.accepted if spec else 0,
                                      "rejected_prediction_tokens": spec.rejected if spec else 0},
    }


class ToolCallIds:
    """One fresh id per tool call of a response (`call_0` would repeat across turns)."""

    def __init__(self) -> None:
        self._ids: dict[int, str] = {}

    def __getitem__(self, index: int) -> str:
        return self._ids.setdefault(index, new_id("call_"))


def message_json(result: ChatResult, ids: ToolCallIds) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": result.text if result.text or not result.tool_calls
                               else None}
    if result.reasoning:
        message["reasoning_content"] = message["reasoning"] = result.reasoning
    if result.tool_calls:
        message["tool_calls"] = [{**call, "id": ids[i]} for i, call in enumerate(result.tool_calls)]
    return message


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(request: Request) -> Response:
    body = await read_model(request, ChatCompletionRequest)
    chat = build_chat_request(body)
    started = await start(request, body.model, lambda service: service.submit_chat(chat), chat=chat)
    completion_id, created = new_id("chatcmpl-"), int(time.time())
    model = started.model
    ids = ToolCallIds()
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = _chunks(started, completion_id, created, model, ids, include_usage)
        return stream_response(started, chunks, lambda err: sse({"error": err.error_object()}) + DONE)
    result: ChatResult = (await collect(request, started))[-1].result
    return JSONResponse({
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": [{"index": 0, "message": message_json(result, ids), "logprobs": None,
                     "finish_reason": result.finish_reason}],
        "usage": chat_usage(result),
    })


async def _chunks(started: Started, completion_id: str, created: int, model: str, ids: ToolCallIds,
                  include_usage: bool) -> AsyncIterator[bytes]:
    head = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": SYSTEM_FINGERPRINT}

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        data = {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
        return sse({**data, "usage": None} if include_usage else data)

    yield chunk({"role": "assistant", "content": ""})
    async for event in started.events:
        if isinstance(event, ReasoningDelta):
            yield chunk({"reasoning_content": event.text, "reasoning": event.text})
        elif isinstance(event, ContentDelta):
            yield chunk({"content": event.text})
        elif isinstance(event, ToolCallStart):
            yield chunk({"tool_calls": [{"index": event.index, "id": ids[event.index], "type": "function",
                                         "function": {"name": event.name, "arguments": ""}}]})
        elif isinstance(event, ToolCallArgsDelta):
            yield chunk({"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]})
        elif isinstance(event, ChatFinished):
            yield chunk({}, event.result.finish_reason)
            if include_usage:
                yield sse({**head, "choices": [], "usage": chat_usage(event.result)})
    yield DONE

"""POST /v1/chat/completions: OpenAI Chat Completions, whole or streamed as SSE chunks.

Stream shape (what clients rely on): one `id` / `created` for every chunk, `role` only in the
first delta, reasoning in both `reasoning_content` (DeepSeek, llama.cpp) and `reasoning` (vLLM,
Ollama), tool calls as deltas whose first fragment carries index, id, type and name with empty
arguments and whose later fragments carry only the index and argument text, `finish_reason`
`tool_calls` once a call was made, and with `stream_options.include_usage` a null `usage` on
every chunk plus one final chunk with empty `choices` and the usage. With `logprobs`, a step's
token logprobs ride on the next chunk sent (every answer token, reasoning included, in order).
`n` answers are n requests of one prompt in the same batch (generation.start_choices): their chunks
interleave as they come, each under its choice `index`; the usage counts the prompt once.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..chat.output_parser import ContentDelta, ReasoningDelta, ToolCallArgsDelta, ToolCallStart
from ..engine.logprobs import TokenLogprob
from ..llm import ChatFinished, ChatRequest, ChatResult, LogprobsDelta
from ..tokenizer import Tokenizer
from .body import read_model
from .chat_input import (
    chat_content,
    chat_request,
    guided_constraint,
    one_constraint,
    response_format_constraint,
    sampling_params,
    select_tools,
    tool_constraint,
)
from .errors import ApiError
from .generation import Started, collect_choices, merged_events, start_choices, stream_response
from .ids import new_id
from .logprobs import chat_logprobs
from .schemas import ChatCompletionRequest, plain
from .sse import DONE, sse

router = APIRouter()
SYSTEM_FINGERPRINT = "ninfer"


def build_chat_request(body: ChatCompletionRequest) -> ChatRequest:
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    messages = []
    for i, message in enumerate(body.messages):
        m = plain(message)
        m["content"] = chat_content(m.get("content"), f"messages[{i}].content")
        messages.append(m)
    tools = plain(body.tools or [])
    named = hasattr(body.tool_choice, "function")
    choice = body.tool_choice.function.name if named else body.tool_choice  # type: ignore[union-attr]
    declared = select_tools(tools, choice)  # type: ignore[arg-type]
    forced = tool_constraint(declared, choice, named=named, parallel=body.parallel_tool_calls)  # type: ignore[arg-type]
    constraint = one_constraint(response_format_constraint(body.response_format), guided_constraint(body), forced)
    sampling = sampling_params(body, body.max_completion_tokens or body.max_tokens, body.stop,
                               logprobs=(body.top_logprobs or 0) if body.logprobs else None)
    return chat_request(messages, sampling, tools=declared, template_kwargs=body.chat_template_kwargs,
                        reasoning_effort=body.reasoning_effort, constraint=constraint,
                        continue_final=body.continue_final_message)


def chat_usage(results: Sequence[ChatResult]) -> dict[str, Any]:
    """The usage of a response's choices: the prompt once (every choice reads the same one), the
    answers' tokens summed."""
    prompt, completion = len(results[0].prompt_token_ids), sum(len(r.token_ids) for r in results)
    specs = [r.spec for r in results if r.spec]
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": results[0].timings.cached_tokens},
        # accepted / rejected prediction tokens: the speculative decoder's draft counters
        "completion_tokens_details": {"reasoning_tokens": sum(r.reasoning_tokens for r in results),
                                      "accepted_prediction_tokens": sum(s.accepted for s in specs),
                                      "rejected_prediction_tokens": sum(s.rejected for s in specs)},
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
    n = body.n or 1
    choices = await start_choices(request, body.model, lambda service: service.submit_chat_choices(chat, n), chat=chat)
    completion_id, created = new_id("chatcmpl-"), int(time.time())
    model = choices[0].model
    tokenizer = choices[0].lease.service.llm.tokenizer
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = _chunks(choices, completion_id, created, model, include_usage, tokenizer)
        return stream_response(choices, chunks, lambda err: sse({"error": err.error_object()}) + DONE)
    results: list[ChatResult] = [events[-1].result for events in await collect_choices(request, choices)]
    return JSONResponse({
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": [{"index": i, "message": message_json(result, ToolCallIds()),
                     "logprobs": chat_logprobs(tokenizer, result.logprobs) if result.logprobs is not None else None,
                     "finish_reason": result.finish_reason} for i, result in enumerate(results)],
        "usage": chat_usage(results),
    })


async def _chunks(choices: list[Started], completion_id: str, created: int, model: str, include_usage: bool,
                  tokenizer: Tokenizer) -> AsyncIterator[bytes]:
    """Each choice's deltas under its `index`, as they come; the usage chunk once every choice ended."""
    head = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": SYSTEM_FINGERPRINT}
    pending: list[list[TokenLogprob]] = [[] for _ in choices]  # logprobs not sent yet: with the choice's next chunk
    ids = [ToolCallIds() for _ in choices]
    results: dict[int, ChatResult] = {}

    def chunk(i: int, delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        logprobs = chat_logprobs(tokenizer, pending[i]) if pending[i] else None
        pending[i].clear()
        choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        data = {**head, "choices": [choice]}
        return sse({**data, "usage": None} if include_usage else data)

    for i in range(len(choices)):
        yield chunk(i, {"role": "assistant", "content": ""})
    async for i, event in merged_events(choices):
        if isinstance(event, LogprobsDelta):
            pending[i] += event.logprobs
        elif isinstance(event, ReasoningDelta):
            yield chunk(i, {"reasoning_content": event.text, "reasoning": event.text})
        elif isinstance(event, ContentDelta):
            yield chunk(i, {"content": event.text})
        elif isinstance(event, ToolCallStart):
            yield chunk(i, {"tool_calls": [{"index": event.index, "id": ids[i][event.index], "type": "function",
                                            "function": {"name": event.name, "arguments": ""}}]})
        elif isinstance(event, ToolCallArgsDelta):
            yield chunk(i, {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]})
        elif isinstance(event, ChatFinished):
            results[i] = event.result
            yield chunk(i, {}, event.result.finish_reason)
    if include_usage:
        yield sse({**head, "choices": [], "usage": chat_usage([results[i] for i in sorted(results)])})
    yield DONE

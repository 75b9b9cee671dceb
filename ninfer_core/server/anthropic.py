"""POST /v1/messages (Anthropic Messages API) and /v1/messages/count_tokens.

Content blocks map to chat messages: `text` -> content, `image` -> an image part of it (a base64
source as a data: URL), `thinking` -> reasoning_content, `tool_use` -> an assistant tool call,
`tool_result` -> a tool message (before the user's text of the same turn). Output: `thinking`
(empty signature: nothing to verify locally), `text` and `tool_use` blocks; streams send
message_start, content_block_start / _delta / _stop, message_delta (stop reason, output tokens)
and message_stop.

Thinking follows Anthropic's rule, not the model's default: off unless the request enables it
(`thinking: {"type": "enabled" | "adaptive"}`), so a client reading `content[0].text` gets text.
tool_choice `any` / `tool` are OpenAI's "required" / a named function: a grammar forces tool calls
(one with `tool` or `disable_parallel_tool_use`), after the thinking when it is on.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from ..engine.sampling import SamplingParams
from ..llm import ChatFinished, ChatRequest, ChatResult
from .blocks import Block, BlockDelta, BlockSequencer, BlockStart, BlockStop, sequence_all
from .body import read_model
from .chat_input import chat_content, chat_request, content_text, sampling_params, select_tools, tool_constraint
from .errors import ApiError
from .generation import Started, collect, lease, start, stream_response
from .ids import new_id
from .media_fetch import resolve_media
from .schemas import (
    AnthropicBlock,
    AnthropicMessage,
    AnthropicTool,
    AnthropicToolChoice,
    CountTokensRequest,
    MessagesRequest,
    Thinking,
    plain,
)
from .sse import sse

router = APIRouter()


# -- input ------------------------------------------------------------------------------------

_NOT_CONTENT = ("thinking", "redacted_thinking", "tool_use", "tool_result")  # carried outside `content`


def chat_messages(system: str | list[AnthropicBlock] | None, messages: list[AnthropicMessage]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": content_text(plain(system), "system") or ""})
    for i, message in enumerate(messages):
        where = f"messages[{i}].content"
        content = [{"type": "text", "text": message.content}] if isinstance(message.content, str) else message.content
        blocks = _image_parts(plain(content), where)
        if message.role == "assistant":
            out.append(_assistant(blocks, where))
            continue
        for j, block in enumerate(blocks):
            if block["type"] == "tool_result":
                if block.get("tool_use_id") is None:
                    raise ApiError(400, f"{where}[{j}]: a tool_result needs 'tool_use_id'", param=f"{where}[{j}]")
                result = chat_content(_image_parts(block.get("content"), f"{where}[{j}].content"),
                                      f"{where}[{j}].content")
                out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result or ""})
        if any(b["type"] not in _NOT_CONTENT for b in blocks) or not blocks:
            out.append({"role": "user", "content": chat_content(blocks, where, skip=_NOT_CONTENT) or ""})
    return out


def _image_parts(blocks: Any, where: str) -> Any:
    """Content with its `image` blocks as OpenAI image_url parts (other content as it is)."""
    if not isinstance(blocks, list):
        return blocks
    return [_image_part(b, f"{where}[{j}]") if isinstance(b, dict) and b.get("type") == "image" else b
            for j, b in enumerate(blocks)]


def _image_part(block: dict[str, Any], where: str) -> dict[str, Any]:
    """A base64 source becomes a data: URL."""
    source = block.get("source")
    source = source if isinstance(source, dict) else {}
    if source.get("type") == "base64" and isinstance(source.get("data"), str):
        media_type = source.get("media_type") or "application/octet-stream"
        return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{source['data']}"}}
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise ApiError(400, f"{where}: an image source must be {{'type': 'base64', 'media_type': ..., 'data': ...}} or "
                        f"{{'type': 'url', 'url': ...}}, got type {source.get('type')!r} (file ids are not supported)",
                   param=f"{where}.source", code="invalid_media")


def _assistant(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content_text(blocks, where, skip=_NOT_CONTENT) or ""}
    thinking = "".join(b.get("thinking", "") for b in blocks if b["type"] == "thinking")
    if thinking:
        message["reasoning_content"] = thinking
    calls = []
    for j, block in enumerate(blocks):
        if block["type"] != "tool_use":
            continue
        if block.get("id") is None or block.get("name") is None:
            raise ApiError(400, f"{where}[{j}]: a tool_use block needs 'id' and 'name'", param=f"{where}[{j}]")
        function = {"name": block["name"], "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}
        calls.append({"id": block["id"], "type": "function", "function": function})
    if calls:
        message["tool_calls"] = calls
    return message


def chat_tools(tools: list[AnthropicTool] | None) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools or ()):
        kind = (tool.model_extra or {}).get("type")
        if kind not in (None, "custom"):
            raise ApiError(400, f"tools[{i}]: server tools ('{kind}') are not supported", param=f"tools[{i}]")
        function = {"name": tool.name, "parameters": tool.input_schema or {"type": "object", "properties": {}}}
        if tool.description:
            function["description"] = tool.description
        out.append({"type": "function", "function": function})
    return out


def tool_choice(choice: AnthropicToolChoice | None) -> str | None:
    if choice is None or choice.type != "tool":
        return {"auto": "auto", "any": "required", "none": "none"}[choice.type if choice else "auto"]
    if choice.name is None:
        raise ApiError(400, "tool_choice of type 'tool' needs the tool's 'name'", param="tool_choice.name")
    return choice.name


def thinking_on(thinking: Thinking | None) -> bool:
    return thinking is not None and thinking.type != "disabled"


def build(body: MessagesRequest | CountTokensRequest) -> ChatRequest:
    forced = body.tool_choice if isinstance(body, MessagesRequest) else None  # count_tokens: only the prompt
    declared = select_tools(chat_tools(body.tools), tool_choice(forced))
    constraint, sampling, kwargs = None, SamplingParams(), None
    if isinstance(body, MessagesRequest):
        sampling, kwargs = sampling_params(body, body.max_tokens, body.stop_sequences), body.chat_template_kwargs
        single = forced is not None and bool(forced.disable_parallel_tool_use)
        constraint = tool_constraint(declared, tool_choice(forced), named=forced is not None and forced.type == "tool",
                                     parallel=not single)
    messages = chat_messages(body.system, body.messages)
    # Anthropic's prefill: a conversation that ends with an assistant turn is continued from its text
    return chat_request(messages, sampling, tools=declared, template_kwargs=kwargs,
                        enable_thinking=thinking_on(body.thinking), constraint=constraint,
                        continue_final=messages[-1].get("role") == "assistant")


# -- output -----------------------------------------------------------------------------------

class ToolUseIds:
    def __init__(self) -> None:
        self._ids: dict[int, str] = {}

    def __getitem__(self, block: Block) -> str:
        return self._ids.setdefault(block.index, new_id("toolu_"))


def content_block(block: Block, ids: ToolUseIds, *, empty: bool = False) -> dict[str, Any]:
    """A finished block, or (empty=True) the opening of one in a stream."""
    if block.kind == "reasoning":
        return {"type": "thinking", "thinking": "" if empty else block.text, "signature": ""}
    if block.kind == "text":
        return {"type": "text", "text": "" if empty else block.text}
    arguments = {} if empty else json.loads(block.text or "{}")
    return {"type": "tool_use", "id": ids[block], "name": block.name, "input": arguments}


def stop_fields(result: ChatResult) -> dict[str, Any]:
    if result.finish_reason == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if result.finish_reason == "tool_calls":
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if isinstance(result.stop_reason, str):
        return {"stop_reason": "stop_sequence", "stop_sequence": result.stop_reason}
    return {"stop_reason": "end_turn", "stop_sequence": None}


def _usage(result: ChatResult) -> dict[str, int]:
    """Anthropic counts prompt tokens read from the cache apart from `input_tokens`."""
    cached = result.timings.cached_tokens
    return {"input_tokens": len(result.prompt_token_ids) - cached, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0, "output_tokens": len(result.token_ids)}


@router.post("/v1/messages", response_model=None)
async def messages(request: Request) -> Response:
    body = await read_model(request, MessagesRequest)
    chat = build(body)
    started = await start(request, body.model, lambda service: service.submit_chat(chat), chat=chat)
    message_id, model, ids = new_id("msg_"), started.model, ToolUseIds()
    if body.stream:
        frames = _stream(started, message_id, model, ids)
        return stream_response(started, frames, lambda err: sse(err.body(anthropic=True), event="error"))
    blocks, result = sequence_all(await collect(request, started))
    return JSONResponse({
        "id": message_id, "type": "message", "role": "assistant", "model": model,
        "content": [content_block(b, ids) for b in blocks],
        **stop_fields(result), "usage": _usage(result),
    })


async def _stream(started: Started, message_id: str, model: str, ids: ToolUseIds) -> AsyncIterator[bytes]:
    def frame(kind: str, **fields: Any) -> bytes:
        return sse({"type": kind, **fields}, event=kind)

    yield frame("message_start", message={
        "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": started.prompt_tokens, "output_tokens": 0},
    })
    yield frame("ping")
    sequencer = BlockSequencer()
    deltas = {"reasoning": ("thinking_delta", "thinking"), "text": ("text_delta", "text"),
              "tool_call": ("input_json_delta", "partial_json")}
    async for event in started.events:
        for block_event in sequencer.feed(event):
            block = block_event.block
            if isinstance(block_event, BlockStart):
                opening = content_block(block, ids, empty=True)
                yield frame("content_block_start", index=block.index, content_block=opening)
            elif isinstance(block_event, BlockDelta):
                kind, key = deltas[block.kind]
                yield frame("content_block_delta", index=block.index, delta={"type": kind, key: block_event.text})
            elif isinstance(block_event, BlockStop):
                yield frame("content_block_stop", index=block.index)
        if isinstance(event, ChatFinished):
            yield frame("message_delta", delta=stop_fields(event.result),
                        usage={"output_tokens": len(event.result.token_ids)})
            yield frame("message_stop")


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> JSONResponse:
    body = await read_model(request, CountTokensRequest)
    chat = build(body)
    held = await lease(request, body.model)
    try:
        await resolve_media(request, chat, held.service)
        prepared = await run_in_threadpool(held.service.llm.prepare_chat, chat)
    finally:
        held.release()
    return JSONResponse({"input_tokens": len(prepared.prompt_token_ids)})

"""POST /v1/responses (OpenAI Responses API), GET / DELETE /v1/responses/{id}.

Input items become chat messages (`input_image` parts stay images, a `reasoning` item rides on
the next assistant turn, a `function_call` joins the assistant turn before it, a
`function_call_output` is a tool message); output blocks become items: `reasoning`
(reasoning_text content), `message` (output_text) and `function_call`. Streams send the typed
events (`response.created`, `response.output_item.added`, `response.output_text.delta`,
`response.reasoning_text.delta`, `response.function_call_arguments.delta`, ...,
`response.completed` or `response.incomplete`), each with a `sequence_number`.

`previous_response_id` continues a stored conversation; `instructions` are not carried over
from it (OpenAI's rule). Responses with `store: false` are not kept. `text.format` json_object /
json_schema and tool_choice "required" / a named function are enforced by a grammar
(chat_input.py).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..llm import ChatFinished, ChatRequest, ChatResult
from .blocks import Block, BlockDelta, BlockEvent, BlockSequencer, BlockStart, BlockStop, sequence_all
from .body import read_model
from .chat_input import (
    chat_content,
    chat_request,
    content_text,
    json_constraint,
    one_constraint,
    sampling_params,
    select_tools,
    tool_constraint,
)
from .errors import ApiError
from .generation import Started, collect, start, stream_response
from .ids import new_id
from .response_store import ResponseStore, StoredResponse
from .schemas import InputItem, ResponsesRequest, ResponsesTool, ResponsesToolChoice, plain
from .sse import sse

router = APIRouter()


# -- input ------------------------------------------------------------------------------------

def input_messages(items: str | list[InputItem]) -> list[dict[str, Any]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None  # from a reasoning item, for the next assistant turn
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if item.type == "message":
            role = item.role
            if role not in ("user", "assistant", "system", "developer"):
                raise ApiError(400, f"{where}.role must be user, assistant, system or developer", param=f"{where}.role")
            message = {"role": role, "content": chat_content(plain(item.content), f"{where}.content") or ""}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif item.type == "function_call":
            if item.name is None or item.call_id is None:
                raise ApiError(400, f"{where}: a function_call needs 'name' and 'call_id'", param=where)
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments or "{}"}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            if reasoning is not None:
                last["reasoning_content"], reasoning = reasoning, None
            last.setdefault("tool_calls", []).append(call)
        elif item.type == "function_call_output":
            text = content_text(plain(item.output), f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": text or ""})
        else:  # reasoning: its reasoning_text content, else its summary
            parts = item.content or item.summary or []
            reasoning = parts if isinstance(parts, str) else "\n".join(p.text or "" for p in parts)
    return messages


def chat_tools(tools: list[ResponsesTool] | None) -> list[dict[str, Any]]:
    """Responses function tools (flat) -> chat tools (nested under `function`)."""
    out = []
    for i, tool in enumerate(tools or ()):
        if tool.type != "function" or tool.name is None:
            raise ApiError(400, f"tools[{i}]: only function tools with a name are supported (got type "
                                f"{tool.type!r})", param=f"tools[{i}]")
        function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
        out.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
    return out


def tool_choice_name(choice: str | ResponsesToolChoice | None) -> str | None:
    if isinstance(choice, ResponsesToolChoice):
        if choice.type != "function" or choice.name is None:
            raise ApiError(400, "tool_choice must be none, auto, required or {'type': 'function', 'name': ...}",
                           param="tool_choice")
        return choice.name
    return choice


def build(body: ResponsesRequest, store: ResponseStore) -> tuple[ChatRequest, list[dict[str, Any]]]:
    """The engine request and the conversation it continues (for the store)."""
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id)
        if previous is None:
            raise ApiError(400, f"previous response '{body.previous_response_id}' was not found (this server keeps "
                                f"the last {store.max_items} stored responses)", param="previous_response_id",
                           code="previous_response_not_found")
        history = previous.messages
    conversation = history + input_messages(body.input)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    fmt = body.text.format if body.text else None
    json_output = json_constraint(fmt.type, fmt.json_schema, "text.format") if fmt else None
    choice = tool_choice_name(body.tool_choice)
    declared = select_tools(chat_tools(body.tools), choice)
    tools = tool_constraint(declared, choice, named=isinstance(body.tool_choice, ResponsesToolChoice),
                            parallel=body.parallel_tool_calls)
    sampling = sampling_params(body, body.max_output_tokens, None)
    chat = chat_request(system + conversation, sampling, tools=declared, template_kwargs=body.chat_template_kwargs,
                        reasoning_effort=body.reasoning.effort if body.reasoning else None,
                        constraint=one_constraint(json_output, tools))
    return chat, conversation


# -- output -----------------------------------------------------------------------------------

@dataclass
class ResponseBuilder:
    """Item ids and the response object for one request."""

    body: ResponsesRequest
    model: str
    response_id: str = field(default_factory=lambda: new_id("resp_"))
    created: int = field(default_factory=lambda: int(time.time()))
    _ids: dict[int, tuple[str, str]] = field(default_factory=dict)

    def ids(self, block: Block) -> tuple[str, str]:
        """(item id, call id) of a block."""
        if block.index not in self._ids:
            prefix = {"reasoning": "rs_", "text": "msg_", "tool_call": "fc_"}[block.kind]
            self._ids[block.index] = (new_id(prefix), new_id("call_"))
        return self._ids[block.index]

    def item(self, block: Block) -> dict[str, Any]:
        item_id, call_id = self.ids(block)
        status = "completed" if block.done else "in_progress"
        if block.kind == "reasoning":
            content = [{"type": "reasoning_text", "text": block.text}] if block.done else []
            return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}
        if block.kind == "text":
            content = [text_part(block.text)] if block.done else []
            return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}
        return {"type": "function_call", "id": item_id, "call_id": call_id, "name": block.name,
                "arguments": block.text if block.done else "", "status": status}

    def response(self, blocks: list[Block], result: ChatResult | None) -> dict[str, Any]:
        incomplete = result is not None and result.finish_reason == "length"
        body = self.body
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created,
            "status": "in_progress" if result is None else "incomplete" if incomplete else "completed",
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.model,
            "output": [self.item(b) for b in blocks],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
            "store": body.store,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "text": {"format": plain(body.text.format) if body.text and body.text.format else {"type": "text"}},
            "tool_choice": plain(body.tool_choice) or "auto",
            "tools": plain(body.tools or []),
            "truncation": "disabled",
            "usage": None if result is None else usage(result),
            "metadata": body.metadata or {},
        }

    def assistant_message(self, blocks: list[Block]) -> dict[str, Any]:
        """The output as a chat message, for continuing the conversation."""
        message: dict[str, Any] = {"role": "assistant", "content": "".join(b.text for b in blocks if b.kind == "text")}
        reasoning = "".join(b.text for b in blocks if b.kind == "reasoning")
        if reasoning:
            message["reasoning_content"] = reasoning
        calls = [{"id": self.ids(b)[1], "type": "function", "function": {"name": b.name, "arguments": b.text}}
                 for b in blocks if b.kind == "tool_call"]
        if calls:
            message["tool_calls"] = calls
        return message


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def usage(result: ChatResult) -> dict[str, Any]:
    prompt, output = len(result.prompt_token_ids), len(result.token_ids)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": result.timings.cached_tokens},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": result.reasoning_tokens}, "total_tokens": prompt + output}


def _finish(builder: ResponseBuilder, blocks: list[Block], result: ChatResult, conversation: list[dict[str, Any]],
            store: ResponseStore) -> dict[str, Any]:
    response = builder.response(blocks, result)
    if builder.body.store:
        messages = conversation + [builder.assistant_message(blocks)]
        store.put(builder.response_id, StoredResponse(response=response, messages=messages))
    return response


# -- routes -----------------------------------------------------------------------------------

@router.post("/v1/responses", response_model=None)
async def create_response(request: Request) -> Response:
    body = await read_model(request, ResponsesRequest)
    store: ResponseStore = request.app.state.responses
    chat, conversation = build(body, store)
    # media fetched into `chat` are also in `conversation`: a continuation reuses them
    started = await start(request, body.model, lambda service: service.submit_chat(chat), chat=chat)
    builder = ResponseBuilder(body, started.model)
    if body.stream:
        seq = itertools.count()

        def frame(kind: str, **fields: Any) -> bytes:
            return sse({"type": kind, "sequence_number": next(seq), **fields}, event=kind)

        def error_frame(err: ApiError) -> bytes:
            obj = err.error_object()
            return frame("error", code=obj["code"], message=obj["message"], param=obj["param"], error=obj)

        events = _stream(started, builder, conversation, store, frame)
        return stream_response(started, events, error_frame)
    blocks, result = sequence_all(await collect(request, started))
    return JSONResponse(_finish(builder, blocks, result, conversation, store))


async def _stream(started: Started, builder: ResponseBuilder, conversation: list[dict[str, Any]],
                  store: ResponseStore, frame: Callable[..., bytes]) -> AsyncIterator[bytes]:
    yield frame("response.created", response=builder.response([], None))
    yield frame("response.in_progress", response=builder.response([], None))
    sequencer = BlockSequencer()
    async for event in started.events:
        for block_event in sequencer.feed(event):
            for data in _block_frames(builder, block_event, frame):
                yield data
        if isinstance(event, ChatFinished):
            response = _finish(builder, sequencer.blocks, event.result, conversation, store)
            yield frame(f"response.{response['status']}", response=response)


def _block_frames(builder: ResponseBuilder, event: BlockEvent, frame: Callable[..., bytes]) -> list[bytes]:
    block = event.block
    item_id = builder.ids(block)[0]
    at = {"item_id": item_id, "output_index": block.index}
    if isinstance(event, BlockStart):
        frames = [frame("response.output_item.added", output_index=block.index, item=builder.item(block))]
        if block.kind == "text":
            frames.append(frame("response.content_part.added", **at, content_index=0, part=text_part("")))
        return frames
    if isinstance(event, BlockDelta):
        if block.kind == "text":
            return [frame("response.output_text.delta", **at, content_index=0, delta=event.text, logprobs=[])]
        if block.kind == "reasoning":
            return [frame("response.reasoning_text.delta", **at, content_index=0, delta=event.text)]
        return [frame("response.function_call_arguments.delta", **at, delta=event.text)]
    assert isinstance(event, BlockStop)
    if block.kind == "text":
        frames = [frame("response.output_text.done", **at, content_index=0, text=block.text, logprobs=[]),
                  frame("response.content_part.done", **at, content_index=0, part=text_part(block.text))]
    elif block.kind == "reasoning":
        frames = [frame("response.reasoning_text.done", **at, content_index=0, text=block.text)]
    else:
        frames = [frame("response.function_call_arguments.done", **at, name=block.name, arguments=block.text)]
    return frames + [frame("response.output_item.done", output_index=block.index, item=builder.item(block))]


def _stored(request: Request, response_id: str) -> StoredResponse:
    stored = request.app.state.responses.get(response_id)
    if stored is None:
        raise ApiError(404, f"no stored response with id '{response_id}'", param="response_id")
    return stored


@router.get("/v1/responses/{response_id}")
async def get_response(request: Request, response_id: str) -> JSONResponse:
    return JSONResponse(_stored(request, response_id).response)


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> JSONResponse:
    _stored(request, response_id)
    request.app.state.responses.delete(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


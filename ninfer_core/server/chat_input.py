"""From any API's request to one engine ChatRequest: message text, tools, thinking, sampling.

The OpenAI chat shape is the common form: the Responses and Anthropic endpoints translate their
input items / content blocks into OpenAI-style messages and then use these same functions, so the
three APIs cannot drift apart on how a request reaches the template or the sampler.

tool_choice: "none" drops the tools from the prompt; "auto" and "required" declare them all; a
named function declares only that one. Nothing constrains decoding, so "required" / named are
requests to the model, not guarantees.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..engine.sampling import SamplingParams
from ..llm import ChatRequest
from .errors import ApiError
from .schemas import SamplingFields

TEXT_PARTS = ("text", "input_text", "output_text")
MEDIA_PARTS = ("image_url", "input_image", "image", "input_audio", "audio", "file", "input_file", "video", "document")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
_RESERVED_TEMPLATE_KEYS = ("messages", "tools", "add_generation_prompt", "documents")


def content_text(content: Any, where: str) -> str | None:
    """A message's content as text: a string, or its text parts joined by newlines."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or a list of content parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in MEDIA_PARTS:
            raise ApiError(
                400, f"{where}[{j}]: '{kind}' content is not supported yet; this server takes text only",
                param=f"{where}[{j}]", code="unsupported_content",
            )
        else:
            got = repr(part)[:200]
            raise ApiError(400, f"{where}[{j}]: expected a text part ({{'type': 'text', 'text': ...}}), got {got}",
                           param=f"{where}[{j}]")
    return "\n".join(texts)


def thinking_enabled(template_kwargs: Mapping[str, Any], reasoning_effort: str | None) -> bool:
    """chat_template_kwargs.enable_thinking wins; else reasoning_effort "none" / "minimal" turn it off."""
    if reasoning_effort is not None and reasoning_effort not in REASONING_EFFORTS:
        raise ApiError(400, f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {reasoning_effort!r}",
                       param="reasoning_effort")
    flag = template_kwargs.get("enable_thinking")
    if flag is not None:
        if not isinstance(flag, bool):
            raise ApiError(400, "chat_template_kwargs.enable_thinking must be true or false",
                           param="chat_template_kwargs.enable_thinking")
        return flag
    return reasoning_effort not in ("none", "minimal")


def select_tools(tools: Sequence[Mapping[str, Any]] | None, choice: str | None) -> list[dict[str, Any]] | None:
    """The tools to declare in the prompt (OpenAI chat shape) for a tool_choice; see the module doc."""
    if not tools or choice == "none":
        return None
    if choice in (None, "auto", "required"):
        return [dict(t) for t in tools]
    chosen = [dict(t) for t in tools if t["function"]["name"] == choice]
    if not chosen:
        raise ApiError(400, f"tool_choice names the function '{choice}', which is not in tools", param="tool_choice")
    return chosen


def sampling_params(fields: SamplingFields, max_tokens: int | None, stop: str | list[str] | None) -> SamplingParams:
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    return SamplingParams(
        temperature=fields.temperature,
        top_p=fields.top_p,
        top_k=fields.top_k,
        min_p=fields.min_p,
        repetition_penalty=fields.repetition_penalty,
        presence_penalty=fields.presence_penalty,
        frequency_penalty=fields.frequency_penalty,
        seed=fields.seed,
        max_tokens=max_tokens,
        stop=[stop] if isinstance(stop, str) else list(stop or []),
        stop_token_ids=list(fields.stop_token_ids or []),
        ignore_eos=fields.ignore_eos,
    )


def chat_request(
    messages: list[dict[str, Any]],
    sampling: SamplingParams,
    *,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    reasoning_effort: str | None = None,
    enable_thinking: bool | None = None,
) -> ChatRequest:
    """The engine request; `enable_thinking` (when given) is the API's own thinking switch."""
    kwargs = dict(template_kwargs or {})
    reserved = [k for k in _RESERVED_TEMPLATE_KEYS if k in kwargs]
    if reserved:
        raise ApiError(400, f"chat_template_kwargs may not set '{reserved[0]}'", param="chat_template_kwargs")
    if enable_thinking is None or "enable_thinking" in kwargs:
        thinking = thinking_enabled(kwargs, reasoning_effort)
    else:
        thinking = enable_thinking
    kwargs.pop("enable_thinking", None)
    return ChatRequest(messages=messages, sampling=sampling, tools=tools, enable_thinking=thinking,
                       template_kwargs=kwargs)

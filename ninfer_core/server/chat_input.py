"""From any API's request to one engine ChatRequest: message content, tools, thinking, sampling.

The OpenAI chat shape is the common form: the Responses and Anthropic endpoints translate their
input items / content blocks into OpenAI-style messages and then use these same functions, so the
three APIs cannot drift apart on how a request reaches the template or the sampler.

Media parts (`image_url`, `video_url`, `image`, `video`, Responses' `input_image`) stay in the
message as `{"type": kind, kind: MediaPart}`; before the request is submitted, media_fetch
replaces each MediaPart by its MediaSource (fetching http(s) URLs), and LLM.prepare_chat does the rest.

tool_choice: "none" drops the tools from the prompt; "auto" and "required" declare them all; a
named function declares only that one. "required" and a named function are enforced: a grammar
lets the answer be only tool calls (one, for a named function or parallel_tool_calls false),
their arguments valid for the tools' schemas (chat/constraints.py). JSON response formats are
enforced the same way, after the reasoning when the model thinks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..chat.constraints import (
    ChoiceOutput,
    GrammarOutput,
    JsonOutput,
    OutputConstraint,
    RegexOutput,
    ToolCallOutput,
)
from ..chat.template import final_text
from ..engine.sampling import SamplingParams
from ..llm import ChatRequest
from ..media.limits import MediaError
from ..media.sources import MediaKind, part_reference
from .body import BadJson, parse_json
from .errors import ApiError
from .schemas import GuidedFields, ResponseFormat, SamplingFields

TEXT_PARTS = ("text", "input_text", "output_text")
UNSUPPORTED_PARTS = ("input_audio", "audio", "file", "input_file", "document")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
_RESERVED_TEMPLATE_KEYS = ("messages", "tools", "add_generation_prompt", "documents")


@dataclass(frozen=True)
class MediaPart:
    """An image or video of a request, not yet read: `where` (e.g. messages[0].content[2]) names it in errors."""

    kind: MediaKind
    url: str
    where: str


def content_text(content: Any, where: str, skip: Sequence[str] = ()) -> str | None:
    """Text-only content (system prompts, tool results): a string, or its text parts joined by newlines.

    Parts whose type is in `skip` are left out (the caller reads them)."""
    if content is None or isinstance(content, str):
        return content
    parts = _content_parts(content, where, skip, media=False)
    return "\n".join(p["text"] for p in parts)


def chat_content(content: Any, where: str, skip: Sequence[str] = ()) -> str | list[dict[str, Any]] | None:
    """A message's content for the template: text only -> one string (as content_text); with media ->
    the list of `{"type": "text", "text": ...}` and `{"type": kind, kind: MediaPart}` parts in order."""
    if content is None or isinstance(content, str):
        return content
    parts = _content_parts(content, where, skip, media=True)
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def pending_media(messages: Sequence[Mapping[str, Any]]) -> list[tuple[dict[str, Any], MediaPart]]:
    """(part, MediaPart) of every media part not yet turned into a MediaSource, in prompt order."""
    found = []
    for message in messages:
        content = message.get("content")
        for part in content if isinstance(content, list) else ():
            value = part.get(part.get("type")) if isinstance(part, dict) else None
            if isinstance(value, MediaPart):
                found.append((part, value))
    return found


def _content_parts(content: Any, where: str, skip: Sequence[str], *, media: bool) -> list[dict[str, Any]]:
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or a list of content parts", param=where)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        here = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in skip:
            continue
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
            continue
        found = _media_part(part, here) if isinstance(part, Mapping) else None
        if found is not None and media:
            parts.append({"type": found.kind, found.kind: found})
        elif found is not None or kind in UNSUPPORTED_PARTS:
            place = "here (images and videos go in message content)" if found is not None else "by this server"
            raise ApiError(400, f"{here}: '{kind}' content is not supported {place}", param=here,
                           code="unsupported_content")
        else:
            got = repr(part)[:200]
            raise ApiError(400, f"{here}: expected a text, image or video part (e.g. {{'type': 'text', 'text': ...}}), "
                                f"got {got}", param=here)
    return parts


def _media_part(part: Mapping[str, Any], where: str) -> MediaPart | None:
    if part.get("type") == "input_image":  # Responses API: {"image_url": URL} or {"file_id": ...}
        if part.get("image_url") is None:
            raise ApiError(400, f"{where}: input_image needs an image_url (a data: or http(s) URL); file_id is not "
                                f"supported (this server has no Files API)", param=where, code="unsupported_content")
        reference: tuple[MediaKind, Any] | None = ("image", part["image_url"])
    else:
        try:
            reference = part_reference(part)
        except MediaError as e:
            raise ApiError(400, f"{where}: {e}", param=where, code="invalid_media") from None
    if reference is None:
        return None
    kind, url = reference
    if not isinstance(url, str) or not url:
        raise ApiError(400, f"{where}: the {kind} URL must be a non-empty string, got {url!r:.80}", param=where,
                       code="invalid_media")
    return MediaPart(kind, url, where)


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


def tool_constraint(tools: list[dict[str, Any]] | None, choice: str | None, *, named: bool,
                    parallel: bool | None) -> ToolCallOutput | None:
    """tool_choice "required" or a named function (`tools`: those select_tools declared) -> the
    calls a grammar forces; None: the model decides."""
    if not named and choice != "required":
        return None
    if not tools:
        raise ApiError(400, "tool_choice 'required' needs at least one tool in 'tools'", param="tool_choice")
    return ToolCallOutput(tools, single=named or parallel is False)


def json_constraint(kind: str, schema: Any, where: str) -> JsonOutput | None:
    """A response format (`where`: its field) -> the JSON a grammar forces; None for plain text."""
    if kind == "text":
        return None
    if kind == "json_object":
        return JsonOutput(source=where)
    if schema is None:
        raise ApiError(400, f"{where}: a json_schema format needs its 'schema'", param=where)
    return JsonOutput(schema, source=where)


def response_format_constraint(fmt: ResponseFormat | None) -> JsonOutput | None:
    """Chat Completions' (and vLLM's Completions') `response_format` -> the JSON a grammar forces."""
    if fmt is None:
        return None
    return json_constraint(fmt.type, fmt.json_schema.json_schema if fmt.json_schema else None, "response_format")


def one_constraint(*constraints: OutputConstraint | None) -> OutputConstraint | None:
    """The one constraint a request sets (None: none); two are a 400 naming the later field."""
    given = [c for c in constraints if c is not None]
    if len(given) > 1:
        first, second = given[:2]
        raise ApiError(400, f"{first.source} and {second.source} both constrain the answer: choose one",
                       param=second.source)
    return given[0] if given else None


def guided_constraint(fields: GuidedFields) -> OutputConstraint | None:
    """vLLM's guided_json / guided_regex / guided_choice / guided_grammar and `structured_outputs`
    (json / regex / choice / grammar) -> the constraint; at most one may be set."""
    kinds = ("json", "regex", "choice", "grammar")
    given = [(kind, f"guided_{kind}", getattr(fields, f"guided_{kind}")) for kind in kinds]
    if (nested := fields.structured_outputs) is not None:
        given += [(kind, f"structured_outputs.{kind}", getattr(nested, "json_" if kind == "json" else kind))
                  for kind in kinds]
    constraints: list[OutputConstraint] = []
    for kind, where, value in given:
        if value is None:
            continue
        if kind == "json":
            constraints.append(JsonOutput(_schema(value, where), source=where))
        elif kind == "regex":
            constraints.append(RegexOutput(value, source=where))
        elif kind == "choice":
            constraints.append(ChoiceOutput(tuple(value), source=where))
        else:
            constraints.append(GrammarOutput(value, source=where))
    return one_constraint(*constraints)


def _schema(value: Any, where: str) -> Any:
    """A JSON Schema given as an object or as its JSON text."""
    if not isinstance(value, str):
        return value
    try:
        return parse_json(value)
    except BadJson as e:
        raise ApiError(400, f"{where}: the schema text {e}", param=where) from None


def sampling_params(fields: SamplingFields, max_tokens: int | None, stop: str | list[str] | None,
                    logprobs: int | None = None, prompt_logprobs: int | None = None) -> SamplingParams:
    """The engine's SamplingParams, which checks every range (SamplingParamError names the field)."""
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
        min_tokens=fields.min_tokens or 0,
        stop=[stop] if isinstance(stop, str) else list(stop or []),
        stop_token_ids=list(fields.stop_token_ids or []),
        ignore_eos=fields.ignore_eos,
        logit_bias=_logit_bias(fields.logit_bias or {}),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def _logit_bias(bias: Mapping[str, float]) -> dict[int, float]:
    """OpenAI's {"token id as text": bias} -> {token id: bias}."""
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise ApiError(400, f"logit_bias keys must be token ids (decimal integers), got {key!r:.40}",
                           param="logit_bias")
        out[int(key)] = value
    return out


def chat_request(
    messages: list[dict[str, Any]],
    sampling: SamplingParams,
    *,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    reasoning_effort: str | None = None,
    enable_thinking: bool | None = None,
    constraint: OutputConstraint | None = None,
    continue_final: bool = False,
) -> ChatRequest:
    """The engine request; `enable_thinking` (when given) is the API's own thinking switch;
    `continue_final`: the answer continues the final message, an assistant's text (a prefill)."""
    if continue_final:
        if messages[-1].get("role") != "assistant" or not final_text(messages[-1]).strip():
            raise ApiError(400, "continuing the final message needs the messages to end with an assistant message "
                                "that has text", param="messages")
        if constraint is not None:
            raise ApiError(400, f"{constraint.source} cannot constrain an answer that continues the final message",
                           param=constraint.source)
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
                       template_kwargs=kwargs, constraint=constraint, continue_final=continue_final)

"""Chat template rendering: messages (+ tools) -> the prompt text, with the checkpoint's own template.

Templates are Jinja2 run in an immutable sandbox with the helpers HF templates expect
(`raise_exception`, a `tojson` that keeps non-ASCII text, `strftime_now`, the `{% generation %}`
tag), so a checkpoint's template renders here as it does in transformers. Where the template comes
from, first match wins: a file given by the user (--chat-template), the checkpoint's
(chat_template.jinja / tokenizer_config.json, via Tokenizer), our Qwen3.5-style fallback.

Messages are normalised first so every template sees one shape: `reasoning` / `thinking` are copied
to `reasoning_content`, a tool call's JSON-text `arguments` (OpenAI wire form) become an object,
the `developer` role is `system`, and keys set to None are dropped.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import NinferError
from ..resources import asset_path
from ..tokenizer import ChatTemplateSource, Tokenizer

FALLBACK_TEMPLATE = "chat_template.jinja"  # in assets/
_REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")


class ChatTemplateError(NinferError):
    """A template that does not compile, or a conversation the template rejects."""


class ToolsNotSupportedError(ChatTemplateError):
    """Tools were given, but the template leaves them out of the prompt: the model would never see them."""


_PROBE_TOOL = {"type": "function", "function": {"name": "ninfer_probe_tool", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}
_PROBE_MESSAGES = [{"role": "user", "content": "hi"}]


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; render its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    def __init__(self, source: ChatTemplateSource, origin: str, bos_token: str | None = None,
                 eos_token: str | None = None):
        self.templates = {"default": source} if isinstance(source, str) else dict(source)
        if not self.templates:
            raise ChatTemplateError(f"{origin}: no chat template in it")
        self.origin = origin
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        self._compiled: dict[str, jinja2.Template] = {}

    @classmethod
    def from_file(cls, path: str | Path, bos_token: str | None = None, eos_token: str | None = None) -> ChatTemplate:
        path = Path(path)
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ChatTemplateError(f"{path}: cannot read chat template: {exc}") from exc
        return cls(source, str(path), bos_token, eos_token)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        preserve_thinking: bool = False,
        **kwargs: Any,
    ) -> str:
        """The prompt text; `kwargs` reach the template as extra variables (chat_template_kwargs).
        Tools the template would drop are refused (ToolsNotSupportedError), never lost silently."""
        if tools and not self.supports_tools:
            raise ToolsNotSupportedError(f"this model's chat template ({self.origin}) has no place for tools, so the "
                                         "model cannot call them; send the request without tools")
        return self._run({
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **kwargs,
            "messages": normalize_messages(messages),
            "tools": [dict(t) for t in tools] if tools else None,
            "add_generation_prompt": add_generation_prompt,
            "enable_thinking": enable_thinking,
            "preserve_thinking": preserve_thinking,
        })

    @cached_property
    def supports_tools(self) -> bool:
        """Whether the template puts tools into the prompt: a probe conversation renders differently
        with a tool than without."""
        probe = {"bos_token": self.bos_token, "eos_token": self.eos_token, "messages": _PROBE_MESSAGES,
                 "add_generation_prompt": True}
        try:
            return self._run({**probe, "tools": [_PROBE_TOOL]}) != self._run({**probe, "tools": None})
        except ChatTemplateError:
            return False

    @cached_property
    def supports_thinking(self) -> bool:
        """Whether the model reasons in <think> blocks (its template knows them or the thinking switch)."""
        return any("<think>" in t or "enable_thinking" in t for t in self.templates.values())

    def _run(self, variables: dict[str, Any]) -> str:
        """The template (its `tool_use` variant when tools are given and it has one) over `variables`."""
        template = self._compile("tool_use" if variables["tools"] and "tool_use" in self.templates else "default")
        try:
            return template.render(**variables)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template ({self.origin}): {exc}") from exc
        except Exception as exc:  # a template is a program over request data: a filter given the wrong type
            raise ChatTemplateError(f"chat template ({self.origin}): {type(exc).__name__}: {exc}") from exc

    def _compile(self, name: str) -> jinja2.Template:
        if name not in self._compiled:
            if name not in self.templates:
                raise ChatTemplateError(
                    f"{self.origin}: no '{name}' chat template (has: {', '.join(sorted(self.templates))})"
                )
            try:
                self._compiled[name] = _environment().from_string(self.templates[name])
            except jinja2.TemplateSyntaxError as exc:
                raise ChatTemplateError(f"{self.origin}: chat template line {exc.lineno}: {exc.message}") from exc
        return self._compiled[name]


def load_chat_template(tokenizer: Tokenizer | None = None, override: str | Path | None = None) -> ChatTemplate:
    """The user's template file, else the checkpoint's, else our Qwen3.5-style fallback."""
    bos = tokenizer.bos_token if tokenizer else None
    eos = tokenizer.eos_token if tokenizer else None
    if override is not None:
        return ChatTemplate.from_file(override, bos, eos)
    if tokenizer is not None and tokenizer.chat_template:
        return ChatTemplate(tokenizer.chat_template, f"{tokenizer.source} chat template", bos, eos)
    return ChatTemplate.from_file(asset_path(FALLBACK_TEMPLATE), bos, eos)


def final_text(message: Mapping[str, Any]) -> str:
    """The text a continued message ends with: its string content, or its last text part (as
    transformers reads a final message's content parts)."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    parts = [p["text"] for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str)] \
        if isinstance(content, list) else []
    return parts[-1] if parts else ""


def open_final_message(prompt: str, message: Mapping[str, Any]) -> str:
    """A prompt rendered without a generation prompt, cut right after the final message's text, so
    the answer continues that message (an assistant prefill: Anthropic's trailing assistant message,
    vLLM's continue_final_message). As transformers' continue_final_message, the text is found by
    its last occurrence, stripped as templates strip it."""
    text = final_text(message).strip()
    at = prompt.rfind(text) if text else -1
    if at < 0:
        raise ChatTemplateError("the chat template does not write the final message's text into the prompt, so "
                                "it cannot be continued")
    return prompt[: at + len(text)]


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copies of the messages in the one shape templates read (see the module docstring)."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ChatTemplateError(f"message {i}: expected an object with a string 'role'")
        msg = {k: v for k, v in message.items() if v is not None}
        if msg["role"] == "developer":
            msg["role"] = "system"
        reasoning = next((msg[k] for k in _REASONING_KEYS if isinstance(msg.get(k), str)), None)
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
        if "tool_calls" in msg:
            msg["tool_calls"] = [_normalize_tool_call(call, i, j) for j, call in enumerate(msg["tool_calls"])]
        out.append(msg)
    return out


def _normalize_tool_call(call: Any, message_index: int, call_index: int) -> Any:
    if not isinstance(call, Mapping):
        return call
    function = call.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("arguments"), str):
        return dict(call)
    try:
        arguments = json.loads(function["arguments"]) if function["arguments"].strip() else {}
    except (ValueError, RecursionError) as exc:  # invalid, or nested past the interpreter's limit
        raise ChatTemplateError(
            f"message {message_index}: tool_calls[{call_index}].function.arguments is not valid JSON: {exc}"
        ) from exc
    return {**call, "function": {**function, "arguments": arguments}}

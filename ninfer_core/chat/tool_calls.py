"""Tool calls in Qwen output: the body of one <tool_call>...</tool_call> block, parsed as it streams.

Qwen3.5 writes XML:

    <tool_call>
    <function=NAME>
    <parameter=P>
    VALUE
    </parameter>
    </function>
    </tool_call>

Values are raw text; one newline after the opening tag and before the closing tag belongs to the
format, not to the value. A value becomes a JSON value (number, bool, object, array, null) when
the tool's JSON schema says the parameter has such a type, or, without a schema, whenever it
parses as one; otherwise it stays a string. Older Qwen models (2.5, 3) write a JSON body
`{"name": ..., "arguments": {...}}` inside the same tags; that form is accepted too.

Arguments are produced as JSON text fragments, one per finished parameter, whose concatenation is
the call's final `arguments` string: a server can stream them as OpenAI argument deltas.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..textscan import find_earliest

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAM_OPEN = "<parameter="
PARAM_CLOSE = "</parameter>"
_FUNCTION_RE = re.compile(r"\s*<function=([^>\n]*)>")
_PARAM_RE = re.compile(r"<parameter=([^>\n]*)>")

# function name -> parameter name -> JSON schema types it accepts
ParamTypes = dict[str, dict[str, frozenset[str]]]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    complete: bool = True  # False: the output ended inside the call (e.g. at max_tokens)


def parameter_types(tools: Sequence[Mapping[str, Any]] | None) -> ParamTypes:
    """Schema types of each tool parameter, from OpenAI-style tool definitions. Best effort: a
    schema is the client's JSON, so any part of the wrong shape just declares no type."""
    result: ParamTypes = {}
    for tool in tools or ():
        function = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            continue
        properties = _mapping(_mapping(function.get("parameters")).get("properties"))
        result[function["name"]] = {
            name: types for name, schema in properties.items() if (types := schema_types(schema))
        }
    return result


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def schema_types(schema: Any) -> frozenset[str]:
    """The JSON types a schema admits, read from type / anyOf / oneOf / enum / const (empty: any)."""
    if not isinstance(schema, Mapping):
        return frozenset()
    declared = schema.get("type")
    types = {t for t in ([declared] if isinstance(declared, str) else _list(declared)) if isinstance(t, str)}
    for key in ("anyOf", "oneOf"):
        for option in _list(schema.get(key)):
            types |= schema_types(option)
    for value in [*_list(schema.get("enum")), *([schema["const"]] if "const" in schema else [])]:
        types.add(_json_type(value))
    return frozenset(types)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return {str: "string", dict: "object", list: "array"}.get(type(value), "string")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def convert_value(raw: str, types: frozenset[str] | None) -> Any:
    """A parameter's raw text as the JSON value its schema types ask for (None: no schema)."""
    if types == {"string"}:
        return raw
    try:
        parsed = json.loads(raw, parse_constant=_reject_constant)
    except ValueError:
        if types and "boolean" in types and raw.strip() in ("True", "False"):
            return raw.strip() == "True"
        return raw
    if types is None:
        return raw if isinstance(parsed, str) else parsed
    kind = _json_type(parsed)
    if kind in types or (kind == "integer" and "number" in types):
        return parsed
    if kind == "number" and "integer" in types and parsed.is_integer():
        return int(parsed)
    return raw


def _strip_format_newlines(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


class ToolCallBodyParser:
    """Incremental parser for the text between <tool_call> and </tool_call>.

    `name` is set as soon as `<function=NAME>` has arrived, so a caller can announce the call
    before its arguments are complete.
    """

    def __init__(self, types: ParamTypes):
        self._types = types
        self.text = ""  # the whole body seen so far
        self._pos = 0  # start of the unparsed rest
        self._mode = "header"  # header -> params -> done | other (not the XML form)
        self.name: str | None = None
        self._fragments: list[str] = []

    def feed(self, text: str) -> list[str]:
        """Argument fragments of the parameters this text completes."""
        self.text += text
        out: list[str] = []
        while self._step(out, at_end=False):
            pass
        return out

    def close(self, complete: bool) -> tuple[list[str], ToolCall | None]:
        """End of the body (`complete`: </tool_call> seen). None: the body is not a tool call."""
        if self.name is None:
            call = _json_body_call(self.text) if complete else None
            if call is None:
                return [], None
            self.name = call.name
            return [call.arguments], call
        out: list[str] = []
        if complete:  # a closed block ends an unterminated last value
            while self._step(out, at_end=True):
                pass
        out.append("}" if self._fragments else "{}")
        self._fragments.append(out[-1])
        return out, ToolCall(self.name, "".join(self._fragments), complete)

    def _step(self, out: list[str], at_end: bool) -> bool:
        rest = self.text[self._pos :]
        if self._mode == "header":
            match = _FUNCTION_RE.match(rest)
            if match:
                self.name = match.group(1).strip()
                self._pos += match.end()
                self._mode = "params"
                return True
            if not _may_become(rest.lstrip(), FUNCTION_OPEN):
                self._mode = "other"
            return False
        if self._mode != "params":
            return False
        body = rest.lstrip()
        skipped = len(rest) - len(body)
        if body.startswith(FUNCTION_CLOSE):
            self._pos += skipped + len(FUNCTION_CLOSE)
            self._mode = "done"
            return False
        match = _PARAM_RE.match(body)
        if match:
            end = find_earliest(body, (PARAM_CLOSE, PARAM_OPEN, FUNCTION_CLOSE), match.end())
            if end is None and not at_end:
                return False  # the value is still streaming
            value_end = len(body) if end is None else end[0]
            consumed = value_end + (len(PARAM_CLOSE) if end is not None and end[1] == PARAM_CLOSE else 0)
            self._pos += skipped + consumed
            out.append(self._fragment(match.group(1).strip(), body[match.end() : value_end]))
            return True
        if not body or _may_become(body, PARAM_OPEN) or FUNCTION_CLOSE.startswith(body):
            return False
        # Stray text between parameters: skip to the next tag.
        next_tag = body.find("<", 1)
        self._pos = len(self.text) if next_tag < 0 else self._pos + skipped + next_tag
        return next_tag >= 0

    def _fragment(self, key: str, raw: str) -> str:
        types = self._types.get(self.name or "", {}).get(key)  # None: no schema, guess from the text
        value = convert_value(_strip_format_newlines(raw), types)
        prefix = ", " if self._fragments else "{"
        fragment = f"{prefix}{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
        self._fragments.append(fragment)
        return fragment


def _may_become(text: str, tag: str) -> bool:
    """`text` is a prefix of `<tag ...>` whose name part has not ended yet."""
    if tag.startswith(text):
        return True
    return text.startswith(tag) and ">" not in text and "\n" not in text


def _json_body_call(body: str) -> ToolCall | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(data["name"], arguments)

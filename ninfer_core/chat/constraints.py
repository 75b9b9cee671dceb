"""What a constrained answer must be, as an xgrammar structural tag (compiled by engine/grammar.py).

- `JsonOutput` (response_format json_object / json_schema, `ninfer run --format`): one JSON value
  of the schema (JSON mode: any object). Objects hold only the properties the schema names, in
  its order (as OpenAI's strict mode); whitespace between tokens is free, at most MAX_WHITESPACE
  in a row.
- `ToolCallOutput` (tool_choice "required" / a named function, Anthropic "any" / "tool"): one or
  more calls (exactly one when `single`), nothing else, in Qwen's XML form exactly as the chat
  templates write it:  <tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n
  ...</function>\\n</tool_call>, calls separated by one newline.
- `RegexOutput`, `ChoiceOutput`, `GrammarOutput` (vLLM's guided_regex / guided_choice /
  guided_grammar, or `structured_outputs`): the answer matches a regular expression, is one of the
  given strings, or is a sentence of an EBNF grammar (xgrammar's dialect, root rule `root`).
- Thinking: when the prompt opens <think>, the grammar first lets the reasoning run to </think>
  (then the blank line Qwen writes); otherwise it starts with the answer's first token.

Why the XML is built here rather than with xgrammar's `qwen_xml` style: that style lets whitespace
surround every value, and Qwen's tool-call parsers (ours, vLLM's) keep a string's surrounding
whitespace as part of it, so a forced call could break its schema's maxLength / enum / pattern
once parsed. Here each value sits between exactly the one newline on each side that the parser
strips: a parameter whose schema admits only strings is raw text (one of its enum / const, its
pattern, a length range without '<', else any text without the parser's closing tags), any other
is JSON of its schema (xgrammar's converter): what tool_calls.convert_value reads back.
Properties come in the schema's order; optional ones may be left out. Free text is matched as
bytes (xgrammar's any_text): a model that writes invalid UTF-8 there gets U+FFFD in the parsed
value, still a string; length ranges are regex classes, matched as characters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import NinferError
from .reasoning import THINK_CLOSE, THINK_OPEN
from .tool_calls import FUNCTION_CLOSE, FUNCTION_OPEN, PARAM_CLOSE, PARAM_OPEN, TOOL_CALL_CLOSE, TOOL_CALL_OPEN, schema_types

MAX_WHITESPACE = 16  # whitespace characters in a row between JSON tokens (pretty-printing fits)
# Text that ends a parameter value when the call is parsed: never inside a value.
_VALUE_ENDS = [PARAM_CLOSE, PARAM_OPEN, FUNCTION_CLOSE, TOOL_CALL_CLOSE]
_NAME = "[A-Za-z_][A-Za-z0-9_.-]*"  # a parameter name, when the schema names none


class ConstraintError(NinferError):
    """A constraint that cannot be enforced; `param` names the request field it came from."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


Format = dict[str, Any]  # an xgrammar structural-tag format, as JSON


@dataclass(frozen=True)
class JsonOutput:
    """The answer is one JSON value of `schema` (default: any object, OpenAI's JSON mode)."""

    schema: Mapping[str, Any] = field(default_factory=lambda: {"type": "object"})
    source: str = "response_format"  # the request field, for errors

    def answer_format(self) -> Format:
        return _json(self.schema)


@dataclass(frozen=True)
class ToolCallOutput:
    """The answer is tool calls of `tools` (OpenAI chat shape), at least one, `single`: one only."""

    tools: Sequence[Mapping[str, Any]]
    single: bool = False
    source: str = "tool_choice"

    def answer_format(self) -> Format:
        if not self.tools:
            raise ConstraintError("a required tool call needs at least one tool", self.source)
        calls = [self._call(tool) for tool in self.tools]
        return {"type": "tags_with_separator", "tags": calls, "separator": "\n", "at_least_one": True,
                "stop_after_first": self.single}

    def _call(self, tool: Mapping[str, Any]) -> Format:
        function = tool.get("function", tool)
        name, parameters = function.get("name"), function.get("parameters")
        if not isinstance(name, str) or not name or ">" in name or "\n" in name:
            raise ConstraintError(f"cannot force a call of the function {name!r}: its name is not a plain name",
                                  self.source)
        return _tag(f"{TOOL_CALL_OPEN}\n{FUNCTION_OPEN}{name}>\n", self._parameters(name, parameters),
                    f"{FUNCTION_CLOSE}\n{TOOL_CALL_CLOSE}")

    def _parameters(self, function: str, schema: Any) -> Format:
        schema = schema if isinstance(schema, Mapping) else {}
        properties = schema.get("properties")
        if not isinstance(properties, Mapping):  # no declared parameters: any names, any values
            value = _tag(">\n", _text(), f"\n{PARAM_CLOSE}\n")
            parameter = {"type": "sequence", "elements": [_const(PARAM_OPEN), {"type": "regex", "pattern": _NAME},
                                                          value]}
            return {"type": "star", "content": parameter}
        listed = schema.get("required")
        required = {n for n in listed if isinstance(n, str)} if isinstance(listed, list) else set()
        names = list(properties) + sorted(required - set(properties))
        elements = []
        for name in names:
            if ">" in name or "\n" in name:
                raise ConstraintError(f"cannot force a call of {function}: its parameter name {name!r} cannot be "
                                      f"written as <parameter=NAME>", self.source)
            parameter = _tag(f"{PARAM_OPEN}{name}>\n", _value(properties.get(name, {})), f"\n{PARAM_CLOSE}\n")
            elements.append(parameter if name in required else {"type": "optional", "content": parameter})
        return {"type": "sequence", "elements": elements} if elements else _const("")


@dataclass(frozen=True)
class RegexOutput:
    """The answer matches `pattern` whole (xgrammar's regex dialect: no look-arounds, no back-references)."""

    pattern: str
    source: str = "guided_regex"

    def answer_format(self) -> Format:
        return {"type": "regex", "pattern": self.pattern}


@dataclass(frozen=True)
class ChoiceOutput:
    """The answer is exactly one of `choices`."""

    choices: Sequence[str]
    source: str = "guided_choice"

    def answer_format(self) -> Format:
        if not self.choices or not all(isinstance(c, str) and c for c in self.choices):
            raise ConstraintError("the choices must be a non-empty list of non-empty strings", self.source)
        return {"type": "or", "elements": [_const(c) for c in self.choices]}


@dataclass(frozen=True)
class GrammarOutput:
    """The answer is a sentence of the EBNF grammar `ebnf` (its rule `root`)."""

    ebnf: str
    source: str = "guided_grammar"

    def answer_format(self) -> Format:
        return {"type": "grammar", "grammar": self.ebnf}


OutputConstraint = JsonOutput | ToolCallOutput | RegexOutput | ChoiceOutput | GrammarOutput


def structural_tag(constraint: OutputConstraint, *, reasoning: bool) -> Format:
    """The whole answer's structural tag; `reasoning`: the prompt opened <think>, so the answer
    starts inside the reasoning block and the constraint applies after it."""
    answer = constraint.answer_format()
    if reasoning:
        think = _tag("", {"type": "any_text", "excludes": [THINK_OPEN, THINK_CLOSE]}, THINK_CLOSE)
        answer = {"type": "sequence", "elements": [think, _const("\n\n"), answer]}
    return {"type": "structural_tag", "format": answer}


def _value(schema: Any) -> Format:
    """A parameter value: raw text when the schema admits only strings, else JSON of the schema."""
    if not isinstance(schema, Mapping) or schema_types(schema) != {"string"}:
        return _json(schema if isinstance(schema, (Mapping, bool)) else {}, excludes=_VALUE_ENDS)
    options = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(options, list) and options and all(isinstance(v, str) for v in options):
        return {"type": "or", "elements": [_const(v) for v in options]}
    if isinstance(schema.get("pattern"), str):
        return {"type": "regex", "pattern": schema["pattern"]}
    low, high = schema.get("minLength"), schema.get("maxLength")
    low = low if isinstance(low, int) and low > 0 else 0
    high = high if isinstance(high, int) and high >= low else None
    if low or high is not None:  # counted in characters: a regex class (any text is matched as bytes)
        return {"type": "regex", "pattern": f"[^<]{{{low},{'' if high is None else high}}}"}
    return _text()


def _json(schema: Mapping[str, Any] | bool, excludes: list[str] | None = None) -> Format:
    # inside a tool call, a string with a length range holds no '<' either (as raw values; excludes
    # do not apply to patterns)
    banned = _CONTROLS + ("<" if excludes else "")
    out: Format = {"type": "json_schema", "json_schema": _quoted_strings(schema, banned),
                   "max_whitespace_cnt": MAX_WHITESPACE}
    if excludes:
        out["excludes"] = excludes
    return out


_CONTROLS = '\\u0000-\\u001f"\\\\'  # JSON's unescaped-forbidden characters, quote, backslash (regex)
_SUBSCHEMA = ("items", "additionalProperties", "not", "contains", "if", "then", "else", "propertyNames")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def _quoted_strings(schema: Any, banned: str) -> Any:
    """The schema with each length-limited string as a pattern of the same lengths without the
    `banned` characters (a regex class body): xgrammar writes such a string as any characters but
    quote, backslash, CR and LF (and drops the limits beside `excludes`), so a tab or another
    control character could land unescaped in the JSON (invalid)."""
    if not isinstance(schema, Mapping):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), Mapping):
            out[key] = _quoted_strings(out[key], banned)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_quoted_strings(s, banned) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), Mapping):
            out[key] = {name: _quoted_strings(s, banned) for name, s in out[key].items()}
    low, high = out.get("minLength", 0), out.get("maxLength", "")
    if ("string" in schema_types(out) and ("minLength" in out or "maxLength" in out) and "pattern" not in out
            and "format" not in out and isinstance(low, int) and isinstance(high, (int, str))):
        out.pop("minLength", None), out.pop("maxLength", None)  # the pattern holds them
        out["pattern"] = f"^[^{banned}]{{{low},{high}}}$"
    return out


def _text() -> Format:
    return {"type": "any_text", "excludes": _VALUE_ENDS}


def _tag(begin: str, content: Format, end: str) -> Format:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def _const(value: str) -> Format:
    return {"type": "const_string", "value": value}

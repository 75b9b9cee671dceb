"""Streaming output parser for Qwen3.5 output: reasoning split, XML tool calls, held-back tags.

Every streaming case is run with the text cut at every position (and char by char) and must give
the same result as the one-shot parse, without any markup reaching reasoning or content deltas.
The template round trip renders calls with our fallback template and parses them back.
"""

from __future__ import annotations

import json

import pytest

from ninfer_core.chat.output_parser import (
    ContentDelta,
    OutputParser,
    ParsedOutput,
    ParserEvent,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    collect,
    parse_output,
)
from ninfer_core.chat.reasoning import prompt_opens_reasoning
from ninfer_core.chat.template import load_chat_template
from ninfer_core.chat.tool_calls import ToolCall, convert_value, parameter_types

TOOLS = [
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"},
        "limit": {"type": "integer"},
        "exact": {"type": "boolean"},
        "filters": {"type": "object"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "score": {"anyOf": [{"type": "number"}, {"type": "null"}]},
        "mode": {"enum": ["fast", "slow"]},
    }}}},
    {"name": "write_file", "parameters": {"properties": {"path": {"type": "string"}, "content": {"type": "string"}}}},
]
TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<function", "<parameter", "</parameter>")


def _run(pieces: list[str], starts_in_reasoning: bool, tools: list | None = None) -> list[ParserEvent]:
    parser = OutputParser(starts_in_reasoning=starts_in_reasoning, tools=tools)
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    _check_invariants(events)
    return events


def _check_invariants(events: list[ParserEvent]) -> None:
    started: dict[int, str] = {}
    args: dict[int, str] = {}
    for event in events:
        if isinstance(event, (ReasoningDelta, ContentDelta)):
            assert event.text  # no empty deltas
        elif isinstance(event, ToolCallStart):
            assert event.index == len(started)
            started[event.index] = event.name
            args[event.index] = ""
        elif isinstance(event, ToolCallArgsDelta):
            args[event.index] += event.text  # KeyError if a fragment came before its start
        elif isinstance(event, ToolCallEnd):
            assert started[event.index] == event.call.name
            assert args[event.index] == event.call.arguments
            json.loads(event.call.arguments)


def _splits(text: str) -> list[list[str]]:
    """The text in two pieces cut at every position, and char by char."""
    return [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]


def _assert_streams_like_one_shot(text: str, starts_in_reasoning: bool, tools: list | None = None,
                                  markup_free: bool = True) -> ParsedOutput:
    whole = parse_output(text, starts_in_reasoning=starts_in_reasoning, tools=tools)
    for pieces in _splits(text):
        events = _run(pieces, starts_in_reasoning, tools)
        assert collect(events) == whole, pieces
        if markup_free:
            for event in events:
                if isinstance(event, (ReasoningDelta, ContentDelta)):
                    assert not any(tag in event.text for tag in TAGS) and "<" not in event.text, (pieces, event)
    return whole


def _args(call: ToolCall) -> dict:
    return json.loads(call.arguments)


def test_reasoning_split_at_every_position() -> None:
    text = "Step 1: compare.\nStep 2: answer.\n</think>\n\nThe answer is **4**.\n"
    out = _assert_streams_like_one_shot(text, starts_in_reasoning=True)
    assert out == ParsedOutput("Step 1: compare.\nStep 2: answer.", "The answer is **4**.", [])


def test_explicit_leading_think_tag() -> None:
    text = "\n<think>\nHmm.\n</think>\n\nHi."
    for starts_in_reasoning in (True, False):
        out = _assert_streams_like_one_shot(text, starts_in_reasoning)
        assert out == ParsedOutput("Hmm.", "Hi.", [])


def test_thinking_disabled_gives_no_reasoning() -> None:
    text = "Plain answer.\nSecond line, with a > b and c </ d."
    out = _assert_streams_like_one_shot(text, starts_in_reasoning=False, markup_free=False)
    assert out == ParsedOutput("", text, [])


def test_unfinished_reasoning_and_partial_tags_at_end() -> None:
    assert parse_output("still thinking </thi", starts_in_reasoning=True) == ParsedOutput("still thinking </thi")
    assert parse_output("ok <tool_ca", starts_in_reasoning=False) == ParsedOutput("", "ok <tool_ca")
    assert parse_output("", starts_in_reasoning=True) == ParsedOutput()
    # only the first </think> ends reasoning; a call inside reasoning is reasoning text
    text = "I could use <tool_call>x</tool_call>.</think>Text about </think> tags."
    assert parse_output(text, starts_in_reasoning=True) == ParsedOutput(
        "I could use <tool_call>x</tool_call>.", "Text about </think> tags."
    )


SEVERAL_CALLS = (
    "Need two searches.\n</think>\n\n"
    "Searching now.\n\n"
    "<tool_call>\n<function=search>\n"
    "<parameter=query>\n42\n</parameter>\n"
    "<parameter=limit>\n5\n</parameter>\n"
    "<parameter=exact>\ntrue\n</parameter>\n"
    '<parameter=filters>\n{"lang": ["en", "fr"], "range": {"from": 1, "to": null}, "deep": {"a": {"b": [1, 2.5]}}}\n'
    "</parameter>\n"
    '<parameter=tags>\n["x", "y"]\n</parameter>\n'
    "<parameter=score>\n0.75\n</parameter>\n"
    "<parameter=mode>\nfast\n</parameter>\n"
    "</function>\n</tool_call>\n"
    "<tool_call>\n<function=write_file>\n"
    "<parameter=path>\n/tmp/a.py\n</parameter>\n"
    "<parameter=content>\n\ndef f():\n    return {'a': 1}\n\n</parameter>\n"
    "</function>\n</tool_call>\n"
    "Both calls sent."
)


def test_several_calls_with_typed_values_streamed() -> None:
    out = _assert_streams_like_one_shot(SEVERAL_CALLS, starts_in_reasoning=True, tools=TOOLS)
    assert out.reasoning == "Need two searches."
    assert out.content == "Searching now.\nBoth calls sent."
    assert [c.name for c in out.tool_calls] == ["search", "write_file"]
    assert all(c.complete for c in out.tool_calls)
    assert _args(out.tool_calls[0]) == {
        "query": "42",  # a string parameter stays a string even when it looks like a number
        "limit": 5,
        "exact": True,
        "filters": {"lang": ["en", "fr"], "range": {"from": 1, "to": None}, "deep": {"a": {"b": [1, 2.5]}}},
        "tags": ["x", "y"],
        "score": 0.75,
        "mode": "fast",
    }
    # one format newline stripped on each side; the value's own blank lines survive
    assert _args(out.tool_calls[1]) == {"path": "/tmp/a.py", "content": "\ndef f():\n    return {'a': 1}\n"}


def test_values_without_tool_schemas_are_guessed() -> None:
    out = parse_output(SEVERAL_CALLS, starts_in_reasoning=True)
    assert _args(out.tool_calls[0])["query"] == 42 and _args(out.tool_calls[0])["exact"] is True
    assert _args(out.tool_calls[0])["mode"] == "fast"


def test_streaming_events_for_one_call() -> None:
    text = "<tool_call>\n<function=search>\n<parameter=query>\nhi\n</parameter>\n<parameter=limit>\n3\n</parameter>\n" \
           "</function>\n</tool_call>"
    pieces = text.split("\n")
    events = _run([p + "\n" for p in pieces[:-1]] + [pieces[-1]], starts_in_reasoning=False, tools=TOOLS)
    assert events == [
        ToolCallStart(0, "search"),
        ToolCallArgsDelta(0, '{"query": "hi"'),
        ToolCallArgsDelta(0, ', "limit": 3'),
        ToolCallArgsDelta(0, "}"),
        ToolCallEnd(0, ToolCall("search", '{"query": "hi", "limit": 3}')),
    ]
    # the call is announced as soon as its name is complete, before any argument
    parser = OutputParser(starts_in_reasoning=False, tools=TOOLS)
    assert parser.feed("<tool_call>\n<function=sea") == []
    assert parser.feed("rch>\n<parameter=query>\nlong value") == [ToolCallStart(0, "search")]


def test_unterminated_call_is_incomplete() -> None:
    text = "Let me write.\n<tool_call>\n<function=write_file>\n<parameter=path>\na.txt\n</parameter>\n" \
           "<parameter=content>\nhalf of the fi"
    out = _assert_streams_like_one_shot(text, starts_in_reasoning=False, tools=TOOLS)
    assert out.content == "Let me write."
    assert out.tool_calls == [ToolCall("write_file", '{"path": "a.txt"}', complete=False)]
    # without even a function name there is nothing to report but the text itself
    assert parse_output("Hi <tool_call>\n<func", starts_in_reasoning=False) == ParsedOutput("", "Hi <tool_call>\n<func")


def test_malformed_and_json_bodies() -> None:
    out = parse_output('A <tool_call>{"name": "search", "arguments": {"query": "ü"}}</tool_call> B',
                       starts_in_reasoning=False, tools=TOOLS)
    assert out == ParsedOutput("", "A  B", [ToolCall("search", '{"query": "ü"}')])
    out = parse_output("A <tool_call>not a call</tool_call> B", starts_in_reasoning=False)
    assert out == ParsedOutput("", "A <tool_call>not a call</tool_call> B")


def test_lenient_xml() -> None:
    # missing </parameter> (the next tag ends the value), stray text, missing </function>
    text = "<tool_call>\n<function=search>\n<parameter=query>\nq\n<parameter=limit>\n7\n</function>\n</tool_call>" \
           "<tool_call><function=write_file>junk<parameter=path>p</parameter>\n<parameter=content>\nc\n</tool_call>"
    out = _assert_streams_like_one_shot(text, starts_in_reasoning=False, tools=TOOLS)
    assert [(c.name, _args(c)) for c in out.tool_calls] == [
        ("search", {"query": "q", "limit": 7}),
        ("write_file", {"path": "p", "content": "c"}),
    ]


def test_convert_value_follows_schema_types() -> None:
    types = parameter_types(TOOLS)["search"]
    assert types["score"] == {"number", "null"} and types["mode"] == {"string"}
    assert convert_value("null", types["score"]) is None
    assert convert_value("3", types["score"]) == 3
    assert convert_value("3.0", types["limit"]) == 3 and isinstance(convert_value("3.0", types["limit"]), int)
    assert convert_value("3.5", types["limit"]) == "3.5"  # not an integer: keep the text
    assert convert_value("True", types["exact"]) is True
    assert convert_value("[1, 2]", types["filters"]) == "[1, 2]"  # an array is not an object
    assert convert_value("NaN", None) == "NaN" and convert_value("1e5", None) == 100000.0
    assert convert_value('"quoted"', None) == '"quoted"'  # without a schema, JSON strings stay raw text
    assert parameter_types([{"junk": 1}, "x"]) == {}
    # a client's schema of the wrong shape declares no types (the fuzzing found a 500 here)
    schemas = [{"properties": [None]}, [1],
               {"properties": {"a": {"type": [{}], "anyOf": 5, "enum": 3}, "b": {"type": ["integer", 1]}}}]
    odd = [{"type": "function", "function": {"name": f"f{i}", "parameters": p}} for i, p in enumerate(schemas)]
    assert parameter_types(odd) == {"f0": {}, "f1": {}, "f2": {"b": {"integer"}}}


def test_template_round_trip() -> None:
    """What the fallback template renders for an assistant turn parses back to the same message."""
    arguments = {"query": "multi\nline\n\nvalue", "limit": 3, "exact": False,
                 "filters": {"nested": [{"k": "v"}, None]}, "tags": []}
    message = {
        "role": "assistant",
        "reasoning_content": "I will search.",
        "content": "Searching.",
        "tool_calls": [{"type": "function", "function": {"name": "search", "arguments": json.dumps(arguments)}},
                       {"type": "function", "function": {"name": "write_file", "arguments": {"path": "x"}}}],
    }
    template = load_chat_template()
    rendered = template.render([{"role": "user", "content": "go"}, message], tools=TOOLS, add_generation_prompt=False)
    head = template.render([{"role": "user", "content": "go"}], tools=TOOLS)  # prompt with thinking on
    assert prompt_opens_reasoning(head) and not prompt_opens_reasoning(
        template.render([{"role": "user", "content": "go"}], enable_thinking=False))
    assert rendered.startswith(head)
    output = rendered[len(head): -len("<|im_end|>\n")]
    out = _assert_streams_like_one_shot(output, starts_in_reasoning=True, tools=TOOLS, markup_free=False)
    assert (out.reasoning, out.content) == ("I will search.", "Searching.")
    assert [(c.name, _args(c)) for c in out.tool_calls] == [("search", arguments), ("write_file", {"path": "x"})]


def test_feed_after_finish_is_an_error() -> None:
    parser = OutputParser(starts_in_reasoning=False)
    assert parser.feed("x <tool") == [ContentDelta("x ")]
    assert parser.finish() == [ContentDelta("<tool")] and parser.finish() == []
    with pytest.raises(RuntimeError):
        parser.feed("y")

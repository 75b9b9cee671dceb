"""Streaming parser for Qwen3.5-style model output: reasoning, content and tool calls.

Fed the text deltas of one generation, it emits events and never lets `<think>`, `</think>`,
`<tool_call>` or `</tool_call>` reach the content: the tail of a delta that could be the start of a
tag is held back until the next delta settles it. `parse_output` runs the same parser over a whole
text, so streaming and one-shot results cannot disagree.

Layout of an output: [<think>] reasoning </think> content (<tool_call> ... </tool_call> content)*.
The generation prompt usually opens <think> itself (`starts_in_reasoning`); an explicit leading
<think> is accepted either way. Only the first </think> ends reasoning; tool calls inside reasoning
are reasoning text.

Newlines that belong to the format are dropped: newlines at the start of reasoning and of content,
and runs of newlines right before a tag or the end of the output.

Edge cases, decided:
- A `<tool_call>` block still open when the output ends (e.g. max_tokens) becomes a call with
  `complete=False` holding the parameters finished so far, if its `<function=NAME>` had arrived;
  otherwise its raw text is content.
- A closed block that is neither the XML nor the JSON form is returned as content, raw.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..textscan import partial_suffix_len
from .reasoning import THINK_CLOSE, THINK_OPEN
from .tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ToolCall, ToolCallBodyParser, parameter_types

_NEWLINES = "\r\n"


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """A call's name is known; its arguments follow as ToolCallArgsDelta fragments."""

    index: int
    name: str


@dataclass(frozen=True)
class ToolCallArgsDelta:
    index: int
    text: str  # the fragments of one call concatenate to its final `arguments`


@dataclass(frozen=True)
class ToolCallEnd:
    index: int
    call: ToolCall


ParserEvent = ReasoningDelta | ContentDelta | ToolCallStart | ToolCallArgsDelta | ToolCallEnd


@dataclass
class ParsedOutput:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


def collect(events: Iterable[ParserEvent], into: ParsedOutput | None = None) -> ParsedOutput:
    """Accumulate events into a whole result (for non-streaming responses)."""
    out = into if into is not None else ParsedOutput()
    for event in events:
        if isinstance(event, ReasoningDelta):
            out.reasoning += event.text
        elif isinstance(event, ContentDelta):
            out.content += event.text
        elif isinstance(event, ToolCallEnd):
            out.tool_calls.append(event.call)
    return out


class _Section:
    """One text channel (reasoning or content) with the format's newlines trimmed.

    Leading newlines are dropped until the channel has real text; a trailing run of newlines is
    held until more text follows it (emitted) or a tag / the end does (dropped).
    """

    def __init__(self) -> None:
        self._started = False
        self._pending = ""

    def text(self, text: str) -> str:
        if not self._started:
            text = text.lstrip(_NEWLINES)
        body = text.rstrip(_NEWLINES)
        if not body:
            self._pending += text
            return ""
        out, self._pending, self._started = self._pending + body, text[len(body) :], True
        return out

    def boundary(self) -> None:
        self._pending = ""


class OutputParser:
    def __init__(self, *, starts_in_reasoning: bool, tools: Sequence[Mapping[str, Any]] | None = None,
                 tool_calls: bool = True):
        """`tool_calls` False: the answer is plain content even where it spells <tool_call> (a JSON
        answer forced by a grammar holds no calls)."""
        self._types = parameter_types(tools)
        self._call_tag = TOOL_CALL_OPEN if tool_calls else None
        self._mode = "reasoning" if starts_in_reasoning else "content"
        self._at_start = True  # an explicit leading <think> is still possible
        self._buf = ""
        self._reasoning = _Section()
        self._content = _Section()
        self._call: ToolCallBodyParser | None = None
        self._call_started = False
        self._calls = 0
        self._finished = False

    @property
    def phase(self) -> str:
        """"reasoning", "answer", or "undecided" while the output may still open with <think>."""
        if self._mode == "reasoning":
            return "reasoning"
        return "undecided" if self._at_start else "answer"

    def feed(self, delta: str) -> list[ParserEvent]:
        if self._finished:
            raise RuntimeError("OutputParser.feed after finish")
        self._buf += delta
        events: list[ParserEvent] = []
        while self._step(events, final=False):
            pass
        return events

    def finish(self) -> list[ParserEvent]:
        """The output ended: release held-back text and close an open tool call."""
        if self._finished:
            return []
        events: list[ParserEvent] = []
        while self._step(events, final=True):
            pass
        self._finished = True
        return events

    def _step(self, events: list[ParserEvent], final: bool) -> bool:
        """Consume what the buffer allows; True when a tag was crossed and there may be more."""
        if self._at_start:
            head = self._buf.lstrip(_NEWLINES)
            if THINK_OPEN.startswith(head) and not final:
                return False
            self._at_start = False
            if head.startswith(THINK_OPEN):
                self._buf, self._mode = head[len(THINK_OPEN) :], "reasoning"
            return True
        if self._mode == "reasoning":
            return self._scan_text(events, THINK_CLOSE, self._reasoning, ReasoningDelta, final)
        if self._mode == "content":
            return self._scan_text(events, self._call_tag, self._content, ContentDelta, final)
        return self._scan_call(events, final)

    def _scan_text(self, events: list[ParserEvent], tag: str | None, section: _Section, kind: type,
                   final: bool) -> bool:
        pos = self._buf.find(tag) if tag is not None else -1
        if tag is not None and pos >= 0:
            self._emit(events, section, kind, self._buf[:pos])
            section.boundary()
            self._buf = self._buf[pos + len(tag) :]
            if tag == THINK_CLOSE:
                self._mode = "content"
            else:
                self._mode, self._call, self._call_started = "call", ToolCallBodyParser(self._types), False
            return True
        keep = 0 if final or tag is None else partial_suffix_len(self._buf, (tag,))
        self._emit(events, section, kind, self._buf[: len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep :]
        if final:
            section.boundary()
        return False

    def _scan_call(self, events: list[ParserEvent], final: bool) -> bool:
        pos = self._buf.find(TOOL_CALL_CLOSE)
        if pos >= 0:
            self._feed_call(events, self._buf[:pos])
            self._buf = self._buf[pos + len(TOOL_CALL_CLOSE) :]
            self._close_call(events, complete=True)
            return True
        keep = 0 if final else partial_suffix_len(self._buf, (TOOL_CALL_CLOSE,))
        self._feed_call(events, self._buf[: len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep :]
        if final:
            self._close_call(events, complete=False)
            return True  # flush the content section
        return False

    def _feed_call(self, events: list[ParserEvent], text: str) -> None:
        assert self._call is not None
        self._call_fragments(events, self._call.feed(text))

    def _call_fragments(self, events: list[ParserEvent], fragments: list[str]) -> None:
        assert self._call is not None
        if self._call.name is not None and not self._call_started:
            events.append(ToolCallStart(self._calls, self._call.name))
            self._call_started = True
        events.extend(ToolCallArgsDelta(self._calls, text) for text in fragments)

    def _close_call(self, events: list[ParserEvent], complete: bool) -> None:
        assert self._call is not None
        fragments, call = self._call.close(complete)
        if call is None:
            raw = TOOL_CALL_OPEN + self._call.text + (TOOL_CALL_CLOSE if complete else "")
            self._emit(events, self._content, ContentDelta, raw)
        else:
            self._call_fragments(events, fragments)
            events.append(ToolCallEnd(self._calls, call))
            self._calls += 1
        self._mode, self._call = "content", None

    @staticmethod
    def _emit(events: list[ParserEvent], section: _Section, kind: type, text: str) -> None:
        out = section.text(text)
        if out:
            events.append(kind(out))


def parse_output(
    text: str, *, starts_in_reasoning: bool, tools: Sequence[Mapping[str, Any]] | None = None
) -> ParsedOutput:
    """One-shot parse of a whole output (the streaming parser fed a single delta)."""
    parser = OutputParser(starts_in_reasoning=starts_in_reasoning, tools=tools)
    return collect([*parser.feed(text), *parser.finish()])

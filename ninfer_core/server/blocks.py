"""Chat events -> a sequence of output blocks (reasoning, text, tool call), opened and closed in
order, for the APIs whose streams are block-structured (Responses items, Anthropic content
blocks). A new block opens whenever the kind changes; a tool call is one block from its start
to its end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..chat.output_parser import (
    ContentDelta,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallStart,
)
from ..llm import ChatFinished, ChatResult, ChatStreamEvent, LogprobsDelta

Kind = Literal["reasoning", "text", "tool_call"]


@dataclass
class Block:
    index: int  # position among this response's blocks
    kind: Kind
    name: str = ""  # tool calls: the function name
    text: str = ""  # accumulated text / reasoning / arguments
    done: bool = False


@dataclass(frozen=True)
class BlockStart:
    block: Block


@dataclass(frozen=True)
class BlockDelta:
    block: Block
    text: str


@dataclass(frozen=True)
class BlockStop:
    block: Block


BlockEvent = BlockStart | BlockDelta | BlockStop


@dataclass
class BlockSequencer:
    blocks: list[Block] = field(default_factory=list)

    @property
    def _open(self) -> Block | None:
        return self.blocks[-1] if self.blocks and not self.blocks[-1].done else None

    def feed(self, event: ChatStreamEvent) -> list[BlockEvent]:
        if isinstance(event, LogprobsDelta):  # not part of any block (Chat Completions reports them)
            return []
        if isinstance(event, ReasoningDelta):
            return self._text("reasoning", event.text)
        if isinstance(event, ContentDelta):
            return self._text("text", event.text)
        if isinstance(event, ToolCallStart):
            return [*self.close(), *self._start("tool_call", event.name)]
        if isinstance(event, ToolCallArgsDelta):
            return self._append(event.text)
        return self.close()  # ToolCallEnd (its fragments already hold the arguments) or ChatFinished

    def close(self) -> list[BlockEvent]:
        block = self._open
        if block is None:
            return []
        block.done = True
        return [BlockStop(block)]

    def _start(self, kind: Kind, name: str = "") -> list[BlockEvent]:
        block = Block(len(self.blocks), kind, name)
        self.blocks.append(block)
        return [BlockStart(block)]

    def _text(self, kind: Kind, text: str) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        if self._open is None or self._open.kind != kind:
            events += [*self.close(), *self._start(kind)]
        return events + self._append(text)

    def _append(self, text: str) -> list[BlockEvent]:
        block = self._open
        if block is None or not text:
            return []
        block.text += text
        return [BlockDelta(block, text)]


def sequence_all(events: list[ChatStreamEvent]) -> tuple[list[Block], ChatResult]:
    """A whole (non-streamed) answer as blocks, with its final result."""
    sequencer = BlockSequencer()
    for event in events:
        sequencer.feed(event)
    finished = events[-1]
    assert isinstance(finished, ChatFinished), "a chat stream ends with ChatFinished"
    return sequencer.blocks, finished.result

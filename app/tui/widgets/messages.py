"""Chat messages: the user's (text + attachments) and the assistant's (a collapsible thinking
block with its own token count, streamed Markdown, and a stats line). Both can be focused and
copied."""

from __future__ import annotations

from pathlib import Path

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Collapsible, Label, Markdown, Static
from textual.widgets._markdown import MarkdownStream

from ..backend import TurnResult
from ..conversation import Message
from ..keymap import binding


class MessageView(Vertical):
    can_focus = True
    BINDINGS = [binding("message.copy", "copy")]

    def __init__(self, message: Message, **kwargs) -> None:
        super().__init__(**kwargs)
        self.message = message

    def action_copy(self) -> None:
        self.app.copy_to_clipboard(self.message.content)
        self.notify("message copied to the clipboard", timeout=2)


class UserMessage(MessageView):
    def compose(self) -> ComposeResult:
        yield Label("You", classes="role")
        for path in self.message.media:
            yield Label(f"📎 {Path(path).name}", classes="attachment")
        yield Static(self.message.content, classes="text", markup=False)


def thinking_title(tokens: int, live: bool) -> str:
    return f"Thinking{'…' if live else ''} · {tokens} token{'s' if tokens != 1 else ''}"


def stats_line(message: Message) -> str:
    meta = message.meta
    if meta.get("error"):
        return f"error: {meta['error']}"
    parts = [f"{meta.get('completion_tokens', 0)} tok"]
    if meta.get("decode_tok_s"):
        parts.append(f"{meta['decode_tok_s']:.1f} tok/s")
    finish = meta.get("finish_reason")
    if finish == "abort":
        parts.append("stopped")
    elif finish == "length":
        parts.append("cut at the token limit")
    return " · ".join(parts)


class AssistantMessage(MessageView):
    """Streams into two Markdown widgets; on finish each gets its full text once."""

    def __init__(self, message: Message, model: str, **kwargs) -> None:
        super().__init__(message, **kwargs)
        self.model = model
        self._streams: list[MarkdownStream] = []

    def compose(self) -> ComposeResult:
        yield Label(f"Assistant · {self.message.meta.get('model') or self.model}", classes="role")
        with Collapsible(title=thinking_title(self.message.meta.get("reasoning_tokens", 0), False),
                         collapsed=True, classes="thinking") as thinking:
            thinking.display = bool(self.message.reasoning)
            yield Markdown(self.message.reasoning, classes="reasoning")
        yield Markdown(self.message.content, classes="content")
        yield Label(stats_line(self.message) if self.message.meta else "", classes="meta")

    @property
    def thinking(self) -> Collapsible:
        return self.query_one(".thinking", Collapsible)

    @property
    def content_view(self) -> Markdown:
        return self.query_one(".content", Markdown)

    @property
    def reasoning_view(self) -> Markdown:
        return self.query_one(".reasoning", Markdown)

    def start_stream(self) -> None:
        self._streams = [Markdown.get_stream(self.reasoning_view), Markdown.get_stream(self.content_view)]
        self.query_one(".meta", Label).update("generating…")

    async def feed(self, reasoning: str, content: str, reasoning_tokens: int) -> None:
        if reasoning:
            self.message.reasoning += reasoning
            if not self.thinking.display:
                self.thinking.display = True
                self.thinking.collapsed = False  # watch it think; folded once the answer starts
            await self._streams[0].write(reasoning)
        if self.thinking.display:
            self.thinking.title = thinking_title(reasoning_tokens, live=not self.message.content and not content)
        if content:
            if not self.message.content and self.thinking.display:
                self.thinking.collapsed = True
            self.message.content += content
            await self._streams[1].write(content)

    async def finish(self, result: TurnResult | None) -> None:
        """Stop streaming and render the final text once (a streamed unclosed fence may be off)."""
        for stream in self._streams:
            await stream.stop()
        self._streams = []
        if result is not None:
            self.message.content, self.message.reasoning = result.text, result.reasoning
        if self.message.reasoning:
            self.thinking.display = True
            self.thinking.title = thinking_title(self.message.meta.get("reasoning_tokens", 0), live=False)
        await self.reasoning_view.update(self.message.reasoning)
        await self.content_view.update(self.message.content)
        self.query_one(".meta", Label).update(stats_line(self.message))
        self.set_class(bool(self.message.meta.get("error")), "failed")

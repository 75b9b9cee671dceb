"""The chat prompt: a multi-line editor, as in oterm and elia.

Enter sends (a `Submitted` message); Shift+Enter or Ctrl+J start a new line (terminals without the
kitty keyboard protocol send Shift+Enter as plain Enter; Ctrl+J works everywhere); a paste keeps
its newlines. The box grows with the text up to MAX_LINES lines, then scrolls. While a slash
command is typed, its completion (commands.complete_prompt) is shown inline and → accepts it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from textual import events
from textual.message import Message
from textual.widgets import TextArea

from ..commands import complete_prompt

MAX_LINES = 6
NEWLINE_KEYS = ("shift+enter", "ctrl+j")


class PromptEditor(TextArea):
    DEFAULT_CSS = f"""
    PromptEditor {{
        height: auto;
        max-height: {MAX_LINES + 2};
    }}
    """

    @dataclass
    class Submitted(Message):
        editor: PromptEditor
        text: str

    def __init__(self, choices: Callable[[str], list[str]], *, placeholder: str = "", id: str | None = None):
        """`choices(command)`: the words /model and /preset complete to."""
        super().__init__(id=id, soft_wrap=True, tab_behavior="focus", show_line_numbers=False,
                         highlight_cursor_line=False, placeholder=placeholder)
        self.choices = choices

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self, self.text))
            return
        if event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            self.replace("\n", *self.selection, maintain_selection_offset=False)
            return
        await super()._on_key(event)

    def update_suggestion(self) -> None:
        """Complete a one-line slash command when the cursor is at its end."""
        text = self.text
        at_end = self.cursor_location == self.document.end
        completed = complete_prompt(text, self.choices) if "\n" not in text and at_end else None
        self.suggestion = completed[len(text):] if completed and completed.startswith(text) else ""

    def set_text(self, text: str) -> None:
        """Replace the text and put the cursor after it."""
        self.text = text
        self.move_cursor(self.document.end)
        self.update_suggestion()

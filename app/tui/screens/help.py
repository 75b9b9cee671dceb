"""Help: the slash commands and the key bindings in force (after the user's keymap)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Label, Static

from ..commands import COMMANDS
from ..keymap import KEYS, binding
from ..paths import keymap_path


class HelpScreen(ModalScreen):
    BINDINGS = [binding("screen.close", "app.pop_screen")]

    def compose(self) -> ComposeResult:
        keymap = getattr(self.app, "keymap", {})
        commands = "\n".join(f"{c.usage:<26} {c.help}" for c in COMMANDS.values())
        keys = "\n".join(f"{keymap.get(i, k):<16} {d:<14} {i}" for i, (k, d) in KEYS.items())
        with VerticalScroll(id="help"):
            yield Label("Slash commands", classes="panel-title")
            yield Static(commands, markup=False)
            yield Label("Keys", classes="panel-title")
            yield Static(keys, markup=False)
            yield Static(f"Remap keys in {keymap_path()}, e.g.  \"chat.stop\" = \"ctrl+x\"", markup=False,
                         classes="hint")

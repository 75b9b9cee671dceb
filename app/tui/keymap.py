"""Key bindings by id, remappable from a TOML file (config dir/keymap.toml), e.g.

    "chat.stop" = "escape,ctrl+x"
    "app.models" = "f5"

Every binding of the TUI is made here with `binding(id, ...)`, so the ids in the file are checked
against the real set and the help screen lists the keys actually in force.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from textual.binding import Binding

from ninfer_core.errors import NinferError

from .paths import keymap_path

# id -> (default keys, what it does)
KEYS: dict[str, tuple[str, str]] = {
    "app.quit": ("ctrl+q", "Quit"),
    "app.help": ("f1", "Help"),
    "app.models": ("f2", "Models"),
    "app.server": ("f3", "Server"),
    "chat.history": ("ctrl+b", "History"),
    "chat.stop": ("escape", "Stop"),
    "chat.regenerate": ("ctrl+r", "Regenerate"),
    "chat.edit": ("ctrl+up", "Edit last"),
    "chat.think": ("ctrl+t", "Thinking"),
    "chat.new": ("ctrl+n", "New chat"),
    "chat.copy": ("ctrl+y", "Copy reply"),
    "chat.panel": ("f4", "Stats panel"),
    "message.copy": ("c", "Copy"),
    "screen.close": ("escape", "Back"),
}


def binding(binding_id: str, action: str, *, show: bool = True, priority: bool = False) -> Binding:
    keys, description = KEYS[binding_id]
    return Binding(keys, action, description, show=show, priority=priority, id=binding_id)


def load_keymap(path: Path | None = None) -> dict[str, str]:
    """The user's remapping (empty without a file); NinferError naming the file for bad entries."""
    path = path or keymap_path()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise NinferError(f"{path}: not a valid keymap ({e})") from None
    unknown = [k for k in data if k not in KEYS]
    if unknown:
        raise NinferError(f"{path}: unknown binding id(s) {', '.join(unknown)} (known: {', '.join(KEYS)})")
    bad = [k for k, v in data.items() if not isinstance(v, str) or not v.strip()]
    if bad:
        raise NinferError(f"{path}: {', '.join(bad)}: expected keys as a string, e.g. \"ctrl+x\" or \"f5,ctrl+x\"")
    return {k: v.replace(" ", "") for k, v in data.items()}

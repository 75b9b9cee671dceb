"""Where ninfer keeps its data (pulled-model registry, the TUI's history): a module of its own so
the CLI and the TUI can find it without importing huggingface_hub."""

from __future__ import annotations

import os
from pathlib import Path


def ninfer_home() -> Path:
    """NINFER_HOME, else $XDG_DATA_HOME/ninfer, else ~/.local/share/ninfer."""
    if home := os.environ.get("NINFER_HOME"):
        return Path(home).expanduser()
    return Path(os.environ.get("XDG_DATA_HOME") or "~/.local/share").expanduser() / "ninfer"

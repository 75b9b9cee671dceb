"""Where the TUI keeps its files: settings and keymap (config), chat history (data).

NINFER_HOME, when set, holds everything (tests and portable installs); otherwise the XDG
directories are used: $XDG_CONFIG_HOME/ninfer and $XDG_DATA_HOME/ninfer (the data directory is
the one the hub registry uses for pulled models).
"""

from __future__ import annotations

import os
from pathlib import Path

from ninfer_core.home import ninfer_home


def data_dir() -> Path:
    return ninfer_home()


def config_dir() -> Path:
    if home := os.environ.get("NINFER_HOME"):
        return Path(home).expanduser()
    return Path(os.environ.get("XDG_CONFIG_HOME") or "~/.config").expanduser() / "ninfer"


def settings_path() -> Path:
    return config_dir() / "settings.json"


def keymap_path() -> Path:
    return config_dir() / "keymap.toml"


def history_path() -> Path:
    return data_dir() / "history.sqlite"

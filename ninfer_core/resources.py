"""Where ninfer's data files (assets/: chat templates, styles, ...) live at run time.

A wheel carries the repository's assets/ as ninfer_core/assets (pyproject.toml force-includes it).
A source checkout and an editable install have no such copy: there the package directory is the
checkout's ninfer_core/, and assets/ sits beside it, so edits show up without reinstalling.
"""

from __future__ import annotations

import functools
from pathlib import Path

from .errors import NinferError

_PACKAGE_DIR = Path(__file__).resolve().parent


@functools.cache
def assets_dir() -> Path:
    """The assets directory: the installed copy if present, else the checkout's."""
    candidates = (_PACKAGE_DIR / "assets", _PACKAGE_DIR.parent / "assets")
    for candidate in candidates:
        if candidate.is_dir():
            return candidate
    looked = ", ".join(str(c) for c in candidates)
    raise NinferError(f"ninfer's assets directory is missing (looked in {looked}); reinstall ninfer")


def asset_path(name: str) -> Path:
    """The path of one asset file, e.g. `asset_path("chat/qwen3_5.jinja")`."""
    path = assets_dir() / name
    if not path.is_file():
        raise NinferError(f"ninfer asset {name!r} not found in {assets_dir()}; reinstall ninfer")
    return path

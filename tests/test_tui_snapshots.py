"""Snapshots of the main screens at a fixed terminal size (pytest-textual-snapshot; the SVGs are in
__snapshots__/test_tui_snapshots/). Review a change with `pytest tests/test_tui_snapshots.py
--snapshot-update` and look at the new SVGs before committing them.

Every state shown is deterministic: a loaded tiny model that has not answered yet (live panels at
zero, no timings), no GPU (hub.local_gpu is stubbed), a fixed server port and API key.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.widgets import Input, TextArea

from ninfer_app.tui.screens import help as help_screen
from ninfer_core import hub
from tui_harness import SIZE, home, make_app, model_dir, wait_until  # noqa: F401 - fixtures


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch):
    monkeypatch.setattr(hub, "local_gpu", lambda: None)


def shot(keys: tuple[str, ...] = ()):
    async def run_before(pilot) -> None:
        await wait_until(pilot, lambda: pilot.app.backend is not None, what="the model to load")
        for key in keys:
            await pilot.press(key)
        await pilot.pause(0.6)  # a live-panel refresh
        pilot.app.clear_notifications()  # toasts expire on a timer
        for field in [*pilot.app.screen.query(Input), *pilot.app.screen.query(TextArea)]:
            field.cursor_blink = False  # a blinking cursor is drawn or not depending on timing
        await pilot.pause()

    return run_before


def test_chat_screen(snap_compare, model_dir, home):
    assert snap_compare(make_app(model_dir, home), terminal_size=SIZE, run_before=shot())


def test_model_wizard(snap_compare, model_dir, home):
    assert snap_compare(make_app(model_dir, home), terminal_size=SIZE, run_before=shot(("f2",)))


def test_server_screen(snap_compare, model_dir, home):
    assert snap_compare(make_app(model_dir, home), terminal_size=SIZE, run_before=shot(("f3",)))


def test_help_screen(snap_compare, model_dir, home, monkeypatch):
    # The help names the keymap file, under the test's temporary home: a path as long as pytest's
    # (xdist's worker folders made it wrap, so the snapshot differed with -n), shown fixed instead.
    monkeypatch.setattr(help_screen, "keymap_path", lambda: Path("/home/user/.config/ninfer/keymap.toml"))
    assert snap_compare(make_app(model_dir, home), terminal_size=SIZE, run_before=shot(("f1",)))

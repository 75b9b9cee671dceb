"""Shared pieces of the TUI tests: a tiny real model, a private home, the app, waiting helpers.

Everything runs the real engine (random-weight tiny Qwen3.5, greedy), so what the TUI shows can
be compared with what LLM.chat returns for the same conversation.
"""

from __future__ import annotations

import asyncio
import struct
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ninfer_app.tui.app import LaunchOptions, NinferApp
from ninfer_app.tui.widgets.messages import AssistantMessage
from ninfer_app.tui.settings import ModelPrefs, Settings
from ninfer_core.engine.sampling import SamplingParams
from ninfer_core.llm import LLM, ChatRequest, ChatResult, EngineOptions
from tiny_model_dir import write_tiny_model_dir

torch.set_num_threads(1)  # tiny tensors: thread start-up dominates and the cores are shared

MODEL_NAME = "tiny-qwen"  # the directory name is the model's name in the UI (fixed for snapshots)
MAX_CONTEXT = 512
ENGINE = dict(device="cpu", dtype="float32", max_context=MAX_CONTEXT, max_seqs=2)
TEST_PRESET = {"temperature": 0.0, "max_tokens": 24}
SIZE = (120, 36)


def write_model(root: Path) -> Path:
    directory = root / MODEL_NAME
    if not (directory / "config.json").exists():
        write_tiny_model_dir(directory, moe=True, max_positions=4096)
    return directory


def engine_options(**overrides: Any) -> EngineOptions:
    return EngineOptions(**{**ENGINE, **overrides})


def tui_settings(home: Path, preset: dict[str, Any] | None = None, **fields: Any) -> Settings:
    """Greedy, short answers for the tiny model; written to the home's settings.json."""
    settings = Settings(presets={"test": dict(preset or TEST_PRESET)},
                        models={MODEL_NAME: ModelPrefs(preset="test")}, path=home / "settings.json", **fields)
    settings.server.api_key = "sk-ninfer-test"
    settings.save()
    return settings


def make_app(model: Path | str | None, home: Path, *, settings: Settings | None = None, pull_options: Any = None,
             **launch: Any) -> NinferApp:
    """The app on a private home; `app.notices` records every notification as (severity, message)."""
    launch.setdefault("engine", engine_options())
    app = NinferApp(LaunchOptions(model=str(model) if model else None, **launch),
                    settings=settings or tui_settings(home), pull_options=pull_options)
    app.notices = []
    notify = app.notify

    def recording_notify(message: str, *args: Any, **kwargs: Any) -> None:
        app.notices.append((kwargs.get("severity", "information"), str(message)))
        notify(message, *args, **kwargs)

    app.notify = recording_notify
    return app


def noticed(app: NinferApp, text: str, severity: str | None = None) -> bool:
    return any(text in m and (severity is None or s == severity) for s, m in app.notices)


def reference(llm: LLM, messages: list[dict[str, Any]], thinking: bool = True,
              sampling: dict[str, Any] | None = None) -> ChatResult:
    """What the engine answers on its own (no service, no UI) for the same conversation."""
    return llm.chat_result(ChatRequest(messages=messages, sampling=SamplingParams(**(sampling or TEST_PRESET)),
                                       enable_thinking=thinking))


async def wait_until(pilot: Any, condition: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)


KEY_CHARACTERS = {"enter": "\r", "escape": "\x1b"}


async def press_now(pilot: Any, *keys: str) -> None:
    """Key presses as the terminal driver sends them, without Pilot.press's wait for an idle CPU
    (which, while the engine computes on another thread, costs up to 2 s per key)."""
    from textual import events

    for key in keys:
        event = events.Key(key, KEY_CHARACTERS.get(key, key if len(key) == 1 else None))
        event.set_sender(pilot.app)
        pilot.app._driver.send_message(event)
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.05)


async def submit(pilot: Any, text: str, taken: bool = True) -> None:
    """Put text in the prompt and press Enter (set directly: typing each key is slow). `taken`: wait
    until the prompt took it (it clears once a message is on screen or a command has run; what it
    refuses stays there)."""
    prompt = pilot.app.screen.query_one("#prompt")
    prompt.set_text(text)
    prompt.focus()
    await press_now(pilot, "enter")
    if taken:
        await wait_until(pilot, lambda: prompt.text != text, what=f"the prompt to take {text!r}")


async def loaded(pilot: Any) -> None:
    await wait_until(pilot, lambda: pilot.app.backend is not None, what="the model to load")


async def answered(pilot: Any, messages: int) -> None:
    chat = pilot.app.chat_screen
    await wait_until(pilot, lambda: not chat.generating and len(chat.chat.messages) == messages, what="the answer")


def reply_view(app: NinferApp) -> AssistantMessage:
    return app.chat_screen.query(AssistantMessage).last()


def write_png(path: Path) -> Path:
    """A 1x1 PNG (hand-built: no imaging library needed)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(b"\x00\xff\x00\x00")) + chunk(b"IEND", b""))
    return path


# ---- fixtures (import them into the test module) --------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("tui_model"))


@pytest.fixture(scope="module")
def ref_llm(model_dir) -> LLM:
    """The same model loaded on its own, for reference answers."""
    return LLM.load(str(model_dir), engine_options())


@pytest.fixture(scope="module")
def long_llm(model_dir) -> LLM:
    return LLM.load(str(model_dir), engine_options(max_context=2048))


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A private NINFER_HOME (settings, keymap, history, pulled models)."""
    home = tmp_path / "home"
    monkeypatch.setenv("NINFER_HOME", str(home))
    return home

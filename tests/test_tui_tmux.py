"""The real `ninfer chat`, in a real terminal (tmux), on the embedded default model (SmolLM2),
answers a question. Skipped without tmux (`apt-get install -y tmux`)."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

TMUX = shutil.which("tmux")
REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = "SmolLM2-135M-Instruct.Q4_1"  # the embedded model's name in the UI

pytestmark = pytest.mark.skipif(TMUX is None, reason="tmux is not installed")


def tmux(*args: str) -> str:
    return subprocess.run([TMUX, *args], check=True, capture_output=True, text=True).stdout


def screen(session: str) -> str:
    return tmux("capture-pane", "-p", "-t", session)


def wait_for(session: str, text: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        shown = screen(session)
        if text in shown:
            return shown
        time.sleep(0.25)
    raise AssertionError(f"'{text}' did not appear within {timeout:.0f}s; the screen:\n{screen(session)}")


def test_ninfer_chat_answers_a_question_in_a_terminal(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    # greedy, so the answer is the model's most likely one
    (home / "settings.json").write_text(json.dumps({"models": {DEFAULT_MODEL: {"preset": "precise"}}}))
    session = f"ninfer-tui-{os.getpid()}"
    command = (f"cd {REPO} && exec env NINFER_HOME={home} TERM=xterm-256color "
               f"{sys.executable} -m ninfer_app chat --device cpu")
    tmux("new-session", "-d", "-s", session, "-x", "120", "-y", "40", command)
    try:
        wait_for(session, f"{DEFAULT_MODEL} ·", timeout=90)  # the header names the loaded model
        tmux("send-keys", "-t", session, "What is the capital of France?", "Enter")
        shown = wait_for(session, "Paris", timeout=120)
        assert "What is the capital of France?" in shown
        tmux("send-keys", "-t", session, "C-q")
        deadline = time.monotonic() + 20
        while subprocess.run([TMUX, "has-session", "-t", session], capture_output=True).returncode == 0:
            assert time.monotonic() < deadline, "ninfer chat did not quit on ctrl+q"
            time.sleep(0.2)
    finally:
        subprocess.run([TMUX, "kill-session", "-t", session], capture_output=True)
    with sqlite3.connect(home / "history.sqlite") as db:  # the conversation was saved as shown
        saved = db.execute("SELECT role, content FROM messages ORDER BY position").fetchall()
    assert saved[0] == ("user", "What is the capital of France?")
    assert saved[1][0] == "assistant" and "Paris" in saved[1][1]

"""The chat flows of the TUI, driven with Textual's Pilot on a real engine (tiny random Qwen3.5, greedy).

What the UI shows and stores is compared with what LLM.chat answers on its own for the same
conversation (a separately loaded model), so a flow that sends the wrong conversation, drops or
duplicates text while streaming, or keeps a stale turn, fails.
"""

from __future__ import annotations

import re

import threading
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ninfer_app.tui.export import chat_markdown
from ninfer_app.tui.screens.chat import LIVE_REFRESH_S
from ninfer_app.tui.screens.help import HelpScreen
from ninfer_app.tui.settings import Settings, default_model
from ninfer_app.tui.store import HistoryStore
from ninfer_app.tui.widgets.messages import AssistantMessage
from ninfer_core.engine.sampling import SamplingParams
from ninfer_core.errors import NinferError
from ninfer_core.llm import LLM, ChatRequest
from tiny_model_dir import write_tiny_multimodal_dir
from tui_harness import (  # noqa: F401 - model_dir, ref_llm, long_llm and home are fixtures
    MAX_CONTEXT,
    MODEL_NAME,
    SIZE,
    answered,
    engine_options,
    home,
    loaded,
    long_llm,
    make_app,
    model_dir,
    noticed,
    press_now,
    ref_llm,
    reference,
    reply_view,
    submit,
    tui_settings,
    wait_until,
    write_png,
)

pytestmark = pytest.mark.asyncio
# long enough to stop, type or watch the panels mid-answer (the tiny model would stop at ~360 tokens)
LONG = {"temperature": 0.0, "max_tokens": 1500, "ignore_eos": True}


# ---- send / stream ------------------------------------------------------------------------------


async def test_send_shows_and_stores_the_engines_answer(model_dir, ref_llm, home):
    app = make_app(model_dir, home)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await submit(pilot, "Hello")
        await answered(pilot, 2)
        chat = app.chat_screen
        view = reply_view(app)
        gauge = str(chat.query_one("#gauge").render())
        shown = (view.content_view.source, view.reasoning_view.source, view.thinking.display, view.thinking.title)
    expected = reference(ref_llm, [{"role": "user", "content": "Hello"}])
    reply = chat.chat.messages[-1]
    assert (reply.content, reply.reasoning) == (expected.text, expected.reasoning)
    assert shown == (expected.text, expected.reasoning, True, f"Thinking · {expected.reasoning_tokens} tokens")
    assert reply.meta["completion_tokens"] == len(expected.token_ids)
    assert reply.meta["prompt_tokens"] == len(expected.prompt_token_ids)
    used = len(expected.prompt_token_ids) + len(expected.token_ids)
    assert f"context {used} / {MAX_CONTEXT} tok" in gauge
    stored = HistoryStore(home / "history.sqlite").load(chat.chat.id)
    assert [(m.role, m.content, m.reasoning) for m in stored.messages] == [
        ("user", "Hello", ""), ("assistant", expected.text, expected.reasoning)]


async def test_streaming_keeps_the_ui_responsive_and_esc_stops_freeing_the_kv(model_dir, long_llm, home):
    app = make_app(model_dir, home, settings=tui_settings(home, preset=LONG), engine=engine_options(max_context=2048))
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await submit(pilot, "Hello")
        screen, view = app.chat_screen, reply_view(app)
        await wait_until(pilot, lambda: len(view.reasoning_view.source) > 0, what="first streamed text")
        partial = view.reasoning_view.source
        await press_now(pilot, "a", "b", "c")  # the prompt takes keys while the engine works
        assert screen.generating and screen.prompt.text == "abc"
        await press_now(pilot, "escape")
        await answered(pilot, 2)
        stats = app.backend.service_stats()
        stopped = screen.chat.messages[-1]
        meta_line = str(view.query_one(".meta").render())
        shown = view.reasoning_view.source
    n = stopped.meta["completion_tokens"]
    assert stopped.meta["finish_reason"] == "abort" and "stopped" in meta_line and 0 < n < LONG["max_tokens"]
    # what was shown is what the engine generated: the first n tokens of the same greedy answer
    upto = reference(long_llm, [{"role": "user", "content": "Hello"}], sampling={**LONG, "max_tokens": n})
    assert stopped.reasoning.startswith(partial) and upto.reasoning.startswith(stopped.reasoning)
    assert len(upto.reasoning) - len(stopped.reasoning) <= 8  # at most a held-back partial character
    assert shown == stopped.reasoning
    assert stats.engine.running == 0 and stats.engine.kv_used_tokens == 0


async def test_thinking_toggle_changes_the_prompt_and_where_the_text_goes(model_dir, ref_llm, home):
    app = make_app(model_dir, home)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await pilot.press("ctrl+t")
        assert Settings.load(home / "settings.json").thinking is False
        assert "thinking off" in str(app.chat_screen.query_one("#mode").render())
        await submit(pilot, "Hello")
        await answered(pilot, 2)
        view = reply_view(app)
        shown = (view.thinking.display, view.content_view.source)
        reply = app.chat_screen.chat.messages[-1]
    off = reference(ref_llm, [{"role": "user", "content": "Hello"}], thinking=False)
    on = reference(ref_llm, [{"role": "user", "content": "Hello"}], thinking=True)
    assert off.text and not off.reasoning and on.reasoning and not on.text  # the switch matters for this model
    assert (reply.content, reply.reasoning) == (off.text, "")
    assert shown == (False, off.text)


async def test_regenerate_replaces_the_last_answer(model_dir, ref_llm, home):
    app = make_app(model_dir, home)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await submit(pilot, "Hello")
        await answered(pilot, 2)
        first = app.chat_screen.chat.messages[-1]
        await pilot.press("ctrl+r")
        await wait_until(pilot, lambda: app.chat_screen.chat.messages[-1] is not first, what="a new answer")
        await answered(pilot, 2)
        finished = app.backend.service_stats().engine.requests_finished
        chat = app.chat_screen.chat
        views = len(app.chat_screen.query(AssistantMessage))
    expected = reference(ref_llm, [{"role": "user", "content": "Hello"}])
    assert finished == 2 and views == 1  # generated again, shown once
    assert [m.role for m in chat.messages] == ["user", "assistant"]
    assert chat.messages[-1].reasoning == expected.reasoning
    stored = HistoryStore(home / "history.sqlite").load(chat.id)
    assert [(m.role, m.reasoning) for m in stored.messages] == [("user", ""), ("assistant", expected.reasoning)]


async def test_edit_resends_the_edited_last_message(model_dir, ref_llm, home):
    app = make_app(model_dir, home)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await submit(pilot, "Hello")
        await answered(pilot, 2)
        await pilot.press("ctrl+up")
        screen = app.chat_screen
        assert screen.prompt.text == "Hello" and "EDITING" in str(screen.query_one("#mode").render())
        await submit(pilot, "Paris is the capital")
        await answered(pilot, 2)
        chat = screen.chat
    expected = reference(ref_llm, [{"role": "user", "content": "Paris is the capital"}])
    assert [(m.role, m.content) for m in chat.messages][0] == ("user", "Paris is the capital")
    assert chat.messages[1].reasoning == expected.reasoning
    stored = HistoryStore(home / "history.sqlite").load(chat.id)
    assert [m.content for m in stored.messages] == ["Paris is the capital", expected.text]


# ---- attachments ---------------------------------------------------------------------------------


async def test_image_attach_with_path_completion_and_a_clear_notice_without_vision(model_dir, ref_llm, home, tmp_path):
    picture = write_png(tmp_path / "picture.png")
    app = make_app(model_dir, home)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        screen = app.chat_screen
        screen.prompt.set_text(f"/image {tmp_path}/pic")
        screen.prompt.focus()
        await wait_until(pilot, lambda: screen.prompt.suggestion == "ture.png", what="path completion")
        await pilot.press("end", "right")  # accept the suggestion
        assert screen.prompt.text == f"/image {picture}"
        await pilot.press("enter")
        assert screen.attachments == [str(picture)]
        assert "picture.png" in str(screen.query_one("#attachments").render())
        await submit(pilot, "What is in this picture?", taken=False)
        await wait_until(pilot, lambda: noticed(app, "cannot read images or videos", "error"), what="the notice")
        assert screen.chat.messages == [] and screen.prompt.text == "What is in this picture?"
        await submit(pilot, "/image clear")
        await submit(pilot, "What is in this picture?")
        await answered(pilot, 2)
        assert screen.chat.messages[0].media == []
        await submit(pilot, "/image /no/such/file.png", taken=False)
        await wait_until(pilot, lambda: noticed(app, "/no/such/file.png: no such file", "error"), what="the notice")


async def test_an_attached_image_reaches_a_vision_model(home, tmp_path):
    tiny = write_tiny_multimodal_dir(tmp_path / "tiny-vl", moe=False)
    picture = tmp_path / "wide.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (17, 40, 3), dtype=np.uint8)).save(picture)
    preset = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
    app = make_app(tiny.directory, home, settings=tui_settings(home, preset=preset, thinking=False))
    app.settings.models["tiny-vl"] = app.settings.prefs(MODEL_NAME)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        assert app.backend.supports_media
        await submit(pilot, f"/image {picture}")
        await submit(pilot, "Describe")
        await answered(pilot, 2)
        question, reply = app.chat_screen.chat.messages
    llm = LLM.load(str(tiny.directory), engine_options())
    sampling = SamplingParams(**preset)
    with_image = llm.chat_result(ChatRequest([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": str(picture)}}, {"type": "text", "text": "Describe"}]}],
        sampling, enable_thinking=False))
    text_only = llm.chat_result(ChatRequest([{"role": "user", "content": "Describe"}], sampling, enable_thinking=False))
    assert question.media == [str(picture)]
    assert reply.content == with_image.text and reply.meta["prompt_tokens"] == len(with_image.prompt_token_ids)
    assert len(with_image.prompt_token_ids) > len(text_only.prompt_token_ids)  # the image's tokens went in


async def test_image_from_the_command_line_is_attached_to_the_first_message(model_dir, home, tmp_path):
    picture = write_png(tmp_path / "cli.png")
    app = make_app(model_dir, home, images=[str(picture)])
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        assert app.chat_screen.attachments == [str(picture)]
    notes = tmp_path / "notes.txt"
    notes.write_text("not a picture")
    with pytest.raises(NinferError, match="notes.txt: not an image or video file"):
        make_app(model_dir, home, images=[str(notes)])


# ---- commands, copy, history ---------------------------------------------------------------------


async def test_slash_commands(model_dir, ref_llm, home, tmp_path):
    app = make_app(model_dir, home)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        screen = app.chat_screen
        await submit(pilot, "/system You answer in French.")
        await submit(pilot, "Hello")
        await answered(pilot, 2)
        await submit(pilot, "/save My first chat")
        await submit(pilot, "/export " + str(tmp_path / "chat.md"))
        await submit(pilot, "/preset balanced")
        await submit(pilot, "/think off")
        await submit(pilot, "/nonsense", taken=False)
        await wait_until(pilot, lambda: noticed(app, "unknown command /nonsense", "error"), what="the notice")
        screen.prompt.set_text("")
        await submit(pilot, "/help")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        exported = chat_markdown(screen.chat)
        chat_id = screen.chat.id
        await submit(pilot, "/clear")
        assert screen.chat.messages == [] and screen.chat.id is None
        assert len(screen.query(AssistantMessage)) == 0
    expected = reference(ref_llm, [{"role": "system", "content": "You answer in French."},
                                   {"role": "user", "content": "Hello"}])
    settings = Settings.load(home / "settings.json")
    assert settings.prefs(MODEL_NAME).system == "You answer in French."
    assert settings.prefs(MODEL_NAME).preset == "balanced" and settings.thinking is False
    assert (tmp_path / "chat.md").read_text() == exported and expected.reasoning.splitlines()[0] in exported
    summaries = HistoryStore(home / "history.sqlite").chats()
    assert [(s.id, s.title, s.messages) for s in summaries] == [(chat_id, "My first chat", 2)]
    assert noticed(app, "unknown command /nonsense", "error")


async def test_copy_a_message(model_dir, home):
    app = make_app(model_dir, home)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await submit(pilot, "Hello")
        await answered(pilot, 2)
        reply = app.chat_screen.chat.messages[-1]
        app.chat_screen.query("UserMessage").first().focus()
        await pilot.press("c")
        assert app.clipboard == "Hello"
        await pilot.press("ctrl+y")
        assert app.clipboard == reply.content


async def test_history_reopens_after_restart_and_continues_the_conversation(model_dir, ref_llm, home):
    first = make_app(model_dir, home)
    async with first.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await submit(pilot, "Hello")
        await answered(pilot, 2)
        answer = first.chat_screen.chat.messages[-1]
    second = make_app(model_dir, home)
    async with second.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        screen = second.chat_screen
        await pilot.press("ctrl+b")
        assert screen.query_one("#sidebar").display
        await pilot.press("enter")  # the newest chat is selected
        await wait_until(pilot, lambda: len(screen.chat.messages) == 2, what="the chat to reopen")
        assert [v.message.content for v in screen.query(AssistantMessage)] == [answer.content]
        await submit(pilot, "Again")
        await answered(pilot, 4)
        reply = screen.chat.messages[-1]
    expected = reference(ref_llm, [{"role": "user", "content": "Hello"},
                                   {"role": "assistant", "content": answer.content},
                                   {"role": "user", "content": "Again"}])
    assert reply.reasoning == expected.reasoning
    assert len(HistoryStore(home / "history.sqlite").chats()) == 1


async def test_context_gauge_warns_before_overflow_and_an_overflow_is_refused(model_dir, ref_llm, home):
    app = make_app(model_dir, home)
    sentence = "The quick brown fox jumps over the lazy dog. "
    per_sentence = len(ref_llm.tokenizer.encode(sentence * 10)) / 10
    long_text = sentence * int(0.85 * MAX_CONTEXT / per_sentence)  # ~85% of the context with its answer
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        screen = app.chat_screen
        await submit(pilot, long_text)
        await answered(pilot, 2)
        assert screen.query_one("#gauge").has_class("warn")
        assert noticed(app, "of the context", "warning")
        await submit(pilot, long_text)
        await answered(pilot, 4)
        failed = screen.chat.messages[-1]
    assert "context limit is 512 tokens" in failed.meta["error"] and "/clear" in failed.meta["error"]
    assert noticed(app, "context limit is 512 tokens", "error")


# ---- live panels, keymap, themes -----------------------------------------------------------------


async def test_live_panels_follow_the_engine(model_dir, home):
    app = make_app(model_dir, home, settings=tui_settings(home, preset=LONG),
                   engine=engine_options(max_context=2048, spec="ngram"))
    assert LIVE_REFRESH_S <= 0.5  # at least twice a second
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        panel = app.chat_screen.query_one("#live")
        text = lambda name: str(panel.query_one(f"#{name}").render())  # noqa: E731
        await submit(pilot, "Hello")
        await wait_until(pilot, lambda: "tok/s" in text("decode") and text("kv").split()[0] != "0",
                         what="live decode rate and KV use")
        assert panel.query_one("#decode-history").data
        await wait_until(pilot, lambda: "accepted" in text("spec"), what="speculative acceptance")
        assert text("spec").startswith("ngram, 4 drafts/round\n")
        assert text("kv-chat").startswith("this chat ") and not text("kv-chat").startswith("this chat 0 tok")
        await pilot.press("escape")
        await answered(pilot, 2)
        await wait_until(pilot, lambda: text("kv").startswith("0 tok in use"), what="KV freed in the panel")
        assert "cpu: no GPU" in text("gpu")
        # one context number on screen: the gauge's limit, and the KV capacity in chats of it (2 x 2,048)
        assert "/ 2,048 tok" in str(app.chat_screen.query_one("#gauge").render())
        assert text("kv-room") == "room for 2 chats of 2,048"
        assert "4,096" not in "".join(text(n) for n in ("kv", "kv-chat", "kv-room"))
        # the prefix cache beside the active KV: the answer's pages and checkpoints stay cached
        assert re.fullmatch(r"cached [1-9].* · \d+% reused", text("kv-cached")), text("kv-cached")


async def test_keymap_file_remaps_bindings_and_bad_ids_are_named(model_dir, home):
    home.mkdir(parents=True, exist_ok=True)
    (home / "keymap.toml").write_text('"chat.think" = "f9"\n')
    app = make_app(model_dir, home)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await pilot.press("f9")
        assert app.settings.thinking is False
        await pilot.press("ctrl+t")  # the default key no longer toggles
        assert app.settings.thinking is False
        app.theme = "ninfer-light"
        await pilot.pause()
    assert Settings.load(home / "settings.json").theme == "ninfer-light"
    (home / "keymap.toml").write_text('"chat.nope" = "f9"\n')
    with pytest.raises(NinferError, match=r"keymap.toml: unknown binding id\(s\) chat.nope"):
        make_app(model_dir, home)


async def test_set_default_model_is_used_without_a_model_argument(model_dir, home):
    settings = tui_settings(home, default_model=str(model_dir))
    assert default_model() == str(model_dir)
    app = make_app(None, home, settings=settings)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        assert app.backend.name == MODEL_NAME


async def test_model_command_switches_models_and_reports_load_errors(model_dir, home):
    others = engine_threads()  # engines of other tests' fixtures, if any
    app = make_app(model_dir, home)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        first = app.backend
        await submit(pilot, "/model nosuchmodel")
        await wait_until(pilot, lambda: noticed(app, "nosuchmodel: no such model directory", "error"),
                         what="the load error")
        assert app.backend is None and first.service._thread is None  # the old engine was stopped first
        await submit(pilot, f"/model {model_dir}")
        await loaded(pilot)
        second = app.backend
        assert second is not first and second.name == MODEL_NAME
        app.switch_model(str(model_dir))
        app.switch_model(str(model_dir))  # supersedes the first: its engine, once loaded, is closed
        await loaded(pilot)
        await wait_until(pilot, lambda: engine_threads() == others + 1, what="the superseded engine to stop")
        assert second.service._thread is None
    assert app.backend.service._thread is None and engine_threads() == others  # quitting stops the engine


def engine_threads() -> int:
    return sum(t.name == "ninfer-engine" and t.is_alive() for t in threading.enumerate())

"""Issue 17 item 2 in the TUI (Textual Pilot, real engine): the multi-line prompt, the stats panel
key, no thinking switch for a model that does not think; and remote mode's decode rate for a
stream that arrives in one burst."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator

import httpx
import pytest
from textual import events

from ninfer_app.tui.remote import RemoteGeneration, decode_rate, request_body
from ninfer_app.tui.backend import TurnDone
from ninfer_app.tui.widgets.prompt import MAX_LINES
from ninfer_core.llm import ChatRequest
from tui_harness import (  # noqa: F401 - model_dir, ref_llm and home are fixtures
    MODEL_NAME,
    SIZE,
    answered,
    home,
    loaded,
    make_app,
    model_dir,
    noticed,
    press_now,
    ref_llm,
    reference,
    wait_until,
)

CODE_QUESTION = "Fix this code:\ndef add(a, b):\n    return a - b\nprint(add(2, 2))"
PLAIN_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


async def paste(pilot, text: str) -> None:
    """A bracketed paste, as the terminal driver delivers it."""
    event = events.Paste(text)
    event.set_sender(pilot.app)
    pilot.app._driver.send_message(event)
    await wait_until(pilot, lambda: text in pilot.app.focused.text, what="the pasted text")


@pytest.mark.asyncio
async def test_a_pasted_multi_line_question_is_sent_whole(model_dir, ref_llm, home):
    app = make_app(model_dir, home)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        screen = app.chat_screen
        prompt = screen.prompt
        prompt.focus()
        one_line = prompt.outer_size.height
        await paste(pilot, CODE_QUESTION)
        assert prompt.text == CODE_QUESTION
        # it grows with the four lines (on the next layout pass: wait for it, a slow CI box lags)
        await wait_until(pilot, lambda: prompt.outer_size.height == one_line + 3, what="the prompt to grow")
        await press_now(pilot, "ctrl+j", "x")  # a new line, without sending
        assert prompt.text == CODE_QUESTION + "\nx" and not screen.chat.messages
        await press_now(pilot, "backspace", "backspace")
        await press_now(pilot, "enter")
        await answered(pilot, 2)
        sent, reply = screen.chat.messages
        assert sent.content == CODE_QUESTION and prompt.text == ""
        expected = reference(ref_llm, [{"role": "user", "content": CODE_QUESTION}])
        assert (reply.content, reply.reasoning) == (expected.text, expected.reasoning)
        await paste(pilot, "\n".join(f"line {i}" for i in range(30)))
        # grows to a few lines, then scrolls
        await wait_until(pilot, lambda: prompt.outer_size.height == MAX_LINES + 2, what="the prompt to stop growing")
        assert prompt.max_scroll_y > 0


@pytest.mark.asyncio
async def test_the_stats_panel_hides_on_a_key_and_starts_hidden_on_a_narrow_terminal(model_dir, home):
    app = make_app(model_dir, home)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        panel, main = app.chat_screen.query_one("#live"), app.chat_screen.query_one("#main")
        assert panel.display and SIZE[0] >= 100
        width = main.size.width
        await pilot.press("f4")
        await pilot.pause()
        assert not panel.display and main.size.width >= width + 30  # the panel's 34 columns go to the messages
        await pilot.press("f4")
        await pilot.pause()
        assert panel.display and main.size.width == width
    narrow = make_app(model_dir, home)
    async with narrow.run_test(size=(80, 24)) as pilot:
        await loaded(pilot)
        assert not narrow.chat_screen.query_one("#live").display
        assert narrow.chat_screen.query_one("#main").size.width == 80  # the messages get every column


@pytest.mark.asyncio
async def test_no_thinking_switch_for_a_model_that_does_not_think(model_dir, home, tmp_path):
    plain = tmp_path / MODEL_NAME
    shutil.copytree(model_dir, plain)
    (plain / "chat_template.jinja").write_text(PLAIN_CHATML)
    app = make_app(plain, home)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        mode = str(app.chat_screen.query_one("#mode").render())
        assert "thinking" not in mode and "preset test" in mode
        before = app.settings.thinking
        await pilot.press("ctrl+t")
        await wait_until(pilot, lambda: noticed(app, "does not think", "warning"), what="the notice")
        assert app.settings.thinking == before and "thinking" not in str(app.chat_screen.query_one("#mode").render())
    thinking = make_app(model_dir, home)  # the Qwen-style template: the switch is there
    async with thinking.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        assert "thinking on" in str(thinking.chat_screen.query_one("#mode").render())


def test_remote_decode_rate_of_a_burst_is_not_thousands_of_tokens_a_second():
    """A proxy that buffers sent 5 tokens at once after 0.3 s: 12,301 tok/s was shown."""
    def body() -> Iterator[bytes]:
        time.sleep(0.3)
        for piece in ("Par", "is", " is", " the", " capital"):
            yield f"data: {json.dumps({'choices': [{'delta': {'content': piece}}]})}\n\n".encode()
        yield b"data: [DONE]\n\n"

    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body()))
    client = httpx.Client(base_url="http://remote/v1", transport=transport)
    events_ = list(RemoteGeneration(client, request_body("m", ChatRequest([{"role": "user", "content": "hi"}])),
                                    "http://remote/v1"))
    result = events_[-1].result if isinstance(events_[-1], TurnDone) else None
    assert result is not None and result.completion_tokens == 5
    assert 0 < result.decode_tok_s <= 5 / 0.3  # all tokens over the whole request, not over 0.1 ms
    assert decode_rate(11, started=0.0, first=1.0, ended=2.0) == pytest.approx(10.0)  # a real stream: its own rate
    assert decode_rate(0, 0.0, None, 1.0) == 0.0

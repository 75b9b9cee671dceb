"""The TUI's model wizard (against the local fake hub), its server toggle (then real HTTP requests to
the embedded server) and remote mode (against the real embedded server on loopback)."""

from __future__ import annotations

import hashlib
import re

import httpx
import pytest
from huggingface_hub import constants

from ninfer_app.tui.screens.models import FileRow, ModelsScreen
from ninfer_app.tui.screens.server import ServerScreen
from ninfer_app.tui.settings import ModelPrefs, Settings, default_model
from fake_hub import FakeHub
from ninfer_core import hub
from ninfer_core.hub import PullOptions, Registry, RetryPolicy
from ninfer_core.llm import LLM
from ninfer_core.server.app import ServerHandle
from tui_harness import (  # noqa: F401 - model_dir, ref_llm and home are fixtures
    SIZE,
    answered,
    engine_options,
    home,
    loaded,
    make_app,
    model_dir,
    noticed,
    press_now,
    ref_llm,
    reference,
    submit,
    tui_settings,
    wait_until,
    write_png,
)

pytestmark = pytest.mark.asyncio
REPO = "org/tiny-qwen"


def log_text(widget) -> str:
    """The lines of a RichLog as plain text."""
    return "\n".join("".join(segment.text for segment in line) for line in widget.lines)


# ---- model wizard --------------------------------------------------------------------------------


@pytest.fixture
def fake_hub(model_dir, home, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(hub, "local_gpu", lambda: None)
    with FakeHub() as fake:
        fake.add_repo(REPO, {p.name: p.read_bytes() for p in model_dir.iterdir()})
        yield fake


async def test_wizard_pulls_with_progress_resume_retry_and_verification_then_sets_default_uses_and_removes(
        model_dir, ref_llm, home, fake_hub):
    options = PullOptions(endpoint=fake_hub.url, max_workers=1,
                          retry=RetryPolicy(attempts=4, base_s=0.01, max_s=0.05))
    weights = (model_dir / "model.safetensors").read_bytes()
    settings = tui_settings(home)
    settings.models[REPO] = ModelPrefs(preset="test")  # the pulled copy answers greedily too
    app = make_app(model_dir, home, settings=settings, pull_options=options)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await pilot.press("f2")
        screen = app.screen
        assert isinstance(screen, ModelsScreen)
        catalog = screen.query_one("#catalog")
        assert catalog.row_count == len(hub.ALIASES)
        screen.query_one("#spec").value = REPO

        # an interrupted pull keeps its partial file...
        fake_hub.faults.chunk_delay = 0.03
        await pilot.click("#pull")
        await wait_until(pilot, lambda: any(r.file_name == "model.safetensors" and r.done > 0
                                            for r in screen.query(FileRow)), what="the weights to download")
        await pilot.click("#cancel")
        await wait_until(pilot, lambda: not screen.query_one("#pull").disabled, what="the pull to stop")
        assert noticed(app, "resumes", "error")

        # ...and the next pull resumes it, through a failing listing request, and verifies every file
        fake_hub.faults.chunk_delay = 0.0
        fake_hub.faults.fail_next = 1
        await pilot.click("#pull")
        await wait_until(pilot, lambda: Registry().load(REPO) is not None and not screen.query_one("#pull").disabled,
                         what="the pull to finish")
        log = log_text(screen.query_one("#pull-log"))
        assert "retry metadata" in log and "HTTP 503" in log
        assert re.search(r"resuming model.safetensors at \d", log) and "done: org/tiny-qwen ready" in log
        states = {r.file_name: r.state for r in screen.query(FileRow)}
        assert all(str(r.query_one(".file-state").render()) == r.state for r in screen.query(FileRow))
        assert set(states) == {p.name for p in model_dir.iterdir()}
        assert all(s.startswith("✓") for s in states.values())
        assert states["model.safetensors"].startswith(f"✓ sha256 {hashlib.sha256(weights).hexdigest()[:12]}")

        local = screen.query_one("#local")
        # the pulled model, the one running now (a path, never added) and the embedded one
        pulled = local.get_row(REPO)
        assert local.row_count == 3 and pulled[1] == "pulled" and pulled[3] == "yes"
        running = local.get_row(str(model_dir))
        assert running[0] == "tiny-qwen" and running[1] == "path" and running[5] == "▶"
        assert local.get_row("SmolLM2-135M-Instruct")[1] == "embedded"
        local.move_cursor(row=local.get_row_index(REPO))
        await pilot.click("#default")
        assert Settings.load(home / "settings.json").default_model == REPO == default_model()
        assert local.get_row(REPO)[4] == "no GPU" and local.get_row(REPO)[5] == "★"

        await pilot.click("#use")
        await wait_until(pilot, lambda: app.backend is not None and app.backend.name == REPO, what="the pulled model")
        await submit(pilot, "Hello")
        await answered(pilot, 2)
        reply = app.chat_screen.chat.messages[-1]

        await pilot.press("f2")
        local = app.screen.query_one("#local")
        assert local.get_row(REPO)[5] == "▶★"
        local.move_cursor(row=local.get_row_index(REPO))
        await pilot.click("#remove")
        await pilot.click("#yes")
        await wait_until(pilot, lambda: not Registry().entries(), what="the model to be removed")
    assert reply.reasoning == reference(ref_llm, [{"role": "user", "content": "Hello"}]).reasoning
    assert default_model() is None


async def test_wizard_lists_every_local_model_adds_a_path_and_enter_acts(model_dir, home, fake_hub, tmp_path):
    """Issue 17 item 2: the running and the embedded model are listed, a checkpoint directory can be
    added, Enter in the search field pulls, and a long error is kept whole in the wrapped log."""
    other = tmp_path / "my-checkpoint"
    other.mkdir()
    for p in model_dir.iterdir():
        (other / p.name).write_bytes(p.read_bytes())
    app = make_app(model_dir, home, pull_options=PullOptions(endpoint=fake_hub.url, max_workers=1,
                                                             retry=RetryPolicy(attempts=1)))
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await pilot.press("f2")
        screen = app.screen
        local = screen.query_one("#local")
        assert local.get_row(str(model_dir))[5] == "▶" and local.get_row("SmolLM2-135M-Instruct")[1] == "embedded"
        field = screen.query_one("#add-path")
        field.value = str(other)
        field.focus()
        await press_now(pilot, "enter")
        await wait_until(pilot, lambda: "my-checkpoint" in local.rows, what="the added checkpoint")
        added = local.get_row("my-checkpoint")
        assert added[1] == "local" and added[3] == "ok"
        assert hub.LocalModels().entries() == {"my-checkpoint": other.resolve()}
        field.value = str(tmp_path / "nothing-here")
        await press_now(pilot, "enter")
        await wait_until(pilot, lambda: noticed(app, "no such file or directory", "error"), what="the add error")

        spec = screen.query_one("#spec")
        spec.value = "org/" + "a-repository-with-a-very-long-name-" * 3 + "that-is-not-there"
        spec.focus()
        await press_now(pilot, "enter")  # Enter in the search field pulls
        await wait_until(pilot, lambda: noticed(app, "not-there", "error"), what="the pull to fail")
        error = next(m for s, m in app.notices if s == "error" and "not-there" in m)
        log = screen.query_one("#pull-log")
        squeeze = lambda text: "".join(text.split())  # noqa: E731 - wrapping turns spaces into line breaks
        assert squeeze(error) in squeeze(log_text(log)) and len(error) > log.size.width
        assert all(line.cell_length <= log.size.width for line in log.lines)  # wrapped: nothing past the edge
        await wait_until(pilot, lambda: not screen.query_one("#pull").disabled, what="the pull to end")


async def test_model_command_pulls_a_missing_model_then_uses_it(model_dir, ref_llm, home, fake_hub):
    """`/model org/name` of a model this machine lacks pulls it in the wizard (as `ninfer run` does),
    keeping the model in use until the pull has succeeded, then switches to it; a pull that fails
    leaves the chat on its model."""
    settings = tui_settings(home)
    settings.models[REPO] = ModelPrefs(preset="test")  # the pulled copy answers greedily too
    options = PullOptions(endpoint=fake_hub.url, max_workers=1, retry=RetryPolicy(attempts=1))
    app = make_app(model_dir, home, settings=settings, pull_options=options)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        before = app.backend

        await submit(pilot, "/model org/not-on-the-hub")
        await wait_until(pilot, lambda: noticed(app, "not-on-the-hub", "error"), what="the failed pull")
        assert isinstance(app.screen, ModelsScreen) and app.backend is before
        await pilot.press("escape")
        await wait_until(pilot, lambda: app.chat_screen is app.screen, what="the chat")

        fake_hub.faults.chunk_delay = 0.03
        await submit(pilot, f"/model {REPO}")
        await wait_until(pilot, lambda: isinstance(app.screen, ModelsScreen) and any(
            r.done > 0 for r in app.screen.query(FileRow)), what="the pull to start")
        assert app.backend is before  # still chatting with the old model while the files come
        fake_hub.faults.chunk_delay = 0.0
        await wait_until(pilot, lambda: app.backend is not None and app.backend.name == REPO, what="the pulled model")
        assert app.screen is app.chat_screen and Registry().load(REPO) is not None
        await submit(pilot, "Hello")
        await answered(pilot, 2)
        reply = app.chat_screen.chat.messages[-1]
    assert reply.reasoning == reference(ref_llm, [{"role": "user", "content": "Hello"}]).reasoning


# ---- server toggle -------------------------------------------------------------------------------


async def test_server_toggle_serves_the_chat_model_over_http(model_dir, ref_llm, home):
    app = make_app(model_dir, home)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await pilot.press("f3")
        screen = app.screen
        assert isinstance(screen, ServerScreen)
        screen.query_one("#port").value = "0"  # any free port
        await pilot.click("#toggle")
        await wait_until(pilot, lambda: app.server.running, what="the server to start")
        url = app.server.url
        await wait_until(pilot, lambda: f"{url}/v1" in str(screen.query_one("#server-url").render()),
                         what="the URL on screen")
        assert "sk-ninfer-test" in str(screen.query_one("#server-key").render())
        assert all(url in str(screen.query_one(f"#snippet-{i}").render()) for i in range(4))

        body = {"model": "tiny-qwen", "messages": [{"role": "user", "content": "Hello"}], "temperature": 0,
                "max_tokens": 24}
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            ok = await client.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-ninfer-test"})
            refused = await client.post("/v1/chat/completions", json=body)
        requests = screen.query_one("#server-requests")
        await wait_until(pilot, lambda: "requests: 2 total" in str(requests.render()), what="the request count")
        log = log_text(screen.query_one("#server-log"))

        await pilot.click("#toggle")
        await wait_until(pilot, lambda: not app.server.running, what="the server to stop")
        with pytest.raises(httpx.ConnectError):
            httpx.post(f"{url}/v1/chat/completions", json=body, timeout=5)
    expected = reference(ref_llm, [{"role": "user", "content": "Hello"}])
    message = ok.json()["choices"][0]["message"]
    assert ok.status_code == 200 and message["reasoning_content"] == expected.reasoning
    assert refused.status_code == 401
    assert re.search(r"200  /v1/chat/completions", log) and re.search(r"401  /v1/chat/completions", log)


# ---- remote mode ---------------------------------------------------------------------------------


@pytest.fixture
def remote(model_dir):
    handle = ServerHandle.start(LLM.load(str(model_dir), engine_options()), "127.0.0.1", 0, api_key="remote-key",
                                model_id="tiny-remote")
    yield handle
    handle.stop()


def remote_settings(home, **preset):
    settings = tui_settings(home, preset=preset or None)
    settings.models["tiny-remote"] = ModelPrefs(preset="test")
    settings.save()
    return settings


async def test_remote_mode_chats_through_an_openai_compatible_server(ref_llm, home, remote, tmp_path):
    app = make_app("tiny-remote", home, settings=remote_settings(home), endpoint=remote.url, api_key="remote-key")
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        backend = app.backend
        assert backend.remote and backend.name == "tiny-remote" and backend.context_limit == 512
        await submit(pilot, "Hello")
        await answered(pilot, 2)
        thinking = app.chat_screen.chat.messages[-1]

        await pilot.press("ctrl+n", "ctrl+t")
        await submit(pilot, "Hello")
        await answered(pilot, 2)
        plain = app.chat_screen.chat.messages[-1]

        await submit(pilot, f"/image {write_png(tmp_path / 'remote.png')}")
        await submit(pilot, "What is this?")
        await answered(pilot, 4)
        rejected = app.chat_screen.chat.messages[-1]
    on = reference(ref_llm, [{"role": "user", "content": "Hello"}], thinking=True)
    off = reference(ref_llm, [{"role": "user", "content": "Hello"}], thinking=False)
    assert (thinking.reasoning, thinking.content) == (on.reasoning, on.text)
    assert thinking.meta["completion_tokens"] == len(on.token_ids)
    assert thinking.meta["prompt_tokens"] == len(on.prompt_token_ids)
    assert (plain.reasoning, plain.content) == ("", off.text)
    assert "HTTP 400" in rejected.meta["error"] and "cannot read images" in rejected.meta["error"]
    assert noticed(app, "HTTP 400", "error")


async def test_remote_stop_cancels_the_servers_request(home, remote):
    settings = remote_settings(home, temperature=0.0, max_tokens=480, ignore_eos=True)
    app = make_app("tiny-remote", home, settings=settings, endpoint=remote.url, api_key="remote-key")
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await submit(pilot, "Hello")
        await wait_until(pilot, lambda: app.chat_screen.generation is not None
                         and app.chat_screen.generation.completion_tokens > 2, what="streamed tokens")
        await press_now(pilot, "escape")
        await answered(pilot, 2)
        stopped = app.chat_screen.chat.messages[-1]
        await wait_until(pilot, lambda: remote.service.stats().engine.running == 0, what="the server to drop it")
    assert stopped.meta["finish_reason"] == "abort" and stopped.meta["completion_tokens"] < 480
    assert remote.service.stats().engine.requests_finished == 1


async def test_remote_mode_reports_a_bad_key_or_model(home, remote):
    app = make_app(None, home, endpoint=remote.url, api_key="wrong")
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: noticed(app, "HTTP 401"), what="the refusal")
    app = make_app("gpt-9", home, endpoint=remote.url, api_key="remote-key")
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: noticed(app, "no model 'gpt-9' (the server lists: tiny-remote)"),
                         what="the unknown model")

"""The TUI's pieces without a screen: settings, history store, export, snippets, keymap, commands and
completion, the live-stats sampler, the remote client's request body, and the delta buffer."""

from __future__ import annotations

import base64
import json
import threading

import pytest

from ninfer_app.tui import paths
from ninfer_app.tui.commands import complete_path, complete_prompt, parse_command
from ninfer_app.tui.conversation import Chat, Message, api_messages, check_media, media_kind
from ninfer_app.tui.export import chat_markdown
from ninfer_app.tui.keymap import KEYS, load_keymap
from ninfer_app.tui.live import LiveSampler
from ninfer_app.tui.remote import api_base, request_body
from ninfer_app.tui.settings import BUILTIN_PRESETS, Settings, default_model
from ninfer_app.tui.snippets import snippets
from ninfer_app.tui.store import HistoryStore
from ninfer_app.tui.streaming import DeltaBuffer
from ninfer_app.tui.widgets.gauge import gauge_text
from ninfer_app.tui.widgets.live_panel import spec_text
from ninfer_core.capabilities import Capabilities
from ninfer_core.chat.output_parser import ContentDelta, ReasoningDelta
from ninfer_core.engine.llm_engine import EngineStats
from ninfer_core.engine.request import SpecStats
from ninfer_core.engine.sampling import SamplingParams
from ninfer_core.engine.service import ServiceStats
from ninfer_core.errors import NinferError
from ninfer_core.llm import ChatRequest


# ---- paths and settings --------------------------------------------------------------------------


def test_files_live_under_ninfer_home_or_the_xdg_directories(tmp_path, monkeypatch):
    monkeypatch.delenv("NINFER_HOME", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert paths.settings_path() == tmp_path / "config" / "ninfer" / "settings.json"
    assert paths.history_path() == tmp_path / "data" / "ninfer" / "history.sqlite"
    monkeypatch.setenv("NINFER_HOME", str(tmp_path / "home"))
    assert paths.settings_path().parent == paths.history_path().parent == tmp_path / "home"


def test_settings_round_trip_presets_and_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("NINFER_HOME", str(tmp_path))
    settings = Settings.load()
    assert settings == Settings() and default_model() is None
    settings.default_model = "qwen3.5-0.8b"
    settings.presets["mine"] = {"temperature": 0.3, "max_tokens": 99}
    settings.prefs("m").preset = "mine"
    key = settings.server_api_key()  # made once, saved
    again = Settings.load()
    assert default_model() == "qwen3.5-0.8b" and again.server_api_key() == key and key.startswith("sk-ninfer-")
    assert again.sampling("m") == SamplingParams(temperature=0.3, max_tokens=99)
    assert again.sampling("other") == SamplingParams()  # "default": the model's own generation_config
    assert again.sampling_for_preset("precise") == SamplingParams(**BUILTIN_PRESETS["precise"])
    assert again.preset_names()[: len(BUILTIN_PRESETS)] == list(BUILTIN_PRESETS) and "mine" in again.preset_names()
    with pytest.raises(NinferError, match="no sampling preset 'nope'"):
        again.sampling_for_preset("nope")
    (tmp_path / "settings.json").write_text('{"presets": {"bad": {"temprature": 1}}}')
    with pytest.raises(NinferError, match="preset 'bad' has unknown field\\(s\\) temprature"):
        Settings.load()
    (tmp_path / "settings.json").write_text('{"presets": {"bad": {"temperature": -1}}}')
    with pytest.raises(NinferError, match="temperature must be"):
        Settings.load()
    (tmp_path / "settings.json").write_text("{not json")
    with pytest.raises(NinferError, match="settings.json: unreadable settings"):
        Settings.load()


# ---- history and export --------------------------------------------------------------------------


def test_history_store_keeps_messages_in_order_by_identity(tmp_path):
    store = HistoryStore(tmp_path / "h.sqlite")
    chat = Chat(title="t", model="m")
    store.create(chat)
    turns = [Message("user", "same"), Message("assistant", "a1", "r1", meta={"completion_tokens": 3}),
             Message("user", "same", media=["/x.png"]), Message("assistant", "a2")]
    for m in turns:
        chat.messages.append(m)
        store.save_message(chat, m)
    turns[3].content = "a2 (final)"
    store.save_message(chat, turns[3])  # an update, not a new row
    loaded = store.load(chat.id)
    assert [(m.role, m.content, m.reasoning, m.media, m.meta) for m in loaded.messages] == [
        ("user", "same", "", [], {}), ("assistant", "a1", "r1", [], {"completion_tokens": 3}),
        ("user", "same", "", ["/x.png"], {}), ("assistant", "a2 (final)", "", [], {})]
    store.truncate(chat, 2)
    assert [m.content for m in store.load(chat.id).messages] == ["same", "a1"] and len(chat.messages) == 2
    other = Chat(title="newer", model="m")
    store.create(other)
    store.save_message(other, other.messages.append(Message("user", "x")) or other.messages[0])
    assert [(c.title, c.messages) for c in store.chats()] == [("newer", 1), ("t", 2)]
    store.delete(chat.id)
    assert store.load(chat.id) is None and [c.title for c in store.chats()] == ["newer"]


def test_markdown_export():
    chat = Chat(title="Capitals", model="m", created=0, messages=[
        Message("user", "Capital of France?", media=["/tmp/map.png"]),
        Message("assistant", "**Paris**", reasoning="France...\nits capital"),
    ])
    text = chat_markdown(chat)
    assert text.startswith("# Capitals\n")
    assert "## You\n\n![attachment](/tmp/map.png)\nCapital of France?" in text
    assert "## Assistant\n\n> **Thinking**\n>\n> France...\n> its capital\n\n**Paris**\n" in text


def test_api_messages_system_media_and_failed_turns(tmp_path):
    picture = tmp_path / "a.PNG"
    picture.write_bytes(b"x")
    messages = [Message("user", "look", media=[check_media(str(picture))]), Message("assistant", "", meta={"error": "x"}),
                Message("user", "again"), Message("assistant", "ok")]
    assert api_messages(messages, "be brief") == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": str(picture)}},
                                     {"type": "text", "text": "look"}]},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "ok"},
    ]
    assert media_kind("clip.MP4") == "video"
    with pytest.raises(NinferError, match="notes.txt: not an image or video file"):
        media_kind("notes.txt")
    with pytest.raises(NinferError, match="missing.png: no such file"):
        check_media(str(tmp_path / "missing.png"))


# ---- snippets, keymap, commands ------------------------------------------------------------------


def test_client_snippets_point_at_the_server():
    out = {s.client: s for s in snippets("http://127.0.0.1:8080", "sk-1", "qwen", 32768,
                                         Capabilities(tools=True, vision=False, thinking=True))}
    assert list(out) == ["Continue", "Zed", "VS Code", "aider"]
    assert "apiBase: http://127.0.0.1:8080/v1" in out["Continue"].text and "apiKey: sk-1" in out["Continue"].text
    assert "contextLength: 32768" in out["Continue"].text and "maxTokens: 8192" in out["Continue"].text
    zed = json.loads(out["Zed"].text)["language_models"]["openai_compatible"]["ninfer"]
    assert zed["api_url"] == "http://127.0.0.1:8080/v1" and zed["available_models"][0]["max_tokens"] == 32768
    vscode = json.loads(out["VS Code"].text)[0]
    assert vscode["apiKey"] == "sk-1" and vscode["models"][0]["url"] == "http://127.0.0.1:8080/v1/chat/completions"
    assert vscode["models"][0]["maxInputTokens"] + vscode["models"][0]["maxOutputTokens"] == 32768
    assert out["aider"].text == "aider --model openai/qwen --openai-api-base http://127.0.0.1:8080/v1 --openai-api-key sk-1"
    assert "capabilities: [tool_use]" in out["Continue"].text and vscode["models"][0]["toolCalling"] is True


def test_client_snippets_advertise_only_what_the_model_supports():
    """Issue 17 item 5: a model whose template drops tools must not be offered to editors as a tool user."""
    out = {s.client: s for s in snippets("http://h:1", "k", "smol", 8192,
                                         Capabilities(tools=False, vision=True, thinking=False))}
    assert "capabilities: [image_input]" in out["Continue"].text and "tool_use" not in out["Continue"].text
    zed = json.loads(out["Zed"].text)["language_models"]["openai_compatible"]["ninfer"]["available_models"][0]
    assert zed["capabilities"]["tools"] is False and zed["capabilities"]["images"] is True
    vscode = json.loads(out["VS Code"].text)[0]["models"][0]
    assert (vscode["toolCalling"], vscode["vision"], vscode["thinking"]) == (False, True, False)


def test_keymap_file(tmp_path):
    path = tmp_path / "keymap.toml"
    assert load_keymap(path) == {}
    path.write_text('"chat.stop" = "ctrl+x, f9"\n"app.models" = "f5"\n')
    assert load_keymap(path) == {"chat.stop": "ctrl+x,f9", "app.models": "f5"}
    path.write_text('"chat.stop" = 3\n')
    with pytest.raises(NinferError, match="chat.stop: expected keys as a string"):
        load_keymap(path)
    path.write_text('"chat.stop" = \n')
    with pytest.raises(NinferError, match="keymap.toml: not a valid keymap"):
        load_keymap(path)
    assert all(isinstance(k, str) and d for k, d in KEYS.values())


def test_commands_and_completion(tmp_path):
    assert parse_command("/system  You are terse. ")[1] == "You are terse."
    assert parse_command("/THINK off")[0].name == "think"
    with pytest.raises(NinferError, match="unknown command /nope"):
        parse_command("/nope")
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "cat.png").write_bytes(b"")
    (tmp_path / "photos" / "car.jpg").write_bytes(b"")
    assert complete_path(f"{tmp_path}/pho") == f"{tmp_path}/photos/"
    assert complete_path(f"{tmp_path}/photos/ca") is None  # cat / car: nothing longer in common
    assert complete_path(f"{tmp_path}/photos/cat") == f"{tmp_path}/photos/cat.png"
    assert complete_path(f"{tmp_path}/none") is None
    choices = lambda command: ["qwen3.5-0.8b", "qwen3.6-27b"] if command == "model" else []  # noqa: E731
    ask = lambda value: complete_prompt(value, choices)  # noqa: E731
    assert ask("/mo") == "/model " and ask("/model qwen3.6") == "/model qwen3.6-27b"
    assert ask("/think of") == "/think off" and ask(f"/image {tmp_path}/photos/cat") == f"/image {tmp_path}/photos/cat.png"
    assert ask("hello") is None and ask("/zzz") is None


# ---- live stats, remote body, delta buffer -------------------------------------------------------


def service_stats(**engine) -> ServiceStats:
    return ServiceStats(EngineStats(kv_capacity_tokens=1000, **engine), waiting=0, max_queue=4, max_concurrency=2,
                        kv_reserved_tokens=0)


def test_live_sampler_measures_decode_rate_between_samples():
    sampler = LiveSampler()
    first = sampler.frame(service_stats(generated_tokens=100, running=1, kv_used_tokens=64), "cpu", now=10.0)
    assert first.decode_tok_s is None and first.kv_used == 64 and first.spec is None
    second = sampler.frame(service_stats(generated_tokens=150, running=1), "cpu", chat_tokens=70, now=10.5)
    assert second.decode_tok_s == pytest.approx(100.0) and list(sampler.decode_history) == [pytest.approx(100.0)]
    assert second.chat_tokens == 70 and second.requests_running == 1
    idle = sampler.frame(service_stats(generated_tokens=150, running=0, last_decode_tok_s=97.0), "cpu", now=11.0)
    assert idle.decode_tok_s == 97.0 and len(sampler.decode_history) == 1  # between requests: the last one's rate
    remote = LiveSampler().frame(None, "remote", chat_tokens=5, client_rate=42.0)
    assert remote.decode_tok_s == 42.0 and remote.kv_capacity is None


def test_speculative_panel_text():
    assert spec_text(None) == "off"
    assert spec_text(SpecStats("mtp", 3)) == "mtp, 3 drafts/round\nno rounds yet"
    spec = SpecStats("mtp", 3, drafted=300, accepted=240, rounds=100, round_tokens=340)
    assert spec_text(spec) == "mtp, 3 drafts/round\n80% accepted · 3.40 tok/round"


def test_remote_request_body(tmp_path):
    picture = tmp_path / "p.png"
    picture.write_bytes(b"\x89PNG")
    request = ChatRequest(
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": str(picture)}},
                                               {"type": "text", "text": "hi"}]}],
        sampling=SamplingParams(temperature=0.0, top_k=20, max_tokens=9, stop=["END"]),
        enable_thinking=False,
    )
    body = request_body("m", request)
    assert body["model"] == "m" and body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert {k: body[k] for k in ("temperature", "top_k", "max_tokens", "stop")} == {
        "temperature": 0.0, "top_k": 20, "max_tokens": 9, "stop": ["END"]}
    assert "top_p" not in body and "seed" not in body  # unset: the server's defaults
    url = body["messages"][0]["content"][0]["image_url"]["url"]
    assert url == "data:image/png;base64," + base64.b64encode(b"\x89PNG").decode()
    assert api_base("http://h:8000") == api_base("http://h:8000/v1/") == "http://h:8000/v1"
    with pytest.raises(NinferError, match="must be an http"):
        api_base("h:8000")


def test_gauge_text():
    assert gauge_text(0, 512, width=4) == "context 0 / 512 tok ▱▱▱▱ 0%"
    assert gauge_text(448, 512, width=4) == "context 448 / 512 tok ▰▰▰▱ 88%"
    assert gauge_text(12, None) == "context 12 tok"


def test_delta_buffer_keeps_order_across_threads():
    buffer = DeltaBuffer()
    pieces = [f"{i} " for i in range(2000)]

    def produce() -> None:
        for i, piece in enumerate(pieces):
            buffer.add(ReasoningDelta(piece) if i < 1000 else ContentDelta(piece))

    worker = threading.Thread(target=produce)
    worker.start()
    taken = []
    while worker.is_alive():
        taken.append(buffer.take())
    worker.join()
    taken.append(buffer.take())
    assert "".join(r for r, _ in taken) == "".join(pieces[:1000])
    assert "".join(c for _, c in taken) == "".join(pieces[1000:])

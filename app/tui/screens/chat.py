"""The chat screen: messages, prompt with slash commands, history sidebar, context gauge and live panels.

Generation runs on a thread worker that only appends deltas to a DeltaBuffer and posts one
TurnEnded message at the end; a 20 Hz timer moves the buffered text into the streaming Markdown.
Esc cancels the request (the engine frees its KV at once) and keeps the partial answer.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from textual import work
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message as TextualMessage
from textual.screen import Screen
from textual.widgets import Footer, Header, Label

from ninfer_core.errors import ContextLengthError, EngineError, NinferError
from ninfer_core.llm import ChatRequest

from ..backend import Backend, Generation, TurnDone, TurnResult
from ..commands import COMMANDS, parse_command
from ..conversation import Chat, Message, api_messages, check_media, title_from
from ..export import export_chat
from ..keymap import binding
from ..live import LiveSampler
from ..streaming import REFRESH_S, DeltaBuffer
from ..widgets.gauge import ContextGauge
from ..widgets.live_panel import LivePanel
from ..widgets.messages import AssistantMessage, MessageView, UserMessage
from ..widgets.prompt import PromptEditor
from ..widgets.sidebar import HistorySidebar

if TYPE_CHECKING:
    from ..app import NinferApp

LIVE_REFRESH_S = 0.4  # the live panels redraw 2.5 times a second
PANEL_MIN_WIDTH = 100  # narrower terminals start with the live panels hidden (chat.panel shows them)


class TurnEnded(TextualMessage):
    """Posted by the generation worker when its reply ends (finished, stopped or failed)."""

    def __init__(self, result: TurnResult | None, meta: dict[str, Any], error: str | None) -> None:
        super().__init__()
        self.result = result
        self.meta = meta  # what the reply's stats line and the history keep
        self.error = error


def turn_meta(generation: Generation | None, result: TurnResult | None) -> dict[str, Any]:
    """A reply's stats: the engine's final numbers, or the counts so far for a stopped or failed one."""
    if result is not None:
        return {"finish_reason": result.finish_reason, "prompt_tokens": result.prompt_tokens,
                "completion_tokens": result.completion_tokens, "reasoning_tokens": result.reasoning_tokens,
                "decode_tok_s": round(result.decode_tok_s, 2), "prefill_tok_s": round(result.prefill_tok_s, 2)}
    if generation is None:
        return {"finish_reason": None, "prompt_tokens": 0, "completion_tokens": 0, "reasoning_tokens": 0}
    return {"finish_reason": "abort" if generation.cancelled else None, "prompt_tokens": generation.prompt_tokens,
            "completion_tokens": generation.completion_tokens, "reasoning_tokens": generation.reasoning_tokens}


class ChatScreen(Screen):
    app: NinferApp

    BINDINGS = [
        binding("chat.stop", "stop"),
        binding("chat.regenerate", "regenerate"),
        binding("chat.edit", "edit_last"),
        binding("chat.think", "toggle_thinking"),
        binding("chat.new", "new_chat"),
        binding("chat.copy", "copy_last", show=False, priority=True),  # (over the prompt's redo)
        binding("chat.history", "toggle_sidebar"),
        binding("chat.panel", "toggle_panel"),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.chat = Chat()
        self.attachments: list[str] = []
        self.editing = False
        self.generation: Generation | None = None
        self.generating = False
        self._stop_requested = False
        self._buffer = DeltaBuffer()
        self._view: AssistantMessage | None = None
        self._ui_lock = asyncio.Lock()
        self._sampler = LiveSampler()
        self._client_rate: tuple[float, int] | None = None  # remote mode: (time, tokens) of the last tick

    # -- layout -------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="body"):
            yield HistorySidebar(id="sidebar")
            with Vertical(id="main"):
                yield VerticalScroll(id="messages")
                yield Label("", id="attachments")
                with Horizontal(id="status"):
                    yield ContextGauge("context –", id="gauge")
                    yield Label("", id="mode")
                yield PromptEditor(self._completions, placeholder="Loading the model…  (/help for commands)",
                                   id="prompt")
            yield LivePanel(id="live")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#sidebar").display = False
        self.query_one("#attachments").display = False
        self._drain_timer = self.set_interval(REFRESH_S, self._drain, pause=True)
        self.set_interval(LIVE_REFRESH_S, self._refresh_live)
        self.query_one("#live").display = self.app.size.width >= PANEL_MIN_WIDTH
        self.prompt.focus()
        self._refresh_sidebar()

    @property
    def backend(self) -> Backend | None:
        return self.app.backend

    @property
    def messages_view(self) -> VerticalScroll:
        return self.query_one("#messages", VerticalScroll)

    @property
    def prompt(self) -> PromptEditor:
        return self.query_one("#prompt", PromptEditor)

    def _completions(self, command: str) -> list[str]:
        if command == "model":
            return self.app.model_names()
        if command == "preset":
            return self.app.settings.preset_names()
        return []

    # -- backend state ------------------------------------------------------------------------

    def backend_ready(self) -> None:
        """Called by the app when a model (or a remote server) is ready."""
        backend = self.backend
        assert backend is not None
        self.chat.model = backend.name
        self.sub_title = f"{backend.name} · {backend.location}"
        self.prompt.placeholder = "Message  (Enter sends, Ctrl+J new line, / for commands, Esc stops, F1 help)"
        self._show_mode()
        self._show_gauge(self._last_context_use())

    def backend_loading(self, what: str) -> None:
        self.prompt.placeholder = f"Loading {what}…"

    @property
    def model_thinks(self) -> bool:
        """False for a model that does not reason (its template knows no <think>); a remote server's
        model counts as thinking unless its card says otherwise."""
        can = self.backend.capabilities if self.backend is not None else None
        return can is None or can.thinking

    def _show_mode(self) -> None:
        settings = self.app.settings
        if self.backend is None:
            return
        prefs = settings.prefs(self.backend.name)
        parts = [f"thinking {'on' if settings.thinking else 'off'}"] if self.model_thinks else []
        parts.append(f"preset {prefs.preset}")
        if prefs.system:
            parts.append("system prompt set")
        if self.editing:
            parts.insert(0, "EDITING last message (Esc cancels)")
        self.query_one("#mode", Label).update(" · ".join(parts))

    def _show_gauge(self, used: int) -> None:
        limit = self.backend.context_limit if self.backend else None
        if self.query_one("#gauge", ContextGauge).show(used, limit) and limit:
            self.notify(f"this chat uses {used / limit:.0%} of the context ({used:,} / {limit:,} tokens); "
                        "/clear starts a new chat", severity="warning", timeout=8)

    def _last_context_use(self) -> int:
        last = self.chat.last("assistant")
        return (last.meta.get("prompt_tokens", 0) + last.meta.get("completion_tokens", 0)) if last else 0

    def show_attachments(self) -> None:
        label = self.query_one("#attachments", Label)
        label.display = bool(self.attachments)
        label.update("📎 " + ", ".join(Path(p).name for p in self.attachments) + "   (/image clear removes them)")

    # -- prompt -------------------------------------------------------------------------------

    async def on_prompt_editor_submitted(self, event: PromptEditor.Submitted) -> None:
        text = event.text.strip()
        if not text:
            return
        if text.startswith("/"):
            try:
                await self.run_command(text)
            except NinferError as e:  # the command stays in the prompt, to be fixed
                self.notify(str(e), severity="error", timeout=8)
                return
            if self.prompt.text == event.text:  # (/edit puts the message to edit there)
                self.prompt.set_text("")
            return
        if await self.send(text):
            self.prompt.set_text("")

    async def send(self, text: str) -> bool:
        """Append a user message and answer it; False (text kept in the prompt) when it cannot go now."""
        backend = self.backend
        if backend is None:
            self.notify("the model is still loading", severity="warning")
            return False
        if self.generating:
            self.notify("an answer is still being written: wait, or press Esc to stop it", severity="warning")
            return False
        media = list(self.attachments)
        if media and backend.supports_media is False:
            self.notify(f"{backend.name} cannot read images or videos (it has no vision tower): remove the "
                        "attachment with /image clear, or switch to a vision model with /model",
                        severity="error", timeout=10)
            return False
        if self.editing:
            index = self._last_index("user")
            if index is not None:
                media = media or self.chat.messages[index].media
                await self._truncate(index)
            self.editing = False
            self._show_mode()
        message = Message("user", text, media=media)
        self._save(message)
        self.attachments = []
        self.show_attachments()
        await self.messages_view.mount(UserMessage(message, classes="message user"))
        await self._answer()
        return True

    def _save(self, message: Message) -> None:
        store = self.app.store
        if message not in self.chat.messages:
            self.chat.messages.append(message)
        if self.chat.id is None:
            self.chat.title = title_from(message.content) or "New chat"
            store.create(self.chat)
            self._refresh_sidebar()
        store.save_message(self.chat, message)

    def _last_index(self, role: str) -> int | None:
        return next((i for i in range(len(self.chat.messages) - 1, -1, -1) if self.chat.messages[i].role == role), None)

    async def _truncate(self, keep: int) -> None:
        """Drop messages (and their views) from position `keep` on."""
        if self.chat.id is not None:
            self.app.store.truncate(self.chat, keep)
        else:
            del self.chat.messages[keep:]
        views = list(self.messages_view.query_children(MessageView))
        for view in views[keep:]:
            await view.remove()

    # -- generation ---------------------------------------------------------------------------

    def chat_request(self) -> ChatRequest:
        settings, backend = self.app.settings, self.backend
        assert backend is not None
        return ChatRequest(
            messages=api_messages(self.chat.messages, settings.prefs(backend.name).system),
            sampling=settings.sampling(backend.name),
            enable_thinking=settings.thinking,
        )

    async def _answer(self) -> None:
        backend = self.backend
        assert backend is not None
        request = self.chat_request()
        self.chat.model = backend.name
        reply = Message("assistant", "", meta={"model": backend.name})
        self.chat.messages.append(reply)
        self._view = AssistantMessage(reply, backend.name, classes="message assistant")
        await self.messages_view.mount(self._view)
        self._view.start_stream()
        self.messages_view.scroll_end(animate=False)
        self.generating, self._stop_requested, self.generation = True, False, None
        self._buffer = DeltaBuffer()
        self._drain_timer.resume()
        self._generate(backend, request, self._buffer)

    @work(thread=True, exit_on_error=False, group="generation")
    def _generate(self, backend: Backend, request: ChatRequest, buffer: DeltaBuffer) -> None:
        """Runs on a worker thread: submit, read the stream into `buffer`, post one TurnEnded."""
        generation: Generation | None = None
        result, error = None, None
        try:
            generation = backend.start(request)  # template + tokenizer work happens here, off the UI
            self.generation = generation
            if self._stop_requested:
                generation.cancel()
            for event in generation:
                if isinstance(event, TurnDone):
                    result = event.result
                else:
                    buffer.add(event)
        except ContextLengthError as e:
            error = f"{e} — /clear starts a new chat"
        except (NinferError, EngineError) as e:  # one-line messages: the request's fault, or the engine's
            error = str(e)
        except Exception as e:  # noqa: BLE001 - a bug must not leave the chat stuck in "generating"
            error = f"internal error: {type(e).__name__}: {e}"
        self.post_message(TurnEnded(result, turn_meta(generation, result), error))

    async def _drain(self) -> None:
        async with self._ui_lock:
            view, generation = self._view, self.generation
            if view is None:
                return
            reasoning, content = self._buffer.take()
            if not (reasoning or content):
                return
            scroll = self.messages_view
            following = scroll.scroll_y >= scroll.max_scroll_y - 1
            await view.feed(reasoning, content, generation.reasoning_tokens if generation else 0)
            if generation is not None:
                self._show_gauge(generation.prompt_tokens + generation.completion_tokens)
            if following:
                scroll.scroll_end(animate=False)

    async def on_turn_ended(self, event: TurnEnded) -> None:
        self._drain_timer.pause()
        await self._drain()
        async with self._ui_lock:
            view, self._view, self.generation = self._view, None, None
            if view is None:
                self.generating = False
                return
            reply = view.message
            reply.meta = {"model": reply.meta.get("model"), **event.meta}
            if event.error:
                reply.meta["error"] = event.error
                self.notify(event.error, severity="error", timeout=10)
            await view.finish(event.result)
            self._save(reply)
            self._show_gauge(reply.meta["prompt_tokens"] + reply.meta["completion_tokens"])
            self._refresh_sidebar()
            self.generating = False  # last: the reply is complete on screen and in the history
        self.messages_view.scroll_end(animate=False)

    # -- actions ------------------------------------------------------------------------------

    def action_stop(self) -> None:
        if self.generating:
            self._stop_requested = True
            if self.generation is not None:
                self.generation.cancel()
        elif self.editing:
            self.editing = False
            self.prompt.set_text("")
            self._show_mode()
        self.prompt.focus()

    async def action_regenerate(self) -> None:
        if self.generating or self.backend is None:
            return
        index = self._last_index("assistant")
        if index is not None and index == len(self.chat.messages) - 1:
            await self._truncate(index)
        if not self.chat.messages or self.chat.messages[-1].role != "user":
            self.notify("nothing to regenerate yet", severity="warning")
            return
        await self._answer()

    def action_edit_last(self) -> None:
        if self.generating:
            return
        index = self._last_index("user")
        if index is None:
            self.notify("no message to edit yet", severity="warning")
            return
        self.editing = True
        self.prompt.set_text(self.chat.messages[index].content)
        self.prompt.focus()
        self._show_mode()

    def action_toggle_thinking(self) -> None:
        self.set_thinking(not self.app.settings.thinking)

    def set_thinking(self, on: bool) -> None:
        if not self.model_thinks:
            self.notify(f"{self.backend.name} does not think: there is no reasoning to turn on or off",  # type: ignore[union-attr]
                        severity="warning", timeout=4)
            return
        self.app.settings.thinking = on
        self.app.settings.save()
        self._show_mode()
        self.notify(f"thinking {'on' if on else 'off'}", timeout=2)

    async def action_new_chat(self) -> None:
        if self.generating:
            self.notify("stop the answer first (Esc)", severity="warning")
            return
        self.chat = Chat(model=self.backend.name if self.backend else "")
        self.editing = False
        await self.messages_view.remove_children()
        self._show_gauge(0)
        self._show_mode()
        self._refresh_sidebar()

    def action_copy_last(self) -> None:
        last = self.chat.last("assistant")
        if last is None:
            self.notify("no answer to copy yet", severity="warning")
            return
        self.app.copy_to_clipboard(last.content)
        self.notify("answer copied to the clipboard", timeout=2)

    def action_toggle_panel(self) -> None:
        """Hide or show the live panels (hidden, the messages get their 34 columns)."""
        panel = self.query_one(LivePanel)
        panel.display = not panel.display

    def action_toggle_sidebar(self) -> None:
        sidebar = self.query_one("#sidebar", HistorySidebar)
        sidebar.display = not sidebar.display
        if sidebar.display:
            self._refresh_sidebar()
            sidebar.query_one("#chats").focus()
        else:
            self.prompt.focus()

    def _refresh_sidebar(self) -> None:
        self.query_one("#sidebar", HistorySidebar).show(self.app.store.chats(), self.chat.id)

    async def on_history_sidebar_opened(self, event: HistorySidebar.Opened) -> None:
        await self.open_chat(event.chat_id)

    async def open_chat(self, chat_id: int) -> None:
        if self.generating:
            self.notify("stop the answer first (Esc)", severity="warning")
            return
        chat = self.app.store.load(chat_id)
        if chat is None:
            self.notify(f"chat {chat_id} is no longer in the history", severity="error")
            return
        self.chat, self.editing = chat, False
        await self.messages_view.remove_children()
        model = self.backend.name if self.backend else chat.model
        await self.messages_view.mount_all(
            UserMessage(m, classes="message user") if m.role == "user"
            else AssistantMessage(m, chat.model or model, classes="message assistant")
            for m in chat.messages
        )
        self.messages_view.scroll_end(animate=False)
        self._show_gauge(self._last_context_use())
        self.prompt.focus()

    # -- slash commands -----------------------------------------------------------------------

    async def run_command(self, text: str) -> None:
        command, arg = parse_command(text)
        settings = self.app.settings
        model = self.backend.name if self.backend else None
        match command.name:
            case "help":
                self.app.action_help()
            case "server":
                self.app.action_server()
            case "model":
                if arg:
                    self.app.switch_model(arg)
                else:
                    self.app.action_models()
            case "think":
                if arg not in ("", "on", "off"):
                    raise NinferError("/think takes on or off")
                self.set_thinking(not settings.thinking if not arg else arg == "on")
            case "system":
                if model is None:
                    raise NinferError("the model is still loading")
                prefs = settings.prefs(model)
                if not arg:
                    self.notify(f"system prompt for {model}: {prefs.system or '(none)'}", timeout=8)
                    return
                prefs.system = "" if arg == "clear" else arg
                settings.save()
                self._show_mode()
                self.notify(f"system prompt for {model} {'cleared' if not prefs.system else 'set'}", timeout=3)
            case "preset":
                if model is None:
                    raise NinferError("the model is still loading")
                if not arg:
                    self.notify("presets: " + ", ".join(settings.preset_names()) +
                                f" (now: {settings.prefs(model).preset})", timeout=8)
                    return
                settings.sampling_for_preset(arg)  # raises for an unknown name
                settings.prefs(model).preset = arg
                settings.save()
                self._show_mode()
            case "clear":
                await self.action_new_chat()
            case "image":
                if arg == "clear":
                    self.attachments = []
                elif not arg:
                    raise NinferError("usage: /image PATH (or /image clear)")
                else:
                    self.attachments.append(check_media(arg))
                self.show_attachments()
            case "export":
                if not self.chat.messages:
                    raise NinferError("nothing to export yet")
                path = export_chat(self.chat, Path(arg) if arg else None)
                self.notify(f"exported to {path}", timeout=6)
            case "save":
                if not self.chat.messages:
                    raise NinferError("nothing to save yet")
                if self.chat.id is None:
                    self.app.store.create(self.chat)
                self.chat.title = arg or self.chat.title
                self.app.store.rename(self.chat.id, self.chat.title)  # type: ignore[arg-type]
                self._refresh_sidebar()
                self.notify(f"saved as '{self.chat.title}'", timeout=3)
            case "regen":
                await self.action_regenerate()
            case "edit":
                self.action_edit_last()
            case _:  # every command in COMMANDS has a case above
                raise AssertionError(f"/{command.name} is not handled ({', '.join(COMMANDS)})")

    # -- live panels --------------------------------------------------------------------------

    def _refresh_live(self) -> None:
        backend = self.backend
        if backend is None:
            return
        generation = self.generation
        chat_tokens = generation.prompt_tokens + generation.completion_tokens if generation else 0
        client_rate = None
        if backend.remote and generation is not None:
            now, tokens = time.monotonic(), generation.completion_tokens
            if self._client_rate is not None and now > self._client_rate[0]:
                client_rate = (tokens - self._client_rate[1]) / (now - self._client_rate[0])
            self._client_rate = (now, tokens)
        else:
            self._client_rate = None
        frame = self._sampler.frame(backend.service_stats(), backend.device, chat_tokens, client_rate)
        self.query_one(LivePanel).show(frame, list(self._sampler.decode_history), backend.context_limit)

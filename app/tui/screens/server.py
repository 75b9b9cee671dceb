"""The server toggle: start / stop the embedded OpenAI-compatible server on the chat's engine,
its URL and API key, copy-ready snippets for editors, the request count and a request log."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Button, Footer, Header, Input, Label, RichLog, Static, TabbedContent, TabPane

from ninfer_core.capabilities import Capabilities

from ..backend import LocalBackend
from ..keymap import binding
from ..snippets import Snippet, snippets

if TYPE_CHECKING:
    from ..app import NinferApp

POLL_S = 0.5
UNKNOWN_CAPABILITIES = Capabilities(tools=False, vision=False, thinking=False)  # until a model is loaded


class ServerScreen(Screen):
    app: NinferApp
    BINDINGS = [binding("screen.close", "app.pop_screen")]

    def compose(self) -> ComposeResult:
        prefs = self.app.settings.server
        yield Header()
        with Vertical(id="server"):
            with Horizontal(id="server-controls"):
                yield Button("Start", id="toggle", variant="success")
                yield Label("host", classes="field-label")
                yield Input(prefs.host, id="host")
                yield Label("port", classes="field-label")
                yield Input(str(prefs.port), id="port", type="integer")
            yield Label("", id="server-state")
            yield Label("", id="server-url")
            with Horizontal(id="server-key-row"):
                yield Label("", id="server-key")
                yield Button("Copy key", id="copy-key")
            yield Label("", id="server-requests")
            with TabbedContent(id="snippets"):
                for i, snippet in enumerate(self._snippets()):
                    with TabPane(snippet.client, id=f"tab-{i}"):
                        with Horizontal(classes="snippet-head"):
                            yield Button("Copy", id=f"copy-{i}")
                            yield Label(snippet.where, classes="hint snippet-where")
                        with VerticalScroll(classes="snippet-scroll"):
                            yield Static(snippet.text, markup=False, id=f"snippet-{i}", classes="snippet")
            yield Label("Request log", classes="panel-title")
            yield RichLog(id="server-log", max_lines=200, wrap=True, min_width=20)
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = "Server"
        log = self.query_one(RichLog)
        for line in self.app.server.log:
            log.write(self._log_text(line))
        self._refresh()
        self.set_interval(POLL_S, self._refresh)

    # -- state --------------------------------------------------------------------------------

    def _base_url(self) -> str:
        if self.app.server.url:
            return self.app.server.url
        prefs = self.app.settings.server
        return f"http://{prefs.host}:{prefs.port}"

    def _snippets(self) -> list[Snippet]:
        backend = self.app.backend
        model = backend.name if backend else "model"
        context = (backend.context_limit or 32768) if backend else 32768
        can = (backend.capabilities if backend else None) or UNKNOWN_CAPABILITIES
        return snippets(self._base_url(), self.app.settings.server_api_key(), model, context, can)

    def _refresh(self) -> None:
        server = self.app.server
        running = server.running
        backend = self.app.backend
        toggle = self.query_one("#toggle", Button)
        toggle.label, toggle.variant = ("Stop", "error") if running else ("Start", "success")
        toggle.disabled = not isinstance(backend, LocalBackend)
        if backend is None:
            state = "stopped · waiting for the model to load"
        elif not isinstance(backend, LocalBackend):
            state = "not available in remote mode"
        else:
            state = f"serving {backend.name}" if running else "stopped"
        self.query_one("#server-state", Label).update(f"state: {state}")
        self.query_one("#server-url", Label).update(
            f"OpenAI base URL: {self._base_url()}/v1{'' if running else '  (when started)'}")
        self.query_one("#server-key", Label).update(f"API key: {self.app.settings.server_api_key()}")
        for i, snippet in enumerate(self._snippets()):
            self.query_one(f"#snippet-{i}", Static).update(snippet.text)
        log = self.query_one(RichLog)
        for line in server.poll():
            log.write(self._log_text(line))
        in_flight = 0
        if running and isinstance(backend, LocalBackend):
            stats = backend.service_stats()
            chat = self.app.chat_screen
            own = 1 if chat is not None and chat.generating else 0
            in_flight = max(0, stats.engine.running + stats.waiting - own)
        self.query_one("#server-requests", Label).update(
            f"requests: {server.total_requests()} total · {in_flight} generating now")

    @staticmethod
    def _log_text(line) -> str:
        count = f" ×{line.count}" if line.count > 1 else ""
        return f"{datetime.fromtimestamp(line.at):%H:%M:%S}  {line.status}  {line.route}{count}"

    # -- actions ------------------------------------------------------------------------------

    def on_button_pressed(self, event: Button.Pressed) -> None:
        button = event.button.id or ""
        if button == "toggle":
            self.toggle()
        elif button == "copy-key":
            self.app.copy_to_clipboard(self.app.settings.server_api_key())
            self.notify("API key copied", timeout=2)
        elif button.startswith("copy-"):
            snippet = self._snippets()[int(button.removeprefix("copy-"))]
            self.app.copy_to_clipboard(snippet.text)
            self.notify(f"{snippet.client} configuration copied", timeout=2)

    def toggle(self) -> None:
        if self.app.server.running:
            self.app.server.stop()
            self._refresh()
            return
        host = self.query_one("#host", Input).value.strip() or "127.0.0.1"
        port_text = self.query_one("#port", Input).value.strip()
        if not port_text.isdigit() or not 0 <= int(port_text) < 65536:
            self.notify(f"port must be a number from 0 to 65535, got '{port_text}'", severity="error")
            return
        prefs = self.app.settings.server
        prefs.host, prefs.port = host, int(port_text)
        self.app.settings.save()
        self.app.start_server()

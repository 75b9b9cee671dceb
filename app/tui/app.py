"""The Textual app: owns the backend (local engine or remote server), the settings, the history
store and the embedded server, and hosts the screens (chat, model wizard, server, help).

Model loading runs on a thread worker; the chat screen keeps working (history, typing) meanwhile.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from textual import work
from textual.app import App, SystemCommand
from textual.message import Message
from textual.screen import Screen

from ninfer_core.errors import NinferError
from ninfer_core.hub import ALIASES, PullOptions, list_models, pull_needed
from ninfer_core.llm import LLM, EngineOptions

from .backend import Backend, LocalBackend
from .conversation import check_media
from .keymap import binding, load_keymap
from .screens.chat import ChatScreen
from .server_control import EmbeddedServer
from .settings import Settings
from .store import HistoryStore
from .themes import THEMES


@dataclass
class LaunchOptions:
    model: str | None = None  # local: path, pulled name or None (the default); remote: the model id
    engine: EngineOptions = field(default_factory=EngineOptions)
    endpoint: str | None = None  # remote mode: an OpenAI-compatible server
    api_key: str | None = None
    images: list[str] = field(default_factory=list)  # attached to the first message


class BackendReady(Message):
    def __init__(self, backend: Backend, load: int) -> None:
        super().__init__()
        self.backend = backend
        self.load = load  # which load_backend call made it (a later call makes it stale)


class BackendFailed(Message):
    def __init__(self, error: str, load: int) -> None:
        super().__init__()
        self.error = error
        self.load = load


class NinferApp(App):
    CSS_PATH = "styles/app.tcss"
    TITLE = "ninfer"
    BINDINGS = [
        binding("app.quit", "quit", priority=True),
        binding("app.help", "help"),
        binding("app.models", "models"),
        binding("app.server", "server"),
    ]

    def __init__(self, launch: LaunchOptions | None = None, *, settings: Settings | None = None,
                 pull_options: PullOptions | None = None):
        """Settings, keymap and attachments are read here, so the CLI reports their errors in one line."""
        super().__init__()
        self.launch = launch or LaunchOptions()
        self.settings = settings or Settings.load()
        self.keymap = load_keymap()
        self.attachments = [check_media(p) for p in self.launch.images]
        self.store = HistoryStore()
        self.pull_options = pull_options or PullOptions()
        self.backend: Backend | None = None
        self.server = EmbeddedServer()
        self.model_spec: str | None = None  # what the local backend was loaded from (None: the embedded model)
        self._loads = 0  # load_backend calls so far
        self._restart_server = False

    # -- lifecycle ----------------------------------------------------------------------------

    def on_mount(self) -> None:
        for theme in THEMES:
            self.register_theme(theme)
        self.theme = self.settings.theme if self.settings.theme in self.available_themes else "ninfer"
        self.set_keymap(self.keymap)
        self.push_screen(ChatScreen())
        self.load(self.launch.model or (None if self.launch.endpoint else self.settings.default_model))

    def watch_theme(self, theme: str) -> None:
        if theme != self.settings.theme:
            self.settings.theme = theme
            self.settings.save()

    def on_unmount(self) -> None:
        chat = self.chat_screen
        if chat is not None and chat.generation is not None:
            chat.generation.cancel()
        self.server.stop()
        if self.backend is not None:
            self.backend.close()
        self.store.close()

    @property
    def chat_screen(self) -> ChatScreen | None:
        return next((s for s in self.screen_stack if isinstance(s, ChatScreen)), None)

    # -- the backend --------------------------------------------------------------------------

    def switch_model(self, spec: str) -> None:
        chat = self.chat_screen
        if chat is not None and chat.generating:
            self.notify("stop the answer first (Esc)", severity="warning")
            return
        if not self.launch.endpoint and pull_needed(spec):
            # as `ninfer run` does: pull it first (the wizard shows the progress), then load it; the
            # model in use stays loaded until the pull has succeeded
            self.action_models(pull=spec)
            return
        self._restart_server = self.server.running
        self.server.stop()
        if self.backend is not None:
            self.backend.close()
            self.backend = None
        self.load(spec)

    def load(self, spec: str | None) -> None:
        self._loads += 1
        self.model_spec = spec
        chat = self.chat_screen
        if chat is not None and chat.is_mounted:  # (at start its placeholder already says so)
            chat.backend_loading(spec or ("the model list" if self.launch.endpoint else "the default model"))
        self._load_backend(spec, self._loads)

    @work(thread=True, group="load", exit_on_error=False)
    def _load_backend(self, spec: str | None, load: int) -> None:
        launch = self.launch
        try:
            if launch.endpoint:
                from .remote import RemoteBackend

                backend: Backend = RemoteBackend(launch.endpoint, launch.api_key, spec)
            else:
                # a pulled model is shown by the name it was asked for, not its snapshot directory
                pulled = spec is not None and not Path(spec).expanduser().exists()
                # --mmproj names the launch model's projector: another model finds its own
                engine = launch.engine if spec == launch.model else replace(launch.engine, mmproj=None)
                backend = LocalBackend(LLM.load(spec, engine), name=spec if pulled else None)
        except NinferError as e:
            self.post_message(BackendFailed(str(e), load))
            return
        self.post_message(BackendReady(backend, load))

    def on_backend_ready(self, event: BackendReady) -> None:
        if event.load != self._loads:  # a later /model superseded it
            event.backend.close()
            return
        self.backend = event.backend
        chat = self.chat_screen
        if chat is not None:
            chat.backend_ready()
            if self.attachments:
                chat.attachments, self.attachments = self.attachments, []
                chat.show_attachments()
        if self._restart_server and isinstance(event.backend, LocalBackend):
            self._restart_server = False
            self.start_server()

    def on_backend_failed(self, event: BackendFailed) -> None:
        if event.load != self._loads:
            return
        self.notify(event.error, title="cannot load the model", severity="error", timeout=15)
        chat = self.chat_screen
        if chat is not None:
            chat.backend_loading("nothing: /model NAME loads a model")

    def model_names(self) -> list[str]:
        """What /model completes: the models of this machine, then the aliases one could pull."""
        try:
            local = [m.name for m in list_models()]
        except NinferError:
            local = []
        return list(dict.fromkeys([*local, *ALIASES]))

    # -- the embedded server ------------------------------------------------------------------

    @work(thread=True, exclusive=True, group="server", exit_on_error=False)
    def start_server(self) -> None:
        backend = self.backend
        if not isinstance(backend, LocalBackend):
            self.call_from_thread(self.notify, "the embedded server needs a local model (not in remote mode)",
                                  severity="error")
            return
        prefs = self.settings.server
        try:
            self.server.start(backend, prefs.host, prefs.port, self.settings.server_api_key())
        except NinferError as e:
            self.call_from_thread(self.notify, str(e), title="server", severity="error", timeout=10)
            return
        self.call_from_thread(self.notify, f"serving {backend.name} at {self.server.url}/v1", timeout=4)

    # -- screens and commands -----------------------------------------------------------------

    def action_help(self) -> None:
        from .screens.help import HelpScreen

        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_models(self, pull: str | None = None) -> None:
        """The model wizard; `pull`: a hub model to pull there at once and use once pulled."""
        from .screens.models import ModelsScreen

        if not isinstance(self.screen, ModelsScreen):
            self.push_screen(ModelsScreen(pull_then_use=pull))
        elif pull is not None:
            self.screen.pull_then_use(pull)

    def action_server(self) -> None:
        from .screens.server import ServerScreen

        if not isinstance(self.screen, ServerScreen):
            self.push_screen(ServerScreen())

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand("Models", "Download, remove and pick models", self.action_models)
        yield SystemCommand("Server", "Start or stop the OpenAI-compatible server", self.action_server)
        yield SystemCommand("Help", "Slash commands and key bindings", self.action_help)
        chat = self.chat_screen
        if chat is not None:
            yield SystemCommand("New chat", "Start a new conversation", chat.action_new_chat)
            yield SystemCommand("Toggle thinking", "Reasoning before the answer on / off", chat.action_toggle_thinking)
            yield SystemCommand("History", "Show or hide the chat history", chat.action_toggle_sidebar)
            yield SystemCommand("Copy last answer", "Copy the last reply to the clipboard", chat.action_copy_last)

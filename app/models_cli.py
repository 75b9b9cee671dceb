"""`ninfer pull / verify / ls / show / rm / add`: the models on this machine (pulled from the Hugging
Face hub, local checkpoints added by path, the embedded one), on the command line.

The hub code (ninfer_core.hub) emits events; this module turns them into rich progress bars on
stderr. Listings go to stdout (a table, or JSON with --json); errors are one line on stderr with a
non-zero exit status (130 after Ctrl-C, when a pull keeps its partial files for the next run).
"""

from __future__ import annotations

import json
import sys
from contextlib import nullcontext
from datetime import datetime
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from ninfer_core.errors import NinferError

from .output import fail
from .units import human_bytes

err = Console(stderr=True, soft_wrap=True)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
QuantOpt = Annotated[Optional[str], typer.Option("--quant", help="Weights: bf16, fp8, int8, int4 (default: own).")]
ContextOpt = Annotated[Optional[int], typer.Option("--context", "--max-context", "--ctx-size",
                                                   help="Tokens per sequence (default 32768, capped).")]
KvOpt = Annotated[str, typer.Option("--kv-dtype", help="KV cache type: bf16, fp16, fp8, fp32.")]
SeqOpt = Annotated[int, typer.Option("--sequences", help="Sequences served at once.")]


def _stdout() -> Console:
    """Tables on stdout; unclipped when piped (rich would otherwise assume 80 columns)."""
    return Console() if sys.stdout.isatty() else Console(width=250)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def _when(timestamp: float | None) -> str:
    return datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M") if timestamp else "-"


# ---- pull ---------------------------------------------------------------------------------------


class _ProgressView:
    """Rich progress from hub events: a bar per file (bytes, rate, ETA) and, for a pull, one for the total."""

    def __init__(self) -> None:
        self.progress = Progress(
            TextColumn("{task.description}", style="bold"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=err,
        )
        self.tasks: dict[str, TaskID] = {}
        self.sizes: dict[str, int] = {}
        self.done: dict[str, int] = {}
        self.total: TaskID | None = None

    def _task(self, name: str, total: int, label: str) -> TaskID:
        if name not in self.tasks:
            self.tasks[name] = self.progress.add_task(f"{label} {name}", total=total)
        else:
            self.progress.update(self.tasks[name], description=f"{label} {name}")
        return self.tasks[name]

    def _advance_total(self) -> None:
        if self.total is not None:
            self.progress.update(self.total, completed=sum(self.done.values()))

    def __call__(self, event) -> None:
        from ninfer_core import hub

        if isinstance(event, hub.PullStarted):
            err.print(f"pulling {event.repo_id} @ {event.revision} ({event.commit[:12]}): "
                      f"{len(event.files)} files, {human_bytes(event.total_bytes)}")
            self.sizes = dict(event.files)
            self.total = self.progress.add_task("total", total=event.total_bytes)
        elif isinstance(event, hub.FileStarted):
            task = self._task(event.name, event.size, "resuming" if event.resume_from else "downloading")
            self.progress.update(task, completed=event.resume_from)
        elif isinstance(event, hub.Progress):
            task = self._task(event.name, event.total, "verifying" if event.phase == "hash" else "downloading")
            self.progress.update(task, completed=event.bytes_done)
            if event.phase == "download":
                self.done[event.name] = event.bytes_done
                self._advance_total()
        elif isinstance(event, hub.FileVerified):
            if event.name in self.tasks:
                task = self.tasks[event.name]
                self.progress.update(task, description=f"[green]✓[/] {event.name}",
                                     completed=self.progress.tasks[task].total)
            else:
                self.progress.console.print(f"[green]✓[/] {event.name} (already on disk, verified)")
            self.done[event.name] = self.sizes.get(event.name, 0)
            self._advance_total()
        elif isinstance(event, hub.Retry):
            self.progress.console.print(f"[yellow]retry[/] {event.reason}; next attempt in {event.delay_s:.1f} s")


def _fit_line(estimate) -> str:
    parts = (f"{human_bytes(estimate.weight_bytes)} weights ({estimate.quantization}) + {human_bytes(estimate.kv_bytes)} KV "
             f"({estimate.context:,} tokens, {estimate.kv_dtype}) + {human_bytes(estimate.state_bytes)} GDN state + "
             f"{human_bytes(estimate.reserve_bytes)} runtime = {human_bytes(estimate.total_bytes)}")
    if estimate.gpu is None:
        return f"{parts}; no GPU (CUDA not available)"
    gpu = estimate.gpu
    verdict = "fits" if estimate.fits else "does NOT fit"
    return (f"{parts}; {gpu.name}: {human_bytes(gpu.free_bytes)} free of {human_bytes(gpu.total_bytes)}: {verdict} "
            f"(up to {estimate.max_context:,} tokens of context)")


def pull_command(
    model: Annotated[str, typer.Argument(help="Alias (see `ninfer ls --aliases`), org/name or org/name@revision.")],
    file: Annotated[Optional[str], typer.Option(help="One GGUF file of the repo (its name, or e.g. Q4_K_M).")] = None,
    revision: Annotated[Optional[str], typer.Option(help="Branch, tag or commit (default main).")] = None,
    workers: Annotated[int, typer.Option(help="Files downloaded at once.")] = 4,
) -> None:
    """Download a model's inference files from the hub, verify their hashes, mark it ready."""
    entry = pull_with_progress(model, revision, file, workers)
    print(f"{entry.display_name}: ready at {entry.path}")


def pull_with_progress(model: str, revision: str | None = None, file: str | None = None, workers: int = 4):
    """`ninfer pull`'s work: progress bars on stderr, then the memory estimate; exits on failure."""
    from ninfer_core import hub

    view = _ProgressView()
    try:
        with view.progress:
            entry = hub.pull(model, revision, gguf_file=file, on_event=view,
                             options=hub.PullOptions(max_workers=workers))
    except KeyboardInterrupt:
        fail(f"interrupted: partial files are kept; run `ninfer pull {model}` again to resume", code=130)
    except NinferError as e:
        fail(str(e))
    try:
        err.print(f"memory: {_fit_line(hub.fit_for(entry.key, gpu=hub.local_gpu()))}")
    except NinferError as e:
        err.print(f"memory: {e}")
    return entry


def pull_if_needed(model: str | None) -> None:
    """Pull a hub model that is not on this machine before `ninfer run / chat / serve` load it, as
    `ollama run` does (HF_HUB_OFFLINE=1 turns it into the offline error)."""
    from ninfer_core import hub

    if model is not None and hub.pull_needed(model):
        err.print(f"{model} is not on this machine yet: pulling it (`ninfer pull {model}`)")
        pull_with_progress(model)


# ---- verify -------------------------------------------------------------------------------------


def verify_command(
    model: Annotated[str, typer.Argument(help="A pulled model (name as in `ninfer ls`).")],
    json_out: JsonOpt = False,
) -> None:
    """Re-hash a pulled model's files against the hub's sha256 / git hashes."""
    from ninfer_core import hub

    view = _ProgressView()
    try:
        with view.progress if not json_out else nullcontext():
            report = hub.verify(model, on_event=None if json_out else view)
    except NinferError as e:
        fail(str(e))
    if json_out:
        print(json.dumps({
            "name": report.entry.key, "ok": report.ok,
            "files": [{"name": c.name, "algorithm": c.algorithm, "expected": c.expected, "actual": c.actual,
                       "ok": c.ok} for c in report.checks],
        }))
    if not report.ok:
        bad = ", ".join(f"{c.name} ({c.problem})" for c in report.failed)
        fail(f"{report.entry.key}: {len(report.failed)} of {len(report.checks)} files failed: {bad}; "
              f"run `ninfer pull {report.entry.key}` to repair")
    if not json_out:
        print(f"{report.entry.display_name}: all {len(report.checks)} files match")


# ---- ls ----------------------------------------------------------------------------------------


def _entry_json(entry) -> dict:
    s = entry.summary
    return {
        "name": entry.display_name, "key": entry.key, "repo_id": entry.repo_id, "alias": entry.alias,
        "revision": entry.revision, "commit": entry.commit, "gguf_file": entry.gguf_file, "path": str(entry.path),
        "arch": s.arch if s else None, "quantization": s.quantization if s else None,
        "context": s.context if s else None, "params": s.params if s else None,
        "size_bytes": entry.disk_bytes(), "verified": entry.status, "verified_at": entry.verified_at,
    }


def _model_json(model) -> dict:
    """A catalog model (pulled, local or embedded) as `ls --json` lists it."""
    if model.entry is not None:
        return dict(_entry_json(model.entry), source=model.source)
    s = model.summary()
    return {"name": model.name, "source": model.source, "path": str(model.path), "arch": s.arch if s else None,
            "quantization": s.quantization if s else None, "context": s.context if s else None,
            "params": s.params if s else None, "size_bytes": model.disk_bytes(), "verified": None}


def ls_command(
    json_out: JsonOpt = False,
    aliases: Annotated[bool, typer.Option("--aliases", help="List the model aliases ninfer knows instead.")] = False,
    all_: Annotated[bool, typer.Option("--all", help="Include unfinished pulls.")] = False,
) -> None:
    """List the models on this machine: pulled, added local checkpoints (`ninfer add`), the embedded one."""
    from ninfer_core import hub

    try:
        if aliases:
            return _ls_aliases(json_out)
        registry = hub.Registry()
        rows = [dict(_model_json(m), ready=True) for m in hub.list_models(registry)]
        rows += [dict(_entry_json(e), source="pulled", ready=False) for e in registry.entries(partial=True)] \
            if all_ else []
    except NinferError as e:
        fail(str(e))
    if json_out:
        print(json.dumps(rows))
        return
    if not rows:
        err.print("no models yet; try `ninfer pull qwen3.5-0.8b` (aliases: `ninfer ls --aliases`) or "
                  "`ninfer add PATH` for a checkpoint on disk")
        return
    table = Table(box=None, header_style="bold")
    for column in ("NAME", "SOURCE", "ARCH", "SIZE", "QUANT", "CONTEXT", "VERIFIED"):
        table.add_column(column, no_wrap=True)
    for r in rows:
        verified = r["verified"] if r["ready"] else "incomplete"
        table.add_row(r["name"], r["source"], r["arch"] or "-", human_bytes(r["size_bytes"]), r["quantization"] or "-",
                      f"{r['context']:,}" if r["context"] else "-", verified or "-")
    _stdout().print(table)


def _ls_aliases(json_out: bool) -> None:
    from ninfer_core import hub

    registry = hub.Registry()
    pulled = {e.repo_id.lower() for e in registry.entries() if not e.gguf_file}
    rows = []
    for a in hub.ALIASES.values():
        estimate = hub.estimate_fit(a.config, a.quantization)
        rows.append({"name": a.name, "repo_id": a.repo_id, "quantization": a.quantization, "params": estimate.params,
                     "weight_bytes": estimate.weight_bytes, "pulled": a.repo_id.lower() in pulled,
                     "unconfirmed": a.unconfirmed or None})
    if json_out:
        print(json.dumps(rows))
        return
    table = Table(box=None, header_style="bold")
    for column in ("ALIAS", "REPOSITORY", "PARAMS", "QUANT", "WEIGHTS", "PULLED"):
        table.add_column(column, no_wrap=True)
    for r in rows:
        table.add_row(r["name"] + ("*" if r["unconfirmed"] else ""), r["repo_id"], _count(r["params"]),
                      r["quantization"], human_bytes(r["weight_bytes"]), "yes" if r["pulled"] else "")
    out = _stdout()
    out.print(table)
    for r in rows:
        if r["unconfirmed"]:
            out.print(f"* {r['name']}: unconfirmed: {r['unconfirmed']}")


# ---- show ---------------------------------------------------------------------------------------


def _architecture(cfg) -> str:
    mixer = (f"{len(cfg.full_attention_layers)} attention + {len(cfg.linear_attention_layers)} Gated DeltaNet"
             if cfg.linear_attention_layers else "attention")
    ffn = (f"MoE {cfg.num_experts} experts, top-{cfg.num_experts_per_tok}" if cfg.is_moe
           else f"dense MLP {cfg.intermediate_size}")
    return (f"{cfg.arch}: {cfg.num_layers} layers ({mixer}), hidden {cfg.hidden_size}, "
            f"{cfg.num_heads} q / {cfg.num_kv_heads} kv heads x {cfg.head_dim}, {ffn}")


def show_command(
    model: Annotated[str, typer.Argument(help="A model (`ninfer ls`), an alias, a checkpoint directory or a .gguf file.")],
    quant: QuantOpt = None,
    context: ContextOpt = None,
    kv_dtype: KvOpt = "bf16",
    sequences: SeqOpt = 1,
    json_out: JsonOpt = False,
) -> None:
    """A model's config summary, files with hashes, and whether it fits the local GPU."""
    from ninfer_core import hub
    from ninfer_core.hub.catalog import check_model_path, looks_like_path, model_config
    from ninfer_core.hub.estimate import model_fit
    from ninfer_core.hub.fit import check_choices

    try:
        check_choices(quant, kv_dtype)
        registry = hub.Registry()
        path = Path(model).expanduser()
        found = None if path.exists() else hub.find_model(model, hub.list_models(registry))
        if found is None and path.exists():
            found = hub.CatalogModel(path.name, check_model_path(path), "local")
        alias = None if found is not None else hub.resolve_alias(model.partition("@")[0])
        if found is None and alias is None and looks_like_path(model):
            raise hub.ModelNotFoundError(f"{model}: no such file or directory")
        if found is None and alias is None:
            raise hub.ModelNotFoundError(f"no model '{model}' on this machine and no alias of that name "
                                         f"(`ninfer ls`, `ninfer ls --aliases`)")
    except NinferError as e:
        fail(str(e))
    entry = found.entry if found is not None else None
    try:  # a model ninfer cannot parse still shows its files
        gpu = hub.local_gpu()
        if found is not None:
            cfg = model_config(found.path)
            estimate = model_fit(found, quant, context, kv_dtype, sequences, gpu, config=cfg)
        else:
            cfg = alias.config
            estimate = hub.estimate_fit(cfg, quant or alias.quantization, context, kv_dtype, sequences, gpu)
        unavailable = None
    except NinferError as e:
        cfg = estimate = None
        unavailable = str(e)
    if json_out:
        if found is None:
            data = {"name": alias.name, "repo_id": alias.repo_id, "alias": alias.name,
                    "unconfirmed": alias.unconfirmed or None}
        else:
            data = _model_json(found)
        data["pulled"] = entry is not None
        data["architecture"] = _architecture(cfg) if cfg else None
        data["files"] = [{"name": r.name, "size": r.size, "algorithm": r.remote.algorithm, "digest": r.digest}
                         for r in entry.files.values()] if entry else []
        data["fit"] = estimate.to_json() if estimate else None
        data["fit_error"] = unavailable
        print(json.dumps(data))
        return
    out = _stdout()
    if found is None:
        out.print(f"[bold]{alias.name}[/]  ({alias.repo_id}, not pulled: `ninfer pull {alias.name}`)")
        if alias.unconfirmed:
            out.print(f"  note      unconfirmed: {alias.unconfirmed}")
    elif entry is None:
        s = found.summary()
        out.print(f"[bold]{found.name}[/]  ({found.source})")
        out.print(f"  path      {found.path}")
        if s:
            out.print(f"  params    {_count(s.params)}, context {s.context:,} tokens, quantization {s.quantization}")
        out.print(f"  size      {human_bytes(found.disk_bytes())} on disk")
    else:
        s = entry.summary
        out.print(f"[bold]{entry.key}[/]" + (f"  (alias {entry.alias})" if entry.alias else ""))
        out.print(f"  path      {entry.path}")
        out.print(f"  revision  {entry.revision} ({entry.commit})")
        if s:
            out.print(f"  params    {_count(s.params)}, context {s.context:,} tokens, quantization {s.quantization}")
        out.print(f"  size      {human_bytes(entry.disk_bytes())} on disk")
        out.print(f"  verified  {entry.status} ({_when(entry.verified_at)})")
    if cfg:
        out.print(f"  arch      {_architecture(cfg)}")
    if entry is not None:
        files = Table(box=None, header_style="bold")
        for column in ("FILE", "SIZE", "HASH"):
            files.add_column(column, no_wrap=True)
        for r in entry.files.values():
            files.add_row(r.name, human_bytes(r.size), f"{r.remote.algorithm}:{r.digest}")
        out.print(files)
    out.print(f"memory: {_fit_line(estimate) if estimate else unavailable}")


# ---- add ----------------------------------------------------------------------------------------


def add_command(
    path: Annotated[Path, typer.Argument(help="A checkpoint directory (with config.json) or a .gguf file.")],
    name: Annotated[Optional[str], typer.Option(help="The name to run and serve it by (default: its directory "
                                                     "name or file stem).")] = None,
) -> None:
    """Add a checkpoint on disk to the models ninfer knows by name (nothing is copied; `ninfer rm` forgets it)."""
    from ninfer_core import hub

    try:
        added = hub.LocalModels().add(path, name)
    except NinferError as e:
        fail(str(e))
    print(f"{added.name}: {added.path} (run it with `ninfer run {added.name}`)")


# ---- rm -----------------------------------------------------------------------------------------


def rm_command(models: Annotated[list[str], typer.Argument(help="Pulled models to delete, local ones to forget.")]
               ) -> None:
    """Delete pulled models (registry entries and files in the Hugging Face cache); forget added local
    checkpoints (their files stay)."""
    from ninfer_core import hub

    for model in models:
        try:
            local = hub.LocalModels()
            if any(name.lower() == model.lower() for name in local.entries()):
                print(f"forgot {model} ({local.remove(model)} is left as it is)")
                continue
            entry, freed = hub.remove_model(model)
        except NinferError as e:
            fail(str(e))
        print(f"removed {entry.display_name} (freed {human_bytes(freed)})")


def register(cli: typer.Typer) -> None:
    """Add pull, verify, ls, show, rm and add to the main `ninfer` app."""
    cli.command("pull")(pull_command)
    cli.command("verify")(verify_command)
    cli.command("ls")(ls_command)
    cli.command("show")(show_command)
    cli.command("rm")(rm_command)
    cli.command("add")(add_command)

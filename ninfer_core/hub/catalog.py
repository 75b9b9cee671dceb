"""Every model this machine can run by name, in one list: pulled models (the registry), local
checkpoint directories and GGUF files the user added (`ninfer add`, the wizard), and the embedded
SmolLM2. `ninfer ls / show / run`, the server's model names and the wizard all read it here, so
a model one of them can see, all of them can.

Local additions live in `$NINFER_HOME/local_models.json` ({name: path}); adding one only records
its path (nothing is copied) and forgetting it deletes nothing.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ..config import ModelConfig, load_config
from ..errors import ModelLoadError, NinferError
from ..home import ninfer_home
from ..models.default_model import DEFAULT_MODEL_NAME, default_model_path
from ..weights.gguf_split import model_bytes
from .aliases import resolve_alias
from .registry import ModelEntry, Registry, resolve_local
from .summary import ModelSummary, summarize_checkpoint, summarize_gguf

Source = Literal["pulled", "local", "embedded"]


@dataclass(frozen=True)
class CatalogModel:
    name: str  # what `ninfer ls` prints and what clients send as `model`
    path: Path  # what the loader reads: a checkpoint directory or a .gguf file
    source: Source
    other_names: tuple[str, ...] = ()  # a pulled model's repo id and key, the embedded file's stem
    entry: ModelEntry | None = field(default=None, compare=False)  # pulled models: the registry record

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.other_names)

    def answers_to(self, spec: str) -> bool:
        return spec.lower() in (n.lower() for n in self.names)

    def summary(self) -> ModelSummary | None:
        """Architecture, quantization, context, parameters (None when ninfer cannot read the model)."""
        if self.entry is not None:
            return self.entry.summary
        return cached_summary(self.path)

    def disk_bytes(self) -> int:
        if self.entry is not None:
            return self.entry.disk_bytes()
        if self.path.is_file():
            return model_bytes(self.path)
        return sum(p.stat().st_size for p in self.path.rglob("*") if p.is_file()) if self.path.is_dir() else 0


def cached_summary(path: Path, cache_file: Path | None = None) -> ModelSummary | None:
    """A local model's summary, kept in `$NINFER_HOME/model_summaries.json` while the file (or the
    directory's config.json) is unchanged: reading a GGUF header takes about a second, and `ninfer ls`
    should not pay it on every call. None when ninfer cannot read the model."""
    cache_file = cache_file or ninfer_home() / "model_summaries.json"
    try:
        stat = (path if path.is_file() else path / "config.json").stat()
    except OSError:
        return None
    stamp = [stat.st_size, stat.st_mtime_ns]
    try:
        cache = json.loads(cache_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        cache = {}
    hit = cache.get(str(path)) if isinstance(cache, dict) else None
    if isinstance(hit, dict) and hit.get("stamp") == stamp:
        return ModelSummary.from_json(hit["summary"])
    try:
        summary = summarize_gguf(path) if path.is_file() else summarize_checkpoint(path)
    except (NinferError, OSError, ValueError):
        return None
    cache = {**(cache if isinstance(cache, dict) else {}), str(path): {"stamp": stamp, "summary": summary.to_json()}}
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_name(f".{cache_file.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache), encoding="utf-8")
        os.replace(tmp, cache_file)
    except OSError:
        pass  # a read-only home: no cache, the answer is still right
    return summary


def model_config(path: Path) -> ModelConfig:
    """The ModelConfig of a checkpoint directory (config.json) or a GGUF file (its metadata)."""
    if path.is_file():
        from ..weights.gguf_reader import open_gguf

        return open_gguf(path).config
    return load_config(path)


def looks_like_path(spec: str) -> bool:
    """`/abs`, `./rel`, `../rel`, `~/x` or `*.gguf`: a file the user meant, never a hub name."""
    return spec.startswith(("/", "./", "../", "~", ".\\")) or spec.lower().endswith(".gguf") or spec in (".", "..")


def check_model_path(path: Path) -> Path:
    """A loadable model path: a directory with config.json or a .gguf file (resolved, absolute)."""
    path = path.expanduser().resolve()
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or directory")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ModelLoadError(f"{path}: not a checkpoint directory (no config.json in it)")
    if path.is_file() and path.suffix.lower() != ".gguf":
        raise ModelLoadError(f"{path}: a model is a checkpoint directory (with config.json) or a .gguf file")
    return path


class LocalModels:
    """The user's local checkpoints by name ({name: path} in one JSON file)."""

    def __init__(self, path: Path | None = None):
        self.path = path or ninfer_home() / "local_models.json"

    def entries(self) -> dict[str, Path]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise NinferError(f"{self.path}: unreadable list of local models ({e}); fix or delete it") from None
        if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
            raise NinferError(f"{self.path}: expected an object of name -> path; fix or delete it")
        return {name: Path(p) for name, p in data.items()}

    def add(self, path: Path, name: str | None = None) -> CatalogModel:
        """Record a checkpoint under `name` (default: the directory name or the file's stem)."""
        path = check_model_path(path)
        name = (name or (path.stem if path.is_file() else path.name)).strip()
        if not name or looks_like_path(name):
            raise NinferError(f"'{name}' cannot be a model name (it looks like a path)")
        clash = find_model(name)
        if clash is not None and not (clash.source == "local" and clash.path == path):
            raise NinferError(f"the name '{name}' is taken by {clash.source} model {clash.name} ({clash.path}); "
                              f"choose another with --name")
        entries = self.entries()
        entries[name] = path
        self._write(entries)
        return CatalogModel(name, path, "local")

    def remove(self, name: str) -> Path:
        entries = self.entries()
        key = next((k for k in entries if k.lower() == name.lower()), None)
        if key is None:
            raise NinferError(f"no local model '{name}'")
        path = entries.pop(key)
        self._write(entries)
        return path

    def _write(self, entries: dict[str, Path]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({k: str(v) for k, v in sorted(entries.items())}, indent=1), encoding="utf-8")
        os.replace(tmp, self.path)


def embedded_model() -> CatalogModel | None:
    """The embedded SmolLM2, when its package is installed."""
    try:
        path = default_model_path()
    except NinferError:
        return None
    return CatalogModel(DEFAULT_MODEL_NAME, path, "embedded", other_names=(path.stem,))


def list_models(registry: Registry | None = None, local: LocalModels | None = None) -> list[CatalogModel]:
    """Pulled models (ready ones), then local ones, then the embedded model."""
    models = [CatalogModel(e.display_name, e.path, "pulled", tuple(dict.fromkeys(n for n in (e.key, e.repo_id)
                                                                                 if n != e.display_name)), e)
              for e in (registry or Registry()).entries()]
    models += [CatalogModel(name, path, "local") for name, path in (local or LocalModels()).entries().items()]
    embedded = embedded_model()
    return models + ([embedded] if embedded else [])


def find_model(spec: str, models: list[CatalogModel] | None = None) -> CatalogModel | None:
    """The model answering to `spec` (any of its names, case-insensitive; an alias of a pulled one)."""
    models = list_models() if models is None else models
    alias = resolve_alias(spec.partition("@")[0])
    wanted = [spec, alias.repo_id] if alias else [spec]
    return next((m for w in wanted for m in models if m.answers_to(w)), None)


def pull_needed(spec: str) -> bool:
    """Whether `spec` names a hub model this machine does not have yet (an alias or `org/name`,
    neither pulled nor added): what `ninfer run / chat / serve` pull before loading, as `ollama run`
    does. A partly pulled model counts (its pull resumes); a path or a GGUF file's key never does."""
    if Path(spec).expanduser().exists() or looks_like_path(spec) or ":" in spec:
        return False
    if find_model(spec) is not None:
        return False
    return resolve_alias(spec.partition("@")[0]) is not None or "/" in spec


def locate(spec: str) -> Path:
    """What `ninfer run SPEC` loads: a path on disk, else a model by name (see the module doc)."""
    path = Path(spec).expanduser()
    if path.exists():
        return path
    if looks_like_path(spec):
        raise ModelLoadError(f"{spec}: no such file or directory")
    pulled = resolve_local(spec)  # (refuses a pulled model with missing or damaged files)
    if pulled is not None:
        return pulled
    found = find_model(spec, [m for m in list_models() if m.source != "pulled"])
    if found is not None:
        if not found.path.exists():
            raise ModelLoadError(f"{spec}: its path {found.path} is gone (`ninfer rm {found.name}` forgets it)")
        return found.path
    if pull_needed(spec):
        raise ModelLoadError(f"{spec}: not downloaded yet: run `ninfer pull {spec}` first")
    raise ModelLoadError(f"{spec}: no such model directory or file, and no model of that name (`ninfer ls`)")

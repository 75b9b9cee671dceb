"""The local registry: which models were pulled, from which commit, and whether they verified.

One JSON file per model under $NINFER_HOME/models (default ~/.local/share/ninfer/models):
`{name}.json` exists only for a model that is complete and verified ("ready"); a pull in progress
(or interrupted) keeps `{name}.partial.json`, listing the files already verified, so the next
pull neither downloads nor re-hashes them. The files themselves live in the Hugging Face cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .aliases import alias_for_repo, resolve_alias
from .errors import HubError, ModelNotFoundError
from .files import RemoteFile
from ..home import ninfer_home
from .layout import RepoCache
from .summary import ModelSummary


@dataclass
class FileRecord:
    name: str
    size: int
    digest: str
    lfs: bool
    verified_mtime_ns: int | None = None  # the blob's mtime when its hash last matched

    @property
    def remote(self) -> RemoteFile:
        return RemoteFile(self.name, self.size, self.digest, self.lfs)

    @classmethod
    def of(cls, file: RemoteFile, verified_mtime_ns: int | None) -> "FileRecord":
        return cls(file.name, file.size, file.digest, file.lfs, verified_mtime_ns)


def entry_key(repo_id: str, gguf_file: str | None) -> str:
    """A model's name: the repo id, plus `:file` for one GGUF file of a repository."""
    return f"{repo_id}:{gguf_file}" if gguf_file else repo_id


@dataclass
class ModelEntry:
    key: str
    repo_id: str
    revision: str
    commit: str
    gguf_file: str | None
    cache_dir: str
    files: dict[str, FileRecord] = field(default_factory=dict)
    pulled_at: float = field(default_factory=time.time)
    verified_at: float | None = None
    verify_failed: list[str] = field(default_factory=list)  # files that failed the last verify
    summary: ModelSummary | None = None

    @property
    def cache(self) -> RepoCache:
        return RepoCache(Path(self.cache_dir), self.repo_id)

    @property
    def snapshot_dir(self) -> Path:
        return self.cache.snapshot(self.commit)

    @property
    def path(self) -> Path:
        """What `ninfer run` loads: the snapshot directory, or the GGUF file in it."""
        return self.snapshot_dir / self.gguf_file if self.gguf_file else self.snapshot_dir

    @property
    def alias(self) -> str | None:
        found = alias_for_repo(self.repo_id)
        return found.name if found and not self.gguf_file else None

    @property
    def display_name(self) -> str:
        return self.alias or self.key

    def missing_files(self) -> list[str]:
        return [name for name in self.files if not (self.snapshot_dir / name).exists()]

    def disk_bytes(self) -> int:
        """Bytes of this model's files on disk, partial downloads included (shared blobs count fully)."""
        total = 0
        for digest in {r.digest for r in self.files.values()}:
            for path in (self.cache.blob(digest), self.cache.incomplete(digest)):
                if path.exists():
                    total += path.stat().st_size
        return total

    @property
    def status(self) -> str:
        if self.missing_files():
            return "missing files"
        return "FAILED" if self.verify_failed else "yes"

    def to_json(self) -> dict:
        data = asdict(self)
        data["files"] = [asdict(r) for r in self.files.values()]
        data["summary"] = self.summary.to_json() if self.summary else None
        return data

    @classmethod
    def from_json(cls, data: dict) -> "ModelEntry":
        data = dict(data)
        data["files"] = {r["name"]: FileRecord(**r) for r in data["files"]}
        data["summary"] = ModelSummary.from_json(data["summary"]) if data.get("summary") else None
        return cls(**data)


class Registry:
    def __init__(self, home: Path | None = None):
        self.dir = (home or ninfer_home()) / "models"

    def _path(self, key: str, partial: bool) -> Path:
        stem = re.sub(r"[^A-Za-z0-9._-]+", "_", key) + "-" + hashlib.sha1(key.encode()).hexdigest()[:8]
        return self.dir / f"{stem}{'.partial' if partial else ''}.json"

    def _read(self, path: Path) -> ModelEntry | None:
        try:
            return ModelEntry.from_json(json.loads(path.read_text()))
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise HubError(f"{path}: damaged registry entry ({e}); delete it and pull the model again") from None

    def _write(self, path: Path, entry: ModelEntry) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entry.to_json(), indent=1))
        os.replace(tmp, path)

    def load(self, key: str) -> ModelEntry | None:
        """The ready entry of this exact name."""
        return self._read(self._path(key, partial=False))

    def load_partial(self, key: str) -> ModelEntry | None:
        return self._read(self._path(key, partial=True))

    def save_partial(self, entry: ModelEntry) -> None:
        self._write(self._path(entry.key, partial=True), entry)

    def save_ready(self, entry: ModelEntry) -> None:
        """Mark the model ready (and forget its partial record)."""
        self._write(self._path(entry.key, partial=False), entry)
        self._path(entry.key, partial=True).unlink(missing_ok=True)

    def delete(self, key: str) -> None:
        for partial in (False, True):
            self._path(key, partial).unlink(missing_ok=True)

    def entries(self, partial: bool = False) -> list[ModelEntry]:
        """Ready entries (or partial ones), sorted by name."""
        if not self.dir.is_dir():
            return []
        paths = [p for p in self.dir.glob("*.json") if p.name.endswith(".partial.json") == partial]
        return sorted((e for p in paths if (e := self._read(p)) is not None), key=lambda e: e.key.lower())

    def find(self, spec: str, partial: bool = False) -> ModelEntry:
        """A model by alias, repo id or `repo:file.gguf`, optionally `@revision` (branch, tag, commit prefix)."""
        name, _, revision = spec.partition("@")
        alias = resolve_alias(name)
        wanted = {name.lower(), alias.repo_id.lower()} if alias else {name.lower()}
        for entry in self.entries(partial):
            if entry.key.lower() in wanted and (
                not revision or revision == entry.revision or entry.commit.startswith(revision.lower())
            ):
                return entry
        hint = f"pull it with `ninfer pull {spec}`" if not partial else "see `ninfer ls --all`"
        raise ModelNotFoundError(f"no model '{spec}' in the local registry: {hint}")


def resolve_local(spec: str, registry: Registry | None = None) -> Path | None:
    """Where a pulled model named `spec` lives, for `ninfer run NAME`; None when no pulled model has that name.

    A model that failed `ninfer verify` or lost files is refused with the command that repairs it.
    """
    registry = registry or Registry()
    try:
        entry = registry.find(spec)
    except ModelNotFoundError:
        if any(e.key.lower() == spec.partition("@")[0].lower() for e in registry.entries(partial=True)):
            raise HubError(f"'{spec}' is not fully pulled: run `ninfer pull {spec}` to finish it") from None
        return None
    problems = entry.missing_files() or entry.verify_failed
    if problems:
        raise HubError(
            f"{entry.key}: {'missing' if entry.missing_files() else 'failed verification'}: "
            f"{', '.join(problems[:3])}; run `ninfer pull {entry.key}` to repair it"
        )
    return entry.path


def remove_model(spec: str, registry: Registry | None = None) -> tuple[ModelEntry, int]:
    """Delete a pulled (or partly pulled) model's files and registry entry; returns (entry, bytes freed)."""
    registry = registry or Registry()
    try:
        entry = registry.find(spec)
    except ModelNotFoundError:
        entry = registry.find(spec, partial=True)
    freed = entry.cache.remove_files(entry.commit, {r.name: r.digest for r in entry.files.values()})
    registry.delete(entry.key)
    return entry, freed

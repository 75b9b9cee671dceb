"""`verify`: re-hash a pulled model's files against the hashes recorded from the hub."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from .events import EventCallback, Failed, FileVerified
from .hashing import file_matches
from .meter import ProgressReporter
from .registry import ModelEntry, Registry


@dataclass(frozen=True)
class FileCheck:
    name: str
    algorithm: str
    expected: str
    actual: str | None  # None when the file is missing
    ok: bool

    @property
    def problem(self) -> str:
        if self.ok:
            return ""
        return "missing" if self.actual is None else f"{self.algorithm} is {self.actual}, expected {self.expected}"


@dataclass(frozen=True)
class VerifyReport:
    entry: ModelEntry
    checks: list[FileCheck]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failed(self) -> list[FileCheck]:
        return [c for c in self.checks if not c.ok]


def verify(
    spec: str,
    *,
    on_event: EventCallback | None = None,
    cancel: threading.Event | None = None,
    registry: Registry | None = None,
) -> VerifyReport:
    """Hash every file of a pulled model; record the outcome (`ninfer ls` shows it) and return it.

    Nothing is deleted: `ninfer pull` re-downloads the files that fail.
    """
    registry = registry or Registry()
    entry = registry.find(spec)
    emit = on_event or (lambda event: None)
    should_stop = lambda: cancel is not None and cancel.is_set()  # noqa: E731
    checks = []
    for record in entry.files.values():
        file = record.remote
        path = entry.snapshot_dir / record.name
        if not path.exists():
            checks.append(FileCheck(file.name, file.algorithm, file.digest, None, ok=False))
        else:
            reporter = ProgressReporter(emit, file.name, "hash", file.size)
            ok, actual = file_matches(file, path, reporter.update, should_stop)
            checks.append(FileCheck(file.name, file.algorithm, file.digest, actual, ok))
            record.verified_mtime_ns = path.stat().st_mtime_ns if ok else None
        check = checks[-1]
        emit(FileVerified(file.name, file.algorithm, file.digest, cached=True) if check.ok
             else Failed(file.name, f"{file.name}: {check.problem}"))
    entry.verify_failed = [c.name for c in checks if not c.ok]
    entry.verified_at = time.time()
    registry.save_ready(entry)
    return VerifyReport(entry, checks)

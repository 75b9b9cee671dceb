"""Events a pull or verify emits, so a UI (the CLI's progress bars, the TUI wizard) can render them.

The hub code never draws anything: it calls `on_event(event)` with these dataclasses. Calls are
serialized (never two at once), but they may come from worker threads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Union


@dataclass(frozen=True)
class PullStarted:
    """The plan: which files of which commit, and how many bytes in all."""

    repo_id: str
    revision: str
    commit: str
    files: tuple[tuple[str, int], ...]  # (name in the repo, size in bytes)

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.files)


@dataclass(frozen=True)
class FileStarted:
    """A file's download begins; `resume_from` > 0 when a partial file from an earlier pull continues."""

    name: str
    size: int
    resume_from: int


@dataclass(frozen=True)
class Progress:
    """Bytes of one file done so far: downloaded (phase "download") or re-hashed (phase "hash")."""

    name: str
    phase: Literal["download", "hash"]
    bytes_done: int
    total: int
    rate: float  # bytes per second over the last few seconds

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the current rate (None while the rate is unknown)."""
        return (self.total - self.bytes_done) / self.rate if self.rate > 0 else None


@dataclass(frozen=True)
class FileVerified:
    """A file's hash matches the hub's; `cached` when it was already on disk (not downloaded now)."""

    name: str
    algorithm: Literal["sha256", "git-sha1"]
    digest: str
    cached: bool


@dataclass(frozen=True)
class Retry:
    """A transient failure (5xx, dropped connection, truncated body); the next attempt follows the delay."""

    name: str  # the file, or "metadata" for the repo listing
    attempt: int  # the attempt that failed, from 1
    delay_s: float
    reason: str


@dataclass(frozen=True)
class Done:
    """The model is complete, verified and marked ready."""

    model: str
    path: Path
    downloaded_bytes: int
    seconds: float


@dataclass(frozen=True)
class Failed:
    """A pull stopped (name None), or verify found a bad file (name: that file)."""

    name: str | None
    message: str


Event = Union[PullStarted, FileStarted, Progress, FileVerified, Retry, Done, Failed]
EventCallback = Callable[[Event], None]

"""The embedded server behind the TUI's toggle: ServerHandle over the chat's own EngineService
(chat and HTTP clients share one engine and batch together), plus the request log, read from
the server's own per-route / per-status request counters."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from ninfer_core.server.app import ServerHandle

from .backend import LocalBackend

LOG_LINES = 200


@dataclass(frozen=True)
class LogLine:
    at: float
    route: str
    status: str
    count: int  # requests of this route and status since the previous poll


class EmbeddedServer:
    def __init__(self) -> None:
        self.handle: ServerHandle | None = None
        self.api_key = ""
        self.log: deque[LogLine] = deque(maxlen=LOG_LINES)
        self._seen: dict[tuple[str, str], float] = {}

    @property
    def running(self) -> bool:
        return self.handle is not None

    @property
    def url(self) -> str | None:
        return self.handle.url if self.handle else None

    def start(self, backend: LocalBackend, host: str, port: int, api_key: str) -> ServerHandle:
        """Listen (blocking until the socket is up; call it off the UI thread)."""
        self.stop()
        self.handle = ServerHandle.start(backend.service, host, port, api_key=api_key or None, model_id=backend.name)
        self.api_key = api_key
        self._seen = {}
        return self.handle

    def stop(self) -> None:
        handle, self.handle = self.handle, None
        if handle is not None:
            handle.stop()

    def total_requests(self) -> int:
        return int(sum(self._counts().values()))

    def poll(self) -> list[LogLine]:
        """Requests finished since the last poll, as log lines (also kept in `log`)."""
        now, new = time.time(), []
        for key, value in sorted(self._counts().items()):
            delta = int(value - self._seen.get(key, 0))
            if delta > 0:
                new.append(LogLine(now, key[0], key[1], delta))
            self._seen[key] = value
        self.log.extend(new)
        return new

    def _counts(self) -> dict[tuple[str, str], float]:
        if self.handle is None:
            return {}
        counts = {}
        for metric in self.handle.app.state.metrics.requests.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    counts[(sample.labels["route"], sample.labels["status"])] = sample.value
        return counts

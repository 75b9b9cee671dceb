"""Progress events at a bounded rate, with a transfer rate measured over a moving window."""

from __future__ import annotations

import time
from collections import deque
from typing import Literal

from .events import EventCallback, Progress


class ProgressReporter:
    """Emits Progress for one file at most every `interval` seconds (and always at the end)."""

    def __init__(
        self,
        emit: EventCallback,
        name: str,
        phase: Literal["download", "hash"],
        total: int,
        interval: float = 0.1,
        window: float = 3.0,
    ):
        self._emit = emit
        self._name = name
        self._phase = phase
        self._total = total
        self._interval = interval
        self._window = window
        self._samples: deque[tuple[float, int]] = deque()
        self._last_emit = float("-inf")

    def restart(self, done: int) -> None:
        """Forget the rate history (a resumed or restarted transfer does not count old bytes)."""
        self._samples.clear()
        self._samples.append((time.monotonic(), done))

    def rate(self) -> float:
        if len(self._samples) < 2:
            return 0.0
        (t0, b0), (t1, b1) = self._samples[0], self._samples[-1]
        return (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0

    def update(self, done: int) -> None:
        now = time.monotonic()
        self._samples.append((now, done))
        while len(self._samples) > 2 and now - self._samples[0][0] > self._window:
            self._samples.popleft()
        if now - self._last_emit >= self._interval or done >= self._total:
            self._last_emit = now
            self._emit(Progress(self._name, self._phase, done, self._total, self.rate()))

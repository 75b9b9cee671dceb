"""SIGINT (Ctrl-C) and SIGTERM as a request to stop, for a process that serves until told to.

Left to Python, SIGINT raises KeyboardInterrupt wherever the main thread happens to be (inside a
Thread.join it can even leave the server thread looking finished) and SIGTERM ends the process at
once; either way a stream in flight can be cut without its final error event. Inside StopSignals
both only set `requested` (the first one's name kept for the message): the main thread sees it
and stops the server in order (ServerHandle.stop). Later signals while it stops are ignored:
stopping is bounded (uvicorn's graceful timeout).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

HANDLED = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    def __init__(self) -> None:
        self.requested = threading.Event()
        self.received: str | None = None  # "SIGINT" / "SIGTERM"
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # only it may set handlers
            self._previous = {sig: signal.signal(sig, self._handle) for sig in HANDLED}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name
        self.requested.set()

"""Deltas from the generation thread, collected until the UI's next refresh (~20 per second).

The worker thread only appends here; the UI drains on a timer, so the screen is redrawn at a
steady rate however fast tokens come, and no UI call is made per token.
"""

from __future__ import annotations

import threading

from ninfer_core.chat.output_parser import ContentDelta, ReasoningDelta

REFRESH_S = 1 / 20


class DeltaBuffer:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reasoning: list[str] = []
        self._content: list[str] = []

    def add(self, event: ReasoningDelta | ContentDelta) -> None:
        with self._lock:
            (self._reasoning if isinstance(event, ReasoningDelta) else self._content).append(event.text)

    def take(self) -> tuple[str, str]:
        """(reasoning, content) added since the last take."""
        with self._lock:
            out = "".join(self._reasoning), "".join(self._content)
            self._reasoning.clear()
            self._content.clear()
        return out

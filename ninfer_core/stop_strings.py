"""Stop strings on streamed text: cut the output where one appears, even across deltas.

Text that could be the start of a stop string is held back until the next delta settles it, so a
client never receives the first half of a stop string. The stop string itself is not emitted
(OpenAI semantics).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .errors import NinferError
from .textscan import find_earliest, partial_suffix_len


@dataclass(frozen=True)
class StopCheck:
    text: str  # safe to emit now
    stop: str | None = None  # the stop string that ended the output, if one did


class StopStringFilter:
    def __init__(self, stops: Iterable[str]):
        self.stops = tuple(dict.fromkeys(stops))
        if any(not isinstance(s, str) or not s for s in self.stops):
            raise NinferError("stop strings must be non-empty strings")
        self._held = ""
        self.matched: str | None = None

    def feed(self, delta: str) -> StopCheck:
        if self.matched is not None:
            raise RuntimeError("StopStringFilter.feed after a stop string matched")
        text = self._held + delta
        hit = find_earliest(text, self.stops)
        if hit is not None:
            self._held = ""
            self.matched = hit[1]
            return StopCheck(text[: hit[0]], hit[1])
        keep = partial_suffix_len(text, self.stops)
        self._held = text[len(text) - keep :]
        return StopCheck(text[: len(text) - keep])

    def flush(self) -> str:
        """Generation ended for another reason: the held-back text was not a stop string after all."""
        held, self._held = self._held, ""
        return held

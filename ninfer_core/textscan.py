"""Scanning streamed text for markers (tags, stop strings) that may arrive split across deltas.

Both the stop-string filter and the chat output parser must hold back the tail of what they have
seen when it could be the start of a marker, and must find the earliest complete marker.
"""

from __future__ import annotations

from collections.abc import Sequence


def find_earliest(text: str, needles: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """Position and value of the earliest needle in `text[start:]`; on a tie the longest wins."""
    best: tuple[int, str] | None = None
    for needle in needles:
        pos = text.find(needle, start)
        if pos < 0:
            continue
        if best is None or pos < best[0] or (pos == best[0] and len(needle) > len(best[1])):
            best = (pos, needle)
    return best


def partial_suffix_len(text: str, needles: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some needle.

    That tail must be held back: the next delta may complete the needle.
    """
    best = 0
    for needle in needles:
        for size in range(min(len(needle) - 1, len(text)), best, -1):
            if text.endswith(needle[:size]):
                best = size
                break
    return best

"""Keep-alive durations as Ollama reads them (`keep_alive` in a request, OLLAMA_KEEP_ALIVE) and
`ninfer serve --keep-alive` takes them. Apart from the pool so that the CLI reads its flag without
importing the engine."""

from __future__ import annotations

import math
import re

FOREVER = math.inf  # a keep-alive that never expires

# Go's duration units, as Ollama's keep_alive is written ("5m", "1h30m", "500ms")
_UNITS = {"ns": 1e-9, "us": 1e-6, "\u00b5s": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|\u00b5s|ms|s|m|h)")


def parse_keep_alive(value: str | float) -> float:
    """Seconds a model stays after its last request, read as Ollama reads `keep_alive` and
    OLLAMA_KEEP_ALIVE: a number of seconds, or a Go duration ("5m", "1h30m", "500ms"); any negative
    value (or "forever") is FOREVER; 0 unloads at once. ValueError names what was expected."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration such as 5m, 30s, 1h, 0 or -1 (forever), got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = value.strip().lower()
        if text in ("forever", "inf", "infinity"):
            return FOREVER
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        try:
            seconds = sign * float(body)  # a bare number: seconds
        except ValueError:
            parts = _PART.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise ValueError(f"expected a duration such as 5m, 30s, 1h, 0 or -1 (forever), got {value!r}") from None
            seconds = sign * sum(float(n) * _UNITS[u] for n, u in parts)
    if math.isnan(seconds):
        raise ValueError(f"expected a duration, got {value!r}")
    return FOREVER if seconds < 0 else seconds

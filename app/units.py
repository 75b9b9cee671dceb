"""Numbers for people: sizes in decimal units (as the hub shows them), rates and durations."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def human_count(n: int) -> str:
    return f"{n / 1e9:.1f} B" if n >= 1e9 else f"{n / 1e6:.0f} M"


def human_duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"

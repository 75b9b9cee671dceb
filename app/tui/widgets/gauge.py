"""The context gauge: tokens this chat uses out of the model's limit, with a warning before it fills."""

from __future__ import annotations

from textual.widgets import Static

WARN_AT = 0.8  # warn from 80% of the context on
FULL_AT = 0.95


def gauge_text(used: int, limit: int | None, width: int = 16) -> str:
    if not limit:
        return f"context {used:,} tok"
    fraction = used / limit
    filled = int(min(1.0, fraction) * width)  # full only when full
    return f"context {used:,} / {limit:,} tok {'▰' * filled}{'▱' * (width - filled)} {fraction:.0%}"


class ContextGauge(Static):
    def show(self, used: int, limit: int | None) -> bool:
        """Redraw; True when the chat just crossed the warning line."""
        was_warning = self.has_class("warn")
        fraction = used / limit if limit else 0.0
        self.update(gauge_text(used, limit))
        self.set_class(fraction >= WARN_AT, "warn")
        self.set_class(fraction >= FULL_AT, "full")
        return fraction >= WARN_AT and not was_warning

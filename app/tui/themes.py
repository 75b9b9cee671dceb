"""ninfer's own themes (the built-in Textual themes stay available from the command palette)."""

from __future__ import annotations

from textual.theme import Theme

NINFER_DARK = Theme(
    name="ninfer",
    primary="#7aa2f7",
    secondary="#bb9af7",
    accent="#e0af68",
    warning="#e0af68",
    error="#f7768e",
    success="#9ece6a",
    foreground="#c0caf5",
    background="#16161e",
    surface="#1f2335",
    panel="#24283b",
    dark=True,
)

NINFER_LIGHT = Theme(
    name="ninfer-light",
    primary="#2e5cb8",
    secondary="#7847bd",
    accent="#b15c00",
    warning="#b15c00",
    error="#c4314b",
    success="#387a21",
    foreground="#24283b",
    background="#f5f5f7",
    surface="#e9e9ed",
    panel="#dcdce3",
    dark=False,
)

THEMES = (NINFER_DARK, NINFER_LIGHT)

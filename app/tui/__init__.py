"""The terminal UI (Textual): chat, model wizard, server toggle, live engine panels.

This package's __init__ imports nothing heavy, so the CLI can read the user's settings
(`app.tui.settings.default_model`) without loading Textual.
"""

"""How every command reports a user error: one red line on stderr, a non-zero exit, no traceback."""

from __future__ import annotations

from typing import NoReturn

import typer


def fail(message: str, code: int = 1) -> NoReturn:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)

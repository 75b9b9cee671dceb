"""ninfer's user interface (installed as the package `ninfer_app`): the Typer CLI."""

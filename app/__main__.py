"""`python -m ninfer_app` runs the CLI."""

from .cli import main

main()

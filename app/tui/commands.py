"""Slash commands typed in the prompt, and the completion the prompt offers while typing them
(command names, file paths after /image and /export, model and preset names)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ninfer_core.errors import NinferError


@dataclass(frozen=True)
class Command:
    name: str
    usage: str
    help: str


COMMANDS: dict[str, Command] = {c.name: c for c in (
    Command("model", "/model [NAME]", "switch model, pulling it first if needed (no name: the model wizard)"),
    Command("system", "/system [TEXT | clear]", "this model's system prompt (no text: show it)"),
    Command("think", "/think [on | off]", "thinking on or off (no argument: toggle)"),
    Command("preset", "/preset [NAME]", "this model's sampling preset (no name: list them)"),
    Command("clear", "/clear", "start a new chat (the old one stays in the history)"),
    Command("image", "/image PATH | clear", "attach an image or video to the next message"),
    Command("export", "/export [PATH]", "write this chat as Markdown"),
    Command("save", "/save [TITLE]", "save this chat under a title"),
    Command("regen", "/regen", "generate the last answer again"),
    Command("edit", "/edit", "edit and resend your last message"),
    Command("server", "/server", "start / stop the embedded server"),
    Command("help", "/help", "commands and key bindings"),
)}

PATH_COMMANDS = ("image", "export")


def parse_command(text: str) -> tuple[Command, str]:
    """'/name arg...' -> (command, argument text); NinferError for an unknown command."""
    name, _, arg = text[1:].partition(" ")
    command = COMMANDS.get(name.lower())
    if command is None:
        raise NinferError(f"unknown command /{name} (/help lists the commands)")
    return command, arg.strip()


def complete_path(partial: str) -> str | None:
    """The longest unambiguous completion of a file path (a directory gets its '/')."""
    head, stem = os.path.split(os.path.expanduser(partial))
    if not partial.endswith(stem):  # "~" alone
        return None
    directory = Path(head or ".")
    try:
        names = sorted(n for n in os.listdir(directory) if n.startswith(stem) and (stem or not n.startswith(".")))
    except OSError:
        return None
    if not names:
        return None
    common = os.path.commonprefix(names)
    if len(names) == 1 and (directory / common).is_dir():
        common += os.sep
    if common == stem:
        return None
    return partial[: len(partial) - len(stem)] + common


def complete_prompt(value: str, choices: Callable[[str], list[str]]) -> str | None:
    """The completed prompt for a slash command being typed (command name, its argument, a path), or
    None. `choices(command)` lists the words /model and /preset take."""
    if not value.startswith("/"):
        return None
    name, space, arg = value[1:].partition(" ")
    if not space:
        match = next((c for c in COMMANDS if c.startswith(name.lower()) and c != name), None)
        return f"/{match} " if match else None
    if name in PATH_COMMANDS and arg:
        completed = complete_path(arg)
        return f"/{name} {completed}" if completed else None
    words = {"think": ["on", "off"], "system": ["clear"]}.get(name) or choices(name)
    match = next((w for w in words if w.startswith(arg) and w != arg), None)
    return f"/{name} {match}" if match else None

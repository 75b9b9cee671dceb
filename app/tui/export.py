"""A chat as a Markdown document: title, model, then each turn (reasoning as a quoted block)."""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path

from .conversation import Chat


def chat_markdown(chat: Chat) -> str:
    lines = [f"# {chat.title}", "", f"*{chat.model} · {datetime.fromtimestamp(chat.created):%Y-%m-%d %H:%M}*", ""]
    for message in chat.messages:
        lines += [f"## {'You' if message.role == 'user' else 'Assistant'}", ""]
        lines += [f"![attachment]({path})" for path in message.media]
        if message.reasoning:
            lines += ["> **Thinking**", ">"] + [f"> {line}".rstrip() for line in message.reasoning.splitlines()] + [""]
        lines += [message.content, ""]
    return "\n".join(lines).rstrip() + "\n"


def default_export_path(chat: Chat) -> Path:
    slug = re.sub(r"[^A-Za-z0-9]+", "-", chat.title).strip("-").lower()[:40] or "chat"
    return Path.cwd() / f"ninfer-{slug}.md"


def export_chat(chat: Chat, path: Path | None = None) -> Path:
    path = (path or default_export_path(chat)).expanduser()
    path.write_text(chat_markdown(chat), encoding="utf-8")
    return path

"""The history sidebar: saved chats, newest first; selecting one reopens it."""

from __future__ import annotations

from datetime import datetime

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Label, ListItem, ListView

from ..store import ChatSummary


class ChatItem(ListItem):
    def __init__(self, summary: ChatSummary) -> None:
        when = datetime.fromtimestamp(summary.updated).strftime("%m-%d %H:%M")
        super().__init__(Label(summary.title, classes="chat-title"), Label(f"{when} · {summary.model}", classes="chat-info"))
        self.summary = summary


class HistorySidebar(Vertical):
    class Opened(Message):
        def __init__(self, chat_id: int) -> None:
            super().__init__()
            self.chat_id = chat_id

    def compose(self) -> ComposeResult:
        yield Label("History", classes="panel-title")
        yield ListView(id="chats")

    def show(self, chats: list[ChatSummary], current: int | None) -> None:
        view = self.query_one(ListView)
        view.clear()
        view.extend(ChatItem(s) for s in chats)
        view.index = next((i for i, s in enumerate(chats) if s.id == current), 0 if chats else None)

    def on_list_view_selected(self, event: ListView.Selected) -> None:
        event.stop()
        if isinstance(event.item, ChatItem):
            self.post_message(self.Opened(event.item.summary.id))

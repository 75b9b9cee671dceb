"""Chat history in SQLite (data dir/history.sqlite): chats and their messages, newest first.

Written as the chat goes (a message when it is sent, a reply when it ends), so a crash or a
quit mid-answer loses at most the reply in flight.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from .conversation import Chat, Message
from .paths import history_path

SCHEMA = """
CREATE TABLE IF NOT EXISTS chats (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL,
    model TEXT NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
    position INTEGER NOT NULL,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    reasoning TEXT NOT NULL DEFAULT '',
    media TEXT NOT NULL DEFAULT '[]',
    meta TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS messages_by_chat ON messages(chat_id, position);
"""


@dataclass(frozen=True)
class ChatSummary:
    id: int
    title: str
    model: str
    updated: float
    messages: int


class HistoryStore:
    def __init__(self, path: Path | None = None):
        self.path = path or history_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # the UI thread owns the store; check_same_thread off so tests may read it from theirs
        self.db = sqlite3.connect(self.path, check_same_thread=False)
        self.db.execute("PRAGMA foreign_keys = ON")
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    # -- chats ------------------------------------------------------------------------------

    def create(self, chat: Chat) -> int:
        with self.db:
            cur = self.db.execute("INSERT INTO chats (title, model, created, updated) VALUES (?, ?, ?, ?)",
                                  (chat.title, chat.model, chat.created, chat.updated))
        chat.id = cur.lastrowid
        return chat.id  # type: ignore[return-value]

    def rename(self, chat_id: int, title: str) -> None:
        with self.db:
            self.db.execute("UPDATE chats SET title = ? WHERE id = ?", (title, chat_id))

    def delete(self, chat_id: int) -> None:
        with self.db:
            self.db.execute("DELETE FROM chats WHERE id = ?", (chat_id,))

    def chats(self, limit: int = 200) -> list[ChatSummary]:
        rows = self.db.execute(
            "SELECT c.id, c.title, c.model, c.updated, COUNT(m.id) FROM chats c "
            "LEFT JOIN messages m ON m.chat_id = c.id GROUP BY c.id ORDER BY c.updated DESC, c.id DESC LIMIT ?",
            (limit,),
        ).fetchall()
        return [ChatSummary(*row) for row in rows]

    def load(self, chat_id: int) -> Chat | None:
        row = self.db.execute("SELECT id, title, model, created, updated FROM chats WHERE id = ?", (chat_id,)).fetchone()
        if row is None:
            return None
        chat = Chat(id=row[0], title=row[1], model=row[2], created=row[3], updated=row[4])
        for mid, role, content, reasoning, media, meta in self.db.execute(
            "SELECT id, role, content, reasoning, media, meta FROM messages WHERE chat_id = ? ORDER BY position",
            (chat_id,),
        ):
            chat.messages.append(Message(role, content, reasoning, json.loads(media), json.loads(meta), id=mid))
        return chat

    # -- messages ---------------------------------------------------------------------------

    def save_message(self, chat: Chat, message: Message) -> None:
        """Insert or update one message of `chat` (its position is its index in chat.messages)."""
        assert chat.id is not None
        values = (message.role, message.content, message.reasoning, json.dumps(message.media),
                  json.dumps(message.meta))
        chat.updated = time.time()
        with self.db:
            if message.id is None:
                cur = self.db.execute(
                    "INSERT INTO messages (chat_id, position, role, content, reasoning, media, meta) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)", (chat.id, chat.messages.index(message), *values))
                message.id = cur.lastrowid
            else:
                self.db.execute("UPDATE messages SET role = ?, content = ?, reasoning = ?, media = ?, meta = ? "
                                "WHERE id = ?", (*values, message.id))
            self.db.execute("UPDATE chats SET updated = ?, model = ? WHERE id = ?", (chat.updated, chat.model, chat.id))

    def truncate(self, chat: Chat, keep: int) -> None:
        """Drop the messages from position `keep` on (regenerate, edit)."""
        assert chat.id is not None
        with self.db:
            self.db.execute("DELETE FROM messages WHERE chat_id = ? AND position >= ?", (chat.id, keep))
        del chat.messages[keep:]

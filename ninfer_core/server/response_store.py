"""Recent Responses API results kept in memory, for `previous_response_id` and retrieval.

Bounded (least recently used out first) so a long-running server does not grow without limit;
a conversation older than the window must be sent again in full.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_RESPONSES = 256


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as returned
    messages: list[dict[str, Any]]  # the conversation up to and including this response (no instructions)


class ResponseStore:
    def __init__(self, max_items: int = DEFAULT_MAX_RESPONSES):
        self.max_items = max_items
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        with self._lock:
            self._items[response_id] = stored
            self._items.move_to_end(response_id)
            while len(self._items) > self.max_items:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            stored = self._items.get(response_id)
            if stored is not None:
                self._items.move_to_end(response_id)
            return stored

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._items.pop(response_id, None) is not None

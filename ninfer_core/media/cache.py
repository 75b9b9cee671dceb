"""Prepared media by content hash: the same image sent again (every turn of a chat resends it)
is decoded, resized and patchified once.

Keys are (sha256 of the bytes, kind, preprocessing settings); entries are evicted least recently
used first once their patch rows exceed `max_bytes`. Thread-safe (the server prepares media on
request threads).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from .config import PreprocessConfig
from .prepared import PreparedMedia

CacheKey = tuple[str, str, PreprocessConfig]


class PreparedMediaCache:
    def __init__(self, max_bytes: int = 512 << 20):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[CacheKey, PreparedMedia] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get_or_prepare(self, key: CacheKey, prepare: Callable[[], PreparedMedia]) -> PreparedMedia:
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return found
            self.misses += 1
        prepared = prepare()  # outside the lock: decoding a video can take seconds
        self._put(key, prepared)
        return prepared

    def _put(self, key: CacheKey, prepared: PreparedMedia) -> None:
        if prepared.nbytes > self.max_bytes:
            return
        with self._lock:
            if key in self._entries:
                return
            self._entries[key] = prepared
            self._bytes += prepared.nbytes
            while self._bytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.nbytes

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

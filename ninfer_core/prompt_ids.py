"""Ids of rendered prompts, reusing those of earlier prompts that start the same way.

The turns of one chat, or the calls of an agent, render prompts that repeat a long start (the
system prompt, the conversation so far). `tokenizers` encodes a 30K-token prompt in ~85 ms of one
CPU core, every time, before the engine (whose prefix cache answers such a prompt in ~50 ms) sees
it. The tokenizer splits the text at added tokens such as `<|im_start|>` before anything else, so
a prompt cut at the start of one encodes as the two parts' ids one after the other, exactly: only
the text after the last such token shared with a cached prompt needs encoding.

No library keeps a tokenization cache keyed on text prefixes (`tokenizers` has none; vLLM and
SGLang re-encode), hence this small one.
"""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import tokenizers


@dataclass(frozen=True)
class _Entry:
    text: str
    ids: list[int]
    cuts: list[int]    # text offsets where a splitting added token starts, ascending
    tokens: list[int]  # the index in ids of that token, per cut
    ends: list[int]    # cut + the token's length: the prefix that must match for the cut to hold


class PromptIdCache:
    """LRU of encoded prompts (up to `max_tokens` ids in all); `encode(text)` equals the backend's
    encode(text).ids (no special tokens added) and reuses the longest cached start it can."""

    def __init__(self, backend: tokenizers.Tokenizer, max_tokens: int = 1 << 20, min_chars: int = 256):
        self.backend = backend
        self.max_tokens = max_tokens
        self.min_chars = min_chars  # shorter prompts encode in microseconds: not cached
        # Added tokens the tokenizer splits raw text at, whatever surrounds them (no whitespace
        # stripping, not matched after normalisation): a cut before one is a hard boundary.
        self._splitting = frozenset(
            token_id for token_id, tok in backend.get_added_tokens_decoder().items()
            if not (tok.lstrip or tok.rstrip or tok.single_word or tok.normalized)
        )
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._sorted: list[str] = []  # the entries' texts in sorted order (see _longest_start)
        self._tokens = 0
        self._lock = threading.Lock()
        self.hits = 0  # prompts that reused a cached start
        self.reused_ids = 0

    def encode(self, text: str) -> list[int]:
        if len(text) < self.min_chars:
            return self.backend.encode(text, add_special_tokens=False).ids
        with self._lock:
            best = self._longest_start(text)
        if best is None:
            prefix_ids, start = [], 0
        else:
            entry, i = best
            prefix_ids, start = entry.ids[: entry.tokens[i]], entry.cuts[i]
        encoding = self.backend.encode(text[start:], add_special_tokens=False)
        new_ids = encoding.ids
        ids = prefix_ids + new_ids
        cuts, tokens, ends = self._cuts(encoding, new_ids, start, len(prefix_ids), best)
        with self._lock:
            if best is not None:
                self.hits += 1
                self.reused_ids += len(prefix_ids)
            self._remember(_Entry(text, ids, cuts, tokens, ends))
        return list(ids)

    def _longest_start(self, text: str) -> tuple[_Entry, int] | None:
        """The cached prompt and cut index that leave the least text to encode.

        Only the two cached texts next to `text` in sorted order are tried: one of them shares the
        longest start with it, and a cut usable in any other entry (its token within the start that
        entry shares) lies within that longer shared start too, where the same token splits the
        text. A scan of every entry cost ~1.5 us per cached prompt on each request (3,000 cached
        chats: 4.7 ms more per chat request, on the path to its first token)."""
        at = bisect.bisect_left(self._sorted, text)
        best, best_cut = None, 0
        for key in self._sorted[max(0, at - 1) : at + 1]:
            entry = self._entries[key]
            i = _last_matching(entry, text)
            if i is not None and entry.cuts[i] > best_cut:
                best, best_cut = (entry, i), entry.cuts[i]
        if best is not None:
            self._entries.move_to_end(best[0].text)
        return best

    def _cuts(self, encoding: tokenizers.Encoding, new_ids: list[int], start: int, first: int,
              best: tuple[_Entry, int] | None) -> tuple[list[int], list[int], list[int]]:
        """The cuts of a new entry: the reused entry's up to the one used, then those of the
        newly encoded text (`new_ids`, its offsets shifted by `start`). Only the splitting tokens'
        offsets are read: all of them (`encoding.offsets`) cost more than the ids themselves."""
        cuts, tokens, ends = ([], [], []) if best is None else (
            best[0].cuts[: best[1]], best[0].tokens[: best[1]], best[0].ends[: best[1]])
        for j in [j for j, token_id in enumerate(new_ids) if token_id in self._splitting]:
            span = encoding.token_to_chars(j)
            if span is not None and span[1] > span[0]:
                cuts.append(start + span[0])
                tokens.append(first + j)
                ends.append(start + span[1])
        return cuts, tokens, ends

    def _remember(self, entry: _Entry) -> None:
        old = self._entries.pop(entry.text, None)
        if old is not None:
            self._tokens -= len(old.ids)
        else:
            bisect.insort(self._sorted, entry.text)
        self._entries[entry.text] = entry
        self._tokens += len(entry.ids)
        while self._tokens > self.max_tokens and len(self._entries) > 1:
            _, evicted = self._entries.popitem(last=False)
            self._tokens -= len(evicted.ids)
            del self._sorted[bisect.bisect_left(self._sorted, evicted.text)]


def _last_matching(entry: _Entry, text: str) -> int | None:
    """The last cut of `entry` whose text up to the end of its token starts `text` (binary search:
    if a cut's prefix matches, every earlier one's does)."""
    matches: Callable[[int], bool] = lambda i: text.startswith(entry.text[: entry.ends[i]])  # noqa: E731
    if not entry.cuts or not matches(0):
        return None
    return bisect.bisect_left(range(len(entry.cuts)), True, key=lambda i: not matches(i)) - 1

"""Prefix reuse: KV pages shared by content, and Gated DeltaNet state checkpoints.

KV. A page full of final tokens (prompt, or answer tokens already sampled) is indexed under a
hash chain over the pages before it: h_i = hash(h_{i-1}, the page's token ids, the media rows in
it). A new sequence whose prompt starts with the same pages gets those pages (reference counts;
full pages are never written again, so sharing needs no copy). A page no sequence holds stays
indexed and evictable: the cache hands it out again, least recently used first, only when no free
page is left.

GDN state is not per token: a layer's state after position p summarizes every token before it, so
a cached prefix is only usable where a snapshot of the state was taken. A checkpoint holds, at a
position p: the conv + recurrent state of every GDN layer (a slot of the state pool set aside for
checkpoints) and the page holding tokens p - p % page_size .. p - 1 (kept by reference: its owner
only appends after p; a hit copies it, since the new sequence writes into it). Checkpoints are
taken at the end of every prompt (long prompts, from `split_min` tokens: also one token before it,
so that the same prompt sent again hits), every `interval` tokens of a long prompt and at the end
of every answer, within the slots the memory budget allows (least recently used go first).

A hit resumes at the longest p with a checkpoint whose prefix the prompt repeats, its pages
indexed, and p < prompt length (the last prompt token is always computed: it gives the logits).
A model without recurrent state (no GDN layer: the Llama family) needs no snapshot to resume, so
there every indexed full page the prompt repeats is a resume point too, and every prompt, short
ones included, is checkpointed one token before its end (a fork inside its chunk: no extra step).
vLLM's hybrid prefix caching and SGLang's hybrid radix cache work the same way; this one keys
checkpoints by (page-chain hash, tail tokens) instead of a radix tree.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

ROOT = 0  # the hash "before" the first page
SPLIT_MIN = 256


@dataclass
class Checkpoint:
    tokens: int  # p: the state is after tokens 0 .. p - 1
    anchor: int  # hash of the full pages before the tail (ROOT when p < page_size)
    tail: tuple[int, ...]  # the tokens after the anchor's pages (fewer than a page)
    slot: int  # state pool slot holding the snapshot
    page: int | None  # page holding the tail's KV (None: no tail)
    keys: tuple[object, ...] = ()  # media keys of the tail's tokens


@dataclass(frozen=True)
class Hit:
    tokens: int
    pages: list[int]  # the full pages to share, in order
    hashes: list[int]  # their hash chain
    checkpoint: Checkpoint | None  # None: whole pages only (a model without recurrent state)


def chain(prev: int, tokens: list[int], keys: list[object] | None, start: int, end: int) -> int:
    """The hash of tokens start..end (a page) after the pages hashed into `prev`; media rows count
    by their content key (keys: one per token, None for a text prompt), not their pad token id."""
    return hash((prev, tuple(tokens[start:end]), tuple(keys[start:end]) if keys is not None else ()))


def page_hashes(tokens: list[int], keys: list[object] | None, page_size: int) -> list[int]:
    """The hash chain of every full page of `tokens`."""
    hashes, prev = [], ROOT
    for start in range(0, len(tokens) - page_size + 1, page_size):
        prev = chain(prev, tokens, keys, start, start + page_size)
        hashes.append(prev)
    return hashes


class PrefixCache:
    """The index of shared pages and checkpoints; CacheManager owns the pages themselves."""

    def __init__(self, page_size: int, checkpoint_slots: list[int], interval: int, split_min: int = SPLIT_MIN,
                 stateless: bool = False):
        self.page_size = page_size
        self.interval = interval  # checkpoint every this many tokens of a long prompt (a page multiple)
        self.stateless = stateless  # no recurrent state: any full page boundary is a resume point
        # prompts from this long are also checkpointed before their last token (all, without state)
        self.split_min = 0 if stateless else split_min
        self.pages: dict[int, tuple[int, tuple[int, ...]]] = {}  # hash -> (page, its tokens)
        self.page_hash: dict[int, int] = {}  # page -> hash
        self.evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU, held by nobody
        self.free_slots = list(checkpoint_slots)
        self.capacity = len(checkpoint_slots)  # checkpoints it can keep
        self.checkpoints: collections.OrderedDict[int, Checkpoint] = collections.OrderedDict()  # by slot, LRU
        self._by_anchor: dict[int, list[Checkpoint]] = collections.defaultdict(list)
        self.queried_tokens = 0
        self.hit_tokens = 0

    # -- lookup ---------------------------------------------------------------------------------

    def count(self, queried: int, hit: Hit | None) -> None:
        """Counters of an admitted prompt: tokens looked up, tokens served from the cache."""
        self.queried_tokens += queried
        self.hit_tokens += hit.tokens if hit is not None else 0

    def lookup(self, tokens: list[int], keys: list[object] | None, limit: int) -> Hit | None:
        """The longest cached prefix of `tokens` shorter than `limit`: pages + a checkpoint, or without
        recurrent state whole pages alone."""
        hashes = page_hashes(tokens[:limit], keys, self.page_size)
        pages = []
        for i, h in enumerate(hashes):
            entry = self.pages.get(h)
            start = i * self.page_size
            if entry is None or entry[1] != tuple(tokens[start : start + self.page_size]):
                break
            pages.append(entry[0])
        whole = min(len(pages), (limit - 1) // self.page_size) if self.stateless else 0
        for full in range(len(pages), whole - 1, -1):
            anchor = hashes[full - 1] if full else ROOT
            start = full * self.page_size
            best = None
            for ckpt in self._by_anchor.get(anchor, ()):
                end = start + len(ckpt.tail)
                if end < limit and tuple(tokens[start:end]) == ckpt.tail and \
                        (keys is None or tuple(keys[start:end]) == ckpt.keys) and \
                        (best is None or len(ckpt.tail) > len(best.tail)):
                    best = ckpt
            if best is not None:
                self.checkpoints.move_to_end(best.slot)
                return Hit(best.tokens, pages[:full], hashes[:full], best)
        return Hit(whole * self.page_size, pages[:whole], hashes[:whole], None) if whole else None

    # -- pages ----------------------------------------------------------------------------------

    def index(self, page: int, page_hash: int, tokens: tuple[int, ...]) -> bool:
        """Index a full page under its hash; False when that content is indexed already."""
        if page_hash in self.pages or page in self.page_hash:
            return False
        self.pages[page_hash] = (page, tokens)
        self.page_hash[page] = page_hash
        return True

    def indexed(self, page: int) -> bool:
        return page in self.page_hash

    def park(self, page: int) -> None:
        """An indexed page nobody holds any more: evictable, most recently used last."""
        self.evictable[page] = None

    def unpark(self, page: int) -> None:
        self.evictable.pop(page, None)

    def evict_page(self) -> int | None:
        """The least recently used unheld page, dropped from the index (None: none left)."""
        if not self.evictable:
            return None
        page, _ = self.evictable.popitem(last=False)
        del self.pages[self.page_hash.pop(page)]
        return page

    # -- checkpoints ----------------------------------------------------------------------------

    def take_slot(self) -> int | None:
        return self.free_slots.pop() if self.free_slots else None

    def return_slot(self, slot: int) -> None:
        """A slot taken for a checkpoint that was not kept."""
        self.free_slots.append(slot)

    def add(self, ckpt: Checkpoint) -> None:
        self.checkpoints[ckpt.slot] = ckpt
        self._by_anchor[ckpt.anchor].append(ckpt)

    def has(self, anchor: int, tail: tuple[int, ...]) -> bool:
        return any(c.tail == tail for c in self._by_anchor.get(anchor, ()))

    def oldest(self) -> Checkpoint | None:
        return next(iter(self.checkpoints.values()), None)

    def remove(self, ckpt: Checkpoint) -> None:
        del self.checkpoints[ckpt.slot]
        self._by_anchor[ckpt.anchor].remove(ckpt)
        if not self._by_anchor[ckpt.anchor]:
            del self._by_anchor[ckpt.anchor]
        self.free_slots.append(ckpt.slot)

    @property
    def num_pages(self) -> int:
        return len(self.pages)


"""The model cache (KV pages + GDN state slots) and the bookkeeping the engine uses to share it.

A running sequence owns one state slot and a growing list of KV pages. The engine reserves
pages before a step that appends tokens, frees everything when the sequence ends, and truncates
pages (plus restores a state snapshot) when speculative tokens are rejected.

The block table lives on the device, one row per state slot: a step gathers its rows by slot
instead of rebuilding a table from Python lists; new pages reach it as one small scatter
(`flush`) before the next forward reads it.

With a prefix cache (prefix_cache.py) a page may have several holders (sequences sharing a
prefix, checkpoints keeping a tail): pages are reference counted, and an indexed page nobody
holds stays cached until a free page is needed. State slots past the sequences' (and the
scratch slot) hold the checkpoints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..config import ModelConfig
from ..errors import ContextLengthError, NinferError
from ..ops.dispatch import upload
from .kv_pool import KVPool
from .prefix_cache import ROOT, Checkpoint, Hit, PrefixCache, chain
from .sizes import gdn_conv_dim
from .state_pool import StatePool, StateSnapshot

DEFAULT_PAGE_SIZE = 16


@dataclass
class ModelCache:
    """Everything a model forward reads and writes besides the weights."""

    kv: KVPool
    state: StatePool

    @property
    def page_size(self) -> int:
        return self.kv.page_size

    @classmethod
    def allocate(
        cls,
        config: ModelConfig,
        num_pages: int,
        page_size: int,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kv_dtype: str | torch.dtype | None = None,
    ) -> "ModelCache":
        """`kv_dtype`: what the KV pages store (None: the model dtype; "fp8", "int8": see kv_pool)."""
        kv = KVPool(
            config.full_attention_layers, num_pages, page_size, config.num_kv_heads, config.head_dim, dtype, device,
            kv_dtype,
        )
        state = StatePool(
            config.linear_attention_layers,
            num_slots,
            gdn_conv_dim(config),
            config.linear_conv_kernel_dim,
            config.linear_num_value_heads,
            config.linear_key_head_dim,
            config.linear_value_head_dim,
            dtype,
            device,
        )
        return cls(kv=kv, state=state)


@dataclass
class SequenceCache:
    """One sequence's share of the cache: its state slot and its KV pages in order."""

    slot: int
    pages: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # hash chain of its indexed-or-hashed full pages


class CacheManager:
    """Hands out state slots and KV pages; capacity is `max_tokens` KV tokens over `max_seqs` sequences."""

    def __init__(
        self,
        config: ModelConfig,
        max_tokens: int,
        max_seqs: int,
        page_size: int = DEFAULT_PAGE_SIZE,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        kv_dtype: str | torch.dtype | None = None,
        scratch: bool = False,
        max_seq_tokens: int | None = None,
        checkpoints: int = 0,
        checkpoint_interval: int = 4096,
    ):
        """`scratch`: one more state slot and KV page that no sequence ever gets, for the spare rows
        of a CUDA-graph batch bucket (`engine/cuda_graph.py`); `max_seq_tokens`: the most one
        sequence holds (the block table's width; default: the whole cache); `checkpoints`: state
        slots for prefix-cache checkpoints (0: no prefix cache); `checkpoint_interval`: tokens
        between the checkpoints of a long prompt."""
        if max_tokens < 1 or max_seqs < 1 or page_size < 1:
            raise NinferError(
                f"cache needs max_tokens, max_seqs and page_size >= 1 (got {max_tokens}, {max_seqs}, {page_size})"
            )
        self.page_size = page_size
        self.num_pages = math.ceil(max_tokens / page_size)
        self.max_seqs = max_seqs
        self.device = torch.device(device)
        extra = int(scratch)
        self.cache = ModelCache.allocate(
            config, self.num_pages + extra, page_size, max_seqs + extra + checkpoints, dtype, device, kv_dtype
        )
        first = max_seqs + extra
        self.prefix = (PrefixCache(page_size, list(range(first + checkpoints - 1, first - 1, -1)), checkpoint_interval,
                                   stateless=self.cache.state.nbytes == 0) if checkpoints else None)
        self._refs: dict[int, int] = {}  # page -> holders (sequences and checkpoints)
        self._checkpoint_refs: dict[int, int] = {}  # page -> holders that are checkpoints
        self.scratch_slot = max_seqs if scratch else None
        self.scratch_page = self.num_pages if scratch else None
        self._free_pages = list(range(self.num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._free_slots = list(range(max_seqs - 1, -1, -1))
        self._live_slots: set[int] = set()
        self._pages_high_water = 0  # 1 + the highest page id ever handed out
        self.max_seq_pages = min(self.num_pages, math.ceil((max_seq_tokens or max_tokens) / page_size))
        # unused entries hold page 0, a valid id in every pool that shares these page ids (a drafter's)
        self.table = torch.zeros((max_seqs + extra, self.max_seq_pages), dtype=torch.int32, device=self.device)
        self._new_entries: list[tuple[int, int, int]] = []  # (slot, index, page) not yet in `table`

    # -- capacity ---------------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def free_pages(self) -> int:
        """Pages a sequence can get now: free ones, cached pages nobody holds, and pages only
        checkpoints hold (dropping the checkpoint frees them)."""
        if self.prefix is None:
            return len(self._free_pages)
        return len(self._free_pages) + len(self.prefix.evictable) + self._checkpoint_only_pages()

    @property
    def free_tokens(self) -> int:
        return self.free_pages * self.page_size

    @property
    def active_tokens(self) -> int:
        """KV held by sequences (not free, not merely cached: evictable or kept by a checkpoint)."""
        return (self.num_pages - self.free_pages) * self.page_size

    def _checkpoint_only_pages(self) -> int:
        return sum(1 for page, n in self._checkpoint_refs.items() if self._refs.get(page) == n)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def kv_bytes(self) -> int:
        return self.cache.kv.nbytes

    @property
    def resident_kv_bytes(self) -> int:
        """KV bytes in memory: all of the pool on a GPU; on the CPU, where pages take memory only
        once written (kv_pool.lazy_zeros), at most the pages up to the highest id handed out."""
        if self.device.type != "cpu":
            return self.kv_bytes
        return self.cache.kv.bytes_per_token * self.page_size * self._pages_high_water

    @property
    def state_bytes(self) -> int:
        return self.cache.state.nbytes

    @property
    def total_bytes(self) -> int:
        return self.kv_bytes + self.state_bytes

    # -- sequences --------------------------------------------------------------------------

    def allocate(self) -> SequenceCache:
        """A new sequence: a zeroed state slot and no pages yet."""
        if not self._free_slots:
            raise NinferError(f"all {self.max_seqs} sequence slots of the cache are in use")
        slot = self._free_slots.pop()
        self._live_slots.add(slot)
        self.cache.state.reset(slot)
        return SequenceCache(slot=slot)

    def capacity(self, seq: SequenceCache) -> int:
        """Tokens the sequence can hold with the pages it already owns."""
        return len(seq.pages) * self.page_size

    def can_reserve(self, seq: SequenceCache, total_tokens: int) -> bool:
        return self._pages_needed(seq, total_tokens) <= self.free_pages

    def reserve(self, seq: SequenceCache, total_tokens: int) -> None:
        """Grow the sequence's pages so it can hold `total_tokens` tokens in all."""
        needed = self._pages_needed(seq, total_tokens)
        if needed > self.free_pages:
            available = self.capacity(seq) + self.free_tokens
            raise ContextLengthError(
                f"KV cache exhausted: the sequence needs {total_tokens} tokens, {available} are available "
                f"(cache capacity {self.capacity_tokens} tokens over {self.max_seqs} sequences)",
                prompt_tokens=total_tokens,
                limit=available,
            )
        if len(seq.pages) + needed > self.max_seq_pages:
            raise ContextLengthError(
                f"the sequence needs {total_tokens} tokens, more than the {self.max_seq_pages * self.page_size} "
                f"one sequence may hold", prompt_tokens=total_tokens, limit=self.max_seq_pages * self.page_size)
        for _ in range(needed):
            self._append(seq, self._take_page())

    def truncate(self, seq: SequenceCache, num_tokens: int) -> None:
        """Release the pages beyond the first `num_tokens` tokens (GDN state: use snapshot/restore)."""
        keep = math.ceil(num_tokens / self.page_size)
        while len(seq.pages) > keep:
            self._release(seq.pages.pop())
        del seq.hashes[keep:]

    def free(self, seq: SequenceCache) -> None:
        if seq.slot not in self._live_slots:
            raise ValueError(f"cache slot {seq.slot} is not allocated (freed twice?)")
        self.truncate(seq, 0)
        self._live_slots.remove(seq.slot)
        self._free_slots.append(seq.slot)

    def _append(self, seq: SequenceCache, page: int) -> None:
        self._refs[page] = self._refs.get(page, 0) + 1
        self._pages_high_water = max(self._pages_high_water, page + 1)
        self._new_entries.append((seq.slot, len(seq.pages), page))
        seq.pages.append(page)

    def _take_page(self) -> int:
        """A free page, else the least recently used cached page nobody holds, else one that only
        checkpoints hold (the least recently used of them are dropped)."""
        if self._free_pages:
            return self._free_pages.pop()
        assert self.prefix is not None
        page = self.prefix.evict_page()
        while page is None:
            ckpt = next(c for c in self.prefix.checkpoints.values()
                        if c.page is not None and self._refs[c.page] == self._checkpoint_refs[c.page])
            self.drop_checkpoint(ckpt)
            page = self._free_pages.pop() if self._free_pages else self.prefix.evict_page()
        return page

    def _release(self, page: int) -> None:
        """One holder less; a page nobody holds is free, or cached if its content is indexed."""
        self._refs[page] -= 1
        if self._refs[page]:
            return
        del self._refs[page]
        if self.prefix is not None and self.prefix.indexed(page):
            self.prefix.park(page)
        else:
            self._free_pages.append(page)

    # -- prefix cache -----------------------------------------------------------------------

    def index_pages(self, seq: SequenceCache, tokens: list[int], keys: list[object] | None, upto: int) -> None:
        """Index the sequence's full pages below token `upto` (their tokens final, KV written or
        queued): later prompts that repeat them share them."""
        if self.prefix is None:
            return
        ps = self.page_size
        for i in range(len(seq.hashes), min(upto // ps, len(seq.pages))):
            seq.hashes.append(chain(seq.hashes[-1] if seq.hashes else ROOT, tokens, keys, i * ps, (i + 1) * ps))
            self.prefix.index(seq.pages[i], seq.hashes[-1], tuple(tokens[i * ps : (i + 1) * ps]))

    def resume(self, seq: SequenceCache, hit: Hit) -> None:
        """Start a fresh sequence at a cached prefix: share its full pages, copy the checkpoint's
        tail page (the sequence writes into it) and its GDN state into the sequence's slot."""
        assert self.prefix is not None and not seq.pages
        for page, page_hash in zip(hit.pages, hit.hashes):
            self.prefix.unpark(page)
            self._append(seq, page)
            seq.hashes.append(page_hash)
        ckpt = hit.checkpoint
        if ckpt is None:  # whole pages of a model without recurrent state
            return
        if ckpt.page is not None:
            page = self._take_page()
            self.cache.kv.copy_page(ckpt.page, page)
            self._append(seq, page)
        self.cache.state.copy(ckpt.slot, seq.slot)

    def checkpoint(self, seq: SequenceCache, tokens: list[int], keys: list[object] | None, position: int,
                   filled: int | None = None) -> None:
        """Snapshot the sequence's state after its first `position` tokens (its KV written or
        queued up to there; its full pages below indexed) as a checkpoint, unless one exists.
        `filled`: a slot from `reserve_checkpoint_slot` that a forward already wrote that state
        into (ForwardBatch.fork): kept as the checkpoint, or handed back."""
        if self.prefix is None:
            return
        ps = self.page_size
        full = position // ps
        anchor = seq.hashes[full - 1] if 0 < full <= len(seq.hashes) else ROOT
        tail = tuple(tokens[full * ps : position])
        # pages before the tail not indexed: a lookup could never reach this checkpoint
        useless = full > len(seq.hashes) or not tail and not full or self.prefix.has(anchor, tail)
        slot = None if useless else filled if filled is not None else self.reserve_checkpoint_slot()
        if slot is None:
            if filled is not None:
                self.prefix.return_slot(filled)
            return
        page = seq.pages[full] if tail else None
        if page is not None:
            self._refs[page] += 1
            self._checkpoint_refs[page] = self._checkpoint_refs.get(page, 0) + 1
        if filled is None:
            self.cache.state.copy(seq.slot, slot)
        keys_tail = tuple(keys[full * ps : position]) if keys is not None else ()
        self.prefix.add(Checkpoint(position, anchor, tail, slot, page, keys_tail))

    def reserve_checkpoint_slot(self) -> int | None:
        """A state slot for a new checkpoint (the least recently used checkpoint makes room), or None."""
        assert self.prefix is not None
        slot = self.prefix.take_slot()
        if slot is None:
            oldest = self.prefix.oldest()
            if oldest is None:
                return None
            self.drop_checkpoint(oldest)
            slot = self.prefix.take_slot()
        return slot

    def drop_checkpoint(self, ckpt: Checkpoint) -> None:
        assert self.prefix is not None
        self.prefix.remove(ckpt)
        if ckpt.page is not None:
            self._checkpoint_refs[ckpt.page] -= 1
            if not self._checkpoint_refs[ckpt.page]:
                del self._checkpoint_refs[ckpt.page]
            self._release(ckpt.page)

    def forget_prefixes(self) -> None:
        """Drop every checkpoint and cached page nobody holds, and zero the counters."""
        if self.prefix is None:
            return
        for ckpt in list(self.prefix.checkpoints.values()):
            self.drop_checkpoint(ckpt)
        while (page := self.prefix.evict_page()) is not None:
            self._free_pages.append(page)
        self.prefix.queried_tokens = self.prefix.hit_tokens = 0

    @property
    def prefix_cached_bytes(self) -> int:
        """Memory the prefix cache holds: indexed pages and checkpoint states."""
        if self.prefix is None:
            return 0
        page_bytes = self.cache.kv.bytes_per_token * self.page_size
        return self.prefix.num_pages * page_bytes + len(self.prefix.checkpoints) * self.cache.state.bytes_per_slot

    def flush(self) -> None:
        """Write the pages reserved since the last flush into the device table (one scatter)."""
        if not self._new_entries:
            return
        entries = upload(self._new_entries, torch.long, self.device)
        self.table[entries[:, 0], entries[:, 1]] = entries[:, 2].to(torch.int32)
        self._new_entries.clear()

    def rows(self, slots: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """The table rows of `slots` [B] (a device tensor) wide enough for `num_tokens` tokens:
        [B, P] int32 page ids, entries past a sequence's own pages stale (never read)."""
        self.flush()
        width = min(self.max_seq_pages, max(1, math.ceil(num_tokens / self.page_size)))
        return self.table[:, :width].index_select(0, slots)

    def block_table(self, seqs: list[SequenceCache]) -> torch.Tensor:
        """[B, P] int32 page ids of these sequences, P covering the longest."""
        slots = upload([s.slot for s in seqs], torch.long, self.device)
        return self.rows(slots, max(len(s.pages) for s in seqs) * self.page_size)

    def _pages_needed(self, seq: SequenceCache, total_tokens: int) -> int:
        return max(0, math.ceil(total_tokens / self.page_size) - len(seq.pages))

    # -- GDN state --------------------------------------------------------------------------

    def snapshot(self, slot: int) -> StateSnapshot:
        return self.cache.state.snapshot(slot)

    def restore(self, slot: int, snap: StateSnapshot) -> None:
        self.cache.state.restore(slot, snap)

    def copy_state(self, src: int, dst: int) -> None:
        self.cache.state.copy(src, dst)

"""The model cache (KV pages + GDN state slots) and the bookkeeping the engine uses to share it.

A running sequence owns one state slot and a growing list of KV pages. The engine reserves
pages before a step that appends tokens, frees everything when the sequence ends, and truncates
pages (plus restores a state snapshot) when speculative tokens are rejected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..config import ModelConfig
from ..errors import ContextLengthError, NinferError
from .kv_pool import KVPool
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
    ):
        """`scratch`: one more state slot and KV page that no sequence ever gets, for the spare rows
        of a CUDA-graph batch bucket (`engine/cuda_graph.py`)."""
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
            config, self.num_pages + extra, page_size, max_seqs + extra, dtype, device, kv_dtype
        )
        self.scratch_slot = max_seqs if scratch else None
        self.scratch_page = self.num_pages if scratch else None
        self._free_pages = list(range(self.num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._free_slots = list(range(max_seqs - 1, -1, -1))
        self._live_slots: set[int] = set()
        self._pages_high_water = 0  # 1 + the highest page id ever handed out

    # -- capacity ---------------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def free_tokens(self) -> int:
        return len(self._free_pages) * self.page_size

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
        return self._pages_needed(seq, total_tokens) <= len(self._free_pages)

    def reserve(self, seq: SequenceCache, total_tokens: int) -> None:
        """Grow the sequence's pages so it can hold `total_tokens` tokens in all."""
        needed = self._pages_needed(seq, total_tokens)
        if needed > len(self._free_pages):
            available = self.capacity(seq) + self.free_tokens
            raise ContextLengthError(
                f"KV cache exhausted: the sequence needs {total_tokens} tokens, {available} are available "
                f"(cache capacity {self.capacity_tokens} tokens over {self.max_seqs} sequences)",
                prompt_tokens=total_tokens,
                limit=available,
            )
        seq.pages.extend(self._free_pages.pop() for _ in range(needed))
        if needed:
            self._pages_high_water = max(self._pages_high_water, max(seq.pages[-needed:]) + 1)

    def truncate(self, seq: SequenceCache, num_tokens: int) -> None:
        """Release the pages beyond the first `num_tokens` tokens (GDN state: use snapshot/restore)."""
        keep = math.ceil(num_tokens / self.page_size)
        while len(seq.pages) > keep:
            self._free_pages.append(seq.pages.pop())

    def free(self, seq: SequenceCache) -> None:
        if seq.slot not in self._live_slots:
            raise ValueError(f"cache slot {seq.slot} is not allocated (freed twice?)")
        self.truncate(seq, 0)
        self._live_slots.remove(seq.slot)
        self._free_slots.append(seq.slot)

    def block_table(self, seqs: list[SequenceCache]) -> torch.Tensor:
        """[B, max pages] int32 page ids, rows padded with 0."""
        width = max(1, max(len(s.pages) for s in seqs))
        rows = [s.pages + [0] * (width - len(s.pages)) for s in seqs]
        return torch.tensor(rows, dtype=torch.int32, device=self.device)

    def _pages_needed(self, seq: SequenceCache, total_tokens: int) -> int:
        return max(0, math.ceil(total_tokens / self.page_size) - len(seq.pages))

    # -- GDN state --------------------------------------------------------------------------

    def snapshot(self, slot: int) -> StateSnapshot:
        return self.cache.state.snapshot(slot)

    def restore(self, slot: int, snap: StateSnapshot) -> None:
        self.cache.state.restore(slot, snap)

    def copy_state(self, src: int, dst: int) -> None:
        self.cache.state.copy(src, dst)

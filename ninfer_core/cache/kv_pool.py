"""Paged key/value storage for the full-attention layers.

Per attention layer: k and v [num_pages, page_size, num_kv_heads, head_dim] in the model dtype.
Pages are handed out by `CacheManager`; a sequence's pages are listed in its block-table row.
"""

from __future__ import annotations

import torch


class KVPool:
    def __init__(
        self,
        layers: list[int],
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.layers = list(layers)
        self.num_pages = num_pages
        self.page_size = page_size
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k = {i: torch.zeros(shape, dtype=dtype, device=device) for i in self.layers}
        self.v = {i: torch.zeros(shape, dtype=dtype, device=device) for i in self.layers}
        self.bytes_per_token = 2 * len(self.layers) * num_kv_heads * head_dim * dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.bytes_per_token * self.num_pages * self.page_size

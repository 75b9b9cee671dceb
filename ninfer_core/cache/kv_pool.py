"""Paged key/value storage for the full-attention layers.

Per attention layer: k and v [num_pages, page_size, num_kv_heads, head_dim]; a sequence's pages
are listed in its block-table row (pages are handed out by `CacheManager`). The element type is
the KV dtype: the model's float dtype, or "fp8" (float8_e4m3fn) / "int8", which halve the bytes a
decode step reads at long context. Those two keep one fp32 scale per (token, kv head) in k_scale /
v_scale [num_pages, page_size, num_kv_heads]: value = stored * scale, scale = absmax / 448 (fp8)
or absmax / 127 (int8) over the head's head_dim values, 1 for an all-zero vector
(`ops.attention.quantize_kv`). A per-token scale is set once when the token is written, so pages
never need rescaling and truncation stays pure bookkeeping.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..config import ModelConfig
from ..errors import NinferError
from .sizes import SCALE_BYTES, kv_token_bytes

QUANTIZED = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
FLOAT_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SCALE_DTYPE = torch.float32
assert SCALE_DTYPE.itemsize == SCALE_BYTES


@dataclass(frozen=True)
class KVLayer:
    """One attention layer's pages: what `ops.attention` reads and writes."""

    k: torch.Tensor  # [num_pages, page_size, kv_heads, head_dim]
    v: torch.Tensor
    k_scale: torch.Tensor | None = None  # [num_pages, page_size, kv_heads] fp32; fp8 / int8 only
    v_scale: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def page_size(self) -> int:
        return self.k.shape[1]


def resolve_kv_dtype(kv_dtype: str | torch.dtype | None, model_dtype: torch.dtype) -> torch.dtype | str:
    """A float dtype, "fp8" or "int8" from a name ("auto" / None: the model dtype)."""
    if kv_dtype is None or kv_dtype == "auto":
        return model_dtype
    if isinstance(kv_dtype, torch.dtype):
        if not kv_dtype.is_floating_point or kv_dtype.itemsize < 2:
            raise NinferError(f"KV dtype {kv_dtype} is not a float dtype (use 'fp8' or 'int8' for 1-byte caches)")
        return kv_dtype
    if kv_dtype in QUANTIZED:
        return kv_dtype
    if kv_dtype in FLOAT_NAMES:
        return FLOAT_NAMES[kv_dtype]
    raise NinferError(f"unknown KV dtype '{kv_dtype}' (choose from: auto, {', '.join([*FLOAT_NAMES, *QUANTIZED])})")


def engine_kv_dtype(requested: str, device: torch.device, model_dtype: torch.dtype) -> str:
    """The KV cache an engine makes. `auto`: the model dtype, except that an fp32 model on the CPU gets
    fp16, as llama.cpp does: the CPU kernels round k / v into it and widen them out, and a decode step
    reads half of fp32's KV bytes (SmolLM2 at 2,048 tokens, 1 thread: 38.9 -> 44.1 tok/s) for 2.4e-7
    nats a token of KL (bf16: 1.3e-5; docs/performance.md). `--kv-dtype fp32` keeps the exact cache."""
    if requested == "auto" and device.type == "cpu" and model_dtype == torch.float32:
        return "fp16"
    return requested


def kv_dtype_name(kv_dtype: torch.dtype | str) -> str:
    if isinstance(kv_dtype, str):
        return kv_dtype
    return next((name for name, dt in FLOAT_NAMES.items() if dt == kv_dtype), str(kv_dtype).removeprefix("torch."))


def _token_bytes(num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype | str) -> int:
    """k + v of one token in one layer, scales included (sizes.kv_token_bytes for a resolved dtype)."""
    storage = QUANTIZED[kv_dtype] if isinstance(kv_dtype, str) else kv_dtype
    return kv_token_bytes(num_kv_heads, head_dim, storage.itemsize, scaled=isinstance(kv_dtype, str))


def kv_bytes_per_token(config: ModelConfig, kv_dtype: str | torch.dtype | None, model_dtype: torch.dtype) -> int:
    """KV bytes of one token over every attention layer (before allocating a pool)."""
    kind = resolve_kv_dtype(kv_dtype, model_dtype)
    return len(config.full_attention_layers) * _token_bytes(config.num_kv_heads, config.head_dim, kind)


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Zeros that take memory only where written, on the CPU.

    A CPU pool sized for max_context x sequences (3 GB of fp32 KV for SmolLM2 serving 8 x 8192
    tokens) would otherwise be resident from the start. numpy's zeros come from calloc, which for
    large blocks maps fresh pages the OS zero-fills on first touch, and pages are handed out low ids
    first, so the memory in use follows the longest load seen, not the capacity. GPU pools are
    plain torch.zeros (the GPU has no such pages)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    raw = np.zeros(math.prod(shape) * dtype.itemsize, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)


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
        kv_dtype: str | torch.dtype | None = None,
    ):
        """`dtype` is the model's; `kv_dtype` (None: the model's) what the pages store."""
        kind = resolve_kv_dtype(kv_dtype, dtype)
        self.layers = list(layers)
        self.num_pages = num_pages
        self.page_size = page_size
        self.dtype_name = kv_dtype_name(kind)
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        storage = QUANTIZED[kind] if isinstance(kind, str) else kind
        self.k = {i: lazy_zeros(shape, storage, device) for i in self.layers}
        self.v = {i: lazy_zeros(shape, storage, device) for i in self.layers}
        self.k_scale: dict[int, torch.Tensor] = {}
        self.v_scale: dict[int, torch.Tensor] = {}
        if isinstance(kind, str):
            self.k_scale = {i: torch.ones(shape[:3], dtype=SCALE_DTYPE, device=device) for i in self.layers}
            self.v_scale = {i: torch.ones(shape[:3], dtype=SCALE_DTYPE, device=device) for i in self.layers}
        self.bytes_per_token = len(self.layers) * _token_bytes(num_kv_heads, head_dim, kind)

    def copy_page(self, src: int, dst: int) -> None:
        """Page dst := page src in every layer (a prefix hit's partial page)."""
        for pages in (self.k, self.v, self.k_scale, self.v_scale):
            for t in pages.values():
                t[dst].copy_(t[src])

    def layer(self, i: int) -> KVLayer:
        return KVLayer(self.k[i], self.v[i], self.k_scale.get(i), self.v_scale.get(i))

    @property
    def nbytes(self) -> int:
        return self.bytes_per_token * self.num_pages * self.page_size

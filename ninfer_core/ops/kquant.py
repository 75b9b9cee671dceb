"""GGUF K-quant weights (Q4_K, Q5_K, Q6_K; Q8_0, Q4_0, Q4_1 alike) kept as the file's blocks on the CPU: the weight,
its linear and embedding modules, the ops and their torch references.

A weight is its packed bytes (weights/kquant_layout.py; csrc/cpu/kquant.h describes the layout) and
its parts: the block type and rows of each tensor stacked along the output rows (a merged q|k|v of
a Q4_K_M file holds Q4_K q and k and a Q6_K v). Resident bytes are the file's (plus zero rows that
round each part up to 16). `kquant_linear` is the one place that picks how it multiplies:
  decode (up to CPU_GEMV_ROWS rows) with NINFER_CPU_MATH bf16 (the default) or int8: the CPU
      kernels, x quantized to int8 per 32 inputs (`kquant_linear_a8_ref`; per 256 as llama.cpp's
      q8_K cost Qwen2.5-1.5B 18x the KL for no measurable speed, docs/performance.md);
  prefill, or NINFER_CPU_MATH=exact: a GEMM over tiles dequantized to bf16 / fp32
      (ops/quant.py cpu_tiled_linear), the fp32 values gguf-py's dequantization gives;
  without the CPU extension, or off the CPU: `kquant_linear_ref`, fp32 x @ dequantize_ref(w).T.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from gguf.quants import dequantize as gguf_dequantize
from torch import nn

from ..weights.kquant_layout import BLOCK_TYPES, PACK_ROWS, SUPER_BLOCK, packed_bytes, unpack_packs
from . import dispatch
from .quant import CPU_GEMV_ROWS, cpu_tiled_linear, quantize_activations_ref

MAX_PARTS = 8  # csrc/cpu/kquant.h kMaxParts: a merged projection of more runs its parts mapped


@dataclass(frozen=True)
class KQuantFormat:
    """A K-quant weight's layout before its bytes exist: (block type, rows) of each part."""

    parts: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        if not 0 < len(self.parts) <= MAX_PARTS or any(block not in BLOCK_TYPES or rows <= 0 for block, rows in self.parts):
            raise ValueError(f"K-quant parts must be 1 to {MAX_PARTS} (one of {sorted(BLOCK_TYPES)}, rows > 0), "
                             f"got {self.parts}")

    @property
    def rows(self) -> int:
        return sum(rows for _, rows in self.parts)

    def nbytes(self, in_features: int) -> int:
        return sum(packed_bytes(block, rows, in_features) for block, rows in self.parts)


@dataclass
class KQuantWeight:
    """An [N, K] weight as packed K-quant blocks (`blocks`, flat uint8) of `parts`."""

    blocks: torch.Tensor
    parts: tuple[tuple[str, int], ...]
    in_features: int

    def __post_init__(self) -> None:
        fmt = KQuantFormat(tuple(self.parts))
        if self.in_features <= 0 or self.in_features % SUPER_BLOCK:
            raise ValueError(f"K-quant weights need in_features a multiple of {SUPER_BLOCK}, got {self.in_features}")
        if self.blocks.dtype != torch.uint8 or self.blocks.shape != (fmt.nbytes(self.in_features),):
            raise ValueError(f"K-quant blocks must be uint8 [{fmt.nbytes(self.in_features)}], got "
                             f"{self.blocks.dtype} {tuple(self.blocks.shape)}")

    @property
    def format(self) -> KQuantFormat:
        return KQuantFormat(tuple(self.parts))

    @functools.cached_property
    def out_features(self) -> int:
        """Cached: a decode step asks every weight several times (~5 us each through its format)."""
        return self.format.rows

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    @functools.cached_property
    def cpu_plan(self) -> tuple | None:
        """The CPU kernels' weight arguments (csrc/cpu/bindings.cpp), None where they cannot run it."""
        if not (self.blocks.device.type == "cpu" and self.blocks.is_contiguous()):
            return None
        return (self.blocks.data_ptr(), self.in_features, tuple(int(BLOCK_TYPES[b][0]) for b, _ in self.parts),
                tuple(rows for _, rows in self.parts))


@dataclass
class KQuantExperts:
    """E experts' [N, K] weights as K-quant blocks ([E, bytes] uint8), each expert's rows packed on
    their own like a KQuantWeight of `parts` (a GGUF's routed experts: its ffn_gate_exps and
    ffn_up_exps are the two parts of gate_up)."""

    blocks: torch.Tensor
    parts: tuple[tuple[str, int], ...]
    in_features: int

    def __post_init__(self) -> None:
        nbytes = KQuantFormat(tuple(self.parts)).nbytes(self.in_features)
        if self.blocks.dtype != torch.uint8 or self.blocks.dim() != 2 or self.blocks.shape[1] != nbytes:
            raise ValueError(f"K-quant expert blocks must be uint8 [E, {nbytes}], got {self.blocks.dtype} "
                             f"{tuple(self.blocks.shape)}")

    @property
    def out_features(self) -> int:
        return KQuantFormat(tuple(self.parts)).rows

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.blocks.shape[0], self.out_features, self.in_features)

    @functools.cached_property
    def experts(self) -> tuple[KQuantWeight, ...]:
        """Each expert's weight, a view of its blocks (its CPU plan made once)."""
        return tuple(KQuantWeight(self.blocks[e], self.parts, self.in_features) for e in range(self.blocks.shape[0]))


def kquant_linear(x: torch.Tensor, w: KQuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) -> [..., N] in x's dtype (the module docstring says which math)."""
    if x.dim() == 0 or x.shape[-1] != w.in_features:
        raise ValueError(f"kquant_linear: input shape {tuple(x.shape)} does not end in in_features {w.in_features}")
    if x.device.type == "cpu" and w.cpu_plan is not None and dispatch.cpu_kernels_available():
        x2 = x.reshape(-1, w.in_features)
        if x2.shape[0] <= CPU_GEMV_ROWS and dispatch.cpu_math() != "exact":
            out = _cpu_matmul(x2, w, bias)
        else:
            def dequantize_tile(out: int, first: int, count: int, bf16: bool) -> None:
                dispatch.cpu_extension().kquant_dequantize(out, first, count, bf16, 1, *w.cpu_plan)

            out = cpu_tiled_linear(x2, w.out_features, dequantize_tile, bias)
        out = out.view(*x.shape[:-1], w.out_features)
        return out if out.dtype == x.dtype else out.to(x.dtype)
    return kquant_linear_ref(x, w, bias)


def _cpu_matmul(x: torch.Tensor, w: KQuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """The CPU decode kernel: fp32 [M, N] = x [M, K] (quantized per 32 inputs) @ W^T (+ bias)."""
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.float().contiguous()
    if bias is not None:
        bias = bias.float().contiguous()
    out = torch.empty(x.shape[0], w.out_features)
    dispatch.cpu_extension().kquant_matmul(out.data_ptr(), x.data_ptr(), 0 if bias is None else bias.data_ptr(),
                                           x.shape[0], dispatch.cpu_threads(), *w.cpu_plan)
    return out


def dequantize_ref(w: KQuantWeight, dtype: torch.dtype, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The dense weight [N, K], or its rows `rows` [..., K], as gguf-py dequantizes the file's blocks
    (fp32 values), rounded once to dtype."""
    k = w.in_features
    data = w.blocks.cpu().numpy()
    ids = None if rows is None else rows.cpu().numpy().reshape(-1)
    out = np.empty((w.out_features if ids is None else len(ids), k), dtype=np.float32)
    row0 = offset = 0
    for block, count in w.parts:
        part = data[offset : offset + packed_bytes(block, count, k)]
        if ids is None:
            file_rows = unpack_packs(part, block, k)[:count]
            mine = slice(row0, row0 + count)
        else:
            mine = (ids >= row0) & (ids < row0 + count)
            local = ids[mine] - row0
            packs = part.reshape(-1, packed_bytes(block, PACK_ROWS, k))[local // PACK_ROWS]
            # none of this part's rows: nothing to unpack (an empty unpack fails for some types)
            file_rows = packs[:0] if not len(local) else unpack_packs(packs, block, k).reshape(
                len(local), PACK_ROWS, -1)[np.arange(len(local)), local % PACK_ROWS]
        if len(file_rows):
            out[mine] = gguf_dequantize(file_rows, BLOCK_TYPES[block][0]).reshape(-1, k)
        row0 += count
        offset += packed_bytes(block, count, k)
    dense = torch.from_numpy(out).to(dtype)
    return dense if rows is None else dense.view(*rows.shape, k)


def kquant_linear_ref(x: torch.Tensor, w: KQuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) -> [..., N] in x's dtype: fp32 weights as gguf-py gives them, fp32 sums."""
    out = x.float() @ dequantize_ref(w, torch.float32).to(x.device).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def kquant_linear_a8_ref(x: torch.Tensor, w: KQuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of the CPU decode kernel, in float64 -> [..., N]: x quantized per 32 inputs
    (ops/quant.py quantize_activations_ref) times the weights. The kernel sums the integer products
    exactly and applies d, dmin and the activation scales in fp32; the weights here are gguf-py's
    fp32 values, within 2^-24 of the exact ones."""
    codes, scales = quantize_activations_ref(x)
    xq = (codes.double().unflatten(-1, (-1, 32)) * scales.double()[..., None]).flatten(-2)
    out = xq @ dequantize_ref(w, torch.float64).T
    return out if bias is None else out + bias.double()


class _KQuantBuffers(nn.Module):
    """A module over one K-quant weight: `blocks` is a buffer (state_dict holds the packed bytes)."""

    def __init__(self, w: KQuantWeight) -> None:
        super().__init__()
        self.parts, self.in_features = tuple(w.parts), w.in_features
        self.register_buffer("blocks", w.blocks)

    @property
    def quantized(self) -> KQuantWeight:
        """The weight over this module's buffer (no copy), made again only when the buffer was
        replaced (`to`, `to_empty`): it caches the CPU kernels' arguments. The buffer is read from
        `_buffers` (as _QuantizedBuffers.quantized does: nn.Module.__getattr__ is ~1 us a name)."""
        cached, blocks = self.__dict__.get("_quantized"), self._buffers["blocks"]
        if cached is None or cached.blocks is not blocks:
            cached = self.__dict__["_quantized"] = KQuantWeight(blocks, self.parts, self.in_features)
        return cached

    def _format_repr(self) -> str:
        return ", ".join(f"{block} x {rows}" for block, rows in self.parts)


class KQuantLinear(_KQuantBuffers):
    """nn.Linear with a K-quant weight."""

    def __init__(self, w: KQuantWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__(w)
        self.out_features = w.out_features
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def empty(cls, in_features: int, fmt: KQuantFormat, bias: bool, device: torch.device | str | None,
              dtype: torch.dtype) -> KQuantLinear:
        """Uninitialised bytes of `fmt`, for a fill (`dtype`: the bias's, the model dtype)."""
        blocks = torch.empty(fmt.nbytes(in_features), dtype=torch.uint8, device=device)
        return cls(KQuantWeight(blocks, fmt.parts, in_features),
                   torch.empty(fmt.rows, dtype=dtype, device=device) if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kquant_linear(x, self.quantized, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self._format_repr()}, "
                f"bias={self.bias is not None}")


class KQuantEmbedding(_KQuantBuffers):
    """nn.Embedding over a K-quant table: a lookup dequantizes only the rows it reads. A tied
    lm_head is a KQuantLinear over the same buffer (`tied_head`)."""

    def __init__(self, w: KQuantWeight, dtype: torch.dtype) -> None:
        super().__init__(w)
        self.num_embeddings, self.embedding_dim = w.out_features, w.in_features
        self.dtype = dtype  # of the embeddings returned

    @classmethod
    def empty(cls, fmt: KQuantFormat, embedding_dim: int, device: torch.device | str | None,
              dtype: torch.dtype) -> KQuantEmbedding:
        blocks = torch.empty(fmt.nbytes(embedding_dim), dtype=torch.uint8, device=device)
        return cls(KQuantWeight(blocks, fmt.parts, embedding_dim), dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of `ids`: by the CPU kernel one row a call where it applies (gguf-py's values too;
        a decode step's lookup through gguf-py's numpy took ~0.4 ms), else gguf-py's dequantization."""
        w = self.quantized
        rows = ids.reshape(-1).tolist() if ids.device.type == "cpu" else []
        if rows and not 0 <= min(rows) <= max(rows) < w.out_features:
            raise IndexError(f"token ids {min(rows)}..{max(rows)} are outside the embedding's {w.out_features} rows")
        if not (rows and w.cpu_plan is not None and dispatch.cpu_kernels_available()):
            return dequantize_ref(w, self.dtype, ids).to(ids.device)
        out = torch.empty(len(rows), w.in_features)
        dequantize_row, stride = dispatch.cpu_extension().kquant_dequantize, w.in_features * out.element_size()
        for i, row in enumerate(rows):
            dequantize_row(out.data_ptr() + i * stride, row, 1, False, 1, *w.cpu_plan)
        return out.view(*ids.shape, w.in_features).to(self.dtype)

    def tied_head(self) -> KQuantLinear:
        """lm_head = the embedding table: a KQuantLinear sharing this module's buffer."""
        return KQuantLinear(self.quantized)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self._format_repr()}"

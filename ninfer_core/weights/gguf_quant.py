"""GGUF quantized tensors -> our quantized formats (ops/quant.py) without a second quantization.

Q4_K, Q5_K, Q6_K, Q8_0, Q4_0 and Q4_1 matrices whose rows are whole 256-input spans are kept as the
file's blocks instead (ops/kquant.py), unless a merged projection stacks one with a part of another
type: then this mapping serves them too.

llama.cpp's blocks are affine per group (w = d * q (- m)), which is our format: the codes stay
llama.cpp's codes and the per-group scale / minimum become our scales / offsets (fp16):
  Q4_0  int4 g32  scale d, offset implied (-8 d)          exact
  Q4_1  int4 g32  scale d, offset m                       exact
  Q5_0  int8 g32  code q - 16, scale d                    exact
  Q5_1  int8 g32  code q, scale d, offset m               exact
  Q8_0  int8 g32  scale d                                 exact
  Q4_K  int4 g32  scale d * sc, offset -dmin * m          products rounded once to fp16
  Q5_K  int8 g32  code q, scale d * sc, offset -dmin * m  products rounded once to fp16
  Q6_K  int8 g16  code q - 32, scale d * sc               products rounded once to fp16
The K-quants' two-level scales (an fp16 per 256 values times a 6 / 8-bit one per group) are not
exact in one fp16: rounding costs at most 2^-12 of the scale, under 1% of a quantization step
(fp32 would make them exact but cost 2 bits per weight: past 1.3x the file for a Q4_K_M model).
Other types (Q2_K, Q3_K, the IQ family) are not mapped; the loader re-quantizes their values.

The block layouts are llama.cpp's (ggml-common.h), unpacked with numpy as gguf-py's
`dequantize_blocks` unpacks them (whose float output would cost four bytes a value to hold and
several times longer to make): tests compare every type with gguf-py's dequantization.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import Q4_K

from ..ops.quant import QuantFormat, QuantizedWeight

_VALUES_PER_CHUNK = 1 << 22  # values dequantized at once: bounds the float32 scratch (16 MB a copy)


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte `at` of every block, as float32 [blocks, 1]."""
    return np.ascontiguousarray(blocks[:, at : at + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes [..., n] -> values [..., 2n]: the n low nibbles, then the n high ones (ggml's order)."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=-1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1: 4 bytes -> 32 bits, value j's high bit in bit j (little-endian)."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: (d * sc, -(dmin * m)) per sub-block of 32, fp32 [blocks, 8]."""
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
    return _f16(blocks, 0) * sc.astype(np.float32), -(_f16(blocks, 2) * m.astype(np.float32))


# Per type: blocks [n, bytes] -> (codes [n, values] in value order, scales, offsets or None), the
# scales / offsets fp32 [n, groups per block].
def _q4_0(b):
    return _nibbles(b[:, 2:18]), _f16(b, 0), None


def _q4_1(b):
    return _nibbles(b[:, 4:20]), _f16(b, 0), _f16(b, 2)


def _q5_0(b):
    return (_nibbles(b[:, 6:22]) | (_fifth_bits(b[:, 2:6]) << 4)).view(np.int8) - np.int8(16), _f16(b, 0), None


def _q5_1(b):
    return (_nibbles(b[:, 8:24]) | (_fifth_bits(b[:, 4:8]) << 4)).view(np.int8), _f16(b, 0), _f16(b, 2)


def _q8_0(b):
    return b[:, 2:34].view(np.int8), _f16(b, 0), None


def _q4_k(b):
    return _nibbles(b[:, 16:144].reshape(-1, 4, 32)).reshape(len(b), -1), *_k_scales(b)


def _q5_k(b):
    low = _nibbles(b[:, 48:176].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    high = (b[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    return (low | (high << 4)).reshape(len(b), -1).view(np.int8), *_k_scales(b)


def _q6_k(b):
    low = _nibbles(b[:, 0:128].reshape(-1, 2, 64))
    high = (b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3
    codes = (low | (high.reshape(-1, 2, 128) << 4)).view(np.int8) - np.int8(32)
    return codes.reshape(len(b), -1), _f16(b, 208) * b[:, 192:208].view(np.int8).astype(np.float32), None


# type -> (our kind, values per scale, unpacker)
_TYPES = {
    Q.Q4_0: ("int4", 32, _q4_0),
    Q.Q4_1: ("int4", 32, _q4_1),
    Q.Q5_0: ("int8", 32, _q5_0),
    Q.Q5_1: ("int8", 32, _q5_1),
    Q.Q8_0: ("int8", 32, _q8_0),
    Q.Q4_K: ("int4", 32, _q4_k),
    Q.Q5_K: ("int8", 32, _q5_k),
    Q.Q6_K: ("int8", 16, _q6_k),
}
_OFFSETS = {Q.Q4_1, Q.Q5_1, Q.Q4_K, Q.Q5_K}


def gguf_format(qtype: Q) -> QuantFormat | None:
    """Our format for a GGUF block type, None when it has no exact mapping."""
    if qtype not in _TYPES:
        return None
    kind, group, _ = _TYPES[qtype]
    return QuantFormat(kind, group, torch.float16, offsets=qtype in _OFFSETS)


def gguf_quantized(data: np.ndarray, qtype: Q, rows: int, cols: int) -> QuantizedWeight:
    """The [rows, cols] tensor whose raw blocks are `data` (GGUFReader's uint8 view) in our format,
    converted a chunk of blocks at a time (the scratch stays small)."""
    kind, group, unpack = _TYPES[qtype]
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = data.reshape(-1, type_size)
    int4 = kind == "int4"
    codes = np.empty((len(blocks), block_size // (2 if int4 else 1)), dtype=np.uint8 if int4 else np.int8)
    scales = np.empty((len(blocks), block_size // group), dtype=np.float16)
    offsets = np.empty_like(scales) if qtype in _OFFSETS else None
    step = max(1, _VALUES_PER_CHUNK // block_size)
    for first in range(0, len(blocks), step):
        rows_of = slice(first, first + step)
        values, scale, offset = unpack(blocks[rows_of])
        codes[rows_of] = values[:, 0::2] | (values[:, 1::2] << 4) if int4 else values
        scales[rows_of] = scale  # fp32 -> fp16: the K-quants' one rounding
        if offsets is not None:
            offsets[rows_of] = offset
    shape = (rows, cols // group)
    return QuantizedWeight(
        kind,
        torch.from_numpy(codes.reshape(rows, -1)),
        torch.from_numpy(scales.reshape(shape)),
        group,
        None if offsets is None else torch.from_numpy(offsets.reshape(shape)),
    )

"""The packed layout of GGUF K-quant blocks kept native on the CPU (csrc/cpu/kquant.h describes it):
the file's Q4_K / Q5_K / Q6_K (and Q8_0 / Q4_0 / Q4_1, eight blocks to a 256-input "super-block") bytes
reordered 16 rows at a time, losslessly, and back.

`pack_rows` makes it at load (numpy, a few passes over the tensor); `unpack_packs` is its inverse,
for the torch references (ops/kquant.py) and the embedding lookup. Only Q4_K's and Q5_K's 12 bytes
of six-bit scales and minimums are re-encoded (as Q6_K packs its codes, so one routine decodes
both); every other byte is moved, not changed (Q8_0's codes are stored xor 0x80, an exact recoding).
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import Q4_K

PACK_ROWS = 16
SUPER_BLOCK = 256
# block type -> (ggml type, bytes of one row's super-block); the names are the file's types
BLOCK_TYPES = {"q4_k": (Q.Q4_K, 144), "q5_k": (Q.Q5_K, 176), "q6_k": (Q.Q6_K, 210), "q8_0": (Q.Q8_0, 8 * 34),
               "q4_0": (Q.Q4_0, 8 * 18), "q4_1": (Q.Q4_1, 8 * 20)}


def _bytes_of_blocks(size: int, start: int, count: int) -> np.ndarray:
    """Where bytes start .. start + count of each of a super-block's 8 blocks (of `size` bytes) lie."""
    return (size * np.arange(8)[:, None] + start + np.arange(count)).reshape(-1)


# The 32-input blocks, 8 to a super-block: (the fp16 fields' places, the codes' places); packed as
# each fp16 field [8][16], then the codes in words of 4 bytes, [word][16][4]
_BLOCKS_OF_32 = {
    "q8_0": ([_bytes_of_blocks(34, 0, 2)], _bytes_of_blocks(34, 2, 32)),  # d, codes (int8)
    "q4_0": ([_bytes_of_blocks(18, 0, 2)], _bytes_of_blocks(18, 2, 16)),  # d, nibbles
    "q4_1": ([_bytes_of_blocks(20, 0, 2), _bytes_of_blocks(20, 2, 2)], _bytes_of_blocks(20, 4, 16)),  # d, m
}


def block_type(qtype: Q) -> str | None:
    """Our name of a GGUF type the native kernels run (None: the type has none)."""
    return next((name for name, (q, _) in BLOCK_TYPES.items() if q == qtype), None)


def packed_bytes(block: str, rows: int, cols: int) -> int:
    """Bytes of `rows` x `cols` weights of `block` once packed (rows rounded up to whole packs)."""
    return -(-rows // PACK_ROWS) * PACK_ROWS * (cols // SUPER_BLOCK) * BLOCK_TYPES[block][1]


def pack_rows(rows: np.ndarray, block: str) -> np.ndarray:
    """File blocks [rows, cols / 256 * bytes] (uint8) -> the packed bytes (flat uint8)."""
    size = BLOCK_TYPES[block][1]
    n, row_bytes = rows.shape
    blocks = row_bytes // size
    padded = np.zeros((-(-n // PACK_ROWS) * PACK_ROWS, blocks, size), dtype=np.uint8)
    padded[:n] = rows.reshape(n, blocks, size)
    by_pack = padded.reshape(-1, PACK_ROWS, blocks, size).swapaxes(1, 2)  # [pack, block, row, bytes]
    packs = by_pack.shape[0]
    if block in ("q4_k", "q5_k"):  # Q5_K: Q4_K's fields with qh (32 bytes) before qs
        sc, m = Q4_K.get_scale_min(np.ascontiguousarray(by_pack[..., 4:16]).reshape(-1, 12))
        six = np.concatenate([v.reshape(packs, blocks, PACK_ROWS, 8).swapaxes(2, 3) for v in (sc, m)], axis=2)
        at = 48 if block == "q5_k" else 16
        qs = by_pack[..., at : at + 128].reshape(packs, blocks, PACK_ROWS, 4, 8, 4).transpose(0, 1, 3, 4, 2, 5)
        qh = [by_pack[..., 16:48].reshape(packs, blocks, PACK_ROWS, 8, 4).swapaxes(2, 3)] if block == "q5_k" else []
        parts = [by_pack[..., 0:2], by_pack[..., 2:4], _pack_six_bits(six.reshape(packs, blocks, 256)), *qh, qs]
    elif block in _BLOCKS_OF_32:
        fields, at = _BLOCKS_OF_32[block]
        scales = [by_pack[..., f].reshape(packs, blocks, PACK_ROWS, 8, 2).swapaxes(2, 3) for f in fields]  # [.., j, row, 2]
        codes = by_pack[..., at] ^ (0x80 if block == "q8_0" else 0)
        parts = [*scales, codes.reshape(packs, blocks, PACK_ROWS, -1, 4).swapaxes(2, 3)]  # [.., word, row, 4]
    else:
        ql = by_pack[..., 0:128].reshape(packs, blocks, PACK_ROWS, 2, 2, 8, 4)  # [.., row, h, a|b, c, 4]
        qh = by_pack[..., 128:192].reshape(packs, blocks, PACK_ROWS, 2, 1, 8, 4)
        steps = np.concatenate((ql, qh), axis=4).transpose(0, 1, 3, 5, 4, 2, 6)  # [.., h, c, a|b|qh, row, 4]
        parts = [by_pack[..., 208:210], by_pack[..., 192:208].swapaxes(2, 3), steps]
    return np.concatenate([p.reshape(packs, blocks, -1) for p in parts], axis=2).reshape(-1)


def unpack_packs(packed: np.ndarray, block: str, cols: int) -> np.ndarray:
    """Packed bytes (whole packs) -> the file blocks [packs * 16, cols / 256 * bytes], padding rows
    included: the inverse of `pack_rows`."""
    size = BLOCK_TYPES[block][1]
    blocks = cols // SUPER_BLOCK
    data = packed.reshape(-1, blocks, PACK_ROWS * size)
    packs = data.shape[0]
    out = np.empty((packs, PACK_ROWS, blocks, size), dtype=np.uint8)
    by_pack = out.swapaxes(1, 2)  # [pack, block, row, bytes], a view of out
    if block in ("q4_k", "q5_k"):
        by_pack[..., 0:2] = data[..., 0:32].reshape(packs, blocks, PACK_ROWS, 2)
        by_pack[..., 2:4] = data[..., 32:64].reshape(packs, blocks, PACK_ROWS, 2)
        six = _unpack_six_bits(data[..., 64:256]).reshape(packs, blocks, 2, 8, PACK_ROWS).transpose(0, 1, 4, 2, 3)
        by_pack[..., 4:16] = _k_scale_bytes(six[..., 0, :], six[..., 1, :])
        at, qs_start = (48, 768) if block == "q5_k" else (16, 256)
        if block == "q5_k":
            qh = data[..., 256:768].reshape(packs, blocks, 8, PACK_ROWS, 4).swapaxes(2, 3)
            by_pack[..., 16:48] = qh.reshape(packs, blocks, PACK_ROWS, 32)
        qs = data[..., qs_start:].reshape(packs, blocks, 4, 8, PACK_ROWS, 4).transpose(0, 1, 4, 2, 3, 5)
        by_pack[..., at : at + 128] = qs.reshape(packs, blocks, PACK_ROWS, 128)
    elif block in _BLOCKS_OF_32:
        fields, at = _BLOCKS_OF_32[block]
        for i, f in enumerate(fields):
            by_pack[..., f] = data[..., 256 * i : 256 * (i + 1)].reshape(packs, blocks, 8, PACK_ROWS, 2).swapaxes(
                2, 3).reshape(packs, blocks, PACK_ROWS, 16)
        codes = data[..., 256 * len(fields) :].reshape(packs, blocks, -1, PACK_ROWS, 4).swapaxes(2, 3)
        by_pack[..., at] = codes.reshape(packs, blocks, PACK_ROWS, len(at)) ^ (0x80 if block == "q8_0" else 0)
    else:
        by_pack[..., 208:210] = data[..., 0:32].reshape(packs, blocks, PACK_ROWS, 2)
        by_pack[..., 192:208] = data[..., 32:288].reshape(packs, blocks, 16, PACK_ROWS).swapaxes(2, 3)
        steps = data[..., 288:].reshape(packs, blocks, 2, 8, 3, PACK_ROWS, 4).transpose(0, 1, 5, 2, 4, 3, 6)
        by_pack[..., 0:128] = steps[..., 0:2, :, :].reshape(packs, blocks, PACK_ROWS, 128)
        by_pack[..., 128:192] = steps[..., 2:3, :, :].reshape(packs, blocks, PACK_ROWS, 64)
    return out.reshape(packs * PACK_ROWS, blocks * size)


def _pack_six_bits(values: np.ndarray) -> np.ndarray:
    """[..., 256] values < 64 -> [..., 192]: low nibbles of v and v + 128 in byte v (v < 128), then
    the high two bits of v, v + 64, v + 128, v + 192 in byte 128 + v (v < 64)."""
    low = (values[..., :128] & 15) | (values[..., 128:] & 15) << 4
    high = values >> 4
    high = high[..., 0:64] | high[..., 64:128] << 2 | high[..., 128:192] << 4 | high[..., 192:256] << 6
    return np.concatenate((low, high), axis=-1).astype(np.uint8)


def _unpack_six_bits(packed: np.ndarray) -> np.ndarray:
    """The inverse of `_pack_six_bits`: [..., 192] -> [..., 256]."""
    low, high = packed[..., :128], packed[..., 128:]
    high_bits = np.concatenate([(high >> shift) & 3 for shift in (0, 2, 4, 6)], axis=-1)
    return np.concatenate((low & 15, low >> 4), axis=-1) | high_bits << 4


def _k_scale_bytes(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """[..., 8] six-bit scales and minimums -> Q4_K's 12 bytes (the inverse of gguf's
    Q4_K.get_scale_min: every one of the 96 bits has one place)."""
    first = sc[..., :4] | (sc[..., 4:] >> 4) << 6
    second = m[..., :4] | (m[..., 4:] >> 4) << 6
    third = (sc[..., 4:] & 15) | (m[..., 4:] & 15) << 4
    return np.concatenate((first, second, third), axis=-1).astype(np.uint8)

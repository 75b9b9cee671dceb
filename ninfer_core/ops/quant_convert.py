"""Exact conversions between quantized formats (ops/quant.py), for a weight whose parts differ.

A merged projection (q|k|v, gate|up: `layers/linear.py`) is one quantized matrix, but a GGUF may
store its parts in different block types (Q4_K_M: q and k in Q4_K, v in Q6_K). `concat_rows`
widens every part to the parts' `common_format` and stacks them along the output rows. Every
step keeps each weight's value:
  int4 -> int8         the nibble becomes the byte (minus 8 where the offset is the implied one);
  group G -> g         (g divides G) each scale and offset repeated G / g times; a per-row scale is
                       a group of K;
  offsets made explicit  the implied ones written out (0 for int8 codes).
Scales keep their dtype: the parts of one weight must share it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .quant import GROUP_SIZES, QuantFormat, QuantizedWeight


def common_format(formats: Sequence[QuantFormat], in_features: int) -> QuantFormat:
    """The narrowest format every one of `formats` converts to exactly (their own when they agree)."""
    if len(set(formats)) == 1:
        return formats[0]
    if len({f.scale_dtype for f in formats}) > 1:
        raise ValueError(f"cannot merge quantized parts with different scale dtypes: {formats}")
    group = math.gcd(*(f.group_size or in_features for f in formats))
    int4 = all(f.kind == "int4" for f in formats) and group in GROUP_SIZES
    offsets = any(f.offsets for f in formats)
    if int4:
        return QuantFormat("int4", group, formats[0].scale_dtype, offsets)
    # an int4 part without offsets becomes int8 codes q - 8 with offset 0
    return QuantFormat("int8", 0 if group == in_features else group, formats[0].scale_dtype, offsets)


def convert(qw: QuantizedWeight, fmt: QuantFormat) -> QuantizedWeight:
    """qw in `fmt` (a format `common_format` would give for it), values unchanged."""
    if qw.scales.dtype != fmt.scale_dtype:
        raise ValueError(f"cannot convert {qw.scales.dtype} scales to {fmt.scale_dtype} exactly")
    codes, offsets = qw.qweight, qw.offsets
    if qw.kind == "int4" and fmt.kind == "int8":
        codes = torch.stack((codes & 15, codes >> 4), dim=-1).flatten(-2).to(torch.int8)
        if offsets is None:
            codes -= 8
    elif qw.kind != fmt.kind:
        raise ValueError(f"cannot convert {qw.kind} to {fmt.kind} exactly")
    scales = _regroup(qw.scales, qw.group_size, fmt.group_size, qw.in_features)
    if offsets is not None:
        offsets = _regroup(offsets, qw.group_size, fmt.group_size, qw.in_features)
    elif fmt.offsets:
        offsets = -8 * scales if fmt.kind == "int4" else torch.zeros_like(scales)
    return QuantizedWeight(fmt.kind, codes, scales, fmt.group_size, offsets)


def concat_rows(parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
    """The parts stacked along their output rows, in their common format."""
    if len(parts) == 1:
        return parts[0]
    fmt = common_format([p.format for p in parts], parts[0].in_features)
    same = [convert(p, fmt) for p in parts]
    rows = same[0].qweight.dim() - 2  # [..., N, K]: the scales and offsets keep the codes' leading dims

    def cat(name: str) -> torch.Tensor:
        return torch.cat([getattr(p, name) for p in same], dim=rows)

    return QuantizedWeight(fmt.kind, cat("qweight"), cat("scales"), fmt.group_size,
                           cat("offsets") if fmt.offsets else None)


def _regroup(values: torch.Tensor, group_size: int, to: int, in_features: int) -> torch.Tensor:
    """Values per group of `group_size` -> per group of `to` (0: one per row, [..., N])."""
    if group_size == 0:
        values = values[..., None]
    ratio = (group_size or in_features) // (to or in_features)
    if (group_size or in_features) % (to or in_features):
        raise ValueError(f"cannot split groups of {group_size or in_features} into groups of {to or in_features}")
    values = values.repeat_interleave(ratio, dim=-1) if ratio > 1 else values
    return values[..., 0] if to == 0 else values

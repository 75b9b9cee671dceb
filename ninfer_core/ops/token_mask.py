"""Grammar token masks on logits: a row's disallowed tokens become -inf, in place.

The mask is xgrammar's packed bitmask: int32 [rows, ceil(V / 32)], bit j of word w set = token
32 * w + j is allowed. Only the listed rows are touched (the unconstrained rows of a batch keep
their logits). The kernel is xgrammar's own (`apply_token_bitmask_inplace`: Triton on CUDA,
C++ on the CPU); the torch reference unpacks the bits and uses `masked_fill`. Both read the mask
from the logits' device.
"""

from __future__ import annotations

import torch

from . import dispatch

_BITS = torch.arange(32, dtype=torch.int32)


def words(vocab: int) -> int:
    """int32 words per row of a mask over `vocab` tokens."""
    return (vocab + 31) // 32


def apply_token_mask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Reference: unpack the rows' bits, -inf where a bit is clear."""
    if not rows:
        return
    vocab = logits.shape[-1]
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    packed = bitmask.index_select(0, index)
    allowed = ((packed.unsqueeze(-1) >> _BITS.to(packed.device)) & 1).bool().flatten(1)[:, :vocab]
    logits[index] = logits.index_select(0, index).masked_fill(~allowed, -torch.inf)


def apply_token_mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Mask `rows` of logits [R, V] (float32, on the bitmask's device) with bitmask [R, words(V)]."""
    if not rows:
        return
    if dispatch.kernels_disabled() or not logits.is_contiguous() or logits.dtype != torch.float32:
        dispatch.fallback("token_mask", logits)
        apply_token_mask_ref(logits, bitmask, rows)
        return
    import xgrammar  # only constrained requests get here: xgrammar is loaded with their grammar

    xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)

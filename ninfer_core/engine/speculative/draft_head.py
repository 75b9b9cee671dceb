"""The lm_head the drafters read: an int4 copy of the target's int8 one.

A draft step's lm_head reads the whole vocabulary's weights (35B-A3B: 248,320 x 2,048, 508 MB as
int8: about half of an MTP step's time on the H100), and a K = 3 MTP round runs it three times (the
catch-up's last entry, then two chain steps; a DFlash round once, over its block's rows). Drafts
only propose tokens the target then verifies with its own lm_head, so coarser draft logits cost at
most some acceptance, never output: greedy rounds keep the target's argmax, sampled ones stay exact
(rejection sampling against the draft distribution they were drawn from). An int4 copy (group 128)
halves those bytes, for its memory (254 MB for the 35B, 636 MB for the 27B), made with the
drafter's weights (`load_draft_weights`), before the cache is sized.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ...models.quantize import int4_group
from ...ops.quant import QuantizedWeight, QuantLinear, dequantize, quantize

log = logging.getLogger(__name__)

ROWS_PER_PASS = 16384  # rows dequantized at a time: the fp32 copy of 16K x 5,120 is 320 MB


def draft_lm_head(lm_head: nn.Module) -> nn.Module:
    """An int4 QuantLinear over lm_head's weight where lm_head is an int8 QuantLinear (no offsets) whose
    width int4 groups divide; else lm_head itself. Quantized from the int8 weight (the full-precision
    one is gone once the model loaded), ROWS_PER_PASS rows at a time, bit for bit the whole weight's
    int4 quantization (both are per row)."""
    if not isinstance(lm_head, QuantLinear) or lm_head.kind != "int8" or lm_head.offsets is not None:
        return lm_head
    group = int4_group(lm_head.in_features)
    if group is None:
        return lm_head
    source = lm_head.quantized
    parts = [
        quantize(dequantize(QuantizedWeight("int8", source.qweight[start:start + ROWS_PER_PASS],
                                            source.scales[start:start + ROWS_PER_PASS], 0), torch.float32),
                 "int4", group)
        for start in range(0, lm_head.out_features, ROWS_PER_PASS)
    ]
    weight = QuantizedWeight("int4", torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]), group)
    head = QuantLinear(weight, None if lm_head.bias is None else lm_head.bias.detach())
    log.info("drafts read an int4 copy of lm_head (%.0f MB beside the target's %.0f MB)",
             (weight.qweight.nbytes + weight.scales.nbytes) / 2**20,
             (source.qweight.nbytes + source.scales.nbytes) / 2**20)
    return head

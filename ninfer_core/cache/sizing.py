"""How big the cache is: `--kv-capacity auto|N`, `--kv-dtype`, and the context limit that follows.

On the GPU, `auto` gives the KV pages the memory left once the weights are resident (a drafter's
too), minus the GDN state slots and a workspace reserve (activations of a prefill chunk, logits, CUDA
graphs, allocator slack) and what is loaded later (a vision tower built on its first image), capped
at what max_seqs full-length sequences could ever use; a drafter's own KV (one entry a target token,
its pages mirroring the target's) shares the pages' memory. The context limit then defaults to the
model's limit if the cache can hold it. On the CPU, memory is shared with everything else, so
`auto` is simply max_context x max_seqs, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..errors import NinferError
from .kv_pool import kv_bytes_per_token, resolve_kv_dtype
from .state_pool import state_bytes_per_slot

WORKSPACE_MIN_BYTES = 2 << 30
WORKSPACE_FRACTION = 0.05  # of the GPU's total memory
MIN_KV_TOKENS = 256


@dataclass(frozen=True)
class CachePlan:
    kv_dtype: torch.dtype | str  # a float dtype, "fp8" or "int8"
    kv_tokens: int
    max_context: int


def plan_cache(
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    *,
    kv_dtype: str,
    max_seqs: int,
    max_context: int | None,
    default_context: int,
    kv_capacity: int | None,
    extra_state_slots: int = 0,
    draft_kv_bytes_per_token: int = 0,
    later_bytes: int = 0,
) -> CachePlan:
    """`extra_state_slots`: GDN state slots beyond the sequences' (prefix-cache checkpoints);
    `draft_kv_bytes_per_token`: a drafter's own KV a target token (MTP layer, DFlash model);
    `later_bytes`: weights loaded after the cache (the vision tower)."""
    kv = resolve_kv_dtype(kv_dtype, dtype)
    limit = config.max_position_embeddings
    if kv_capacity is not None or device.type != "cuda":
        context = max_context or min(limit, default_context)
        return CachePlan(kv, kv_capacity or context * max_seqs, context)
    # What torch's allocator freed but keeps cached is free for the pages too: a model quantized as it
    # loads leaves its full-precision tensors there (the 35B's random weights, when drawn whole in bf16,
    # left 2.2 GiB "free" on an 80 GB H100).
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    workspace = max(WORKSPACE_MIN_BYTES, int(WORKSPACE_FRACTION * total))
    state = (max_seqs + 1 + extra_state_slots) * state_bytes_per_slot(config, dtype)  # + the graphs' scratch slot
    per_token = kv_bytes_per_token(config, kv, dtype) + draft_kv_bytes_per_token
    budget = free - workspace - state - later_bytes
    if per_token == 0:  # no attention layers: KV costs nothing, any capacity fits
        tokens = max_seqs * (max_context or limit)
    else:
        tokens = min(budget // per_token, max_seqs * (max_context or limit))
    if tokens < MIN_KV_TOKENS:
        raise NinferError(
            f"not enough GPU memory left for the KV cache: {free / 2**30:.1f} GiB free after the weights, "
            f"{(workspace + state + later_bytes) / 2**30:.1f} GiB needed for workspace, {max_seqs} state slots "
            f"and weights loaded later "
            f"(try --max-seqs 1 / --max-concurrency 1, --weights int4, --kv-dtype fp8 or a smaller --kv-capacity)"
        )
    context = max_context or min(limit, tokens)
    return CachePlan(kv, int(tokens), context)

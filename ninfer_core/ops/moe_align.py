"""The (token, slot) pairs of a routing grouped by expert, for the grouped MoE GEMMs.

Both grouped quantized paths (the CUDA grouped GEMV in ops/moe.py and the Triton GEMMs in
ops/moe_triton.py) take blocks of `block_m` positions that share one expert. The grouping runs
on the device with no host sync, so forwards that contain it are captured by CUDA graphs; its
shapes depend only on the slot count (`align_capacity`), never on the routing. On CUDA it is one
kernel (csrc/moe.cu, `moe_align`); the torch reference below is ~12 ops with a sort. The slot
outputs come back together through `combine_slots` (one kernel on CUDA, a bmm for reference).
"""

from __future__ import annotations

import torch

from . import dispatch

Aligned = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # sorted_slots, block_experts, used


def align_capacity(slots: int, num_experts: int, block_m: int) -> int:
    """Positions any routing of `slots` pairs needs: sum_e ceil(count_e / block_m) * block_m, at
    most (slots + hit * (block_m - 1)) rounded down to block_m, with hit <= min(experts, slots)."""
    hit = min(slots, num_experts)
    return (slots + hit * (block_m - 1)) // block_m * block_m


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> Aligned:
    """Group the slots of ids [N, k] by expert in blocks of `block_m` positions, no host sync.

    Returns (sorted_slots [C] int32, block_experts [C / block_m] int32, used [1] int32): the slot
    ids (n * k + j) of expert 0's rows padded with the invalid id N * k to a multiple of block_m,
    then expert 1's, ...; the expert of each block (the last expert past `used`); the number of
    positions in use (the rest: padding blocks). C = `align_capacity`. Inside an expert's rows
    the order is free (each slot's output is its own): the kernel's follows its atomics."""
    if ids.device.type == "cuda" and dispatch.kernels_available():
        return _align_kernel(ids, num_experts, block_m)
    return align_by_expert_ref(ids, num_experts, block_m)


def align_by_expert_ref(ids: torch.Tensor, num_experts: int, block_m: int) -> Aligned:
    """Torch reference of `align_by_expert` (any device; slots in ascending order per expert)."""
    flat = ids.reshape(-1).long()
    slots = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.long, device=ids.device).index_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.sort(flat, stable=True).indices
    by_expert = flat[order]
    rank = torch.arange(slots, device=ids.device) - (counts.cumsum(0) - counts)[by_expert]
    capacity = align_capacity(slots, num_experts, block_m)
    sorted_slots = torch.full((capacity,), slots, dtype=torch.int32, device=ids.device)
    sorted_slots[(ends - padded)[by_expert] + rank] = order.to(torch.int32)
    starts = torch.arange(0, capacity, block_m, device=ids.device)
    block_experts = torch.searchsorted(ends, starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_slots, block_experts, ends[-1:].to(torch.int32)


def combine_slots(weights: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """out [N, H] = sum_j weights[n, j] * y[n * k + j]: each token's k slot outputs (y [N * k, H],
    in (token, slot) order) weighted and summed; on CUDA one kernel (csrc/moe.cu, `moe_combine`)
    for fp16 / bf16 rows of a multiple of 8, else the reference."""
    if (y.dtype in (torch.float16, torch.bfloat16) and y.shape[1] % 8 == 0 and y.is_contiguous()
            and y.data_ptr() % 16 == 0 and dispatch.use_kernel(y, weights)):
        return _combine_kernel(weights, y)
    return combine_slots_ref(weights, y)


def combine_slots_ref(weights: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Torch reference of `combine_slots`: one bmm (the weights rounded to y's dtype, fp32 sums,
    one rounding; no atomics)."""
    tokens, top_k = weights.shape
    return torch.bmm(weights.to(y.dtype).unsqueeze(1), y.view(tokens, top_k, -1)).squeeze(1)


def _combine_kernel(weights: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    weights = weights.contiguous()
    out = torch.empty(weights.shape[0], y.shape[1], dtype=y.dtype, device=y.device)
    dispatch.extension().moe_combine(out=out, y=y, weights=weights, stream=dispatch.stream_handle(y))
    return out


def _align_kernel(ids: torch.Tensor, num_experts: int, block_m: int) -> Aligned:
    ids = ids.reshape(-1).to(torch.int32).contiguous()
    slots = ids.numel()
    capacity = align_capacity(slots, num_experts, block_m)
    sorted_slots = torch.empty(capacity, dtype=torch.int32, device=ids.device)
    block_experts = torch.empty(capacity // block_m, dtype=torch.int32, device=ids.device)
    used = torch.empty(1, dtype=torch.int32, device=ids.device)
    dispatch.extension().moe_align(
        sorted_slots=sorted_slots, block_experts=block_experts, used=used, ids=ids, experts=num_experts,
        block_m=block_m, stream=dispatch.stream_handle(ids),
    )
    return sorted_slots, block_experts, used

"""The decode step's largest kernels at the 35B-A3B's shapes, each launched a few times, for Nsight
Compute, as the decode step calls them (the router with its folded norm, the routed experts
with the int8 shared expert in the same two launches): GEMVs as fast from L2 as from DRAM (`bench_l2_prefetch.py`) are bound by something inside
the kernel, and ncu's stall reasons say what. One row of x, as batch-1 decode has, or --tokens N
(8: batch-8 decode), or with --dense the 27B's GEMVs (its int4 MLP, the int8 GDN in_proj), or with
--grouped the short-prompt path's grouped GEMVs at N tokens (the engine's slot blocks, or --block-m:
at 512 tokens the 16-slot blocks move the experts' 415 MB at about 1 TB/s, where 64 tokens' 8-slot
ones reach 2.2: what holds the larger blocks is the question).

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section Occupancy \\
        -k regex:"quant_gemv|gate_up|down_|router_kernel" python3 scripts/ncu_decode_kernels.py

(`scripts/device_run.sh ncu` runs that.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ninfer_core.ops import moe, quant  # noqa: E402

HIDDEN, EXPERTS, TOP_K, INTER = 2048, 256, 8, 512
LAUNCHES = 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--dense", action="store_true", help="the 27B's GEMVs instead: int4 MLP, int8 in_proj")
    parser.add_argument("--grouped", action="store_true", help="the grouped MoE GEMVs of a --tokens prompt instead")
    parser.add_argument("--block-m", type=int, default=0, help="--grouped's slots a block (0: the engine's choice)")
    args = parser.parse_args()
    tokens = args.tokens
    torch.manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    if args.dense:
        dense_gemvs(tokens, bf16)
        return
    if args.grouped:
        grouped_gemvs(tokens, bf16, args.block_m or None)
        return
    x = torch.randn(tokens, HIDDEN, **bf16)
    projections = {name: quant.quantize(torch.randn(n, k, **bf16) * 0.02, "int8", 128)
                   for name, (n, k) in {"gdn_in_proj": (12352, HIDDEN), "out_proj": (HIDDEN, 4096)}.items()}
    gate_up, down = routed_experts(bf16)
    shared_gate_up = quant.quantize(torch.randn(2 * INTER, HIDDEN, **bf16) * 0.02, "int8")
    shared_down = quant.quantize(torch.randn(HIDDEN, INTER, **bf16) * 0.02, "int8")
    router = torch.randn(EXPERTS + 1, HIDDEN, **bf16) * 0.02
    norm = moe.RouterNorm(torch.randn(tokens, HIDDEN, **bf16), torch.ones(HIDDEN, **bf16), 1e-6, True)
    for _ in range(LAUNCHES):
        for w in projections.values():
            out = torch.empty(tokens, w.shape[0], **bf16)
            quant._gemv(out, torch.randn(tokens, w.shape[1], **bf16), w, None)
        routed = moe.moe_add_norm_router(x, norm, router, EXPERTS, TOP_K, True)
        assert routed is not None, "the router kernel does not take this shape"
        normed, _, logits, weights, ids = routed
        shared = moe.SharedExpert(shared_gate_up, shared_down, logits[:, EXPERTS:])
        assert moe.moe_experts_with_shared(normed, gate_up, down, weights, ids, shared) is not None
    torch.cuda.synchronize()


def routed_experts(bf16: dict) -> tuple[quant.QuantizedWeight, quant.QuantizedWeight]:
    """The 35B's routed experts (gate_up, down) in int4 groups of 128, random."""
    gate_up = quant.quantize(torch.randn(EXPERTS, 2 * INTER, HIDDEN, **bf16) * 0.02, "int4", 128)
    down = quant.quantize(torch.randn(EXPERTS, HIDDEN, INTER, **bf16) * 0.02, "int4", 128)
    return gate_up, down


def dense_gemvs(tokens: int, bf16: dict) -> None:
    """Qwen3.6-27B: MLP gate_up (SwiGLU epilogue) and down in int4 groups of 128, GDN in_proj int8."""
    hidden, inter = 5120, 17408
    gate_up = quant.quantize(torch.randn(2 * inter, hidden, **bf16) * 0.02, "int4", 128)
    down = quant.quantize(torch.randn(hidden, inter, **bf16) * 0.02, "int4", 128)
    in_proj = quant.quantize(torch.randn(16480, hidden, **bf16) * 0.02, "int8", 128)
    x = torch.randn(tokens, hidden, **bf16)
    for _ in range(LAUNCHES):
        quant.quant_linear(quant.quant_swiglu(x, gate_up), down)
        quant.quant_linear(x, in_proj)
    torch.cuda.synchronize()


def grouped_gemvs(tokens: int, bf16: dict, block_m: int | None) -> None:
    """The routed experts of a short prompt: moe_align, the grouped gate_up and down GEMVs (block_m
    slots a block, else the engine's choice), the combine; random routing, as bench_moe_triton.py times it."""
    gate_up, down = routed_experts(bf16)
    x = torch.randn(tokens, HIDDEN, **bf16)
    ids = torch.stack([torch.randperm(EXPERTS, device="cuda")[:TOP_K] for _ in range(tokens)]).to(torch.int32)
    weights = torch.rand(tokens, TOP_K, **bf16)
    for _ in range(LAUNCHES):
        moe.moe_experts_grouped_gemv(x, gate_up, down, weights, ids, block_m)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()

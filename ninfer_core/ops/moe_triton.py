"""Grouped MoE GEMMs over int4 / int8 expert weights, dequantized in registers (Triton).

The prefill-sized path of `moe_experts` for quantized experts (ops/moe.py): the N * k (token,
slot) pairs are grouped by expert in blocks of BLOCK_M rows (ops/moe_align.py, on the device),
and each program multiplies one block of rows by one tile of its expert's weights, reading the
packed codes and scales and dequantizing them in registers. Every hit expert's weights are read
once per block of its rows, never written back dequantized (the path it replaces dequantized
every expert to bf16 per call: 3x the bytes), and nothing is read on the host, so a forward with
these calls can be captured in a CUDA graph.
  gate_up   h[slot] = silu(x[token] @ gate[e]^T) * (x[token] @ up[e]^T), gate and up tiles of the
            same columns in one program (the SiLU-mul epilogue costs no extra pass);
  down      y[slot] = h[slot] @ down[e]^T, unweighted; the routing weights and the sum over a
            token's k slots stay in torch (one bmm), as in `moe_experts_grouped`.
Weights are dequantized exactly as `dequantize(qw, bf16)` does (code times scale in fp32, rounded
once to the activation dtype), so both paths multiply by the same values; only the order of the
fp32 accumulation differs.

Why Triton: a grouped GEMM with in-register dequantization needs tensor-core tiles per GPU
generation; Triton writes those from one source for sm_80..sm_120 and compiles on first use (the
engine's load-time warm-up pays it). Block sizes are fixed per problem size (no autotuning, so no
first-sight cost).
"""

from __future__ import annotations

import torch

from .moe_align import Aligned, align_by_expert, combine_slots
from .quant import QuantizedWeight
from .quant_triton import TileConfig, available, kernels

__all__ = ["TileConfig", "available", "moe_experts_grouped_quantized"]

DEFAULT_TILES = TileConfig()
# per rows-per-block: the fastest tiling measured at the 35B expert shape on the H200
# (scripts/bench_moe_triton.py --sweep): 128 / 512 tokens (BM 16, 2026-12-01); 2,048 / 8,192 tokens
# (BM 128, 2026-12-02: 0.91 / 2.16 ms a layer against 0.93 / 2.55 with BM 64, each dequantized
# weight tile serves twice the rows)
TILES = {16: TileConfig(128, 128, 4, 3), 32: TileConfig(64, 128, 4, 3), 128: TileConfig(64, 64, 8, 3)}


def moe_gate_up(x: torch.Tensor, gate_up: QuantizedWeight, aligned: Aligned,
                top_k: int, block_m: int, tiles: TileConfig = DEFAULT_TILES) -> torch.Tensor:
    """h [N * k, I] = silu(x[n] @ gate[e]^T) * (x[n] @ up[e]^T) per slot (x [N, H], gate_up [E, 2I, H])."""
    inter = gate_up.out_features // 2
    out = torch.empty(x.shape[0] * top_k, inter, dtype=x.dtype, device=x.device)
    _launch(x, gate_up, out, aligned, top_k, inter, block_m, tiles, gate_up=True)
    return out


def moe_down(h: torch.Tensor, down: QuantizedWeight, aligned: Aligned,
             block_m: int, tiles: TileConfig = DEFAULT_TILES) -> torch.Tensor:
    """y [N * k, H] = h[slot] @ down[e]^T per slot (h [N * k, I], down [E, H, I]), unweighted."""
    out = torch.empty(h.shape[0], down.out_features, dtype=h.dtype, device=h.device)
    _launch(h, down, out, aligned, 1, down.out_features, block_m, tiles, gate_up=False)
    return out


def moe_experts_grouped_quantized(x: torch.Tensor, gate_up: QuantizedWeight, down: QuantizedWeight,
                                  weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`moe_experts` for quantized experts on the Triton kernels: x [N, H] -> [N, H]."""
    tokens, top_k = ids.shape
    block_m = block_m_for(tokens * top_k, gate_up.shape[0])
    tiles = TILES[block_m]
    aligned = align_by_expert(ids, gate_up.shape[0], block_m)
    y = moe_down(moe_gate_up(x, gate_up, aligned, top_k, block_m, tiles), down, aligned, block_m, tiles)
    return combine_slots(weights, y)


def block_m_for(slots: int, num_experts: int) -> int:
    """Rows per block: about the rows an expert gets, so few blocks are mostly padding."""
    per_expert = slots / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 48 else 128


def _launch(a: torch.Tensor, w: QuantizedWeight, out: torch.Tensor,
            aligned: Aligned, rows_per_a: int, n: int, block_m: int,
            tiles: TileConfig, gate_up: bool) -> None:
    kern = kernels()
    assert kern is not None, "Triton is not available"
    sorted_slots, block_experts, used = aligned
    a = a.contiguous()
    grid = (sorted_slots.numel() // block_m * -(-n // tiles.block_n),)
    kern.grouped_gemm[grid](
        a, w.qweight, w.scales, out, sorted_slots, block_experts, used,
        out.shape[0], rows_per_a, n, w.in_features, a.stride(0), w.qweight.stride(0), w.qweight.stride(1),
        w.scales.stride(0), w.scales.stride(1), out.stride(0), n if gate_up else 0,
        GATE_UP=gate_up, INT4=w.kind == "int4", GROUP=w.group_size,
        BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.k_step(w.group_size), num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )

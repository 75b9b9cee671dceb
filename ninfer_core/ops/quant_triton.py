"""Dense GEMMs over an int4 / int8 weight, dequantized in registers (Triton): a short prompt's rows.

A short prompt's rows (33-128) by a wide weight: the GEMV (csrc/quant_gemv.cu) reads the weight once
a 16 rows and dequantizes it as often, and the long prompts' path dequantizes the whole weight to a
transient bf16 copy for cuBLAS (an int8 weight's byte read, two written and two read again), where
the product of a few dozen rows is bound by the weight's one read. Here each program multiplies one
tile of rows by one tile of the weight, dequantizing the codes in registers exactly as
`dequantize(qw, bf16)` does (code times scale in fp32, rounded once to the activation dtype), so
both paths multiply by the same values; only the order of the fp32 accumulation differs. A weight
tile's row tiles are adjacent programs: past one row tile the weight comes from L2.

Why Triton: tensor-core tiles with in-register dequantization for sm_80..sm_120 from one source,
as ops/moe_triton.py's grouped GEMMs (which share this module's tile helper and config).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from . import dispatch

if TYPE_CHECKING:
    from .quant import QuantizedWeight


def available() -> bool:
    """Triton is importable (and runs: a GPU, or the interpreter)."""
    return kernels() is not None


def kernels() -> ModuleType | None:
    return dispatch.triton_kernels("quant_triton_kernels")


@dataclass(frozen=True)
class TileConfig:
    """Kernel tiling (the rows per block come from the problem)."""

    block_n: int = 64
    block_k: int = 64  # capped at the group size (`k_step`)
    num_warps: int = 4
    num_stages: int = 3

    def k_step(self, group_size: int) -> int:
        """The K a program takes a step: block_k, at most one group (a step reads one scale a row)."""
        return min(self.block_k, group_size) if group_size else self.block_k


# per rows-per-block: the fastest tiling of the 35B's GDN in_proj (12352 x 2048, int8 / int4) on the H100
# (bench_quant.py --sweep, forty-eighth session): 48 rows 20.2 us against 44.7 for the dequantized
# copy + cuBLAS and 37.1 for the GEMV; 128 rows 28.3 against 46.8 / 59.1
DENSE_TILES = {64: TileConfig(32, 128, 4, 3), 128: TileConfig(32, 64, 4, 3)}
# The weights it takes: a grid of two programs an SM or more (a narrow weight's few programs leave SMs
# without loads: the 35B's o_proj, 2048 x 4096, 16.1 us at 48 rows against the GEMV's 13.6), each with a
# K loop of at most this (the 27B's MLP down, K = 17,408: 118 us against the GEMV's 97)
MAX_K = 4096


def block_m_for(rows: int) -> int:
    """Rows per program: one tile of up to 64 rows, else tiles of 128 (a weight tile serves them all
    from one read)."""
    return 64 if rows <= 64 else 128


def programs(rows: int, n: int, block_n: int) -> int:
    """The grid of `rows` rows by a weight of n outputs: row tiles (block_m_for) times column tiles."""
    return -(-rows // block_m_for(rows)) * -(-n // block_n)


def fills_gpu(rows: int, n: int, k: int, sms: int) -> bool:
    """Whether the GEMM of `rows` rows by an [n, k] weight has two programs an SM or more and a K loop
    short enough for it to beat the GEMV and the dequantized copy (see MAX_K)."""
    return programs(rows, n, DENSE_TILES[block_m_for(rows)].block_n) >= 2 * sms and k <= MAX_K


def fits(x: torch.Tensor, qw: QuantizedWeight) -> bool:
    """Whether `quant_gemm` takes x [M, K] @ qw, and is the fastest path for it: a 2-D weight without
    offsets, 16-bit rows, a grid that fills the GPU (`fills_gpu`; the interpreter: any)."""
    if not (qw.qweight.dim() == 2 and qw.offsets is None and x.dtype in (torch.float16, torch.bfloat16)
            and qw.qweight.is_contiguous() and qw.scales.is_contiguous() and x.device == qw.device
            and available()):
        return False
    sms = dispatch.num_sms(x.device) if x.is_cuda else 0
    return fills_gpu(x.shape[0], qw.out_features, qw.in_features, sms)


def quant_gemm(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None,
               tiles: TileConfig | None = None) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) -> [M, N] in x's dtype (a weight `fits` would take, but for the grid's
    size); `tiles` overrides the table (benches, tests)."""
    kern = kernels()
    assert kern is not None, "Triton is not available"
    rows, n = x.shape[0], qw.out_features
    block_m = block_m_for(rows)
    tiles = tiles or DENSE_TILES[block_m]
    x = x.contiguous()
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    kern.quant_gemm[(programs(rows, n, tiles.block_n),)](
        x, qw.qweight, qw.scales, out if bias is None else bias.to(x.dtype), out, rows, n, qw.in_features,
        x.stride(0), qw.qweight.stride(0), qw.scales.stride(0), out.stride(0),
        INT4=qw.kind == "int4", GROUP=qw.group_size, HAS_BIAS=bias is not None, BLOCK_M=block_m,
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.k_step(qw.group_size), num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out

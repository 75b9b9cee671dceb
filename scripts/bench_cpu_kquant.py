"""The CPU K-quant decode kernel (csrc/cpu/kquant.h) on one thread: GB/s of packed Q4_K / Q6_K weights
of Qwen2.5-1.5B's shapes, from DRAM (copies cycled past the L3) and from the L2 (one ~1 MB slice,
called again and again), beside a plain read (a sum) of as many bytes from DRAM.

GB/s is weight bytes over the median call time; decode reads each weight once a token, so the
DRAM figure against the plain read says how much of the memory's speed a token gets.

    python3 scripts/bench_cpu_kquant.py [--rows 1] [--iters 60] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ninfer_core.ops import dispatch  # noqa: E402
from ninfer_core.ops.kquant import KQuantWeight  # noqa: E402
from ninfer_core.weights.kquant_layout import BLOCK_TYPES, PACK_ROWS, packed_bytes  # noqa: E402

# (name, block type, rows, inputs): the 1.5B model's gate|up, a Q6_K down_proj, its lm_head's rows
SHAPES = [("gate|up q4_k", "q4_k", 17920, 1536), ("down q6_k", "q6_k", 1536, 8960), ("lm_head q6_k", "q6_k", 16384, 1536)]
DRAM_BYTES = 256 << 20  # copies of a weight cycled: 8x this machine's 32 MB L3
HOT_BYTES = 1 << 20  # a weight of ~1 MB stays in the 2 MB L2 (its ~20 us calls include the call's overhead)


def random_weight(block: str, rows: int, cols: int) -> KQuantWeight:
    """Random codes and scales, every d / dmin 2^-7 (finite sums: the speed does not depend on values)."""
    blocks = torch.randint(0, 256, (packed_bytes(block, rows, cols),), dtype=torch.uint8)
    header = 64 if block == "q4_k" else 32  # the fp16 fields at the start of each 16-row block
    blocks.view(-1, PACK_ROWS * BLOCK_TYPES[block][1])[:, :header].view(torch.float16).fill_(2**-7)
    return KQuantWeight(blocks, ((block, rows),), cols)


def median_seconds(calls: list, iters: int) -> float:
    times = []
    for i in range(iters):
        start = time.perf_counter()
        calls[i % len(calls)]()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def kernel_gbps(block: str, rows: int, cols: int, m: int, copies: int, iters: int) -> float:
    ext = dispatch.cpu_extension()
    weights = [random_weight(block, rows, cols) for _ in range(copies)]
    x, out = torch.randn(m, cols), torch.empty(m, rows)

    def call(w: KQuantWeight):
        return lambda: ext.kquant_matmul(out.data_ptr(), x.data_ptr(), 0, m, 1, *w.cpu_plan)

    return weights[0].blocks.numel() / median_seconds([call(w) for w in weights], iters) / 1e9


def plain_read_gbps(iters: int) -> float:
    chunk = 16 << 20
    buffers = [torch.ones(chunk // 4) for _ in range(DRAM_BYTES // chunk)]  # written: real pages
    return chunk / median_seconds([b.sum for b in buffers], iters) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1, help="activation rows (1: decode)")
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    report = dict(isa=dispatch.cpu_extension().isa(), rows=args.rows, date=time.strftime("%Y-%m-%d %H:%M"),
                  plain_read_gbps=plain_read_gbps(args.iters), shapes=[])
    print(f"plain read from DRAM: {report['plain_read_gbps']:.1f} GB/s ({report['isa']}, {args.rows} activation rows)")
    for name, block, rows, cols in SHAPES:
        copies = max(2, DRAM_BYTES // packed_bytes(block, rows, cols))
        dram = kernel_gbps(block, rows, cols, args.rows, copies, args.iters)
        hot_rows = max(PACK_ROWS, HOT_BYTES // packed_bytes(block, PACK_ROWS, cols) * PACK_ROWS)
        hot = kernel_gbps(block, hot_rows, cols, args.rows, 1, 4 * args.iters)
        report["shapes"].append(dict(name=name, rows=rows, cols=cols, dram_gbps=dram, l2_gbps=hot))
        print(f"{name:14s} {rows:6d} x {cols:5d}: {dram:5.1f} GB/s from DRAM, {hot:5.1f} GB/s from the L2")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()

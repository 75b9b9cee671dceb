"""GEMV timings on a GPU: csrc/quant_gemv.cu (int8, int4 group 128) against bf16 F.linear of the same
shape, against the long-prompt path (a dequantized copy + F.linear) and past 16 rows the Triton GEMM
that dequantizes in registers (ops/quant_triton.py; any weight, whether `fits` takes it or not), for
1 and 8 activation rows or `--rows` (e.g. 16,32,48,64,128,512: where each should hand over to the
next). `--sweep` times the Triton GEMM's tilings too (the table in ops/quant_triton.py: DENSE_TILES).

Every call is replayed from a CUDA graph (no launch overhead, like the engine's decode graphs) and
the calls cycle through enough copies of the weight to keep it out of L2, so GB/s is the DRAM
traffic of the weight (codes + scales; bf16: 2 bytes a weight). `copy_gbps` (a device-to-device
copy: read + write) is the practical ceiling to compare with.

    python3 scripts/bench_quant.py OUT.json [--iters 30] [--rows 1,8] [--shapes qkv,o_proj] [--sweep]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ninfer_core.bench import graph_replay_ms  # noqa: E402
from ninfer_core.ops import dispatch, quant, quant_triton  # noqa: E402

# (name, N, K): Qwen3.6-35B-A3B attention / GDN in_proj / shared expert / lm_head, Qwen3.6-27B MLP, tiny heads.
SHAPES = [
    ("o_proj", 2048, 4096),
    ("qkv", 8192, 2048),
    ("gdn_in_proj", 12352, 2048),
    ("shared_up", 512, 2048),
    ("shared_down", 2048, 512),
    ("lm_head", 248320, 2048),
    ("mlp_up_27b", 17408, 5120),
    ("mlp_down_27b", 5120, 17408),
    ("n1", 1, 2048),
    ("n32", 32, 2048),
    ("n256", 256, 2048),
]
KINDS = ("int8", "int4")
TRITON_FROM_ROWS = 16  # below, a GEMV's rows: the Triton GEMM is not timed
SWEEP = [quant_triton.TileConfig(*t) for t in
         [(32, 128, 4, 3), (32, 64, 4, 3), (32, 128, 4, 4), (16, 128, 4, 4), (64, 128, 4, 3), (32, 128, 8, 3)]]


def seconds_per_call(call: Callable[[int], object], copies: int, iters: int) -> float:
    """Mean time of call(i) over a graph of `copies` calls (one per weight copy), replayed."""
    def calls() -> None:
        for i in range(copies):
            call(i)

    return graph_replay_ms(calls, iters) / 1e3 / copies


def copy_gbps() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / seconds_per_call(lambda i: dst.copy_(src), 1, 20) / 1e9


def copies_for(nbytes: int) -> int:
    """Enough copies to overflow L2 four times (at least 2, at most 64)."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(2, min(64, math.ceil(4 * l2 / nbytes)))


def bench_shape(name: str, n: int, k: int, iters: int, rows_list: tuple[int, ...], sweep: bool) -> list[dict]:
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    dense_copies = copies_for(w.nbytes)
    dense = [w] + [w.clone() for _ in range(dense_copies - 1)]
    results = []
    for kind in KINDS:
        qw = quant.quantize(w, kind, 128)
        nbytes = qw.nbytes
        copies = copies_for(nbytes)
        weights = [qw] + [
            quant.QuantizedWeight(kind, qw.qweight.clone(), qw.scales.clone(), qw.group_size)
            for _ in range(copies - 1)
        ]
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            assert quant._kernel_ok(x, qw, None), "the kernel does not cover this call"
            out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
            t = seconds_per_call(lambda i, x=x, o=out, ws=weights: quant._gemv(o, x, ws[i], None), copies, iters)
            t_dense = seconds_per_call(lambda i, x=x: F.linear(x, dense[i]), dense_copies, iters)
            t_dequant = seconds_per_call(lambda i, x=x, ws=weights: F.linear(x, quant.dequantize(ws[i], x.dtype)),
                                         copies, iters)
            triton = {}
            if rows >= TRITON_FROM_ROWS and quant_triton.available():
                for cfg in [None, *(SWEEP if sweep else [])]:
                    triton["table" if cfg is None else str(tuple(vars(cfg).values()))] = 1e6 * seconds_per_call(
                        lambda i, x=x, ws=weights, c=cfg: quant_triton.quant_gemm(x, ws[i], tiles=c), copies, iters)
            results.append({
                "name": name, "n": n, "k": k, "rows": rows, "kind": kind,
                "group_size": qw.group_size, "weight_bytes": nbytes,
                "us": t * 1e6, "gbps": nbytes / t / 1e9,
                "bf16_us": t_dense * 1e6, "bf16_gbps": w.nbytes / t_dense / 1e9,
                "speedup_vs_bf16": t_dense / t, "dequant_gemm_us": t_dequant * 1e6,
                "triton_us": triton.get("table"), "triton_sweep_us": triton,
            })
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="JSON results")
    parser.add_argument("--iters", type=int, default=30, help="graph replays per measurement")
    parser.add_argument("--rows", default="1,8", help="activation rows, comma-separated")
    parser.add_argument("--shapes", default="", help="shape names to time, comma-separated (default: all)")
    parser.add_argument("--sweep", action="store_true", help="time the Triton GEMM's tilings (SWEEP) too")
    args = parser.parse_args()
    if not torch.cuda.is_available() or dispatch.extension() is None:
        raise SystemExit("needs a CUDA GPU and the built extension ninfer_core._C")
    device = torch.cuda.get_device_name(0)
    ceiling = copy_gbps()
    print(f"{device}: device copy {ceiling:.0f} GB/s")
    print(f"{'shape':<14}{'N x K':>14}{'M':>3} {'kind':<5}{'us':>9}{'GB/s':>8}"
          f"{'bf16 us':>9}{'GB/s':>8}{'x bf16':>8}{'deq+GEMM':>9}{'triton':>9}{'best':>9}")
    results = []
    picked = set(args.shapes.split(",")) if args.shapes else {name for name, _, _ in SHAPES}
    rows = tuple(int(v) for v in args.rows.split(","))
    for name, n, k in (shape for shape in SHAPES if shape[0] in picked):
        for r in bench_shape(name, n, k, args.iters, rows, args.sweep):
            results.append(r)
            sweep = r["triton_sweep_us"]
            best = min(sweep, key=sweep.get) if sweep else ""
            print(f"{name:<14}{f'{n}x{k}':>14}{r['rows']:>3} {r['kind']:<5}{r['us']:>9.2f}"
                  f"{r['gbps']:>8.0f}{r['bf16_us']:>9.2f}{r['bf16_gbps']:>8.0f}"
                  f"{r['speedup_vs_bf16']:>8.2f}{r['dequant_gemm_us']:>9.2f}"
                  f"{sweep.get('table', float('nan')):>9.2f}{sweep.get(best, float('nan')):>9.2f} {best}")
    if args.out:
        args.out.write_text(json.dumps(
            {"device": device, "copy_gbps": ceiling, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()

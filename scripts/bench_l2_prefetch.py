"""Would pulling the next projection's weights into L2 while the current GEMV runs speed up decode?

A decode step's dense GEMVs are small (8-25 MB each) and latency-bound: one alone reaches 1.2-2.5
TB/s (`bench_quant.py --rows 1`), so the DRAM pipe idles between and inside them. This times the
35B-A3B's GDN projections (int8 in_proj 12352 x 2048 and out_proj 2048 x 4096, one row of x) in a
CUDA graph, layer after layer, in three ways:

  cold      the GEMVs alone, over enough layers that nothing stays in L2 (what decode does now)
  prefetch  the same, plus a side stream that reads GEMV i+1's weights (a reduction over them, which
            pulls them through L2) while GEMV i runs; it never joins the main stream before the end
  hot       the GEMVs over one layer's weights only, resident in L2 (the floor prefetching aims at)

    python3 scripts/bench_l2_prefetch.py [--layers 12] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ninfer_core.bench import graph_replay_ms  # noqa: E402
from ninfer_core.ops import quant  # noqa: E402

SHAPES = [(12352, 2048), (2048, 4096)]  # GDN in_proj, out_proj


def prefetch(w: quant.QuantizedWeight) -> None:
    """Read every byte of w (codes as int32 words, scales): the reads allocate its lines in L2."""
    w.qweight.view(torch.int32).sum(dtype=torch.int32)
    w.scales.sum()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    weights = [
        quant.quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, "int8", 128)
        for _ in range(args.layers) for n, k in SHAPES
    ]
    xs = {k: torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for _, k in SHAPES}
    outs = {n: torch.empty(1, n, device="cuda", dtype=torch.bfloat16) for n, _ in SHAPES}
    nbytes = sum(w.nbytes for w in weights)

    def gemv(w: quant.QuantizedWeight) -> None:
        quant._gemv(outs[w.shape[0]], xs[w.shape[1]], w, None)

    def cold() -> None:
        for w in weights:
            gemv(w)

    def hot() -> None:
        for i in range(len(weights)):
            gemv(weights[i % len(SHAPES)])

    side = torch.cuda.Stream()

    def prefetched() -> None:
        main_stream = torch.cuda.current_stream()
        with torch.cuda.stream(side):
            side.wait_stream(main_stream)
            prefetch(weights[0])
        for i, w in enumerate(weights):
            if i + 1 < len(weights):
                side.wait_stream(main_stream)  # GEMV i is about to start
                with torch.cuda.stream(side):
                    prefetch(weights[i + 1])
            gemv(w)
        main_stream.wait_stream(side)

    result = {"gpu": torch.cuda.get_device_name(), "layers": args.layers, "weight_bytes": nbytes,
              "l2_bytes": torch.cuda.get_device_properties(0).L2_cache_size}
    for name, fn in (("cold", cold), ("prefetch", prefetched), ("hot", hot)):
        ms = graph_replay_ms(fn, args.replays)
        result[name] = {"ms": ms, "us_per_gemv": ms * 1e3 / len(weights), "gb_s": nbytes / ms / 1e6}
        print(f"{name:9s} {ms * 1e3 / len(weights):7.2f} us a GEMV, {nbytes / ms / 1e6:6.0f} GB/s "
              f"({len(weights)} GEMVs, {nbytes / 1e6:.0f} MB)", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

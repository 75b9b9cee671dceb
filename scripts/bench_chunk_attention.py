"""A prompt chunk's attention over a cached prefix at the Qwen3.6-35B-A3B shape (16 query heads,
2 KV heads, head_dim 256, page 16, bf16 KV): the Triton kernel (`chunk_attention`, per tiling)
against rows of 16 tokens on the decode kernel (what prefill graphs ran before), CUDA-event times
of graph replays, TFLOP/s (causal: new x (prefix + new / 2) x heads x dim x 4), and the error of
each against the torch reference.

    python3 scripts/bench_chunk_attention.py [--points 384:29700,256:20000,512:0,128:4000] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ninfer_core.cache import KVPool  # noqa: E402
from ninfer_core.bench import graph_replay_ms  # noqa: E402
from ninfer_core.ops import attention as attn  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE = 16, 2, 256, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", default="384:29700,256:20000,512:0,128:4000")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda")
    base = attn.chunk_tiles(HEADS // KV_HEADS, HEAD_DIM)
    variants = {"default": base, "n64": replace(base, block_n=64), "w8": replace(base, num_warps=8),
                "s2": replace(base, num_stages=2), "t16": replace(base, block_t=16)}
    results = []
    for point in args.points.split(","):
        new, prefix = (int(x) for x in point.split(":"))
        pages = math.ceil((prefix + new) / PAGE)
        pool = KVPool([0], pages + 1, PAGE, KV_HEADS, HEAD_DIM, torch.bfloat16, device)
        kv = pool.layer(0)
        kv.k.normal_(0, 2)
        kv.v.normal_()
        table = torch.randperm(pages + 1, device=device)[:pages].to(torch.int32)[None]
        lens = torch.tensor([prefix], device=device)
        q = torch.randn(1, new, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
        scale = HEAD_DIM**-0.5
        ref = attn.attention_ref(q, kv, table, lens, scale).double()
        flops = new * (prefix + new / 2) * HEADS * HEAD_DIM * 4
        row = {"new": new, "prefix": prefix}
        rows_out = attn._rows_attention(q, kv, table, lens, scale)
        row["rows_ms"] = graph_replay_ms(lambda: attn._rows_attention(q, kv, table, lens, scale))
        row["rows_err"] = ((rows_out.double() - ref).norm() / ref.norm()).item()
        for name, tiles in variants.items():
            attn.chunk_tiles = lambda group, dim, tiles=tiles: tiles
            try:
                out = attn.chunk_attention(q, kv, table, lens, scale)
                row[f"{name}_ms"] = graph_replay_ms(lambda: attn.chunk_attention(q, kv, table, lens, scale))
            except Exception as exc:  # noqa: BLE001 - a tiling that does not fit (shared memory) is skipped
                print(f"{name}: {str(exc)[:120]}")
                row[f"{name}_ms"], row[f"{name}_err"], row[f"{name}_tflops"] = float("inf"), None, 0.0
                continue
            row[f"{name}_err"] = ((out.double() - ref).norm() / ref.norm()).item()
            row[f"{name}_tflops"] = flops / row[f"{name}_ms"] / 1e9
        results.append(row)
        best = min(variants, key=lambda v: row[f"{v}_ms"])
        print(f"{new:4d} new over {prefix:6d}: rows {row['rows_ms']:.3f} ms (err {row['rows_err']:.1e}); "
              + ", ".join(f"{v} {row[f'{v}_ms']:.3f}" for v in variants)
              + f" ms; best {best} {row[f'{best}_tflops']:.0f} TFLOP/s, err {row[f'{best}_err']:.1e}, "
              f"{row['rows_ms'] / row[f'{best}_ms']:.1f}x")
    report = {"device": torch.cuda.get_device_name(), "variants": {k: asdict(v) for k, v in variants.items()},
              "points": results}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Split-K decode attention at the Qwen3.6-35B-A3B shape (16 query heads, 2 KV heads, head_dim
256, page size 16, one new token): CUDA-event time, KV bytes read, GB/s, per KV dtype.

    python3 scripts/bench_attention.py OUT.json [--contexts 4096 32768] [--batches 1 8]
                                                [--kv-dtypes bf16 fp8 int8] [--peak-gbs 4800]

One point = one CUDA graph of decode_attention over L layers' caches, replayed `--replays`
times, so the time is the kernels' (no Python launch overhead) and, with L chosen so the caches
total >= 512 MB, the K/V bytes come from DRAM, not from the 50 MB L2 of the previous call.
Bytes = every sequence's `context` cached tokens of K and V (scales included) + q and out.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ninfer_core.cache import KVPool
from ninfer_core.bench import graph_replay_ms
from ninfer_core.ops import dispatch
from ninfer_core.ops.attention import decode_attention, write_kv

HEADS, KV_HEADS, HEAD_DIM, PAGE = 16, 2, 256, 16
MIN_TOTAL_BYTES = 512 << 20


def bench_point(batch: int, context: int, kv_dtype: str, replays: int) -> dict:
    device = torch.device("cuda")
    pages = math.ceil(context / PAGE)
    probe = KVPool([0], 1, PAGE, KV_HEADS, HEAD_DIM, torch.bfloat16, device, kv_dtype=kv_dtype)
    kv_bytes = batch * context * probe.bytes_per_token
    layers = max(1, min(64, math.ceil(MIN_TOTAL_BYTES / kv_bytes)))
    pool = KVPool(list(range(layers)), batch * pages, PAGE, KV_HEADS, HEAD_DIM, torch.bfloat16, device,
                  kv_dtype=kv_dtype)
    rows = batch * pages * PAGE
    for i in pool.layers:  # random contents, written (and quantized) by write_kv
        k, v = (torch.randn(1, rows, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16) for _ in range(2))
        write_kv(pool.layer(i), k, v, torch.arange(rows, device=device)[None])
    table = torch.randperm(batch * pages, device=device).view(batch, pages).to(torch.int32)
    lens = torch.full((batch,), context - 1, dtype=torch.int64, device=device)  # + the new token = context
    q = torch.randn(batch, 1, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    kvs = [pool.layer(i) for i in pool.layers]

    def step() -> None:
        for kv in kvs:
            decode_attention(q, kv, table, lens, HEAD_DIM**-0.5, out=out)

    seconds = graph_replay_ms(step, replays) / 1e3 / layers
    moved = kv_bytes + 2 * q.numel() * q.element_size()
    splits = dispatch.extension().decode_attention_max_splits(
        batch=batch, num_new=1, num_heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, page_size=PAGE,
        table_width=pages, num_sms=torch.cuda.get_device_properties(device).multi_processor_count,
    )
    return {"batch": batch, "context": context, "kv_dtype": pool.dtype_name, "layers": layers, "max_splits": splits,
            "us": seconds * 1e6, "bytes": moved, "gb_s": moved / seconds / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="JSON results path")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--kv-dtypes", nargs="+", default=["bf16", "fp8", "int8"])
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--peak-gbs", type=float, default=None, help="DRAM peak (H200: 4800) for a %% column")
    args = parser.parse_args()
    if not torch.cuda.is_available() or not dispatch.kernels_available():
        sys.exit("bench_attention needs a CUDA device and the built extension (ninfer_core._C)")
    points = []
    for kv_dtype in args.kv_dtypes:
        for batch in args.batches:
            for context in args.contexts:
                point = bench_point(batch, context, kv_dtype, args.replays)
                if args.peak_gbs:
                    point["peak_fraction"] = point["gb_s"] / args.peak_gbs
                points.append(point)
                share = f"  {point['peak_fraction']:.0%} of peak" if args.peak_gbs else ""
                print(f"{point['kv_dtype']:>5} B={batch:<2} ctx={context:<6} {point['us']:8.1f} us  "
                      f"{point['bytes'] / 1e6:8.1f} MB  {point['gb_s']:7.0f} GB/s{share}  "
                      f"(max splits {point['max_splits']}, {point['layers']} layers/graph)")
    result = {"device": torch.cuda.get_device_name(), "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
              "page_size": PAGE, "num_new": 1, "points": points}
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

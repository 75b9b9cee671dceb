"""The grouped quantized MoE kernels (ops/moe_triton.py) at the 35B-A3B expert shape: time per
layer (grouping + gate_up + down + combine) at several token counts for several tilings, against
the dequantize + grouped-GEMM path it replaced and the decode kernels, with the effective
bandwidth over the bytes of the hit experts' int4 codes and scales. The grouped and decode
kernels are timed as CUDA graph replays, as the engine runs them (prefill graphs, decode steps),
so the host's launches (~15 small ops for the grouping) are not counted; until 2026-12-01 they
were timed eagerly. The dequantizing path syncs with the host and is timed eagerly.
    python3 scripts/bench_moe_triton.py [--tokens 16,37,128,512,2048,8192] [--json OUT]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ninfer_core.bench import cuda_median_ms, graph_replay_ms  # noqa: E402
from ninfer_core.ops import moe as moe_ops  # noqa: E402
from ninfer_core.ops import moe_triton  # noqa: E402
from ninfer_core.ops.quant import quantize  # noqa: E402

EXPERTS, HIDDEN, INTER, TOP_K, GROUP = 256, 2048, 512, 8, 128


def hit_bytes(ids: torch.Tensor, gate_up, down) -> int:
    hit = ids.unique().numel()
    per_expert = sum(t.nbytes // EXPERTS for q in (gate_up, down) for t in (q.qweight, q.scales))
    return hit * per_expert


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="16,37,128,512,2048,8192")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    gate_up = quantize(torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02, "int4",
                       GROUP)
    down = quantize(torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", dtype=torch.bfloat16) * 0.02, "int4", GROUP)
    configs = [moe_triton.TileConfig(n, k, w, s) for n, k, w, s in
               itertools.product((64, 128), (64, 128), (4, 8), (3, 4))]
    results = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(tokens, EXPERTS, device="cuda", dtype=torch.bfloat16)
        weights, ids = moe_ops.moe_route(logits, TOP_K, True)
        moved = hit_bytes(ids, gate_up, down)
        ref = moe_ops.moe_experts_grouped(x, gate_up, down, weights, ids)
        row = {"tokens": tokens, "hit_bytes": moved, "dequant_grouped_ms": cuda_median_ms(
            lambda: moe_ops.moe_experts_grouped(x, gate_up, down, weights, ids))}
        if tokens <= moe_ops.QUANTIZED_DECODE_MAX_TOKENS:
            plan = moe_ops._decode_plan(x, gate_up, down, weights, ids, max_tokens=moe_ops.QUANTIZED_DECODE_MAX_TOKENS)
            row["decode_kernels_ms"] = graph_replay_ms(lambda: moe_ops._decode(x, plan, weights, ids, EXPERTS))
        block_m = moe_triton.block_m_for(tokens * TOP_K, EXPERTS)
        timings = {}
        for cfg in configs:
            def run(cfg=cfg):
                aligned = moe_triton.align_by_expert(ids, EXPERTS, block_m)
                h = moe_triton.moe_gate_up(x, gate_up, aligned, TOP_K, block_m, cfg)
                y = moe_triton.moe_down(h, down, aligned, block_m, cfg)
                return torch.bmm(weights.to(y.dtype).unsqueeze(1), y.view(tokens, TOP_K, -1)).squeeze(1)
            try:
                out = run()
                err = float((out.float() - ref.float()).norm() / ref.float().norm())
                timings[f"{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"] = (graph_replay_ms(run), err)
            except Exception as exc:  # noqa: BLE001 - a tiling that does not compile is just skipped
                timings[f"{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"] = (float("nan"), str(exc)[:80])
        best = min((v[0], k) for k, v in timings.items() if v[0] == v[0])
        default = f"{moe_triton.DEFAULT_TILES.block_n}x{moe_triton.DEFAULT_TILES.block_k} " \
                  f"w{moe_triton.DEFAULT_TILES.num_warps} s{moe_triton.DEFAULT_TILES.num_stages}"
        row.update(block_m=block_m, best=best[1], best_ms=best[0], default_ms=timings[default][0],
                   timings={k: v for k, v in timings.items()})
        results.append(row)
        print(f"tokens {tokens:5d} (BM {block_m}): dequant+grouped {row['dequant_grouped_ms']:.3f} ms, "
              f"decode kernels {row.get('decode_kernels_ms', float('nan')):.3f} ms, triton default "
              f"{row['default_ms']:.3f} ms, best {best[0]:.3f} ms [{best[1]}] = "
              f"{moved / best[0] / 1e6:.0f} GB/s over {moved / 1e6:.0f} MB, err {timings[best[1]][1]}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

"""The routed experts of one MoE layer at the 35B-A3B expert shape (E=256, k=8, H=2048, I=512,
int4 g128): time per layer of every quantized path at several token counts, as CUDA graph
replays (the engine runs them in decode and prefill graphs): the decode kernels (csrc/moe.cu,
each (token, expert) pair read once), the grouped GEMV at each slot-block size (csrc/quant_gemv.cu
over ops/moe_align.py), the Triton grouped GEMMs (ops/moe_triton.py; `--sweep` tries 16 tilings),
and the dequantize + grouped-GEMM path they replaced (it syncs: timed eagerly). Effective
bandwidth is over the bytes of the hit experts' int4 codes and scales; errors are relative L2
against the dequantizing path. `--profile` adds the grouped GEMV's kernels one by one (the
engine's block_m; torch.profiler over graph replays).
    python3 scripts/bench_moe_triton.py [--tokens 1,8,37,128,512,2048] [--sweep] [--profile] [--json OUT]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ninfer_core.bench import cuda_median_ms, graph_replay_ms  # noqa: E402
from ninfer_core.ops import moe as moe_ops  # noqa: E402
from ninfer_core.ops import moe_triton  # noqa: E402
from ninfer_core.ops.moe_align import align_by_expert, combine_slots  # noqa: E402
from ninfer_core.engine.graph_capture import capture  # noqa: E402
from ninfer_core.ops.quant import quantize  # noqa: E402
from profile_decode import kernel_rows, print_rows, profile_replays  # noqa: E402

EXPERTS, HIDDEN, INTER, TOP_K, GROUP = 256, 2048, 512, 8, 128
TOKENS = "1,2,4,8,16,24,37,48,64,96,128,256,512,1024,2048,8192"


def hit_bytes(ids: torch.Tensor, gate_up, down) -> int:
    hit = ids.unique().numel()
    per_expert = sum(t.nbytes // EXPERTS for q in (gate_up, down) for t in (q.qweight, q.scales))
    return hit * per_expert


def triton_path(x, gate_up, down, weights, ids, cfg: moe_triton.TileConfig, block_m: int):
    aligned = align_by_expert(ids, EXPERTS, block_m)
    h = moe_triton.moe_gate_up(x, gate_up, aligned, TOP_K, block_m, cfg)
    y = moe_triton.moe_down(h, down, aligned, block_m, cfg)
    return combine_slots(weights, y)


def timed(fn, ref: torch.Tensor) -> tuple[float, float]:
    out = fn()
    err = float((out.float() - ref.float()).norm() / ref.float().norm())
    return graph_replay_ms(fn), err


def kernel_profile(fn, replays: int = 20) -> list[tuple[float, float, str]]:
    """(GPU us per call, launches per call, kernel) of fn's CUDA graph, largest first."""
    graph, _ = capture(fn)
    return kernel_rows(profile_replays(graph.replay, replays), replays)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default=TOKENS)
    parser.add_argument("--sweep", action="store_true", help="time 16 Triton tilings, not just the table's")
    parser.add_argument("--triton-block-m", default="", help="rows per block of the Triton path to time besides "
                        "the engine's choice, e.g. 64,128 (tilings: the table's, or the sweep's)")
    parser.add_argument("--profile", action="store_true", help="the grouped GEMV path's kernels one by one")
    parser.add_argument("--paths", default="", help="time only the paths whose names start with one of these, "
                        "e.g. grouped_gemv_bm8,decode")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    gate_up = quantize(torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02, "int4",
                       GROUP)
    down = quantize(torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", dtype=torch.bfloat16) * 0.02, "int4", GROUP)
    results = []

    def wanted(name: str) -> bool:
        return not args.paths or name.startswith(tuple(args.paths.split(",")))

    for tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(tokens, EXPERTS, device="cuda", dtype=torch.bfloat16)
        weights, ids = moe_ops.moe_route(logits, TOP_K, True)
        moved = hit_bytes(ids, gate_up, down)
        ref = moe_ops.moe_experts_grouped(x, gate_up, down, weights, ids)
        paths: dict[str, tuple[float, float | str]] = {}
        if tokens <= 2048 and wanted("dequant_grouped"):
            paths["dequant_grouped"] = (cuda_median_ms(lambda: moe_ops.moe_experts_grouped(x, gate_up, down, weights,
                                                                                          ids)), 0.0)
        if tokens <= 128 and wanted("decode_kernels"):
            plan = moe_ops._decode_plan(x, gate_up, down, weights, ids, max_tokens=tokens)
            paths["decode_kernels"] = timed(lambda: moe_ops._decode(x, plan, weights, ids), ref)
        if tokens <= 2048:
            for block_m in (b for b in (8, 16, 32) if wanted(f"grouped_gemv_bm{b}")):
                paths[f"grouped_gemv_bm{block_m}"] = timed(
                    lambda b=block_m: moe_ops.moe_experts_grouped_gemv(x, gate_up, down, weights, ids, b), ref)
        chosen = moe_triton.block_m_for(tokens * TOP_K, EXPERTS)
        sweep = [moe_triton.TileConfig(n, k, w, s) for n, k, w, s in
                 itertools.product((64, 128), (64, 128), (4, 8), (3, 4))] if args.sweep else []
        for block_m in dict.fromkeys([chosen, *(int(b) for b in args.triton_block_m.split(",") if b)]) \
                if wanted("triton") else ():
            for cfg in ([moe_triton.TILES[block_m]] if block_m in moe_triton.TILES else []) + sweep:
                name = f"triton_bm{block_m}_{cfg.block_n}x{cfg.block_k}_w{cfg.num_warps}_s{cfg.num_stages}"
                try:
                    paths[name] = timed(lambda c=cfg, b=block_m: triton_path(x, gate_up, down, weights, ids, c, b),
                                        ref)
                except Exception as exc:  # noqa: BLE001 - a tiling that does not compile is just skipped
                    paths[name] = (float("nan"), str(exc)[:80])
        profiled = {}
        if args.profile and tokens <= 2048:
            block_m = moe_ops.grouped_gemv_block_m(tokens * TOP_K, EXPERTS)
            rows = kernel_profile(lambda: moe_ops.moe_experts_grouped_gemv(x, gate_up, down, weights, ids, block_m))
            print(f"tokens {tokens}: grouped_gemv_bm{block_m} kernels")
            print_rows(rows)
            profiled = {"block_m": block_m, "kernels": [{"us": us, "calls": n, "name": name} for us, n, name in rows]}
        best_ms, best = min((v[0], k) for k, v in paths.items() if v[0] == v[0])
        results.append({"tokens": tokens, "hit_bytes": moved, "best": best, "best_ms": best_ms,
                        "paths": {k: {"ms": v[0], "err": v[1]} for k, v in paths.items()},
                        **({"profile": profiled} if profiled else {})})
        listing = ", ".join(f"{k} {v[0]:.3f}" for k, v in paths.items())
        print(f"tokens {tokens:5d}: best {best} {best_ms:.3f} ms = {moved / best_ms / 1e6:.0f} GB/s over "
              f"{moved / 1e6:.0f} MB (err {paths[best][1]}) | {listing}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

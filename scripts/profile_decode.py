"""Where a decode step's time goes: the kernels of one step of a synthetic model, by CUDA time.

Runs eager decode steps (the same kernels a CUDA graph replays) under torch.profiler and prints
each kernel's calls per step and its share of the GPU time, next to the graph-replay step time.
    python3 scripts/profile_decode.py qwen3.6-35b-a3b [--context 4096] [--batch 1] [--json OUT]
`--timeline OUT` adds the graph replay's kernels in launch order (start, length, the gap before
each: what the step spends between kernels rather than in them) and the step's table by kernel
kind: time, bytes and bandwidth (ninfer_core/bench_step.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ninfer_core.bench import BenchSetup, _build, _Harness  # noqa: E402
from ninfer_core.bench_step import kind_bytes, markdown, projection_bytes, step_table  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("preset")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1, help="sequences a step decodes, each at --context")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--weights", default="auto")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--timeline", type=Path, help="JSON of one graph replay's kernels in order (its table "
                        "by kernel kind also goes into --json)")
    args = parser.parse_args()
    setup = BenchSetup(model=args.preset, device="cuda", weights=args.weights, prefill_lengths=(),
                       decode_contexts=(args.context,), decode_batches=(args.batch,), decode_steps=args.steps,
                       batch_context=args.context)
    model, config, dev, dtype, _ = _build(setup)
    harness = _Harness(model, config, dev, dtype, setup)
    # graph_ms also holds each step's host work (building the batch, copying its inputs, the argmax);
    # replay_ms is the GPU's time alone
    graphed = harness.decode(args.batch, args.context, float("nan"))
    graph_ms, replay_ms = graphed.ms_per_step, graphed.graph_ms_per_step
    table = timeline(harness, args.batch, args.context, args.timeline) if args.timeline else None
    harness.graphs = None  # eager: the profiler sees every kernel
    harness.decode(args.batch, args.context, float("nan"))  # warm-up
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        eager_ms = harness.decode(args.batch, args.context, float("nan")).ms_per_step
    rows = kernel_rows(prof, args.steps + 1)  # decode() runs a warm-up step before its timed ones
    gpu_us = sum(r[0] for r in rows)
    launches = sum(r[1] for r in rows)
    print(f"{args.preset}, batch {args.batch}: graph step {graph_ms:.3f} ms (replays alone {replay_ms:.3f} ms), "
          f"eager step {eager_ms:.3f} ms, GPU busy {gpu_us / 1e3:.3f} ms in {launches:.0f} kernels per step")
    print_rows(rows)
    if args.json:
        args.json.write_text(json.dumps({"graph_ms": graph_ms, "replay_ms": replay_ms, "eager_ms": eager_ms,
                                         "gpu_busy_ms": gpu_us / 1e3, "kernels_per_step": launches,
                                         "kernels": [dict(us=u, calls=c, name=n) for u, c, n in rows],
                                         "step_table": table}, indent=1))


def profile_replays(replay: Callable[[], object], replays: int, apart: bool = False) -> profile:
    """torch.profiler over `replays` calls of `replay` (a graph's replay, or several graphs') after
    one warm-up call (apart: each synchronised before the next, so that replays never overlap)."""
    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            replay()
            if apart:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
    return prof


def kernel_rows(prof: profile, steps: int) -> list[tuple[float, float, str]]:
    """(GPU us per step, calls per step, kernel name), largest first."""
    kernels: dict[str, list[float]] = defaultdict(list)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name].append(event.device_time)
    return sorted(((sum(t) / steps, len(t) / steps, name) for name, t in kernels.items()), reverse=True)


def replay_kernels(replay: Callable[[], object], replays: int = 5) -> list[dict]:
    """The kernels of one replay in launch order (the median of `replays` by span): name, start and
    length in us from its first kernel, and the gap since the latest end before it (negative:
    overlapped, as PDL's early launch does)."""
    prof = profile_replays(replay, replays, apart=True)
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    per = len(kernels) // replays
    runs = [kernels[i * per:(i + 1) * per] for i in range(replays)]
    run = sorted(runs, key=lambda r: max(k[1] for k in r) - r[0][0])[replays // 2]
    t0, latest, rows = run[0][0], run[0][0], []
    for start, end, name in run:
        rows.append({"start_us": start - t0, "us": end - start, "gap_us": start - latest, "name": name})
        latest = max(latest, end)
    return rows


def timeline(harness: _Harness, batch: int, context: int, out: Path, replays: int = 5) -> list[dict]:
    """One decode graph replay's kernels in order (replay_kernels), then the step by kernel kind
    with its bytes."""
    bucket = harness.graphs.bucket(batch)
    graph = next(g.graph for key, g in harness.graphs.graphs.items() if key[:2] == (bucket, 0))
    rows = replay_kernels(graph.replay, replays)
    span = max(r["start_us"] + r["us"] for r in rows)
    gaps = sum(r["gap_us"] for r in rows if r["gap_us"] > 0)
    print(f"timeline: {len(rows)} kernels, span {span:.1f} us, {gaps:.1f} us in gaps between them")
    for r in rows[:40] + rows[-15:]:  # the step's start and end: the layers in between repeat
        print(f"{r['start_us']:8.1f} {r['us']:7.1f} {r['gap_us']:+6.1f}  {r['name'][:100]}")
    table = step_table(rows, projection_bytes(harness.model, harness.config),
                       kind_bytes(harness.model, harness.config, harness.manager, batch, context))
    print(markdown(table))
    rows_by_kind = [vars(r) for r in table]
    out.write_text(json.dumps({"span_us": span, "gap_us": gaps, "batch": batch, "context": context,
                               "table": rows_by_kind, "kernels": rows}, indent=1))
    return rows_by_kind


def print_rows(rows: list[tuple[float, float, str]], top: int = 40) -> None:
    gpu_us = sum(r[0] for r in rows)
    for us, calls, name in rows[:top]:
        print(f"{us:9.1f} us {calls:6.1f}x  {100 * us / gpu_us:5.1f}%  {name[:110]}")

if __name__ == "__main__":
    main()

"""Where a short prefill's time goes: wall time against GPU busy time, per prompt length.

For each length: the first prefill of that length after load (compilation / autotuning for a
new shape shows here), the median of later ones, then one under torch.profiler: GPU busy time,
kernel count, the largest kernels, and the host ops with the most self CPU time.
    python3 scripts/profile_prefill.py qwen3.6-35b-a3b --lengths 37,128,512 [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ninfer_core.bench import BenchSetup, _build, _Harness  # noqa: E402
from profile_decode import kernel_rows, print_rows  # noqa: E402


def timed_prefill(harness: _Harness, length: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        seqs = harness.sequences(1, length)
        ids = harness.random_ids(1, length)
        lens = torch.tensor([0], device=harness.device)
        out = harness.model.forward(harness.batch(seqs, ids, lens, "last"), harness.manager.cache)
        out.logits.argmax(-1).item()
        harness.release(seqs)
    return (time.perf_counter() - start) * 1e3


def cpu_rows(prof: profile, top: int = 15, total: bool = False) -> list[tuple[float, int, str]]:
    totals: dict[str, list[float]] = defaultdict(list)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CPU:
            totals[event.name].append(event.cpu_time_total if total else event.self_cpu_time_total)
    return sorted(((sum(t), len(t), name) for name, t in totals.items()), reverse=True)[:top]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("preset")
    parser.add_argument("--lengths", default="37,128,512")
    parser.add_argument("--weights", default="auto")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    setup = BenchSetup(model=args.preset, device="cuda", weights=args.weights, prefill_lengths=tuple(lengths),
                       decode_contexts=(), decode_batches=(1,), prefill_chunk=max(lengths))
    model, config, dev, dtype, _ = _build(setup)
    harness = _Harness(model, config, dev, dtype, setup)
    timed_prefill(harness, 1000)  # a first prefill of an unrelated length: lazy init is not charged below
    report = []
    for length in lengths:
        with profile(activities=[ProfilerActivity.CPU]) as first_prof:
            first = timed_prefill(harness, length)
        repeat = statistics.median(timed_prefill(harness, length) for _ in range(5))
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            timed_prefill(harness, length)
        rows = kernel_rows(prof, 1)
        busy = sum(r[0] for r in rows) / 1e3
        launches = sum(r[1] for r in rows)
        print(f"== prefill {length}: first {first:.1f} ms, repeat {repeat:.1f} ms, GPU busy {busy:.1f} ms "
              f"in {launches:.0f} kernels")
        print_rows(rows, top=12)
        print("   first call, host ops by total CPU time:")
        for us, calls, name in cpu_rows(first_prof, total=True, top=8):
            print(f"   {us / 1e3:8.2f} ms {calls:6d}x  {name[:90]}")
        print("   host ops by self CPU time:")
        for us, calls, name in cpu_rows(prof):
            print(f"   {us / 1e3:8.2f} ms {calls:6d}x  {name[:90]}")
        report.append(dict(tokens=length, first_ms=first, repeat_ms=repeat, gpu_busy_ms=busy, kernels=launches,
                           top=[dict(us=u, calls=c, name=n) for u, c, n in rows[:20]]))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

"""Where an engine TTFT goes beyond one forward: wall time against GPU busy time per prompt length,
through the engine loop (scheduler, prompt chunks, prefix-cache checkpoints, sampling), with the
largest kernels, the host ops by self CPU time and the peak memory above the loaded engine.
Compare with `profile_prefill.py` (one forward). `--chat`: each length also as a chat-shaped prompt
(`ninfer bench engine`'s checkpoints, 27 and 3 tokens before the end), profiled the same way.
Programmatic dependent launch is off unless `--pdl`: with it a kernel starts before the one ahead of
it ends and waits inside, so its time includes that wait and "GPU busy" (the kernels' sum) counts the
overlap twice (the fifty-second session's chat profile gave the fused GDN steps 35 us a launch; taking
their per-token loads out moved the H100's chat TTFT +0.3 to -2.3%, the window's one norm barrier with
them -6 to -10% on the H200). The TTFTs printed first are of the chosen mode.
    python3 scripts/profile_engine_ttft.py .bench/qwen3.6-35b-a3b --lengths 2048,8192 [--prefill-chunk 8192] \
        [--top 40] [--chat] [--pdl]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ninfer_core.bench_engine import _Runner, chat_checkpoints  # noqa: E402
from ninfer_core.llm import LLM, EngineOptions  # noqa: E402
from profile_decode import kernel_rows, print_rows  # noqa: E402
from profile_prefill import cpu_rows  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--lengths", default="2048,8192")
    parser.add_argument("--prefill-chunk", type=int, default=None)
    parser.add_argument("--no-prefix-cache", action="store_true")
    parser.add_argument("--top", type=int, default=14, help="kernels and host ops listed per length")
    parser.add_argument("--chat", action="store_true", help="also each length as a chat-shaped prompt")
    parser.add_argument("--pdl", action="store_true", help="programmatic dependent launch on, as served")
    args = parser.parse_args()
    os.environ["NINFER_PDL"] = "1" if args.pdl else "0"  # read at the extension's first launch
    lengths = [int(x) for x in args.lengths.split(",")]
    # a context of at least 4,096 tokens: a short prompt's alone is under the cache's MIN_KV_TOKENS
    context = max(max(lengths) + 64, 4096)
    llm = LLM.load(args.model, EngineOptions(device="cuda", random_weights=True, max_context=context,
                                             prefill_chunk=args.prefill_chunk,
                                             prefix_cache=not args.no_prefix_cache))
    runner = _Runner(llm.engine, seed=0)
    chat = args.chat and llm.engine.cache.prefix is not None
    runs: list[tuple[int, tuple[int, ...]]] = []
    for length in lengths:
        runs.append((length, ()))
        marks = chat_checkpoints(length) if chat else ()
        if marks:  # a prompt too short for a checkpoint has no chat shape
            runs.append((length, marks))
    for length, marks in runs:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        times = [runner.ttft_ms(length, marks) for _ in range(3)]
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            profiled = runner.ttft_ms(length, marks)
        rows = kernel_rows(prof, 1)
        busy = sum(r[0] for r in rows) / 1e3
        shape = f", chat-shaped (checkpoints {', '.join(map(str, marks))})" if marks else ""
        print(f"== engine TTFT {length}{shape} (chunk {llm.engine.prefill_chunk}): "
              f"{', '.join(f'{t:.1f}' for t in times)} ms; profiled {profiled:.1f} ms, GPU busy {busy:.1f} ms in "
              f"{sum(r[1] for r in rows):.0f} kernels; peak activations {peak:.0f} MiB")
        print_rows(rows, top=args.top)
        print("   host ops by self CPU time:")
        for us, calls, name in cpu_rows(prof, top=args.top):
            print(f"   {us / 1e3:8.2f} ms {calls:6d}x  {name[:90]}")


if __name__ == "__main__":
    main()

"""A GGUF model on the CPU: ninfer against llama.cpp in one run, and the compact weights' accuracy.

    python3 scripts/bench_cpu_gguf.py speed MODEL.gguf --llama-bench PATH/llama-bench [--threads 1,2]
        [--prompt 128] [--prompt-depth 0] [--gen 64] [--depth 64] [--repeats 5] [--dtype auto|float32]
        [--kv-dtype auto|fp32|bf16|fp16] [--json OUT]
    python3 scripts/bench_cpu_gguf.py accuracy MODEL.gguf [--tokens 300] [--kv-dtypes auto,bf16,fp16] [--json OUT]

speed: for each thread count, `repeats` rounds that alternate ninfer and llama-bench (ninfer first
in even rounds, llama.cpp first in odd ones), so both see the same machine. ninfer runs its own
forward as `ninfer bench` does (no tokenizer or sampling): a prefill of `prompt` tokens after
`prompt_depth` tokens already in the cache (a follow-up message), then `gen` decode steps at a context
of `depth` tokens (`--dtype float32`: the exact fp32 path, every tensor
dequantized at load, which was the CPU path before the compact weights); llama-bench runs pp`prompt` at depth `prompt_depth` and tg`gen` at depth
`depth` (-d) with the same thread count. Medians of the rounds and their ratio are printed. Only
decode-sized and prefill-sized forwards are timed, never the load.

Both run the compact weights with the CPU math NINFER_CPU_MATH selects (ops/dispatch.py: bf16 by
default, int8, exact); the JSON records it.

accuracy: the compact weights (`--weights auto`) against the exact fp32 path (`--dtype float32`,
every tensor dequantized) teacher-forced over `tokens` tokens of prose and code: the decode path
one token per forward (the CPU kernels), and the prefill path one forward for all tokens (the
dequantized weights). KL(fp32 || compact) in nats per token, top-1 agreement, resident weight
bytes against the file size. Each of `kv_dtypes` is a KV cache of the compact model (auto: fp16 for
an fp32 model on the CPU, cache/kv_pool.py engine_kv_dtype); the reference always has an fp32 cache, so a 16-bit cache's KL adds its rounding to the weights'.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ninfer_core.bench import BenchSetup, _build, _Harness  # noqa: E402
from ninfer_core.cache import CacheManager  # noqa: E402
from ninfer_core.models.base import ForwardBatch  # noqa: E402
from ninfer_core.models.loader import LoadedModel, load_model  # noqa: E402
from ninfer_core.models.quantize import weight_bytes  # noqa: E402
from ninfer_core.ops import dispatch  # noqa: E402

TEXT = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named "
    "after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889. "
    "Locally nicknamed La dame de fer, it was constructed as the centrepiece of the 1889 World's Fair.\n"
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n"
)


def llama_bench(binary: Path, model: Path, threads: int, args: list[str]) -> float:
    """tok/s of one llama-bench test (one repetition)."""
    out = subprocess.run([str(binary), "-m", str(model), "-t", str(threads), "-r", "1", "-o", "json", *args],
                         capture_output=True, text=True, check=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def speed(args: argparse.Namespace) -> dict:
    setup = BenchSetup(model=str(args.model), device="cpu", dtype=args.dtype,
                       prefill_lengths=(args.prompt_depth + args.prompt,),
                       decode_contexts=(args.depth,), decode_batches=(1,), decode_steps=args.gen,
                       prefill_chunk=max(args.prompt, 1), kv_dtype=args.kv_dtype)
    model, config, dev, dtype, recipe = _build(setup)
    harness = _Harness(model, config, dev, dtype, setup)
    report = dict(model=str(args.model), weights=recipe.label(dtype), kv_dtype=args.kv_dtype,
                  prompt=args.prompt, prompt_depth=args.prompt_depth, gen=args.gen, depth=args.depth,
                  weight_bytes=weight_bytes(model),
                  file_bytes=args.model.stat().st_size, isa=_isa(), math=dispatch.cpu_math(),
                  cpu=platform.processor() or platform.machine(),
                  torch=torch.__version__, date=time.strftime("%Y-%m-%d"), runs=[])
    for threads in args.threads:
        torch.set_num_threads(threads)
        harness.prefill(args.prompt, args.prompt_depth)  # warm-up at this thread count
        rounds = []
        for r in range(args.repeats):
            row = {}
            order = ("ninfer", "llama.cpp") if r % 2 == 0 else ("llama.cpp", "ninfer")
            for who in order:
                if who == "ninfer":
                    row["ninfer_pp"] = harness.prefill(args.prompt, args.prompt_depth).tok_s
                    row["ninfer_tg"] = harness.decode(1, args.depth, float("nan")).tok_s
                else:
                    row["llama_pp"] = llama_bench(args.llama_bench, args.model, threads,
                                                  ["-p", str(args.prompt), "-n", "0", "-d", str(args.prompt_depth)])
                    row["llama_tg"] = llama_bench(args.llama_bench, args.model, threads,
                                                  ["-p", "0", "-n", str(args.gen), "-d", str(args.depth)])
            rounds.append(row)
            print(f"threads {threads} round {r}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)
        med = {k: statistics.median(row[k] for row in rounds) for k in rounds[0]}
        summary = dict(threads=threads, rounds=rounds, median=med,
                       decode_ratio=med["ninfer_tg"] / med["llama_tg"], prefill_ratio=med["ninfer_pp"] / med["llama_pp"])
        report["runs"].append(summary)
        print(f"threads {threads}: decode ninfer {med['ninfer_tg']:.1f} vs llama.cpp {med['llama_tg']:.1f} tok/s "
              f"({summary['decode_ratio']:.2f}x); prefill {med['ninfer_pp']:.1f} vs {med['llama_pp']:.1f} tok/s "
              f"({summary['prefill_ratio']:.2f}x)", flush=True)
    return report


@torch.inference_mode()
def logits(loaded: LoadedModel, ids: list[int], one_by_one: bool, kv_dtype: str = "auto") -> torch.Tensor:
    """Teacher-forced next-token log-probabilities [len(ids), V] (fp64)."""
    cache = CacheManager(loaded.config, max_tokens=len(ids), max_seqs=1, dtype=loaded.dtype, device="cpu",
                         kv_dtype=None if kv_dtype == "auto" else kv_dtype)
    seq = cache.allocate()
    cache.reserve(seq, len(ids))
    steps = [(i, i + 1) for i in range(len(ids))] if one_by_one else [(0, len(ids))]
    out = []
    for start, end in steps:
        batch = ForwardBatch(input_ids=torch.tensor([ids[start:end]]), positions=torch.arange(start, end)[None],
                             cache_lens=torch.tensor([start]), slots=torch.tensor([seq.slot]),
                             block_table=cache.block_table([seq]), logits="all")
        out.append(loaded.model.forward(batch, cache.cache).logits[0].double())
    return torch.cat(out).log_softmax(-1)


def accuracy(args: argparse.Namespace) -> dict:
    exact = load_model(str(args.model), "cpu", "float32")
    ids = exact.tokenizer.encode(TEXT * (1 + args.tokens // 100))[: args.tokens]
    reference = logits(exact, ids, one_by_one=False)
    del exact
    compact = load_model(str(args.model), "cpu")
    report = dict(model=str(args.model), weights=compact.recipe.label(compact.dtype), tokens=len(ids),
                  weight_bytes=weight_bytes(compact.model), file_bytes=args.model.stat().st_size, isa=_isa(),
                  math=dispatch.cpu_math())
    for kv_dtype in args.kv_dtypes:
        for path, one_by_one in (("decode", True), ("prefill", False)):
            ours = logits(compact, ids, one_by_one, kv_dtype)
            kl = (reference.exp() * (reference - ours)).sum(-1)
            key = path if kv_dtype == "auto" else f"{path}_kv_{kv_dtype}"
            report[key] = dict(kl_mean=kl.mean().item(), kl_max=kl.max().item(),
                               top1=(reference.argmax(-1) == ours.argmax(-1)).double().mean().item())
            print(f"{path} path, {kv_dtype} KV: KL {report[key]['kl_mean']:.3g} nats/token (max "
                  f"{report[key]['kl_max']:.3g}), top-1 agreement {report[key]['top1']:.4f} over {len(ids)} tokens",
                  flush=True)
    ratio = report["weight_bytes"] / report["file_bytes"]
    print(f"resident weights {report['weight_bytes'] / 1e6:.1f} MB = {ratio:.3f}x the file", flush=True)
    return report


def _isa() -> str:
    ext = dispatch.cpu_extension()
    return "torch reference" if ext is None or dispatch.kernels_disabled() else ext.isa()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("speed")
    s.add_argument("model", type=Path)
    s.add_argument("--llama-bench", type=Path, required=True)
    s.add_argument("--threads", type=lambda v: [int(t) for t in v.split(",")], default=[1, 2])
    s.add_argument("--prompt", type=int, default=128)
    s.add_argument("--prompt-depth", type=int, default=0, help="tokens in the cache before the prompt")
    s.add_argument("--gen", type=int, default=64)
    s.add_argument("--depth", type=int, default=64)
    s.add_argument("--repeats", type=int, default=5)
    s.add_argument("--dtype", default="auto", choices=("auto", "float32"))
    s.add_argument("--kv-dtype", default="auto", help="ninfer's KV cache (auto: fp16 for an fp32 model on the "
                                                      "CPU, llama.cpp's f16; fp32: the exact cache)")
    a = sub.add_parser("accuracy")
    a.add_argument("model", type=Path)
    a.add_argument("--tokens", type=int, default=300)
    a.add_argument("--kv-dtypes", type=lambda v: v.split(","), default=["auto"])
    for p in (s, a):
        p.add_argument("--json", type=Path)
    args = parser.parse_args()
    report = speed(args) if args.command == "speed" else accuracy(args)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

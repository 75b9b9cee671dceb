"""Where a CPU decode step's Python goes, layer by layer: a tiny Qwen3.5 model (the tests' own builder),
each decoder layer's forward timed around it and the one-call extension entries inside it.

    python3 scripts/profile_cpu_layers.py [--dense] [--steps 200] [--math bf16] [--weights int8]

Prints the median time of a decoder layer's forward, of the one-call wrappers' extension calls, and of
a whole decode step (the tests' Runner: embedding, layers, lm_head). The extension's share is the
arithmetic; the rest of a layer is Python (docs/performance.md, thirty-fourth session).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from hf_reference import Runner  # noqa: E402
from tiny_model_dir import write_tiny_model_dir  # noqa: E402

from ninfer_core.models.decoder import DecoderLayer  # noqa: E402
from ninfer_core.models.loader import load_model  # noqa: E402
from ninfer_core.ops import dispatch  # noqa: E402

ENTRIES = ("gdn_mixer", "attention_mixer", "moe_layer", "mlp_block")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dense", action="store_true", help="a dense model (MLP blocks), not MoE")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--math", default="bf16", choices=dispatch.CPU_MATHS)
    parser.add_argument("--weights", default="int8", choices=["int8", "int4"])
    args = parser.parse_args()
    os.environ[dispatch.CPU_MATH_ENV] = args.math
    directory = Path(tempfile.mkdtemp()) / "model"
    write_tiny_model_dir(directory, moe=not args.dense, overrides=dict(
        hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=64, intermediate_size=96))
    model = load_model(str(directory), "cpu", "float32", weights=args.weights).model
    times: dict[str, list[float]] = defaultdict(list)

    def timed(name, fn):
        def call(*a, **k):
            start = time.perf_counter()
            out = fn(*a, **k)
            times[name].append(time.perf_counter() - start)
            return out
        return call

    layer_forward = DecoderLayer.forward
    DecoderLayer.forward = lambda self, *a: timed("decoder layer", layer_forward)(self, *a)

    class Extension:  # the CPU extension with its one-call entries timed
        def __init__(self, ext):
            self._ext = ext

        def __getattr__(self, name):
            entry = getattr(self._ext, name)
            return timed(f"extension {name}", entry) if name in ENTRIES else entry

    extension = Extension(dispatch.cpu_extension())
    dispatch.cpu_extension = lambda: extension
    runner = Runner(model, max_tokens=args.steps + 16, max_seqs=1, page_size=16)
    seq = runner.new_seq()
    runner.prefill(seq, list(range(1, 9)), chunk=8)
    times.clear()
    for i in range(args.steps):
        start = time.perf_counter()
        runner.step([seq], torch.tensor([[5 + i % 50]]))
        times["decode step"].append(time.perf_counter() - start)
    print(f"{'dense' if args.dense else 'MoE'} tiny Qwen3.5, {len(model.layers)} layers, {args.weights} weights, "
          f"{args.math} math, {args.steps} steps")
    for name, values in times.items():
        print(f"  {name:28s} {len(values):6d} calls, median {statistics.median(values) * 1e6:8.1f} us")


if __name__ == "__main__":
    main()

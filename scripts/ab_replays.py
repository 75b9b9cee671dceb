"""Decode-step graph replays of one synthetic model under several variants, in one process.

A/B comparisons on the lent GPU are cheapest with one model build and fresh decode graphs per
variant, alternating the variants over rounds (drift shows as the spread of one variant). A variant
is a comma list of settings applied before its graphs are captured:
    NAME=VALUE              an environment variable (for switches read at each launch or call)
    py:module.ATTR=INT      a Python module constant (e.g. py:ninfer_core.ops.moe.ROUTER_KERNEL_MAX_TOKENS=4)

    python3 scripts/ab_replays.py OUT.json "NINFER_X=0" "NINFER_X=1" [--preset qwen3.6-35b-a3b]
        [--runs 1:4096,8:512] [--rounds 2]

--runs: batch:context pairs; each prints the median of 10 x 20 back-to-back replays (ms a step).

A process's only CUDA graph replays ~2% faster than any graph once a second one has been captured
(H200, 35B at 4K: 1.663 against 1.698 ms for the same batch-1 graph; not the clock, the KV cache's
placement or the graph pool: docs/performance.md, twenty-first and twenty-second sessions), so a
warm-up harness is built, captured and dropped first: every variant is then measured alike.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ninfer_core.bench import BenchSetup, _build, _Harness  # noqa: E402


def _module_attr(key: str) -> tuple[object, str]:
    module, attr = key[3:].rsplit(".", 1)
    return importlib.import_module(module), attr


def baseline(variants: list[dict[str, str]]) -> dict[str, object]:
    """The settings every variant names, as they were before any ran (None: an unset variable)."""
    keys = {key for variant in variants for key in variant}
    return {key: getattr(*_module_attr(key)) if key.startswith("py:") else os.environ.get(key) for key in keys}


def apply(variant: dict[str, str], base: dict[str, object]) -> None:
    """The baseline, then the variant's settings: a setting of one variant never leaks into the next."""
    for key, value in {**base, **variant}.items():
        if key.startswith("py:"):
            setattr(*_module_attr(key), value if key not in variant else int(value))
        elif value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("variants", nargs="+", help="NAME=VALUE[,NAME=VALUE...] per variant")
    parser.add_argument("--preset", default="qwen3.6-35b-a3b")
    parser.add_argument("--runs", default="1:4096,8:512", help="batch:context pairs")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    variants = [dict(item.split("=", 1) for item in v.split(",")) for v in args.variants]
    runs = [tuple(int(v) for v in item.split(":")) for item in args.runs.split(",")]
    setup = BenchSetup(model=args.preset, device="cuda", weights="auto", prefill_lengths=(),
                       decode_contexts=tuple(c for b, c in runs if b == 1) or (512,),
                       decode_batches=tuple(b for b, _ in runs), decode_steps=8,
                       batch_context=max((c for b, c in runs if b > 1), default=512))
    model, config, dev, dtype, _ = _build(setup)
    results = []
    base = baseline(variants)
    warm_up = _Harness(model, config, dev, dtype, setup)
    for batch, context in runs:
        warm_up.decode(batch, context, float("nan"))
    del warm_up
    torch.cuda.empty_cache()
    for round_ in range(args.rounds):
        for variant in variants:
            apply(variant, base)
            harness = _Harness(model, config, dev, dtype, setup)
            row = {"variant": variant, "round": round_}
            for batch, context in runs:
                # captures the bucket's graph, then times its replays alone
                row[f"b{batch}_ctx{context}_ms"] = harness.decode(batch, context, float("nan")).graph_ms_per_step
            print(json.dumps(row), flush=True)
            results.append(row)
            del harness
            torch.cuda.empty_cache()
    args.out.write_text(json.dumps({"preset": args.preset, "gpu": torch.cuda.get_device_name(), "runs": results},
                                   indent=1))


if __name__ == "__main__":
    main()

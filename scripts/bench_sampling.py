"""Sampler timing at Qwen3.6's vocabulary (248,320): the CUDA kernel vs the float64 torch reference,
both on the GPU, timed with CUDA events; batch 1, 4, 8, 16, 64 with top-k 20 + top-p 0.95 and with
top-p 0.95 alone (temperature 0.7), on LLM-like peaked rows and on wide Gaussian rows (where top-p
keeps thousands of tokens: the kernel's full-vocabulary path). The kernel's draw (`sample`) and its
distribution (`filtered_probs`, what speculative sampling reads), in the same run.

    python scripts/bench_sampling.py --json OUT.json [--iters 50] [--ref-iters 5]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

from ninfer_core.ops import sampling as ops

VOCAB = 248320
BATCHES = (1, 4, 8, 16, 64)
CONFIGS = {"top_k20_top_p0.95": (20, 0.95), "top_p0.95": (0, 0.95)}


def make_logits(kind: str, batch: int, g: torch.Generator) -> torch.Tensor:
    """"llm": a Gaussian body with a few dominant tokens per row; "gauss": the body alone."""
    x = torch.randn(batch, VOCAB, generator=g) * 2.5
    if kind == "llm":
        for i in range(batch):
            top = torch.randint(VOCAB, (8,), generator=g)
            x[i, top] += torch.linspace(14, 8, 8)
    return x.cuda()


def time_ms(fn: Callable[[], object], iters: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def measure(logits: torch.Tensor, params: tuple[torch.Tensor, ...], iters: int, ref_iters: int) -> dict:
    u = torch.rand(logits.shape[0], dtype=torch.float64, device="cuda")
    kernel_ms = time_ms(lambda: ops.sample(logits, *params, u), iters)
    probs_ms = time_ms(lambda: ops.filtered_probs(logits, *params), iters)
    ref_ms = time_ms(lambda: ops.sample_ref(logits, *params, u), ref_iters)
    agree = (ops.sample(logits, *params, u) == ops.sample_ref(logits, *params, u)).float().mean()
    kept = (ops.filtered_probs(logits, *params) > 0).sum(-1).float().mean()
    return {"kernel_ms": round(kernel_ms, 4), "probs_ms": round(probs_ms, 4), "reference_ms": round(ref_ms, 3),
            "speedup": round(ref_ms / kernel_ms, 1), "mean_kept_tokens": round(float(kept), 1),
            "tokens_agree": float(agree)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="JSON results path")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--ref-iters", type=int, default=5)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    results = []
    for kind in ("llm", "gauss"):
        for batch in BATCHES:
            logits = make_logits(kind, batch, g)
            if not ops.use_kernel(logits):
                raise SystemExit("the CUDA sampler kernel is unavailable (build ninfer_core._C)")
            for name, (k, p) in CONFIGS.items():
                params = (torch.full((batch,), 0.7, dtype=torch.float64, device="cuda"),
                          torch.full((batch,), k, device="cuda"),
                          torch.full((batch,), p, dtype=torch.float64, device="cuda"),
                          torch.zeros(batch, dtype=torch.float64, device="cuda"))
                row = {"logits": kind, "batch": batch, "config": name,
                       **measure(logits, params, args.iters, args.ref_iters)}
                print(json.dumps(row), flush=True)
                results.append(row)
    with open(args.json, "w") as f:
        json.dump({"vocab": VOCAB, "device": torch.cuda.get_device_name(), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()

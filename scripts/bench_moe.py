"""MoE op timings on a GPU at Qwen3.6-35B-A3B's routed-expert shape (E=256, top-8, H=2048, I=512).

decode   routing + the two expert kernels for N = 1 and 8 tokens, bf16 and int4 experts. Each
         timed pass is a CUDA graph of 32 calls over 32 different routings, so the selected
         experts come from HBM rather than L2; reported per call with the weight bytes a call must
         read (every (token, expert) pair's gate_up + down, scales included) and the bandwidth
         that makes, next to a plain device copy's. `eager_us` is one un-graphed call, and
         `reference_us` the old loop over hit experts (a host sync per layer) for comparison.
         `--layers L` spreads the routings over L layers' experts (the model's 40: 16 GB of int4
         experts, as a decode step touches them) against one layer's 0.4 GB; `router_us` is the
         router kernel (GEMV over the 256 + 1 rows and the top-k, `moe_router`) beside cuBLAS +
         `moe_route`.
prefill  the grouped path (sorted pairs + torch._grouped_mm) at N = 8192 tokens.

    python3 scripts/bench_moe.py OUT.json [--layers 40] [--decode-only]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ninfer_core.bench import cuda_median_ms  # noqa: E402
from ninfer_core.engine.graph_capture import capture  # noqa: E402
from ninfer_core.ops import dispatch, moe  # noqa: E402
from ninfer_core.ops.quant import QuantizedWeight, quantize  # noqa: E402

EXPERTS, TOP_K, HIDDEN, INTER = 256, 8, 2048, 512
ROUTINGS = 32




def copy_gb_s() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / cuda_median_ms(lambda: dst.copy_(src)) / 1e6


def experts(fmt: str) -> tuple[moe.ExpertTensor, moe.ExpertTensor]:
    gate_up = (
        torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda") / math.sqrt(HIDDEN)
    ).bfloat16()
    down = (torch.randn(EXPERTS, HIDDEN, INTER, device="cuda") / math.sqrt(INTER)).bfloat16()
    if fmt == "bf16":
        return gate_up, down
    return quantize(gate_up, fmt, 128), quantize(down, fmt, 128)


def nbytes(w: moe.ExpertTensor) -> int:
    return w.nbytes if isinstance(w, QuantizedWeight) else w.numel() * w.element_size()


def graphed(step: Callable[[int], object]) -> Callable[[], None]:
    """One CUDA graph of step(0..ROUTINGS-1), captured after a warm-up on a side stream."""
    def steps() -> None:
        for r in range(ROUTINGS):
            step(r)

    graph, _ = capture(steps)
    return graph.replay


def decode_case(fmt: str, tokens: int, layers: list) -> dict:
    gate_up, down = layers[0]
    x = torch.randn(tokens, HIDDEN, device="cuda").bfloat16()
    logits = torch.randn(ROUTINGS, tokens, EXPERTS, device="cuda").bfloat16()
    routes = [moe.moe_route_ref(logits[r], TOP_K, True) for r in range(ROUTINGS)]
    expert_bytes = (nbytes(gate_up) + nbytes(down)) / EXPERTS
    pair_bytes = tokens * TOP_K * expert_bytes
    unique = statistics.mean(len(torch.unique(ids)) for _, ids in routes)

    experts_us = cuda_median_ms(
        graphed(lambda r: moe.moe_experts(x, *layers[r % len(layers)], *routes[r]))
    ) * 1e3 / ROUTINGS
    route_us = cuda_median_ms(graphed(lambda r: moe.moe_route(logits[r], TOP_K, True))) * 1e3 / ROUTINGS
    routers = [
        (torch.randn(EXPERTS + 1, HIDDEN, device="cuda") / math.sqrt(HIDDEN)).bfloat16() for _ in range(4)
    ]
    fused = [moe.moe_router(x, routers[r % 4], EXPERTS, TOP_K, True) for r in range(2)]
    router_us = (
        cuda_median_ms(graphed(lambda r: moe.moe_router(x, routers[r % 4], EXPERTS, TOP_K, True))) * 1e3 / ROUTINGS
        if fused[0] is not None else None
    )
    linear_route_us = cuda_median_ms(
        graphed(lambda r: moe.moe_route(F.linear(x, routers[r % 4])[:, :EXPERTS], TOP_K, True))
    ) * 1e3 / ROUTINGS
    return {
        "format": fmt,
        "tokens": tokens,
        "layers": len(layers),
        "kernel": moe._decode_plan(x, gate_up, down, *routes[0]) is not None,
        "experts_us": experts_us,
        "route_us": route_us,
        "router_us": router_us,
        "linear_route_us": linear_route_us,
        "eager_us": cuda_median_ms(lambda: moe.moe_experts(x, gate_up, down, *routes[0])) * 1e3,
        "reference_us": cuda_median_ms(lambda: moe.moe_experts_ref(x, gate_up, down, *routes[0]), 3) * 1e3,
        "weight_bytes": pair_bytes,
        "gb_s": pair_bytes / experts_us / 1e3,
        "unique_expert_bytes": unique * expert_bytes,
    }


def prefill_case(fmt: str, tokens: int, gate_up, down) -> dict:
    x = torch.randn(tokens, HIDDEN, device="cuda").bfloat16()
    weights, ids = moe.moe_route_ref(
        torch.randn(tokens, EXPERTS, device="cuda").bfloat16(), TOP_K, True
    )
    ms = cuda_median_ms(lambda: moe.moe_experts(x, gate_up, down, weights, ids), 5)
    flops = 2 * tokens * TOP_K * 3 * HIDDEN * INTER
    return {
        "format": fmt,
        "tokens": tokens,
        "ms": ms,
        "tflop_s": flops / ms / 1e9,
        "grouped_mm": moe._grouped_mm_works,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path, help="JSON results")
    parser.add_argument("--layers", type=int, default=1, help="layers of int4 experts the routings cycle over")
    parser.add_argument("--decode-only", action="store_true", help="no prefill case, int4 only")
    args = parser.parse_args()
    torch.manual_seed(0)
    result = {
        "gpu": torch.cuda.get_device_name(),
        "kernels": dispatch.kernels_available(),
        "copy_gb_s": copy_gb_s(),
        "decode": [],
        "prefill": [],
    }
    with torch.inference_mode():
        for fmt in ("int4",) if args.decode_only else ("bf16", "int4"):
            layers = [experts(fmt) for _ in range(args.layers if fmt == "int4" else 1)]
            for tokens in (1, 8):
                result["decode"].append(case := decode_case(fmt, tokens, layers))
                router = f"{case['router_us']:.1f}" if case["router_us"] is not None else "-"
                print(
                    f"decode {fmt} N={tokens} over {len(layers)} layers: {case['experts_us']:.1f} us "
                    f"({case['weight_bytes'] / 1e6:.1f} MB, {case['gb_s']:.0f} GB/s), "
                    f"route {case['route_us']:.1f} us, router {router} us (cuBLAS + route "
                    f"{case['linear_route_us']:.1f} us), eager {case['eager_us']:.1f} us, "
                    f"reference {case['reference_us']:.0f} us",
                    flush=True,
                )
            gate_up, down = layers[0]
            del layers
            if args.decode_only:
                continue
            result["prefill"].append(case := prefill_case(fmt, 8192, gate_up, down))
            print(
                f"prefill {fmt} N=8192: {case['ms']:.2f} ms ({case['tflop_s']:.0f} TFLOP/s)",
                flush=True,
            )
            del gate_up, down
            torch.cuda.empty_cache()
    print(f"copy bandwidth {result['copy_gb_s']:.0f} GB/s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""Host cost of the checked binding interface (csrc/tensor_arg.h): what reading a torch.Tensor at
the binding costs per tensor, beside the Python calls the raw-pointer interface made instead.

Runs on any machine where ninfer_core._C is built (no GPU needed): rmsnorm with CPU tensors goes
through every check and stops at the device check, so the difference between its 5-tensor and
3-tensor forms is two tensors read and checked (the exception both raise cancels out).

    python scripts/bench_binding_checks.py [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from ninfer_core.ops import dispatch


def per_call_us(call, calls: int = 50_000, rounds: int = 5) -> float:
    """Best of `rounds` of the mean time of `calls` calls, in microseconds (exceptions swallowed)."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            try:
                call()
            except ValueError:
                pass
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args()
    ext = dispatch.extension()
    if ext is None:
        raise SystemExit("ninfer_core._C is not built")
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    out, weight = torch.empty_like(x), torch.ones(64, dtype=torch.bfloat16)
    five = per_call_us(lambda: ext.rmsnorm(out, x, x, x, weight, 1e-6, False, 0))
    three = per_call_us(lambda: ext.rmsnorm(out, None, x, None, weight, 1e-6, False, 0))

    def old_interface() -> None:  # what the raw-pointer calls did in Python per tensor
        for t in (out, x, x, x, weight):
            t.data_ptr()

    result = {
        "rmsnorm_5_tensors_us": round(five, 3),
        "rmsnorm_3_tensors_us": round(three, 3),
        "read_and_check_per_tensor_us": round((five - three) / 2, 3),
        "data_ptr_per_tensor_us": round(per_call_us(old_interface) / 5, 3),
        "torch": torch.__version__,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

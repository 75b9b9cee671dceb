"""Gated DeltaNet timings on a GPU at the Qwen3.6-35B-A3B shape (Hk 16, Hv 32, dk = dv = 128,
K 4, bf16 activations, fp32 state), random inputs:

- decode step (`ops.gdn.gdn_decode_step`) for B = 1 and 8: the CUDA kernel replayed from a CUDA
  graph of 30 calls (one token's GDN layers, each on its own pools so the state comes from HBM as
  in a real step) and eager, against the torch reference (eager); per-call microseconds, the
  bytes a step must move and the kernel's GB/s;
- chunked prefill of one 8192-token sequence: `gated_delta_rule_chunked` (torch reference) vs
  flash-linear-attention (`ops.gdn.gated_delta_rule_fla`) where fla imports.

    python3 scripts/bench_gdn.py OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ninfer_core.bench import cuda_median_ms  # noqa: E402
from ninfer_core.engine.graph_capture import capture  # noqa: E402
from ninfer_core.layers.gdn import gated_delta_rule_chunked, l2norm  # noqa: E402
from ninfer_core.ops import gdn as gdn_ops  # noqa: E402

HK, HV, DK, DV, TAPS = 16, 32, 128, 128, 4
CHANNELS = 2 * HK * DK + HV * DV
LAYERS = 30  # GDN layers of the 35B
DTYPE = torch.bfloat16




def decode_layers(batch: int) -> list[dict]:
    """gdn_decode_step's arguments for LAYERS layers: shared weights, a pool pair per layer."""
    gen = torch.Generator(device="cuda").manual_seed(batch)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda") * scale

    shared = {
        "qkv": randn(batch, CHANNELS).to(DTYPE),
        "a": randn(batch, HV).to(DTYPE),
        "b": randn(batch, HV).to(DTYPE),
        "z": randn(batch, HV * DV).to(DTYPE),
        "slots": torch.arange(batch, device="cuda"),
        "w": gdn_ops.GDNWeights(
            conv_weight=randn(CHANNELS, TAPS, scale=0.3).to(DTYPE),
            A_log=torch.empty(HV, device="cuda").uniform_(1, 16, generator=gen).log().to(DTYPE),
            dt_bias=torch.ones(HV, device="cuda", dtype=DTYPE),
            norm_weight=torch.ones(DV, device="cuda", dtype=DTYPE),
            eps=1e-6, num_k_heads=HK, head_k_dim=DK, head_v_dim=DV,
        ),
    }
    return [
        {
            **shared,
            "conv_pool": randn(batch, CHANNELS, TAPS - 1).to(DTYPE),
            "state_pool": randn(batch, HV, DK, DV, scale=0.1),
        }
        for _ in range(LAYERS)
    ]


def decode_bytes(batch: int) -> int:
    """HBM bytes one layer's step must move: state and conv state in and out, inputs, output,
    conv weight (the fp32 activation scratch, 2 x B x C x 4, is not counted)."""
    elt = DTYPE.itemsize
    state = 2 * batch * HV * DK * DV * 4
    conv = 2 * batch * CHANNELS * (TAPS - 1) * elt
    inputs = batch * (CHANNELS + 2 * HV + HV * DV) * elt
    return state + conv + inputs + batch * HV * DV * elt + CHANNELS * TAPS * elt


def bench_decode(batch: int) -> dict:
    layers = decode_layers(batch)
    outs = [torch.empty(batch, HV * DV, device="cuda", dtype=DTYPE) for _ in layers]

    def kernel_step() -> None:
        for args, out in zip(layers, outs, strict=True):
            gdn_ops.gdn_decode_step(**args, out=out)

    def reference_step() -> None:
        for args in layers:
            gdn_ops.gdn_decode_step_ref(**args)

    per_call = 1e3 / LAYERS  # ms for LAYERS calls -> us per call
    result: dict = {"batch": batch, "bytes_per_call": decode_bytes(batch)}
    first = layers[0]
    tokens = [first[n][:, None] for n in ("qkv", "a", "b", "z")]
    step = gdn_ops.GDNStepInputs(*tokens, first["conv_pool"], first["state_pool"], first["slots"])
    if gdn_ops._kernel_applies(step, first["w"]):
        graph, _ = capture(kernel_step)
        result["kernel_graph_us"] = cuda_median_ms(graph.replay, repeats=50) * per_call
        result["kernel_eager_us"] = cuda_median_ms(kernel_step, repeats=20) * per_call
        result["kernel_gbps"] = result["bytes_per_call"] / (result["kernel_graph_us"] * 1e3)
    else:
        result["kernel"] = "not applicable (ninfer_core._C not built, or NINFER_DISABLE_KERNELS set)"
    result["reference_eager_us"] = cuda_median_ms(reference_step, repeats=10) * per_call
    return result


def bench_prefill(seq_len: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seq_len)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda")

    q = l2norm(randn(1, seq_len, HK, DK)) * DK**-0.5
    k = l2norm(randn(1, seq_len, HK, DK))
    v = randn(1, seq_len, HV, DV).to(DTYPE)
    g = -torch.nn.functional.softplus(randn(1, seq_len, HV))
    beta = torch.sigmoid(randn(1, seq_len, HV))
    state = randn(1, HV, DK, DV) * 0.1
    result: dict = {"seq_len": seq_len}
    ref_ms = cuda_median_ms(lambda: gated_delta_rule_chunked(q, k, v, g, beta, state), repeats=5, warmup=1)
    result["reference_ms"] = ref_ms
    result["reference_tok_s"] = seq_len / ref_ms * 1e3
    if gdn_ops._fla_chunk() is None:
        result["fla"] = "not importable"
        return result
    fla_ms = cuda_median_ms(lambda: gdn_ops.gated_delta_rule_fla(q, k, v, g, beta, state), repeats=10, warmup=2)
    result["fla_ms"] = fla_ms
    result["fla_tok_s"] = seq_len / fla_ms * 1e3
    result["fla_speedup"] = ref_ms / fla_ms
    ref_out, ref_state = gated_delta_rule_chunked(q, k, v, g, beta, state)
    out, final = gdn_ops.gated_delta_rule_fla(q, k, v, g, beta, state)
    result["fla_out_rel_err"] = ((out.float() - ref_out).norm() / ref_out.norm()).item()
    result["fla_state_rel_err"] = ((final - ref_state).norm() / ref_state.norm()).item()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="JSON file for the results")
    parser.add_argument("--prefill-tokens", type=int, default=8192)
    args = parser.parse_args()
    with torch.inference_mode():
        results = {
            "device": torch.cuda.get_device_name(),
            "shape": {"Hk": HK, "Hv": HV, "dk": DK, "dv": DV, "K": TAPS, "dtype": str(DTYPE), "layers": LAYERS},
            "decode": [bench_decode(batch) for batch in (1, 8)],
            "prefill": bench_prefill(args.prefill_tokens),
        }
    args.out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

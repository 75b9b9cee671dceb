"""One decode step, kernel kind by kernel kind: the bytes each kind must move and what it takes.

`scripts/profile_decode.py --timeline` records one graph replay's kernels in launch order; this
module names each kernel's kind (the quantized GEMVs by the projection they compute, counted off
in the model's forward order), counts the bytes that kind must move a step (weights read, the
experts a batch is expected to hit, the GDN state read and written, the KV of the context read),
and sets them against the time: the kernel's own start-to-end length, and its share of the step
(from the latest end before it to its own end: with programmatic dependent launch the next kernel
starts while this one runs, so the shares, not the lengths, add up to the step). Bytes over the
share is the bandwidth the step gets from that kind; METHOD.md counts bytes first for this.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from .bench import expected_hit
from .cache.manager import CacheManager
from .config import ModelConfig
from .models.quantize import weight_bytes

# Kernel base name -> the table's row (the quantized GEMVs are named by projection instead).
KERNEL_ROWS = {
    "router_kernel": "router (+ add + norm, top-k)",
    "gate_up_mma_kernel": "MoE gate_up (routed + shared)",
    "gate_up_kernel": "MoE gate_up (routed + shared)",  # moe.cu's: 16-bit / int8 experts, or fp32
    "down_mma_kernel": "MoE down (+ shared, weights, residual)",
    "down_staged_kernel": "MoE down (+ shared, weights, residual)",
    "down_kernel": "MoE down (+ shared, weights, residual)",
    "gdn_recurrent_kernel": "GDN recurrent (state read + written)",
    "gdn_commit_layers_kernel": "GDN recurrent (state read + written)",  # a verify's commits, layers together
    "decode_attention_kernel": "attention (KV read)",
    "decode_attention_reduce_kernel": "attention split reduce",
    "norm_rotary_kv_kernel": "q / k norm + RoPE + KV append",
    "rmsnorm_kernel": "rmsnorm",
    "gdn_conv_kernel": "GDN conv",
}
GEMV_KERNEL = "quant_gemv_kernel"
# 16-bit weights' projections run on cuBLAS (nvjet / gemv / gemm / CUTLASS kernels): one row, no bytes
# (projection_bytes counts the quantized GEMVs only).
DENSE_GEMM = "GEMM / GEMV (cuBLAS: 16-bit weights)"
_CUBLAS_NAME = re.compile(r"nvjet|gemm|gemv|cutlass", re.IGNORECASE)
OTHER = "other (step tables, embedding, copies)"


def kernel_base_name(name: str) -> str:
    """`void ninfer::(anonymous namespace)::quant_gemv_kernel<...>(...)` -> `quant_gemv_kernel`."""
    name = re.sub(r"^void ", "", name).replace("(anonymous namespace)::", "")
    name = re.split(r"[<(]", name, maxsplit=1)[0]
    return name.rsplit("::", 1)[-1]


def projection_bytes(model: nn.Module, config: ModelConfig) -> list[tuple[str, int]]:
    """The step's dense quantized projections in launch order: (row, bytes). A MoE layer's shared
    expert runs inside the experts' kernels, so only a dense MLP's projections are GEMVs."""
    out: list[tuple[str, int]] = []
    for layer in model.layers:
        if layer.is_linear:
            out += [("GEMV: GDN in_proj (+ its folds)", weight_bytes(layer.linear_attn.in_proj)),
                    ("GEMV: GDN out_proj", weight_bytes(layer.linear_attn.out_proj))]
        else:
            out += [("GEMV: attention qkv", weight_bytes(layer.self_attn.qkv_proj)),
                    ("GEMV: attention o_proj", weight_bytes(layer.self_attn.o_proj))]
        if not config.is_moe:
            out += [("GEMV: MLP gate_up", weight_bytes(layer.mlp.gate_up_proj)),
                    ("GEMV: MLP down", weight_bytes(layer.mlp.down_proj))]
    out.append(("GEMV: lm_head", weight_bytes(model.lm_head)))
    return out


def kind_bytes(model: nn.Module, config: ModelConfig, manager: CacheManager, batch: int,
               context: int, tokens: int = 1, state_passes: int = 2) -> dict[str, float]:
    """Bytes a step of `batch` sequences at `context` tokens must move, `tokens` new ones each (a
    verify round: K + 1), by the rows of KERNEL_ROWS (the GEMVs: projection_bytes). The GDN state is
    read and written once a step (`state_passes` 2; a verify round and its commit: 3, read twice).
    Small traffic (activations, norms' weights, the conv state) is not counted."""
    rows: dict[str, float] = {}

    def add(row: str, n: float) -> None:
        rows[row] = rows.get(row, 0.0) + n

    hit = expected_hit(config, batch * tokens) if config.is_moe else 0.0
    kv_per_layer = manager.cache.kv.bytes_per_token / max(1, len(manager.cache.kv.layers))
    for i, layer in enumerate(model.layers):
        if layer.is_linear:
            state = manager.cache.state.recurrent[i]
            add(KERNEL_ROWS["gdn_recurrent_kernel"], state_passes * batch * state[0].numel() * state.element_size())
        else:
            add(KERNEL_ROWS["decode_attention_kernel"], batch * context * kv_per_layer)
        if config.is_moe:
            moe = layer.mlp
            experts = {name: t for name, t in (*moe.experts.named_parameters(), *moe.experts.named_buffers())}
            shared = moe.shared_expert
            add(KERNEL_ROWS["router_kernel"], weight_bytes(moe.gates))
            add(KERNEL_ROWS["gate_up_mma_kernel"],
                hit * sum(t.numel() * t.element_size() for n, t in experts.items() if n.startswith("gate_up"))
                + (weight_bytes(shared.gate_up_proj) if shared is not None else 0))
            add(KERNEL_ROWS["down_mma_kernel"],
                hit * sum(t.numel() * t.element_size() for n, t in experts.items() if n.startswith("down"))
                + (weight_bytes(shared.down_proj) if shared is not None else 0))
    return rows


@dataclass
class KindRow:
    row: str
    calls: int = 0
    own_us: float = 0.0  # start to end, summed
    share_us: float = 0.0  # what it adds to the step after the kernels before it
    bytes: float = 0.0


def step_table(kernels: Sequence[dict], projections: Sequence[tuple[str, int]],
               kinds: dict[str, float]) -> list[KindRow]:
    """One replay's kernels (`start_us`, `us`, `name`, in launch order) by row, largest share first.
    The i-th GEMV computes projections[i]; where the counts differ (another launch order) the
    GEMVs form one row with the projections' bytes summed."""
    gemvs = [k for k in kernels if kernel_base_name(k["name"]) == GEMV_KERNEL]
    by_order = len(gemvs) == len(projections)
    table: dict[str, KindRow] = {}
    latest = kernels[0]["start_us"] if kernels else 0.0
    gemv_index = 0
    for k in kernels:
        base = kernel_base_name(k["name"])
        if base == GEMV_KERNEL:
            label, nbytes = projections[gemv_index] if by_order else ("GEMV: all projections", 0)
            gemv_index += 1
        else:
            label, nbytes = _row(base, k["name"]), 0
        row = table.setdefault(label, KindRow(label))
        end = k["start_us"] + k["us"]
        row.calls += 1
        row.own_us += k["us"]
        row.share_us += max(0.0, end - latest)
        row.bytes += nbytes
        latest = max(latest, end)
    if gemvs and not by_order:
        table["GEMV: all projections"].bytes = sum(b for _, b in projections)
    for label, nbytes in kinds.items():  # a kind whose kernel is not in the timeline: a row of no calls
        table.setdefault(label, KindRow(label)).bytes += nbytes
    return sorted(table.values(), key=lambda r: (-r.share_us, -r.bytes))


def _row(base: str, name: str) -> str:
    """The row of a kernel that is not one of our GEMVs."""
    return KERNEL_ROWS.get(base) or (DENSE_GEMM if _CUBLAS_NAME.search(name) else OTHER)


def markdown(table: Sequence[KindRow]) -> str:
    """The table as docs/performance.md prints it (bandwidths in TB/s)."""
    def tbs(nbytes: float, us: float) -> str:
        return f"{nbytes / us / 1e6:.2f}" if nbytes and us else "-"

    lines = ["| kernel kind | calls | us a call | us of the step (share) | MB a step | TB/s over the share "
             "| TB/s over its own time |", "|---|---|---|---|---|---|---|"]
    for r in table:
        per_call = f"{r.own_us / r.calls:.1f}" if r.calls else "-"
        lines.append(f"| {r.row} | {r.calls} | {per_call} | {r.share_us:.1f} | {r.bytes / 1e6:.1f} | "
                     f"{tbs(r.bytes, r.share_us)} | {tbs(r.bytes, r.own_us)} |")
    share, nbytes = sum(r.share_us for r in table), sum(r.bytes for r in table)
    lines.append(f"| **step** | {sum(r.calls for r in table)} | | {share:.1f} | {nbytes / 1e6:.1f} | "
                 f"{tbs(nbytes, share)} | |")
    return "\n".join(lines)


def compare(builds: dict[str, list[list[KindRow]]]) -> str:
    """Builds' steps by kernel kind side by side (each kind's share, the mean over a build's rounds),
    the later builds against the first: an A/B of a kernel patch shows which kinds it moved. A
    markdown table, the first build's largest kinds first, the step's span last."""
    names = list(builds)

    def mean_shares(rounds: list[list[KindRow]]) -> dict[str, float]:
        shares: dict[str, float] = {}
        for table in rounds:
            for r in table:
                shares[r.row] = shares.get(r.row, 0.0) + r.share_us / len(rounds)
        return shares

    shares = {name: mean_shares(rounds) for name, rounds in builds.items()}
    base = shares[names[0]]
    kinds = sorted({k for s in shares.values() for k in s}, key=lambda k: -base.get(k, 0.0))

    def cell(name: str, value: float, reference: float) -> str:
        if name == names[0] or not reference:
            return f"{value:.1f}"
        return f"{value:.1f} ({100 * (value / reference - 1):+.1f}%)"

    lines = ["| kernel kind (us of the step) | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for kind in kinds:
        lines.append(f"| {kind} | " + " | ".join(cell(n, shares[n].get(kind, 0.0), base.get(kind, 0.0))
                                                 for n in names) + " |")
    totals = {n: sum(s.values()) for n, s in shares.items()}
    lines.append("| **step** | " + " | ".join(cell(n, totals[n], totals[names[0]]) for n in names) + " |")
    return "\n".join(lines)

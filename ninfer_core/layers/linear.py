"""Projections that read the same input, merged into one GEMM, and how they load.

A decode step is launch-latency bound (tens of small kernels per layer inside a CUDA graph), so
the projections of one input (GDN q/k/v + z + b + a, attention q/k/v, MLP gate/up, router +
shared-expert gate) run as one Linear whose output is split. Checkpoints keep them apart
(`q_proj.weight`, `k_proj.weight`, ...): `merged_sources` maps each merged tensor to those names and
`checkpoint_parts` reads and checks them, for the plain copy (`load_parameters`: part by part into
the merged tensor's rows) and the quantized fill (`models/quantize.py`: concatenated along dim 0)
alike. The merged names are what `state_dict()` holds (the quantized artifact). A mixer's merged
input projection may get its input before the layer's RMSNorm (`PendingNorm`): a quantized one then
runs the add + norm inside its GEMV (`project_pending`, `quant_linear_add_norm`: one launch fewer);
so does the decoder's lm_head with the final norm.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..errors import ModelLoadError
from ..ops.quant import QuantLinear, quant_linear_add_norm
from .norm import PendingNorm


class MergedLinear(nn.Module):
    """`parts` names the checkpoint's sibling projections (e.g. {"q_proj": 2048, "k_proj": 512})
    and their output widths, in output order; the call returns one tensor per part (views of the
    one output). `linear` is a plain nn.Linear so the quantization recipe can swap it for a
    QuantLinear; the split does not care which."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool = False):
        super().__init__()
        self.parts = dict(parts)
        self.linear = nn.Linear(in_features, sum(self.parts.values()), bias=bias)

    def forward(self, x: torch.Tensor | PendingNorm) -> tuple[torch.Tensor, ...]:
        return self.split(project_pending(self.linear, x) if isinstance(x, PendingNorm) else self.linear(x))

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split(list(self.parts.values()), dim=-1)


def project_pending(linear: nn.Module, pending: PendingNorm) -> torch.Tensor:
    """linear(h) of a pending norm's h, setting pending.summed: one GEMV with the add + norm in
    front for a QuantLinear (at decode sizes on CUDA), else the add_norm kernel first (any other
    linear: nn.Linear, KQuantLinear). A mixer's first projection and the decoder's lm_head."""
    norm = pending.norm
    if not isinstance(linear, QuantLinear):
        return linear(pending.normed())
    y, pending.summed = quant_linear_add_norm(pending.x, pending.residual, norm.weight, norm.eps,
                                              norm.zero_centered, linear.quantized, linear.bias)
    return y


def merged_sources(module: nn.Module) -> dict[str, list[tuple[str, int]]]:
    """Name (within `module`) of every merged weight / bias -> the checkpoint tensors it
    concatenates along dim 0, as (name, rows). A part is a sibling of the MergedLinear:
    `self_attn.qkv_proj.linear.weight` <- `self_attn.q_proj.weight`, `self_attn.k_proj.weight`, ..."""
    sources: dict[str, list[tuple[str, int]]] = {}
    for name, m in module.named_modules():
        if isinstance(m, MergedLinear):
            parent = name.rpartition(".")[0]
            parent = f"{parent}." if parent else ""
            for tensor in ("weight", "bias"):
                sources[f"{name}.linear.{tensor}"] = [(f"{parent}{part}.{tensor}", n) for part, n in m.parts.items()]
    return sources


def source_names(sources: dict[str, list[tuple[str, int]]], name: str) -> list[str]:
    """The checkpoint names behind one model tensor name (itself unless merged)."""
    return [src for src, _ in sources[name]] if name in sources else [name]


def checkpoint_parts(
    get: Callable[[str], torch.Tensor],
    names: set[str],
    sources: dict[str, list[tuple[str, int]]],
    name: str,
    shape: Sequence[int],
    prefix: str = "",
) -> list[torch.Tensor]:
    """The checkpoint tensors behind the model tensor `name` of `shape` (checkpoint names carry
    `prefix`): [itself], or a merged tensor's parts, which concatenate along dim 0 to it. A missing
    or misshapen part is reported under its own checkpoint name."""
    shape = tuple(shape)
    parts = [(src, (rows, *shape[1:])) for src, rows in sources[name]] if name in sources else [(name, shape)]
    tensors = []
    for src, expected in parts:
        src = prefix + src
        if src not in names:
            raise ModelLoadError(f"checkpoint is missing tensor '{src}' (expected shape {expected})")
        tensor = get(src)
        if tuple(tensor.shape) != expected:
            raise ModelLoadError(f"tensor '{src}' has shape {tuple(tensor.shape)}, expected {expected}")
        tensors.append(tensor)
    return tensors


@torch.no_grad()
def load_parameters(module: nn.Module, get: Callable[[str], torch.Tensor], names: set[str], prefix: str = "") -> None:
    """Copy every parameter of `module` from the checkpoint tensor(s) behind its name; a merged
    one part by part into its row ranges (no concatenated copy)."""
    sources = merged_sources(module)
    for name, param in module.named_parameters():
        parts = checkpoint_parts(get, names, sources, name, param.shape, prefix)
        for rows, part in zip(param.split([len(t) for t in parts]), parts):
            rows.copy_(part)

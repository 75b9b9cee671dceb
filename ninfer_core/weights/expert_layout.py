"""Per-expert MoE tensors presented in the fused 3-D layout.

Qwen's BF16 releases store each MoE block's experts fused (`experts.gate_up_proj` [E, 2I, H] with
rows 0..I-1 the gate, `experts.down_proj` [E, H, I]); FP8 releases and transformers'
`save_pretrained` store them per expert (`experts.{e}.{gate_proj,up_proj,down_proj}.weight`).
`fuse_experts` finds the per-expert groups by name and `StackedExperts.load` builds the fused
tensor, so the model sees one layout.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import ModelLoadError

_PER_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
# fused tensor suffix -> the per-expert projections concatenated along rows, in order
FUSED_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


@dataclass(frozen=True)
class StackedExperts:
    """A fused expert tensor: per expert, the listed source tensors concatenated along rows."""

    name: str  # canonical fused name, for messages
    parts: tuple[tuple[str, ...], ...]  # [expert][part] source tensor names

    def load(self, get: Callable[[str], torch.Tensor]) -> torch.Tensor:
        first = [get(src) for src in self.parts[0]]
        shapes = [t.shape for t in first]
        if any(len(shape) != 2 or shape[1] != shapes[0][1] for shape in shapes):
            raise ModelLoadError(
                f"tensors {list(self.parts[0])}: shapes {[tuple(s) for s in shapes]} cannot form '{self.name}'"
            )
        out = torch.empty((len(self.parts), sum(s[0] for s in shapes), shapes[0][1]), dtype=first[0].dtype)
        for e, sources in enumerate(self.parts):
            tensors = first if e == 0 else [get(src) for src in sources]
            for src, t, shape in zip(sources, tensors, shapes):
                if t.shape != shape:
                    raise ModelLoadError(
                        f"tensor '{src}': shape {tuple(t.shape)} differs from expert 0's {tuple(shape)} ('{self.name}')"
                    )
            torch.cat(tensors, dim=0, out=out[e])
        return out


def fuse_experts(sources: dict[str, str]) -> tuple[dict[str, str], dict[str, StackedExperts]]:
    """Split {canonical name: source name} into plain tensors and fused expert tensors.

    Every per-expert group must hold experts 0..E-1, each with gate, up and down projections.
    """
    plain: dict[str, str] = {}
    groups: dict[str, dict[tuple[int, str], str]] = defaultdict(dict)
    for canonical, source in sources.items():
        m = _PER_EXPERT.match(canonical)
        if m:
            groups[m["prefix"]][(int(m["expert"]), m["proj"])] = source
        else:
            plain[canonical] = source
    fused: dict[str, StackedExperts] = {}
    for prefix, members in groups.items():
        num_experts = 1 + max(e for e, _ in members)
        some_canonical, some_source = next((f"{prefix}.{e}.{p}.weight", s) for (e, p), s in members.items())
        source_prefix = some_source[: len(some_source) - len(some_canonical)]
        for suffix, projs in FUSED_PARTS.items():
            if f"{prefix}.{suffix}" in plain:
                raise ModelLoadError(
                    f"tensor '{source_prefix}{prefix}.{suffix}' is stored both fused and per expert"
                )
            for e in range(num_experts):
                for p in projs:
                    if (e, p) not in members:
                        raise ModelLoadError(
                            f"tensor '{source_prefix}{prefix}.{e}.{p}.weight' not found "
                            f"(the checkpoint has experts up to {num_experts - 1} for '{prefix}')"
                        )
            parts = tuple(tuple(members[(e, p)] for p in projs) for e in range(num_experts))
            fused[f"{prefix}.{suffix}"] = StackedExperts(f"{prefix}.{suffix}", parts)
    return plain, fused

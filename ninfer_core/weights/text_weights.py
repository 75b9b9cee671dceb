"""The text model's weights under canonical names, whatever the checkpoint layout.

Canonical names drop the text-model prefix: `model.language_model.` in the multimodal layout
(`*ForConditionalGeneration`), `model.` in text-only `*ForCausalLM` checkpoints, none in a bare
decoder's (`*Model`: Qwen3-Embedding's layout). `lm_head.weight` and `mtp.*` keep their names; vision
tensors (`model.visual.*`) are not part of the text view.
MoE experts always appear fused (`layers.{i}.mlp.experts.gate_up_proj` [E, 2I, H],
`layers.{i}.mlp.experts.down_proj` [E, H, I]), stacked on `get` when stored per expert.
"""

from __future__ import annotations

import torch

from ..errors import ModelLoadError
from .checkpoint import Checkpoint
from .expert_layout import fuse_experts

MULTIMODAL_PREFIX = "model.language_model."
TEXT_ONLY_PREFIX = "model."
KEPT_NAMES = ("lm_head.weight",)
KEPT_PREFIXES = ("mtp.",)


def canonical_sources(names: set[str]) -> dict[str, str]:
    """{canonical name: checkpoint name} for the text model's tensors."""
    prefix = next((p for p in (MULTIMODAL_PREFIX, TEXT_ONLY_PREFIX) if any(n.startswith(p) for n in names)), "")
    sources = {}
    for name in names:
        if name in KEPT_NAMES or name.startswith(KEPT_PREFIXES):
            sources[name] = name
        elif name.startswith(prefix):
            sources[name.removeprefix(prefix)] = name
    return sources


class TextWeights:
    """`names()` / `get(name, dtype)` over canonical names (the model's `load_weights` contract)."""

    def __init__(self, checkpoint: Checkpoint):
        self._checkpoint = checkpoint
        self._plain, self._fused = fuse_experts(canonical_sources(checkpoint.names()))

    def names(self) -> set[str]:
        return set(self._plain) | set(self._fused)

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        if name in self._plain:
            return self._checkpoint.get(self._plain[name], dtype)
        if name in self._fused:
            return self._fused[name].load(lambda source: self._checkpoint.get(source, dtype))
        raise ModelLoadError(f"{self._checkpoint.directory}: text-model tensor '{name}' not found in the checkpoint")

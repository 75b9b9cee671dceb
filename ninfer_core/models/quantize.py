"""Weight recipes (`--weights auto|bf16|int8|int4`): which module gets which quantized format.

The model is built on the meta device, its Linear / expert modules are swapped for quantized ones
(still meta: shapes only), then materialised on the target device and filled tensor by tensor:
each checkpoint tensor is read, moved to the device and quantized there, so the full-precision
model never exists in memory (a 35B checkpoint in bf16 would not fit most GPUs).

Recipes (the defaults of GPU decode engines: the routed experts hold ~95% of a MoE's bytes and
take int4 well; attention, GDN projections, the shared expert and lm_head are few bytes and more
sensitive, so they keep int8):
  bf16  nothing quantized (the model dtype);
  int8  every large Linear and the experts int8 per output channel;
  int4  routed experts and dense-MLP projections int4 (group 128, or 64 / 32 where 128 does not
        divide the input width; bf16 scales), the rest int8.
Small projections (< 64 outputs) and the router with the shared-expert gate (one merged Linear)
stay in the model dtype: their bytes do not matter and routing is sensitive to them. GDN a/b are
rows of the merged GDN input projection (`layers/linear.py`) and share its int8 format (scales are
per output row, so they keep their own range).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import NinferError
from ..layers.linear import checkpoint_parts, merged_sources, source_names
from ..layers.moe import Experts, SparseMoE
from ..ops import dispatch
from ..ops.quant import QuantLinear, quantize

WEIGHT_MODES = ("auto", "bf16", "int8", "int4")
MIN_QUANT_OUT_FEATURES = 64
GROUP_SIZES = (128, 64, 32)  # int4 groups, preferred first; a shape none divides gets int8
AUTO_MIN_PARAMS = 2_000_000_000  # `auto` quantizes models from this size on


def int4_group(*in_features: int) -> int | None:
    """The largest preferred int4 group that divides every input width (None: int4 does not fit)."""
    return next((g for g in GROUP_SIZES if all(k % g == 0 for k in in_features)), None)


@dataclass(frozen=True)
class QuantRecipe:
    mode: str  # "bf16" (none) | "int8" | "int4"

    @property
    def quantized(self) -> bool:
        return self.mode != "bf16"

    @property
    def key(self) -> str:
        """Names the recipe in the on-disk artifact (a change of format gets a new key)."""
        return self.mode if not self.quantized else f"{self.mode}-v2"  # v2: merged projections

    def label(self, dtype: torch.dtype) -> str:
        """What the weights are, for reports: the recipe key, or the model dtype when unquantized."""
        return self.key if self.quantized else str(dtype).removeprefix("torch.")

    def linear_format(self, name: str, linear: nn.Linear, router: bool) -> tuple[str, int] | None:
        """(kind, int4 group or 0) for one Linear, None to keep it in the model dtype."""
        if not self.quantized or router or linear.out_features < MIN_QUANT_OUT_FEATURES:
            return None
        dense_ffn = ".mlp." in name and ".shared_expert." not in name
        group = int4_group(linear.in_features)
        if self.mode == "int4" and dense_ffn and group is not None:
            return "int4", group
        return "int8", 0

    def experts_format(self, experts: Experts) -> tuple[str, int] | None:
        if not self.quantized:
            return None
        group = int4_group(experts.gate_up_proj.shape[-1], experts.down_proj.shape[-1])
        if self.mode == "int4" and group is not None:
            return "int4", group
        return "int8", 0


def resolve_recipe(mode: str, device: torch.device, dtype: torch.dtype, params: int) -> QuantRecipe:
    """`auto`: int4 for a half-precision model of at least AUTO_MIN_PARAMS parameters on a GPU with
    our kernels (the fast decode path); otherwise the model dtype: the CPU path would only
    dequantize on every call, a float32 model was asked for exactness, and a small model is fast
    in bf16 anyway while 4 bits cost it the most accuracy (SmolLM2-135M: KL 0.36 at int4)."""
    if mode not in WEIGHT_MODES:
        raise NinferError(f"unsupported --weights '{mode}' (use {', '.join(WEIGHT_MODES)})")
    if mode == "auto":
        half = dtype in (torch.bfloat16, torch.float16)
        fast = half and device.type == "cuda" and dispatch.kernels_available()
        mode = "int4" if fast and params >= AUTO_MIN_PARAMS else "bf16"
    return QuantRecipe(mode)


def apply_recipe_(model: nn.Module, recipe: QuantRecipe) -> None:
    """Swap Linear / expert modules for quantized ones (works on meta tensors: shapes only)."""
    if not recipe.quantized:
        return
    routers = {id(m.gates.linear) for m in model.modules() if isinstance(m, SparseMoE)}
    for name, module in list(model.named_modules()):
        if isinstance(module, Experts) and (fmt := recipe.experts_format(module)) is not None:
            module.quantize_(*fmt)
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                full = f"{name}.{child_name}" if name else child_name
                fmt = recipe.linear_format(full, child, id(child) in routers)
                if fmt is not None:
                    setattr(module, child_name, QuantLinear.from_linear(child, *fmt))


@torch.no_grad()
def fill_quantized_(
    model: nn.Module, get: Callable[[str], torch.Tensor], names: set[str], device: torch.device
) -> set[str]:
    """Quantize the checkpoint tensors of every quantized module into its buffers (a merged
    projection's parts concatenated first); returns the checkpoint names consumed (the caller
    copies the rest as plain parameters)."""
    sources = merged_sources(model)
    consumed: set[str] = set()
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, QuantLinear):
            source = prefix + "weight"
            if name == "lm_head" and getattr(model.config, "tie_word_embeddings", False):
                source = "embed_tokens.weight"
            parts = checkpoint_parts(get, names, sources, source, (module.out_features, module.in_features))
            weight = torch.cat([t.to(device) for t in parts]) if len(parts) > 1 else parts[0].to(device)
            _store(module, "", quantize(weight, module.kind, module.group_size))
            consumed.update(source_names(sources, prefix + "weight"))
        elif isinstance(module, Experts) and module.kind is not None:
            for part in ("gate_up_proj", "down_proj"):
                _store(module, f"{part.removesuffix('_proj')}_", quantize(get(prefix + part).to(device), module.kind,
                                                                         module.group_size))
                consumed.add(prefix + part)
    return consumed


def _store(module: nn.Module, prefix: str, qw) -> None:
    getattr(module, f"{prefix}qweight").copy_(qw.qweight)
    getattr(module, f"{prefix}scales").copy_(qw.scales)


def unique_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    """Every parameter and buffer (quantized weights included) once, tied ones counted once."""
    seen: set[int] = set()
    for t in (*model.parameters(), *model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            yield t


def weight_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in unique_tensors(model))

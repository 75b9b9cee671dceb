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
        divide the input width; bf16 scales), the rest int8;
  gguf  (`auto` for a GGUF file on the CPU) each Linear and the embedding table keep the file's
        own quantization: Q4_K / Q5_K / Q6_K / Q8_0 / Q4_0 / Q4_1 matrices their blocks as they are
        (ops/kquant.py; a merged projection of up to 8 such parts stacks them, whatever their mix),
        other types mapped to our
        formats without a second grid (weights/gguf_quant.py), a merged projection in its parts'
        common format (ops/quant_convert.py; a K-quant part beside another type is mapped too),
        routed experts each part in the file's format (K-quant blocks as they are, each expert
        packed on its own: a Q4_K_M file's Q4_K gate / up and Q4_K / Q6_K down; other types
        mapped); tensors without a mapping (float, Q2_K, Q3_K, IQ*) are quantized to int8 per row
        with fp16 scales.
Small projections (< 64 outputs) and the router with the shared-expert gate (one merged Linear)
stay in the model dtype under int8 / int4 (the router under gguf too): their bytes do not matter
and routing is sensitive to them. GDN a/b are rows of the merged GDN input projection
(`layers/linear.py`) and share its int8 format (scales are per output row, so they keep their own
range).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from ..errors import ModelLoadError, NinferError
from ..layers.linear import checkpoint_parts, merged_sources, source_names
from ..layers.moe import Experts, SparseMoE
from ..ops import dispatch
from ..ops.kquant import MAX_PARTS, KQuantEmbedding, KQuantFormat, KQuantLinear
from ..ops.quant import QuantEmbedding, QuantFormat, QuantizedWeight, QuantLinear, quantize
from ..ops.quant_convert import common_format, concat_rows, convert
from ..weights.kquant_layout import BLOCK_TYPES, pack_rows

WEIGHT_MODES = ("auto", "bf16", "int8", "int4")
MIN_QUANT_OUT_FEATURES = 64
GROUP_SIZES = (128, 64, 32)  # int4 groups, preferred first; a shape none divides gets int8
AUTO_MIN_PARAMS = 2_000_000_000  # `auto` quantizes models from this size on


def int4_group(*in_features: int) -> int | None:
    """The largest preferred int4 group that divides every input width (None: int4 does not fit)."""
    return next((g for g in GROUP_SIZES if all(k % g == 0 for k in in_features)), None)


# gguf recipe: the format of a tensor the file does not give one (float, or no exact mapping).
GGUF_FALLBACK = QuantFormat("int8", 0, torch.float16)


@dataclass(frozen=True)
class QuantRecipe:
    mode: str  # "bf16" (none) | "int8" | "int4" | "gguf"
    # gguf: each checkpoint tensor's own format (None: none; it gets GGUF_FALLBACK)
    file_formats: Mapping[str, QuantFormat | KQuantFormat | None] = field(default_factory=dict, compare=False)

    @property
    def quantized(self) -> bool:
        return self.mode != "bf16"

    @property
    def key(self) -> str:
        """Names the recipe in the on-disk artifact (a change of format gets a new key)."""
        return self.mode if self.mode in ("bf16", "gguf") else f"{self.mode}-v2"  # v2: merged projections

    def label(self, dtype: torch.dtype) -> str:
        """What the weights are, for reports: the recipe key, or the model dtype when unquantized."""
        return self.key if self.quantized else str(dtype).removeprefix("torch.")

    def linear_format(self, name: str, linear: nn.Linear, router: bool,
                      sources: list[str]) -> QuantFormat | KQuantFormat | None:
        """The format of one Linear (`sources`: the checkpoint tensors behind its weight), None to
        keep it in the model dtype."""
        if self.mode == "gguf":
            if router:  # llama.cpp keeps the router in float too (ffn_gate_inp: F32)
                return None
            formats = [self.file_format(src) for src in sources]
            if all(isinstance(f, KQuantFormat) for f in formats):
                parts = tuple(part for f in formats for part in f.parts)
                if len(parts) <= MAX_PARTS:
                    return KQuantFormat(parts)
            return common_format([_mapped(f) for f in formats], linear.in_features)
        if not self.quantized or router or linear.out_features < MIN_QUANT_OUT_FEATURES:
            return None
        dense_ffn = ".mlp." in name and ".shared_expert." not in name
        group = int4_group(linear.in_features)
        if self.mode == "int4" and dense_ffn and group is not None:
            return QuantFormat("int4", group)
        return QuantFormat("int8")

    def file_format(self, name: str) -> QuantFormat | KQuantFormat:
        """gguf: the format a checkpoint tensor takes."""
        return self.file_formats.get(name) or GGUF_FALLBACK

    def embedding_format(self) -> QuantFormat | KQuantFormat | None:
        """The embedding table's format: the file's under gguf (None: float in the file), else none."""
        return self.file_formats.get("embed_tokens.weight") if self.mode == "gguf" else None

    def experts_format(self, name: str, experts: Experts) -> tuple[QuantFormat | KQuantFormat, ...] | None:
        """The (gate_up, down) formats of a layer's routed experts (`name`: the module's), None to
        keep them in the model dtype. gguf: each part in the file's format: K-quant blocks as they
        are (a Q4_K_M file's Q4_K gate / up and Q4_K or Q6_K down), other types mapped to ours,
        else GGUF_FALLBACK."""
        if not self.quantized:
            return None
        if self.mode == "gguf":
            return tuple(self.file_format(f"{name}.{part}_proj") for part in ("gate_up", "down"))
        group = int4_group(experts.gate_up_proj.shape[-1], experts.down_proj.shape[-1])
        fmt = QuantFormat("int4", group) if self.mode == "int4" and group is not None else QuantFormat("int8")
        return fmt, fmt


def _mapped(fmt: QuantFormat | KQuantFormat) -> QuantFormat:
    """A K-quant tensor merged with a part of another type: its blocks mapped to our formats
    (weights/gguf_quant.py) like that part's."""
    if isinstance(fmt, QuantFormat):
        return fmt
    from ..weights.gguf_quant import gguf_format

    return gguf_format(BLOCK_TYPES[fmt.parts[0][0]][0])


def resolve_recipe(
    mode: str,
    device: torch.device,
    dtype: torch.dtype,
    params: int,
    *,
    exact: bool = False,
    gguf_formats: Mapping[str, QuantFormat | KQuantFormat | None] | None = None,
) -> QuantRecipe:
    """`auto` on a GPU: int4 for a half-precision model of at least AUTO_MIN_PARAMS parameters with
    our kernels (the fast decode path); otherwise the model dtype: a float32 model was asked for
    exactness, and a small model is fast in bf16 anyway while 4 bits cost it the most accuracy
    (SmolLM2-135M: KL 0.36 at int4).
    `auto` on the CPU, where decode is bound by the bytes it reads at every size: a GGUF keeps
    its own quantization (`gguf_formats`, from the file), other checkpoints take int8, unless a
    dtype was asked for (`exact`: --dtype float32 runs stay exact)."""
    if mode not in WEIGHT_MODES:
        raise NinferError(f"unsupported --weights '{mode}' (use {', '.join(WEIGHT_MODES)})")
    if mode != "auto":
        return QuantRecipe(mode)
    if device.type == "cpu":
        if exact:
            return QuantRecipe("bf16")
        return QuantRecipe("gguf", gguf_formats) if gguf_formats is not None else QuantRecipe("int8")
    half = dtype in (torch.bfloat16, torch.float16)
    fast = half and device.type == "cuda" and dispatch.kernels_available()
    return QuantRecipe("int4" if fast and params >= AUTO_MIN_PARAMS else "bf16")


def apply_recipe_(model: nn.Module, recipe: QuantRecipe, within: str | None = None) -> None:
    """Swap Linear / expert / embedding modules for quantized ones (on meta tensors: shapes only;
    a module given a format gets empty buffers on the Linear's device). `within`: only the modules
    under that module name (random_model quantizes a layer at a time); modules quantized already are
    left as they are."""
    if not recipe.quantized:
        return
    routers = {id(m.gates.linear) for m in model.modules() if isinstance(m, SparseMoE)}
    sources = merged_sources(model)
    for name, module in list(model.named_modules()):
        if within is not None and name != within and not name.startswith(within + "."):
            continue
        if (isinstance(module, Experts) and not module.formats
                and (formats := recipe.experts_format(name, module)) is not None):
            module.quantize_(*formats)
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                full = f"{name}.{child_name}" if name else child_name
                fmt = recipe.linear_format(full, child, id(child) in routers,
                                           source_names(sources, _weight_source(model, full)))
                if fmt is None:
                    continue
                if isinstance(fmt, KQuantFormat):  # only a GGUF's blocks fill it: the load path
                    quantized = KQuantLinear.empty(child.in_features, fmt, child.bias is not None,
                                                   child.weight.device, child.weight.dtype)
                elif child.weight.is_meta:  # the load path: buffers of the format, filled later
                    quantized = QuantLinear.empty(child.in_features, child.out_features, fmt, child.bias is not None,
                                                  child.weight.device, child.weight.dtype)
                else:  # a materialised (random-weight) model: its weights quantized now
                    quantized = QuantLinear.from_linear(child, fmt.kind, fmt.group_size, fmt.scale_dtype)
                setattr(module, child_name, quantized)
    embed = getattr(model, "embed_tokens", None)  # a model's table (an MTP block has none)
    if within is None and (fmt := recipe.embedding_format()) is not None and isinstance(embed, nn.Embedding):
        if isinstance(fmt, KQuantFormat):
            model.embed_tokens = KQuantEmbedding.empty(fmt, embed.embedding_dim, embed.weight.device, embed.weight.dtype)
        else:
            qw = QuantizedWeight.empty(fmt, embed.num_embeddings, embed.embedding_dim, embed.weight.device)
            model.embed_tokens = QuantEmbedding(qw, embed.weight.dtype)
        model.tie_weights()


def _weight_source(model: nn.Module, linear: str) -> str:
    """The model tensor name of a Linear's weight; a tied lm_head reads the embedding table."""
    if linear == "lm_head" and getattr(model.config, "tie_word_embeddings", False):
        return "embed_tokens.weight"
    return f"{linear}.weight"


@torch.no_grad()
def fill_quantized_(
    model: nn.Module,
    get: Callable[[str], torch.Tensor],
    names: set[str],
    device: torch.device,
    recipe: QuantRecipe,
    get_quantized: Callable[[str], QuantizedWeight] | None = None,
    get_blocks: Callable[[str], np.ndarray] | None = None,
    get_expert_blocks: Callable[[str], list[np.ndarray]] | None = None,
) -> set[str]:
    """Fill every quantized module's buffers (a merged projection's parts concatenated first):
    under gguf from the file's own quantized tensors (`get_quantized`, and `get_blocks` /
    `get_expert_blocks` for the K-quant blocks kept as they are), else by quantizing the checkpoint
    tensors. Returns the checkpoint names consumed (the caller copies the rest as plain parameters)."""
    sources = merged_sources(model)
    consumed: set[str] = set()
    filled: set[int] = set()  # a tied lm_head shares the embedding's buffers: filled once
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        kquant = isinstance(module, (KQuantLinear, KQuantEmbedding))
        if kquant or isinstance(module, (QuantLinear, QuantEmbedding)):
            first = (module.blocks if kquant else module.qweight).data_ptr()
            if first in filled:
                continue
            filled.add(first)
            source = _weight_source(model, name) if isinstance(module, (QuantLinear, KQuantLinear)) else prefix + "weight"
            qw = module.quantized
            shape = (qw.out_features, qw.in_features)
            if kquant:
                module.blocks.copy_(torch.from_numpy(_packed(get_blocks, source_names(sources, source), qw.parts)))
            elif recipe.mode == "gguf":
                merged = concat_rows([get_quantized(src) if recipe.file_formats.get(src) else _quantize_fallback(get(src))
                                      for src in source_names(sources, source)])
                if merged.shape != shape:
                    raise ModelLoadError(f"'{source}' (from {', '.join(source_names(sources, source))}) has shape "
                                         f"{merged.shape}, expected {shape}")
                _store(module, "", convert(merged, qw.format))
            else:
                parts = checkpoint_parts(get, names, sources, source, shape)
                weight = torch.cat([t.to(device) for t in parts]) if len(parts) > 1 else parts[0].to(device)
                fmt = qw.format
                _store(module, "", quantize(weight, fmt.kind, fmt.group_size, fmt.scale_dtype))
            # a tied lm_head reads the embedding's tensor but does not consume it
            consumed.update(source_names(sources, prefix + "weight"))
        elif isinstance(module, Experts) and module.formats:
            for part, fmt in module.formats.items():
                source = f"{prefix}{part}_proj"
                consumed.add(source)
                if isinstance(fmt, KQuantFormat):  # the file's blocks, each expert packed on its own
                    module.get_buffer(f"{part}_blocks").copy_(torch.from_numpy(
                        _packed_experts(get_expert_blocks(source), fmt.parts)))
                    continue
                if recipe.mode == "gguf" and recipe.file_formats.get(source):  # the file's codes as they are
                    qw = get_quantized(source)
                else:
                    qw = quantize(get(source).to(device), fmt.kind, fmt.group_size, fmt.scale_dtype)
                expected = tuple(getattr(module, f"{part}_qweight").shape)
                if qw.format != fmt or tuple(qw.qweight.shape) != expected:
                    raise ModelLoadError(f"'{source}' is {qw.format} of shape {tuple(qw.shape)}, expected {fmt} "
                                         f"with codes {expected}")
                _store(module, f"{part}_", qw)
    return consumed


def _packed(get_blocks: Callable[[str], np.ndarray], names: list[str], parts: tuple[tuple[str, int], ...]) -> np.ndarray:
    """The packed bytes of a K-quant module whose parts are the file tensors `names`."""
    packed = []
    for src, (block, rows) in zip(names, parts, strict=True):
        blocks = get_blocks(src)
        if len(blocks) != rows:
            raise ModelLoadError(f"tensor '{src}' has {len(blocks)} rows, expected {rows}")
        packed.append(pack_rows(blocks, block))
    return np.concatenate(packed)


def _packed_experts(halves: list[np.ndarray], parts: tuple[tuple[str, int], ...]) -> np.ndarray:
    """[E, bytes]: each expert's rows of every half (gate, up) packed in turn (csrc/cpu/kquant.h)."""
    for blocks, (_, rows) in zip(halves, parts, strict=True):
        if blocks.shape[1] != rows:
            raise ModelLoadError(f"expert blocks have {blocks.shape[1]} rows, expected {rows}")
    return np.stack([np.concatenate([pack_rows(blocks[e], block) for blocks, (block, _) in zip(halves, parts)])
                     for e in range(halves[0].shape[0])])


def _quantize_fallback(weight: torch.Tensor) -> QuantizedWeight:
    """gguf: a tensor the file holds in float (or in a type without a mapping) -> GGUF_FALLBACK."""
    return quantize(weight.float(), GGUF_FALLBACK.kind, 0, GGUF_FALLBACK.scale_dtype)


def _store(module: nn.Module, prefix: str, qw: QuantizedWeight) -> None:
    getattr(module, f"{prefix}qweight").copy_(qw.qweight)
    getattr(module, f"{prefix}scales").copy_(qw.scales)
    if qw.offsets is not None:
        getattr(module, f"{prefix}offsets").copy_(qw.offsets)


def unique_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    """Every parameter and buffer (quantized weights included) once, tied ones counted once."""
    seen: set[int] = set()
    for t in (*model.parameters(), *model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            yield t


def weight_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in unique_tensors(model))

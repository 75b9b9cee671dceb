"""Fit estimates for a model by name: a pulled model (its own config) or an alias (its known shapes)."""

from __future__ import annotations

from ..config import ModelConfig, load_config
from ..errors import NinferError
from .aliases import resolve_alias
from .errors import HubError, ModelNotFoundError
from .fit import WEIGHT_BYTES, FitEstimate, GpuMemory, estimate_fit
from .registry import ModelEntry, Registry


def entry_config(entry: ModelEntry) -> ModelConfig:
    """The ModelConfig of a pulled model (config.json, or the GGUF metadata)."""
    try:
        if entry.gguf_file:
            from ..weights.gguf_reader import open_gguf

            return open_gguf(entry.path).config
        return load_config(entry.snapshot_dir)
    except NinferError as e:
        raise HubError(f"{entry.key}: no memory estimate ({e})") from None


def fit_for(
    spec: str,
    quantization: str | None = None,
    context: int | None = None,
    kv_dtype: str = "bf16",
    sequences: int = 1,
    gpu: GpuMemory | None = None,
    registry: Registry | None = None,
) -> FitEstimate:
    """Estimate for a pulled model, else an alias. Quantization defaults to the checkpoint's own;
    a GGUF file's weights count at their size on disk unless another quantization is asked for."""
    registry = registry or Registry()
    try:
        entry = registry.find(spec)
    except ModelNotFoundError:
        alias = resolve_alias(spec.partition("@")[0])
        if alias is None:
            raise
        return estimate_fit(alias.config, quantization or alias.quantization, context, kv_dtype, sequences, gpu)
    cfg = entry_config(entry)
    own = entry.summary.quantization if entry.summary else "bf16"
    quantization = quantization or own
    weight_bytes = entry.path.stat().st_size if entry.gguf_file and quantization not in WEIGHT_BYTES else None
    return estimate_fit(cfg, quantization, context, kv_dtype, sequences, gpu, weight_bytes=weight_bytes)

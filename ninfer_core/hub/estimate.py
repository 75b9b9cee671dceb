"""Fit estimates for a model by name (a pulled, local or the embedded model: its own config; an
alias: its known shapes) or by path."""

from __future__ import annotations

from pathlib import Path

from ..config import ModelConfig
from ..errors import NinferError
from .aliases import resolve_alias
from .catalog import CatalogModel, find_model, list_models, model_config
from .errors import HubError, ModelNotFoundError
from .fit import WEIGHT_BYTES, FitEstimate, GpuMemory, estimate_fit
from .registry import ModelEntry, Registry
from .summary import checkpoint_quantization


def entry_config(entry: ModelEntry) -> ModelConfig:
    """The ModelConfig of a pulled model (config.json, or the GGUF metadata)."""
    try:
        return model_config(entry.path)
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
    """Estimate for a pulled model, an alias, a local or the embedded model, or a path. Quantization
    defaults to the checkpoint's own; a GGUF file's weights count at their size on disk unless
    another quantization is asked for."""
    registry = registry or Registry()
    try:
        entry = registry.find(spec)
    except ModelNotFoundError:
        alias = resolve_alias(spec.partition("@")[0])
        if alias is not None:
            return estimate_fit(alias.config, quantization or alias.quantization, context, kv_dtype, sequences, gpu)
        path = Path(spec).expanduser()
        found = CatalogModel(path.name, path, "local") if path.exists() else find_model(spec, list_models(registry))
        if found is None:
            raise
        summary = found.summary()
        try:
            cfg = model_config(found.path)
        except NinferError as e:
            raise HubError(f"{spec}: no memory estimate ({e})") from None
        own = summary.quantization if summary else checkpoint_quantization(cfg)
        return _estimate(cfg, found.path, quantization or own, context, kv_dtype, sequences, gpu)
    own = entry.summary.quantization if entry.summary else "bf16"
    return _estimate(entry_config(entry), entry.path, quantization or own, context, kv_dtype, sequences, gpu)


def _estimate(cfg: ModelConfig, path: Path, quantization: str, context: int | None, kv_dtype: str, sequences: int,
              gpu: GpuMemory | None) -> FitEstimate:
    weight_bytes = path.stat().st_size if path.is_file() and quantization not in WEIGHT_BYTES else None
    return estimate_fit(cfg, quantization, context, kv_dtype, sequences, gpu, weight_bytes=weight_bytes)

"""Fit estimates for a model by name (a pulled, local or the embedded model: its own config; an
alias: its known shapes) or by path."""

from __future__ import annotations

from pathlib import Path

from ..config import ModelConfig
from ..errors import NinferError
from ..weights.gguf_split import model_bytes
from .aliases import resolve_alias
from .catalog import CatalogModel, find_model, list_models, model_config
from .errors import HubError, ModelNotFoundError
from .fit import WEIGHT_BYTES, FitEstimate, GpuMemory, estimate_fit
from .registry import Registry
from .summary import checkpoint_quantization


def fit_for(
    spec: str,
    quantization: str | None = None,
    context: int | None = None,
    kv_dtype: str = "bf16",
    sequences: int = 1,
    gpu: GpuMemory | None = None,
    registry: Registry | None = None,
) -> FitEstimate:
    """Estimate for a pulled model, an alias, a local or the embedded model, or a path."""
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
        return model_fit(found, quantization, context, kv_dtype, sequences, gpu)
    return model_fit(CatalogModel(entry.display_name, entry.path, "pulled", entry=entry), quantization, context,
                     kv_dtype, sequences, gpu)


def model_fit(model: CatalogModel, quantization: str | None = None, context: int | None = None,
              kv_dtype: str = "bf16", sequences: int = 1, gpu: GpuMemory | None = None,
              config: ModelConfig | None = None) -> FitEstimate:
    """Estimate for a model on disk (`config`: its ModelConfig when already read). Quantization
    defaults to the checkpoint's own; a GGUF file's weights count at their size on disk unless
    another quantization is asked for."""
    if config is None:
        try:
            config = model_config(model.path)
        except NinferError as e:
            raise HubError(f"{model.name}: no memory estimate ({e})") from None
    summary = model.summary()
    quantization = quantization or (summary.quantization if summary else checkpoint_quantization(config))
    gguf_size = model_bytes(model.path) if model.path.is_file() and quantization not in WEIGHT_BYTES else None
    return estimate_fit(config, quantization, context, kv_dtype, sequences, gpu, weight_bytes=gguf_size)

"""The one-line facts `ninfer ls` shows about a model: architecture, quantization, context, size."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from ..config import ModelConfig, load_config
from .fit import count_params

_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


@dataclass(frozen=True)
class ModelSummary:
    arch: str
    quantization: str  # "bf16", "fp8", or a GGUF file type such as "Q4_K_M"
    context: int
    params: int

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "ModelSummary":
        return cls(**data)


def checkpoint_quantization(cfg: ModelConfig) -> str:
    """fp8 etc. from `quantization_config.quant_method`, else the stored dtype."""
    if cfg.quantization and cfg.quantization.get("quant_method"):
        return str(cfg.quantization["quant_method"])
    return _DTYPE_NAMES.get(cfg.torch_dtype, cfg.torch_dtype)


def summarize_checkpoint(model_dir: Path) -> ModelSummary:
    """From config.json (raises ModelLoadError when ninfer cannot run the architecture)."""
    cfg = load_config(model_dir)
    return ModelSummary(cfg.arch, checkpoint_quantization(cfg), cfg.max_position_embeddings, count_params(cfg))


def summarize_gguf(path: Path) -> ModelSummary:
    """From GGUF metadata and tensor shapes (no tensor data is read)."""
    from gguf import LlamaFileType

    from ..weights.gguf_reader import GGUFFile

    gguf = GGUFFile(path)  # every shard of a split model
    field = gguf.metadata
    arch = str(field("general.architecture") or "unknown")
    file_type = field("general.file_type")
    try:
        quant = LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except (TypeError, ValueError):
        quant = "unknown"
    params = sum(int(t.n_elements) for t in gguf.tensors)
    return ModelSummary(arch, quant, int(field(f"{arch}.context_length") or 0), params)

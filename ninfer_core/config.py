"""Model configuration: one dataclass for every text architecture we run.

HF `config.json` (Qwen3.5/3.6 multimodal layout with `text_config`, or text-only) and GGUF
metadata are both mapped onto `ModelConfig`, so layers and models never read raw dicts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ModelLoadError

QWEN_ARCHS = ("qwen3_5_moe", "qwen3_5")
LLAMA_ARCHS = ("llama", "qwen2", "qwen3", "mistral")


@dataclass
class ModelConfig:
    arch: str  # "qwen3_5_moe" | "qwen3_5" | one of LLAMA_ARCHS
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: list[str]  # per layer: "full_attention" | "linear_attention"
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    mrope_section: list[int] | None = None  # e.g. [11, 11, 10]
    mrope_interleaved: bool = False
    attn_output_gate: bool = False  # Qwen3.5 gated attention: q_proj emits [query | gate] per head
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3, Qwen3.5)
    attention_bias: bool = False  # q/k/v bias (Qwen2)
    norm_zero_centered: bool = False  # Qwen3.5: x * (1 + w); llama: x * w
    # Gated DeltaNet (linear attention) layers
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    # Feed-forward: dense MLP when num_experts == 0, else sparse MoE
    intermediate_size: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    mtp_num_layers: int = 0
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str = "bfloat16"
    quantization: dict[str, Any] | None = None  # e.g. FP8 block scaling: {"quant_method": "fp8", ...}
    has_vision: bool = False

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def linear_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]


def _eos_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _require(cfg: dict, key: str, path: Path) -> Any:
    if key not in cfg:
        raise ModelLoadError(f"{path}: missing required key '{key}'")
    return cfg[key]


def config_from_hf_dict(raw: dict, path: Path) -> ModelConfig:
    """Map an HF config dict (top-level or nested `text_config`) onto ModelConfig."""
    model_type = raw.get("model_type", "")
    text = raw.get("text_config") or raw
    arch = model_type.removesuffix("_text") if model_type else text.get("model_type", "").removesuffix("_text")
    if arch not in QWEN_ARCHS + LLAMA_ARCHS:
        raise ModelLoadError(
            f"{path}: unsupported model_type '{model_type}' "
            f"(supported: {', '.join(QWEN_ARCHS + LLAMA_ARCHS)})"
        )
    hidden = int(_require(text, "hidden_size", path))
    num_layers = int(_require(text, "num_hidden_layers", path))
    num_heads = int(_require(text, "num_attention_heads", path))
    head_dim = int(text.get("head_dim") or hidden // num_heads)
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    rope_theta = float(rope.get("rope_theta", text.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        # llama3 / yarn / linear scaling change the frequencies: refuse rather than run wrong numerics.
        raise ModelLoadError(f"{path}: RoPE scaling type '{rope_type}' is not supported yet")
    is_qwen35 = arch in QWEN_ARCHS
    if is_qwen35:
        layer_types = text.get("layer_types") or [
            "full_attention" if (i + 1) % int(text.get("full_attention_interval", 4)) == 0 else "linear_attention"
            for i in range(num_layers)
        ]
    else:
        layer_types = ["full_attention"] * num_layers
    if len(layer_types) != num_layers:
        raise ModelLoadError(f"{path}: layer_types has {len(layer_types)} entries, num_hidden_layers is {num_layers}")
    eos = _eos_list(text.get("eos_token_id", raw.get("eos_token_id")))
    # Dense configs may still carry MoE keys (defaults written by save_pretrained): only MoE archs read them.
    moe = text if arch == "qwen3_5_moe" else {}
    return ModelConfig(
        arch=arch,
        vocab_size=int(_require(text, "vocab_size", path)),
        hidden_size=hidden,
        num_layers=num_layers,
        layer_types=list(layer_types),
        num_heads=num_heads,
        num_kv_heads=int(text.get("num_key_value_heads", num_heads)),
        head_dim=head_dim,
        rms_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        partial_rotary_factor=float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))),
        mrope_section=rope.get("mrope_section"),
        mrope_interleaved=bool(rope.get("mrope_interleaved", False)),
        attn_output_gate=bool(text.get("attn_output_gate", is_qwen35)),
        qk_norm=is_qwen35 or arch == "qwen3",
        attention_bias=bool(text.get("attention_bias", arch == "qwen2")),
        norm_zero_centered=is_qwen35,
        linear_num_key_heads=int(text.get("linear_num_key_heads", 0)),
        linear_num_value_heads=int(text.get("linear_num_value_heads", 0)),
        linear_key_head_dim=int(text.get("linear_key_head_dim", 0)),
        linear_value_head_dim=int(text.get("linear_value_head_dim", 0)),
        linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
        intermediate_size=int(text.get("intermediate_size", 0)),
        num_experts=int(moe.get("num_experts", 0)),
        num_experts_per_tok=int(moe.get("num_experts_per_tok", 0)),
        moe_intermediate_size=int(moe.get("moe_intermediate_size", 0)),
        shared_expert_intermediate_size=int(moe.get("shared_expert_intermediate_size", 0)),
        norm_topk_prob=bool(text.get("norm_topk_prob", True)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
        mtp_num_layers=int(text.get("mtp_num_hidden_layers", 0)),
        bos_token_id=text.get("bos_token_id", raw.get("bos_token_id")),
        eos_token_ids=eos,
        torch_dtype=str(text.get("dtype") or text.get("torch_dtype") or raw.get("torch_dtype") or "bfloat16"),
        quantization=raw.get("quantization_config") or text.get("quantization_config"),
        has_vision="vision_config" in raw,
    )


def read_json_object(path: Path, missing: str | None = None) -> dict:
    """A JSON object file, or one ModelLoadError naming it. An absent file is `{}` when optional
    (`missing` None), else an error whose hint `missing` says what the file should be."""
    if not path.is_file():
        if missing is None:
            return {}
        raise ModelLoadError(f"{path}: not found ({missing})")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return raw


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read `config.json` from an HF checkpoint directory."""
    path = Path(model_dir) / "config.json"
    raw = read_json_object(path, f"is '{model_dir}' a Hugging Face checkpoint directory?")
    return config_from_hf_dict(raw, path)


@dataclass
class GenerationDefaults:
    """Sampling defaults from `generation_config.json` (the user's flags override them)."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "GenerationDefaults":
        raw = read_json_object(Path(model_dir) / "generation_config.json")
        sample = raw.get("do_sample", True)
        return cls(
            temperature=raw.get("temperature") if sample else 0.0,
            top_k=raw.get("top_k"),
            top_p=raw.get("top_p"),
            min_p=raw.get("min_p"),
            repetition_penalty=raw.get("repetition_penalty"),
            presence_penalty=raw.get("presence_penalty"),
            eos_token_ids=_eos_list(raw.get("eos_token_id")),
        )

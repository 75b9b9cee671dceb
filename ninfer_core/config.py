"""Model configuration: one dataclass for every text architecture we run.

HF `config.json` (Qwen3.5/3.6 multimodal layout with `text_config`, or text-only) and GGUF
metadata are both mapped onto `ModelConfig`, so layers and models never read raw dicts.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
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


# Sanity bounds on a checkpoint's shape fields, far above any real model and far below what would
# send the loader into a terabyte allocation: a broken or hostile config.json / GGUF header is one
# error naming the file and the key, before anything is allocated.
MAX_VOCAB = 1 << 22  # the largest real vocabularies are ~260k tokens
MAX_WIDTH = 1 << 20  # hidden and intermediate sizes
MAX_COUNT = 1 << 14  # layers, heads, head dims, experts
MAX_POSITIONS = 1 << 26
_REQUIRED = object()


class ConfigFields:
    """Typed, bounded reads from one config source (an HF config dict, GGUF metadata)."""

    def __init__(self, get: Callable[[str], Any], where: str, prefix: str = ""):
        self._get = get  # key -> raw value, None when absent
        self.where = where
        self.prefix = prefix  # how the file spells a key (GGUF: "llama.")

    def _value(self, key: str, default: Any) -> Any:
        value = self._get(key)
        if value is None:
            if default is _REQUIRED:
                raise ModelLoadError(f"{self.where}: missing required key '{self.prefix}{key}'")
            return default
        return value

    def _bad(self, key: str, expected: str, value: Any) -> ModelLoadError:
        return ModelLoadError(f"{self.where}: '{self.prefix}{key}' must be {expected}, got {value!r:.80}")

    def integer(self, key: str, default: Any = _REQUIRED, *, low: int = 1, high: int = MAX_COUNT) -> Any:
        """An int in [low, high] (an integral float too); the default (None included) when absent."""
        value = self._value(key, default)
        if value is None:
            return None
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not (isinstance(value, int) and not isinstance(value, bool) and low <= value <= high):
            raise self._bad(key, f"an integer in [{low}, {high}]", value)
        return value

    def number(self, key: str, default: Any = _REQUIRED, *, high: float = math.inf) -> float:
        value = self._value(key, default)
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= high):
            raise self._bad(key, f"a number in (0, {high:g}]", value)
        return float(value)

    def token_ids(self, key: str) -> list[int]:
        """An id or a list of ids (eos_token_id's two spellings); [] when absent."""
        value = self._value(key, [])
        ids = value if isinstance(value, list) else [value]
        if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < MAX_VOCAB for v in ids):
            raise self._bad(key, "a token id or a list of token ids", value)
        return ids

    def strings(self, key: str, allowed: Sequence[str], default: Any = _REQUIRED) -> list[str]:
        value = self._value(key, default)
        if not (isinstance(value, list) and all(v in allowed for v in value)):
            raise self._bad(key, f"a list of {' / '.join(allowed)}", value)
        return value


def config_from_hf_dict(raw: dict, path: Path) -> ModelConfig:
    """Map an HF config dict (top-level or nested `text_config`) onto ModelConfig."""
    model_type = raw.get("model_type", "")
    text = raw.get("text_config") or raw
    if not isinstance(text, dict) or not isinstance(model_type, str) or not isinstance(text.get("model_type", ""), str):
        raise ModelLoadError(f"{path}: 'model_type' must be a string and 'text_config' an object")
    arch = model_type.removesuffix("_text") if model_type else text.get("model_type", "").removesuffix("_text")
    if arch not in QWEN_ARCHS + LLAMA_ARCHS:
        raise ModelLoadError(
            f"{path}: unsupported model_type '{model_type}' "
            f"(supported: {', '.join(QWEN_ARCHS + LLAMA_ARCHS)})"
        )
    f = ConfigFields(text.get, str(path))
    either = ConfigFields(lambda key: text.get(key, raw.get(key)), str(path))  # text_config first
    hidden = f.integer("hidden_size", high=MAX_WIDTH)
    num_layers = f.integer("num_hidden_layers", low=0)  # 0: an embedding table alone (tests, tools)
    num_heads = f.integer("num_attention_heads")
    head_dim = f.integer("head_dim", max(hidden // num_heads, 1))
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ModelLoadError(f"{path}: 'rope_parameters' / 'rope_scaling' must be an object, got {rope!r:.80}")
    r = ConfigFields(rope.get, str(path))
    rope_theta = r.number("rope_theta", f.number("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        # llama3 / yarn / linear scaling change the frequencies: refuse rather than run wrong numerics.
        raise ModelLoadError(f"{path}: RoPE scaling type '{rope_type}' is not supported yet")
    mrope_section = rope.get("mrope_section")
    if mrope_section is not None and not (isinstance(mrope_section, list) and all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= head_dim for v in mrope_section)):
        raise ModelLoadError(f"{path}: 'mrope_section' must be a list of integers, got {mrope_section!r:.80}")
    is_qwen35 = arch in QWEN_ARCHS
    if is_qwen35:
        interval = f.integer("full_attention_interval", 4)
        default_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
        layer_types = f.strings("layer_types", ("full_attention", "linear_attention"), default_types)
    else:
        layer_types = ["full_attention"] * num_layers
    if len(layer_types) != num_layers:
        raise ModelLoadError(f"{path}: layer_types has {len(layer_types)} entries, num_hidden_layers is {num_layers}")
    quantization = raw.get("quantization_config") or text.get("quantization_config")
    if quantization is not None and not isinstance(quantization, dict):
        raise ModelLoadError(f"{path}: 'quantization_config' must be an object, got {quantization!r:.80}")
    # Dense configs may still carry MoE keys (defaults written by save_pretrained): only MoE archs read them.
    moe = ConfigFields((text if arch == "qwen3_5_moe" else {}).get, str(path))
    num_experts = moe.integer("num_experts", 0, low=0)
    return ModelConfig(
        arch=arch,
        vocab_size=f.integer("vocab_size", high=MAX_VOCAB),
        hidden_size=hidden,
        num_layers=num_layers,
        layer_types=list(layer_types),
        num_heads=num_heads,
        num_kv_heads=f.integer("num_key_value_heads", num_heads),
        head_dim=head_dim,
        rms_eps=f.number("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        partial_rotary_factor=r.number("partial_rotary_factor", f.number("partial_rotary_factor", 1.0), high=1.0),
        mrope_section=mrope_section,
        mrope_interleaved=bool(rope.get("mrope_interleaved", False)),
        attn_output_gate=bool(text.get("attn_output_gate", is_qwen35)),
        qk_norm=is_qwen35 or arch == "qwen3",
        attention_bias=bool(text.get("attention_bias", arch == "qwen2")),
        norm_zero_centered=is_qwen35,
        linear_num_key_heads=f.integer("linear_num_key_heads", 0, low=0),
        linear_num_value_heads=f.integer("linear_num_value_heads", 0, low=0),
        linear_key_head_dim=f.integer("linear_key_head_dim", 0, low=0),
        linear_value_head_dim=f.integer("linear_value_head_dim", 0, low=0),
        linear_conv_kernel_dim=f.integer("linear_conv_kernel_dim", 4),
        intermediate_size=f.integer("intermediate_size", 0, low=0, high=MAX_WIDTH),
        num_experts=num_experts,
        num_experts_per_tok=moe.integer("num_experts_per_tok", 0, low=0, high=num_experts),
        moe_intermediate_size=moe.integer("moe_intermediate_size", 0, low=0, high=MAX_WIDTH),
        shared_expert_intermediate_size=moe.integer("shared_expert_intermediate_size", 0, low=0, high=MAX_WIDTH),
        norm_topk_prob=bool(text.get("norm_topk_prob", True)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        max_position_embeddings=f.integer("max_position_embeddings", 32768, high=MAX_POSITIONS),
        mtp_num_layers=f.integer("mtp_num_hidden_layers", 0, low=0),
        bos_token_id=either.integer("bos_token_id", None, low=0, high=MAX_VOCAB),
        eos_token_ids=either.token_ids("eos_token_id"),
        torch_dtype=str(text.get("dtype") or text.get("torch_dtype") or raw.get("dtype") or raw.get("torch_dtype")
                        or "bfloat16"),
        quantization=quantization,
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
        path = Path(model_dir) / "generation_config.json"
        raw = read_json_object(path)
        sample = raw.get("do_sample", True)
        return cls(
            temperature=raw.get("temperature") if sample else 0.0,
            top_k=raw.get("top_k"),
            top_p=raw.get("top_p"),
            min_p=raw.get("min_p"),
            repetition_penalty=raw.get("repetition_penalty"),
            presence_penalty=raw.get("presence_penalty"),
            eos_token_ids=ConfigFields(raw.get, str(path)).token_ids("eos_token_id"),
        )

"""Short names for the Qwen3.5 / Qwen3.6 family, with their text architecture for fit estimates.

Repository ids were checked against public sources (model cards, projects that load them).
Shapes come from the released config.json files as quoted by public code; where sources were
missing or disagreed, `unconfirmed` says what is assumed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import ModelConfig
from ..models.presets import PRESETS


@dataclass(frozen=True)
class Alias:
    name: str
    repo_id: str
    quantization: str  # of the checkpoint's weights: "bf16" or "fp8"
    config: ModelConfig  # the text architecture, so memory can be estimated before downloading
    unconfirmed: str = ""  # what public sources did not confirm (empty: all confirmed)


def _qwen35_dense(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
                  linear_value_heads: int, tied: bool) -> ModelConfig:
    """A dense Qwen3.5: Qwen3.6-27B's design (head_dim 256, GDN key heads 16 x 128) at another size."""
    return replace(
        PRESETS["qwen3.6-27b"],
        hidden_size=hidden,
        num_layers=layers,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        num_heads=heads,
        num_kv_heads=kv_heads,
        intermediate_size=intermediate,
        linear_num_value_heads=linear_value_heads,
        tie_word_embeddings=tied,
    )


_MOE_35B = PRESETS["qwen3.6-35b-a3b"]
_DENSE_27B = PRESETS["qwen3.6-27b"]

ALIASES: dict[str, Alias] = {a.name: a for a in (
    Alias("qwen3.6-35b-a3b", "Qwen/Qwen3.6-35B-A3B", "bf16", _MOE_35B),
    Alias("qwen3.6-35b-a3b-fp8", "Qwen/Qwen3.6-35B-A3B-FP8", "fp8", _MOE_35B),
    Alias("qwen3.6-27b", "Qwen/Qwen3.6-27B", "bf16", _DENSE_27B),
    Alias("qwen3.6-27b-fp8", "Qwen/Qwen3.6-27B-FP8", "fp8", _DENSE_27B),
    Alias("qwen3.5-35b-a3b", "Qwen/Qwen3.5-35B-A3B", "bf16", _MOE_35B),
    Alias("qwen3.5-27b", "Qwen/Qwen3.5-27B", "bf16", _DENSE_27B,
          unconfirmed="GDN value heads (48) taken from Qwen3.6-27B"),
    Alias("qwen3.5-9b", "Qwen/Qwen3.5-9B", "bf16", _qwen35_dense(4096, 32, 16, 4, 12288, 32, tied=False),
          unconfirmed="shapes are transformers' 'Qwen3.5-9B style' defaults, not the released config.json"),
    Alias("qwen3.5-4b", "Qwen/Qwen3.5-4B", "bf16", _qwen35_dense(2560, 32, 16, 4, 9216, 32, tied=True)),
    Alias("qwen3.5-2b", "Qwen/Qwen3.5-2B", "bf16", _qwen35_dense(2048, 24, 8, 2, 6144, 16, tied=True),
          unconfirmed="GDN value heads: sources say 16 or 32 (16 used)"),
    Alias("qwen3.5-0.8b", "Qwen/Qwen3.5-0.8B", "bf16", _qwen35_dense(1024, 24, 8, 2, 3584, 16, tied=True)),
)}


def resolve_alias(name: str) -> Alias | None:
    return ALIASES.get(name.lower())


def alias_for_repo(repo_id: str) -> Alias | None:
    return next((a for a in ALIASES.values() if a.repo_id.lower() == repo_id.lower()), None)

"""Will a model fit the local GPU? Weights at a quantization + KV cache at a context + GDN state.

The arithmetic (bytes, from ModelConfig):
  weights  = text parameters x bytes per parameter (bf16 2, fp8 1, int8 1, int4 0.5); MoE models
             count every expert, since all of them stay resident. Vision tower and MTP head are
             not counted (text generation does not load them).
  KV       = context x sequences x full-attention layers x 2 (k, v) x kv_heads x head_dim x KV bytes
  GDN      = sequences x linear-attention layers x (conv_dim x (kernel - 1) x 2 bytes [bf16 conv
             state] + value_heads x key_dim x value_dim x 4 bytes [fp32 recurrent state])
  runtime  = a flat 1 GiB for the CUDA context, activations and workspaces (rough)
The context defaults to what `ninfer run` allocates on a GPU: 32768 tokens, capped at the model's limit.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..cache import sizes
from ..cache.sizes import gdn_conv_dim
from ..config import ModelConfig
from .errors import HubError

WEIGHT_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}
KV_BYTES = sizes.KV_ITEM_BYTES  # the --kv-dtype choices (fp8 / int8 add scales)
RUNTIME_RESERVE_BYTES = 1 << 30
DEFAULT_CONTEXT = 32768  # the engine's default max_context on CUDA (ninfer_core.llm.DEFAULT_MAX_CONTEXT)


def _attention_params(cfg: ModelConfig) -> int:
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    n = h * q * (2 if cfg.attn_output_gate else 1) + 2 * h * kv + q * h  # q (+ gate), k, v, o
    if cfg.attention_bias:
        n += q + 2 * kv
    if cfg.qk_norm:
        n += 2 * d
    return n


def _gdn_params(cfg: ModelConfig) -> int:
    h, conv = cfg.hidden_size, gdn_conv_dim(cfg)
    value = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    return (
        h * conv  # in_proj_qkv
        + h * value  # in_proj_z
        + 2 * h * cfg.linear_num_value_heads  # in_proj_b, in_proj_a
        + conv * cfg.linear_conv_kernel_dim  # depthwise conv1d
        + 2 * cfg.linear_num_value_heads  # dt_bias, A_log
        + cfg.linear_value_head_dim  # gated RMSNorm
        + value * h  # out_proj
    )


def _ffn_params(cfg: ModelConfig, active: bool = False) -> int:
    """A layer's FFN parameters (active: those one token uses, its top-k routed experts only)."""
    h = cfg.hidden_size
    if not cfg.is_moe:
        return 3 * h * cfg.intermediate_size
    experts = cfg.num_experts_per_tok if active else cfg.num_experts
    n = h * cfg.num_experts + experts * 3 * h * cfg.moe_intermediate_size  # router + experts
    if cfg.shared_expert_intermediate_size:
        n += 3 * h * cfg.shared_expert_intermediate_size + h  # shared expert + its sigmoid gate
    return n


def count_params(cfg: ModelConfig) -> int:
    """Parameters of the text model (embeddings, decoder layers, final norm, lm_head unless tied)."""
    h = cfg.hidden_size
    total = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2) + h
    for kind in cfg.layer_types:
        mixer = _attention_params(cfg) if kind == "full_attention" else _gdn_params(cfg)
        total += 2 * h + mixer + _ffn_params(cfg)
    return total


def matmul_params_per_token(cfg: ModelConfig) -> int:
    """The decoder layers' parameters one prompt token multiplies with (its routed experts only; no
    embedding row, no lm_head, which a prefill runs for the last token alone): its matmul FLOPs / 2."""
    return sum((_attention_params(cfg) if kind == "full_attention" else _gdn_params(cfg)) + _ffn_params(cfg, True)
               for kind in cfg.layer_types)


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str = "bf16") -> int:
    """The engine's own count (cache/sizes.py), per-token scales of fp8 / int8 included."""
    _lookup(KV_BYTES, kv_dtype, "KV dtype")
    return sizes.kv_bytes_per_token(cfg, kv_dtype)


def gdn_state_bytes(cfg: ModelConfig) -> int:
    """GDN state of one sequence (bf16 conv window, fp32 recurrent state): the engine's count."""
    return sizes.gdn_state_bytes_per_slot(cfg, sizes.KV_ITEM_BYTES["bf16"])


def _lookup(table: dict, key: str, what: str):
    if key not in table:
        raise HubError(f"unknown {what} '{key}' (choose from: {', '.join(table)})")
    return table[key]


def check_choices(quantization: str | None, kv_dtype: str) -> None:
    """HubError naming the choices when a quantization or KV dtype is unknown."""
    if quantization is not None:
        _lookup(WEIGHT_BYTES, quantization, "quantization")
    _lookup(KV_BYTES, kv_dtype, "KV dtype")


@dataclass(frozen=True)
class GpuMemory:
    name: str
    free_bytes: int
    total_bytes: int


def local_gpu() -> GpuMemory | None:
    """Free and total memory of CUDA device 0, or None without a usable GPU.

    Asked without torch where possible (importing it costs seconds, `ninfer show` should not):
    no NVIDIA driver means no GPU; else nvidia-smi answers for the first visible device; torch
    only where nvidia-smi is missing."""
    if not Path("/proc/driver/nvidia/version").exists() and not Path("/dev/nvidia0").exists():
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    if visible == "" or visible.startswith("-"):
        return None
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        try:
            out = subprocess.run([smi, "-i", visible, "--query-gpu=name,memory.free,memory.total",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
            name, free_mib, total_mib = (p.strip() for p in out.stdout.strip().splitlines()[0].rsplit(",", 2))
            return GpuMemory(name, int(free_mib) << 20, int(total_mib) << 20)
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            pass  # an unusual setup (MIG, UUIDs in CUDA_VISIBLE_DEVICES): ask torch
    import torch

    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info(0)
    return GpuMemory(torch.cuda.get_device_name(0), int(free), int(total))


@dataclass(frozen=True)
class FitEstimate:
    quantization: str
    params: int
    weight_bytes: int
    context: int
    kv_dtype: str
    sequences: int
    kv_bytes_per_token: int
    kv_bytes: int
    state_bytes: int
    reserve_bytes: int
    max_position_embeddings: int
    gpu: GpuMemory | None

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.state_bytes + self.reserve_bytes

    @property
    def fits(self) -> bool | None:
        """True / False against the GPU's free memory; None without a GPU."""
        return None if self.gpu is None else self.total_bytes <= self.gpu.free_bytes

    @property
    def max_context(self) -> int | None:
        """The longest context (per sequence) whose KV fits beside the weights; None without a GPU."""
        if self.gpu is None:
            return None
        room = self.gpu.free_bytes - self.weight_bytes - self.state_bytes - self.reserve_bytes
        per_token = self.kv_bytes_per_token * self.sequences
        if room <= 0:
            return 0
        return min(room // per_token, self.max_position_embeddings) if per_token else self.max_position_embeddings

    def to_json(self) -> dict:
        return {
            "quantization": self.quantization, "params": self.params, "weight_bytes": self.weight_bytes,
            "context": self.context, "kv_dtype": self.kv_dtype, "sequences": self.sequences,
            "kv_bytes_per_token": self.kv_bytes_per_token, "kv_bytes": self.kv_bytes,
            "state_bytes": self.state_bytes, "reserve_bytes": self.reserve_bytes, "total_bytes": self.total_bytes,
            "gpu": None if self.gpu is None else {
                "name": self.gpu.name, "free_bytes": self.gpu.free_bytes, "total_bytes": self.gpu.total_bytes},
            "fits": self.fits, "max_context": self.max_context,
        }


def estimate_fit(
    cfg: ModelConfig,
    quantization: str,
    context: int | None = None,
    kv_dtype: str = "bf16",
    sequences: int = 1,
    gpu: GpuMemory | None = None,
    weight_bytes: int | None = None,
) -> FitEstimate:
    """Memory for serving `sequences` sequences of `context` tokens (default: DEFAULT_CONTEXT, capped).

    `weight_bytes` replaces params x bytes-per-param when the real size is known (a GGUF file,
    whose mixed quantization no single width describes).
    """
    context = min(DEFAULT_CONTEXT, cfg.max_position_embeddings) if context is None else context
    if context <= 0 or sequences <= 0:
        raise HubError(f"context ({context}) and sequences ({sequences}) must be positive")
    params = count_params(cfg)
    if weight_bytes is None:
        weight_bytes = int(params * _lookup(WEIGHT_BYTES, quantization, "quantization"))
    per_token = kv_bytes_per_token(cfg, kv_dtype)
    return FitEstimate(
        quantization=quantization,
        params=params,
        weight_bytes=weight_bytes,
        context=context,
        kv_dtype=kv_dtype,
        sequences=sequences,
        kv_bytes_per_token=per_token,
        kv_bytes=per_token * context * sequences,
        state_bytes=gdn_state_bytes(cfg) * sequences,
        reserve_bytes=RUNTIME_RESERVE_BYTES,
        max_position_embeddings=cfg.max_position_embeddings,
        gpu=gpu,
    )

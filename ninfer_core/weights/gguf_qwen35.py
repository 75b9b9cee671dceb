"""llama.cpp's Qwen3.5 / 3.6 GGUF files (architectures `qwen35`, `qwen35moe`) -> our config and
canonical tensors.

llama.cpp's converter (conversion/qwen.py: Qwen3NextModel, _LinearAttentionVReorderBase and the
MTP mixin) changes a checkpoint in six ways, each undone here so the model sees what an HF
checkpoint gives it:
- names: `blk.N.attn_qkv` is a GDN layer's `in_proj_qkv`, `attn_gate` its `in_proj_z`,
  `ssm_alpha` / `ssm_beta` its `in_proj_a` / `b`, `post_attention_norm` the post-attention norm;
- zero-centred RMSNorm weights (x * (1 + w)) are stored as 1 + w, since llama.cpp multiplies by
  the weight as it is; the GDN's gated norm (x * w) is stored as it is;
- `A_log` is stored as A = -exp(A_log), `dt_bias` as `ssm_dt.bias`, conv1d [C, 1, K] as [C, K];
- value heads: a GDN layer keeps its value heads grouped by key head (head v = k * r + j reads key
  head k), the file tiles them (v = j * Hk + k: ggml broadcasts by repeating); in in_proj_qkv's V
  rows, in_proj_z, in_proj_a / b, A_log, dt_bias and conv1d's V channels (rows: moved back), and
  out_proj's columns (kept: the layer takes its inputs in the file's order, `input_orders`);
- routed experts: gate_up_proj [E, 2I, H] split into `ffn_gate_exps` and `ffn_up_exps` (newer
  files may keep them as one `ffn_gate_up_exps`);
- the MTP head: `nextn_predict_layers` extra blocks after the decoder's, their `nextn.*` tensors
  its fc and norms.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import MAX_POSITIONS, MAX_WIDTH, ConfigFields, ModelConfig
from ..errors import ModelLoadError

QWEN35_ARCHS = {"qwen35": "qwen3_5", "qwen35moe": "qwen3_5_moe"}

# blk.N.<key> -> the canonical name after `layers.N.` (or after `mtp.layers.M.` in an MTP block)
_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_up_exps.weight": "mlp.experts.gate_up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
}
# the routed experts' gate and up halves: parts 0 and 1 of gate_up_proj, stacked on their rows
_EXPERT_HALVES = {"ffn_gate_exps.weight": 0, "ffn_up_exps.weight": 1}
_NEXTN = {
    "nextn.eh_proj.weight": "mtp.fc.weight",
    "nextn.enorm.weight": "mtp.pre_fc_norm_embedding.weight",
    "nextn.hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
    "nextn.shared_head_norm.weight": "mtp.norm.weight",
}
_GLOBAL = {
    "token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight", "output.weight": "lm_head.weight",
}
# zero-centred norms (every norm but the GDN's gated one), stored as 1 + w
_OFFSET_NORMS = ("norm.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight")
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(.+)")


def canonical_part(gguf_name: str, num_layers: int) -> tuple[str, int, int] | None:
    """A file tensor's canonical name, its part within it and the number of parts (the routed
    experts' gate and up halves are parts 0 and 1 of gate_up_proj); None for names we do not know."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name], 0, 1
    m = _BLOCK_NAME.fullmatch(gguf_name)
    if m is None:
        return None
    block, key = int(m.group(1)), m.group(2)
    if key in _NEXTN:
        return (_NEXTN[key], 0, 1) if block >= num_layers else None
    if key in _EXPERT_HALVES:
        rest, part, parts = "mlp.experts.gate_up_proj", _EXPERT_HALVES[key], 2
    elif key in _BLOCK:
        rest, part, parts = _BLOCK[key], 0, 1
    else:
        return None
    prefix = f"layers.{block}." if block < num_layers else f"mtp.layers.{block - num_layers}."
    return prefix + rest, part, parts


@dataclass(frozen=True)
class TensorFix:
    """How a file tensor becomes the canonical one: HF row r is the file's row rows[r], then
    `value` (float tensors only: norms, A_log, conv1d, the shared expert's gate)."""

    rows: np.ndarray | None = None
    value: Callable[[Any], Any] | None = None


def v_head_rows(num_k: int, num_v: int, head_dim: int) -> np.ndarray:
    """File rows (tiled value heads: v = j * num_k + k) in HF order (grouped: v = k * r + j)."""
    per_key = num_v // num_k
    return np.arange(num_v * head_dim).reshape(per_key, num_k, head_dim).transpose(1, 0, 2).reshape(-1)


def _minus_one(w):
    return w - 1


def _a_log(a):
    return (-a).log()


def _conv_weight(w):  # [C, K] -> nn.Conv1d's depthwise [C, 1, K]
    return w.unsqueeze(1)


def _one_row(w):  # the shared expert's gate, [1, H]: llama-quantize writes it as a vector [H]
    return w.reshape(1, -1)


def tensor_fix(name: str, config: ModelConfig) -> TensorFix | None:
    """What the converter did to the canonical tensor `name` (None: nothing)."""
    if name.endswith(_OFFSET_NORMS) and not name.endswith("linear_attn.norm.weight"):
        return TensorFix(value=_minus_one)
    if name.endswith("mlp.shared_expert_gate.weight"):
        return TensorFix(value=_one_row)
    if ".linear_attn." not in name:
        return None
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    heads = v_head_rows(hk, hv, 1)
    values = v_head_rows(hk, hv, dv)
    with_qk = np.concatenate([np.arange(2 * hk * dk), 2 * hk * dk + values])
    part = name.rsplit(".linear_attn.", 1)[1]
    return {
        "in_proj_qkv.weight": TensorFix(rows=with_qk),
        "in_proj_z.weight": TensorFix(rows=values),
        "in_proj_a.weight": TensorFix(rows=heads),
        "in_proj_b.weight": TensorFix(rows=heads),
        "A_log": TensorFix(rows=heads, value=_a_log),
        "dt_bias": TensorFix(rows=heads),
        "conv1d.weight": TensorFix(rows=with_qk, value=_conv_weight),
    }.get(part)


def input_orders(config: ModelConfig) -> dict[str, np.ndarray]:
    """Linears whose weight keeps the file's column order, and the order their inputs take instead:
    each GDN layer's out_proj (its columns are the tiled value heads; a K-quant block spans two heads,
    so the blocks cannot move, but its 4K inputs can: x_file = x[order])."""
    values = v_head_rows(config.linear_num_key_heads, config.linear_num_value_heads, config.linear_value_head_dim)
    order = np.argsort(values)
    return {f"layers.{i}.linear_attn.out_proj": order for i in config.linear_attention_layers}


def layer_counts(f: ConfigFields) -> tuple[int, int]:
    """(decoder layers, MTP layers): `block_count` counts both, the MTP blocks last."""
    blocks = f.integer("block_count")
    mtp_layers = f.integer("nextn_predict_layers", 0, low=0, high=blocks - 1)
    return blocks - mtp_layers, mtp_layers


def qwen35_config(f: ConfigFields, get: Callable[[str], Any], common: dict[str, Any]) -> ModelConfig:
    """The ModelConfig of a qwen35 / qwen35moe file (`get`: an `{arch}.` key's raw value; `common`:
    the fields every GGUF reads the same way: vocabulary, special ids, dtype, norm epsilon, RoPE base)."""
    num_layers, mtp_layers = layer_counts(f)
    blocks = num_layers + mtp_layers
    recurrent = get("attention.recurrent_layers")
    if recurrent is not None:
        if not (isinstance(recurrent, list) and len(recurrent) == blocks
                and all(isinstance(r, bool) for r in recurrent)):
            raise ModelLoadError(f"{f.where}: '{f.prefix}attention.recurrent_layers' must be {blocks} booleans")
        layer_types = ["linear_attention" if r else "full_attention" for r in recurrent[:num_layers]]
    else:
        interval = f.integer("full_attention_interval", 4)
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    num_heads = f.integer("attention.head_count")
    kv_heads = get("attention.head_count_kv")
    if isinstance(kv_heads, list):  # per layer, 0 on the recurrent ones: the attention layers' must agree
        counts = {kv_heads[i] for i, t in enumerate(layer_types) if t == "full_attention" and i < len(kv_heads)}
        if len(counts) > 1:
            raise ModelLoadError(f"{f.where}: attention layers with different KV head counts {sorted(counts)}")
        kv_heads = counts.pop() if counts else num_heads
    num_kv_heads = ConfigFields(lambda _: kv_heads, f.where, f.prefix).integer("attention.head_count_kv", num_heads)
    head_dim = f.integer("attention.key_length")
    rotary = f.integer("rope.dimension_count", head_dim, high=head_dim)
    sections = get("rope.dimension_sections")
    if sections is not None and not (isinstance(sections, list) and all(
            isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= head_dim for s in sections)):
        raise ModelLoadError(f"{f.where}: '{f.prefix}rope.dimension_sections' must be a list of integers")
    num_v = f.integer("ssm.time_step_rank")
    num_k = f.integer("ssm.group_count", high=num_v)
    if num_v % num_k:
        raise ModelLoadError(f"{f.where}: {num_v} value heads cannot share {num_k} key heads evenly")
    moe = common["arch"] == "qwen3_5_moe"  # a dense file may carry expert keys (from its HF config's defaults)
    num_experts = f.integer("expert_count") if moe else 0
    return ModelConfig(
        **common,
        num_layers=num_layers,
        layer_types=layer_types,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        partial_rotary_factor=rotary / head_dim,
        mrope_section=list(sections[:3]) if sections else None,
        mrope_interleaved=True,  # Qwen3.5's rotary is always interleaved mRoPE (llama.cpp: IMROPE)
        attn_output_gate=True,
        qk_norm=True,
        norm_zero_centered=True,
        linear_num_key_heads=num_k,
        linear_num_value_heads=num_v,
        linear_key_head_dim=f.integer("ssm.state_size"),
        linear_value_head_dim=f.integer("ssm.inner_size", high=MAX_WIDTH) // num_v,
        linear_conv_kernel_dim=f.integer("ssm.conv_kernel", 4),
        intermediate_size=f.integer("feed_forward_length", 0, low=0, high=MAX_WIDTH),
        num_experts=num_experts,
        num_experts_per_tok=f.integer("expert_used_count", 0, low=0, high=num_experts) if moe else 0,
        moe_intermediate_size=f.integer("expert_feed_forward_length", high=MAX_WIDTH) if moe else 0,
        shared_expert_intermediate_size=f.integer("expert_shared_feed_forward_length", 0, low=0, high=MAX_WIDTH)
        if moe else 0,
        norm_topk_prob=bool(get("expert_weights_norm") if get("expert_weights_norm") is not None else True),
        max_position_embeddings=f.integer("context_length", 262144, high=MAX_POSITIONS),
        mtp_num_layers=mtp_layers,
    )


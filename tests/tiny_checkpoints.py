"""Tiny random Qwen3.5 checkpoints in the exact Hugging Face layouts, for tests.

`write_tiny_qwen` builds a randomly initialised transformers model (MoE `qwen3_5_moe` or dense
`qwen3_5`, multimodal `*ForConditionalGeneration` or text-only `*ForCausalLM`), saves it with
`save_pretrained` (which writes per-expert MoE tensors in transformers 5), then rewrites the
tensors into the requested variant: fused experts (Qwen's BF16 releases), block-scaled FP8
(Qwen's FP8 releases: per-expert e4m3 weights + bf16 `weight_scale_inv`), random `mtp.*`
weights, shards + `model.safetensors.index.json`. The returned fp32 model holds exactly the
values the checkpoint encodes (rounded to `dtype`, FP8 weights dequantized), so it is the
reference. No tokenizer is written (the tokenizer tests ship their own files).
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file, save_file

TINY_TEXT_CONFIG = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=4,  # layers 0-2 Gated DeltaNet, layer 3 full attention
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    intermediate_size=40,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=20,
    shared_expert_intermediate_size=12,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    rope_parameters=dict(
        rope_type="default",
        rope_theta=10000.0,
        partial_rotary_factor=0.5,  # 8 of 16 dims -> 4 frequencies
        mrope_section=[2, 1, 1],
        mrope_interleaved=True,
    ),
)
TINY_VISION_CONFIG = dict(
    depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, num_position_embeddings=16,
    patch_size=4,
)
FP8_BLOCK = (16, 24)  # rows x cols: not square, and leaves partial blocks on the tiny shapes
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# Linear layers Qwen's FP8 releases quantize; routers, in_proj_a/b, norms, embeddings, lm_head,
# mtp.fc and the vision tower stay unquantized.
FP8_MODULES = {
    "q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj", "gate_proj", "up_proj", "down_proj"
}
_PER_EXPERT = re.compile(r"^(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^(.+\.experts)\.(gate_up_proj|down_proj)$")
_SIZE = re.compile(r"^(\d+)\s*(B|KB|MB|GB)$")


def write_tiny_qwen(
    directory: str | Path,
    *,
    moe: bool = True,
    multimodal: bool = True,
    experts: Literal["fused", "per_expert"] = "fused",
    fp8: bool = False,
    shard_size: str | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    mtp: bool = True,
    text_overrides: dict | None = None,
    vision_overrides: dict | None = None,
):
    """Write a tiny checkpoint into `directory`; return the fp32 transformers reference model.

    The model carries `mtp_reference`: {canonical name: fp32 tensor} of the `mtp.*` weights
    written (fused experts), since transformers has no MTP module. `shard_size` like "20KB"
    splits the tensors into `model-0000k-of-0000n.safetensors` with an index.
    """
    if fp8 and experts == "fused" and moe:
        raise ValueError("FP8 releases store experts per expert; fused FP8 experts are not a real layout")
    directory = Path(directory)
    model = _build_model(moe, multimodal, text_overrides or {}, vision_overrides or {})
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(_random_like(param, generator, dtype))
    mtp_state = _random_mtp_state(model, generator, dtype) if mtp else {}
    quantized: dict[str, torch.Tensor] = {}
    if fp8:
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(_fake_quantize(name, param, quantized))
        for name, tensor in mtp_state.items():
            mtp_state[name] = _fake_quantize(name, tensor, quantized)

    copy.deepcopy(model).to(dtype).save_pretrained(directory)
    saved = directory / "model.safetensors"
    tensors = {name: t.clone() for name, t in load_file(saved).items()}
    saved.unlink()
    tensors.update(_split_experts({name: t.to(dtype) for name, t in mtp_state.items()}))
    missing = {name for name in quantized if not name.endswith("_scale_inv")} - set(tensors)
    assert not missing, f"quantized tensors missing from the saved names: {sorted(missing)[:3]}"
    tensors.update(quantized)
    if experts == "fused":
        tensors = _fuse_experts(tensors)
    _write_shards(directory, tensors, _parse_size(shard_size) if shard_size else None)
    _update_config(directory / "config.json", multimodal, mtp, tensors if fp8 else None)
    model.mtp_reference = {name: t.float() for name, t in mtp_state.items()}
    return model


def canonical_reference(model) -> dict[str, torch.Tensor]:
    """The reference tensors under canonical names (text model only, fused experts, + MTP)."""
    prefixes = ("model.language_model.", "model.")
    out = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("model.visual."):
            continue
        prefix = next((p for p in prefixes if name.startswith(p)), "")
        out[name.removeprefix(prefix)] = tensor
    if model.config.tie_word_embeddings:  # no lm_head tensor is saved: it is the embedding
        del out["lm_head.weight"]
    out.update(model.mtp_reference)
    return out


def quantize_block_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block absmax e4m3 quantization of a 2-D weight: (fp8 weight, bf16 scale) with w ~ q * scale."""
    rows, cols = weight.shape
    bn, bk = block
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scale = torch.empty(-(-rows // bn), -(-cols // bk), dtype=torch.bfloat16)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = weight[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].double()
            s = (tile.abs().max() / FP8_MAX).clamp(min=1e-8).to(torch.bfloat16)
            scale[i, j] = s
            tile_q = (tile / s.double()).clamp(-FP8_MAX, FP8_MAX)
            q[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = tile_q.to(torch.float8_e4m3fn)
    return q, scale


def dequantize_reference(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Float64 block-by-block dequantization, independent of the engine's vectorised one."""
    out = torch.empty(q.shape, dtype=torch.float64)
    bn, bk = block
    for i in range(scale.shape[-2]):
        for j in range(scale.shape[-1]):
            rs, cs = slice(i * bn, (i + 1) * bn), slice(j * bk, (j + 1) * bk)
            out[..., rs, cs] = q[..., rs, cs].double() * scale[..., i, j, None, None].double()
    return out


def _build_model(moe: bool, multimodal: bool, text_overrides: dict, vision_overrides: dict):
    import transformers as tf

    text = {**TINY_TEXT_CONFIG, **text_overrides}
    if moe:
        config_cls, text_cls = tf.Qwen3_5MoeConfig, tf.Qwen3_5MoeTextConfig
        mm_cls, causal_cls = tf.Qwen3_5MoeForConditionalGeneration, tf.Qwen3_5MoeForCausalLM
    else:
        config_cls, text_cls = tf.Qwen3_5Config, tf.Qwen3_5TextConfig
        mm_cls, causal_cls = tf.Qwen3_5ForConditionalGeneration, tf.Qwen3_5ForCausalLM
    if multimodal:
        vision = {**TINY_VISION_CONFIG, **vision_overrides}
        return mm_cls(config_cls(text_config=text, vision_config=vision, tie_word_embeddings=False)).eval()
    return causal_cls(text_cls(**text)).eval()


def _random_like(t: torch.Tensor, generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """N(0, 0.1) values rounded to `dtype`: every tensor distinct, norms included."""
    return (torch.randn(t.shape, generator=generator) * 0.1).to(dtype).float()


def _text_prefix(model) -> str:
    return "model.language_model." if hasattr(model.model, "language_model") else "model."


def _random_mtp_state(model, generator: torch.Generator, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`mtp.*` tensors shaped like Qwen's MTP block: fc, two pre-fc norms, a final norm and one
    full-attention decoder layer (a copy of the model's first attention layer's shapes)."""
    hidden = model.config.get_text_config().hidden_size
    prefix = _text_prefix(model)
    attn_layer = model.config.get_text_config().layer_types.index("full_attention")
    layer_prefix = f"{prefix}layers.{attn_layer}."
    shapes = {
        "mtp.fc.weight": (hidden, 2 * hidden),
        "mtp.pre_fc_norm_embedding.weight": (hidden,),
        "mtp.pre_fc_norm_hidden.weight": (hidden,),
        "mtp.norm.weight": (hidden,),
    }
    for name, tensor in model.state_dict().items():
        if name.startswith(layer_prefix):
            shapes["mtp.layers.0." + name.removeprefix(layer_prefix)] = tuple(tensor.shape)
    return {name: _random_like(torch.empty(shape), generator, dtype) for name, shape in shapes.items()}


def _fake_quantize(name: str, tensor: torch.Tensor, quantized: dict[str, torch.Tensor]) -> torch.Tensor:
    """Quantize the FP8-eligible weight `name` (model naming; fused experts per expert matrix),
    record the checkpoint tensors (per-expert names) in `quantized`, return the dequantized values."""
    fused = _FUSED.match(name)
    if fused:
        prefix, kind = fused.groups()
        parts = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
        rows = tensor.shape[1] // len(parts)
        out = torch.empty_like(tensor)
        for e in range(tensor.shape[0]):
            for k, part in enumerate(parts):
                rs = slice(k * rows, (k + 1) * rows)
                out[e, rs] = _quantize_into(f"{prefix}.{e}.{part}.weight", tensor[e, rs], quantized)
        return out
    module = name.removesuffix(".weight").rsplit(".", 1)[-1]
    if name.endswith(".weight") and tensor.dim() == 2 and module in FP8_MODULES and "visual" not in name:
        return _quantize_into(name, tensor, quantized)
    return tensor


def _quantize_into(name: str, weight: torch.Tensor, quantized: dict[str, torch.Tensor]) -> torch.Tensor:
    q, scale = quantize_block_fp8(weight, FP8_BLOCK)
    quantized[name] = q
    quantized[name + "_scale_inv"] = scale
    return dequantize_reference(q, scale, FP8_BLOCK).float()  # exact: 4-bit x 8-bit mantissas


def _split_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused 3-D expert tensors -> per-expert 2-D ones (transformers' save layout)."""
    out = {}
    for name, t in tensors.items():
        m = _FUSED.match(name)
        if not m:
            out[name] = t
            continue
        prefix, kind = m.groups()
        for e in range(t.shape[0]):
            if kind == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = t[e].clone()
            else:
                gate, up = t[e].chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate.clone()
                out[f"{prefix}.{e}.up_proj.weight"] = up.clone()
    return out


def _fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors -> `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I]."""
    groups: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    out = {}
    for name, t in tensors.items():
        m = _PER_EXPERT.match(name)
        if m:
            groups.setdefault(m[1], {})[(int(m[2]), m[3])] = t
        else:
            out[name] = t
    for prefix, members in groups.items():
        n = 1 + max(e for e, _ in members)
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([members[(e, "gate_proj")], members[(e, "up_proj")]]) for e in range(n)]
        )
        out[f"{prefix}.down_proj"] = torch.stack([members[(e, "down_proj")] for e in range(n)])
    return out


def _parse_size(size: str) -> int:
    m = _SIZE.match(size.strip().upper())
    if not m:
        raise ValueError(f"shard size {size!r}: expected e.g. '20KB'")
    return int(m[1]) * {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9}[m[2]]


def _write_shards(directory: Path, tensors: dict[str, torch.Tensor], shard_bytes: int | None) -> None:
    """`model.safetensors`, or HF-named shards plus `model.safetensors.index.json`."""
    tensors = {name: t.contiguous() for name, t in sorted(tensors.items())}
    if shard_bytes is None:
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for k, shard in enumerate(shards):
        filename = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, directory / filename, metadata={"format": "pt"})
        weight_map.update({name: filename for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _update_config(path: Path, multimodal: bool, mtp: bool, fp8_tensors: dict[str, torch.Tensor] | None) -> None:
    """Add what save_pretrained does not write: the MTP layer count and Qwen's FP8 quantization_config."""
    config = json.loads(path.read_text())
    text = config["text_config"] if multimodal else config
    if mtp:
        text["mtp_num_hidden_layers"] = 1
    if fp8_tensors is not None:
        kept = sorted(
            name.removesuffix(".weight")
            for name, t in fp8_tensors.items()
            if name.endswith(".weight") and t.dim() == 2 and t.dtype != torch.float8_e4m3fn and "visual" not in name
        )
        config["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(FP8_BLOCK),
            "modules_to_not_convert": kept + (["model.visual"] if multimodal else []),
        }
    path.write_text(json.dumps(config, indent=2))

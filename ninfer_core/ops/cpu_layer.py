"""One attention decoder layer's decode step on the CPU in one kernel call (csrc/cpu/decode_layer.h).

Its reference is the layer's own forward (models/decoder.py DecoderLayer over layers/attention.py
and layers/mlp.py), which calls the same CPU kernels one at a time from Python; the fused call
runs them in the same order on the same values, so the two agree to the bit. `decode_layer`
returns None whenever a layer or a step is not the plain case the kernel covers: Llama-family
attention (no output gate, plain RMSNorms, optional q/k norms and qkv bias), a dense MLP, compact
weights the CPU kernels run (K-quant blocks only with the bf16 / int8 maths: exact math multiplies
them dequantized), an fp32 cache without scales, up to 16 new tokens per sequence.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import dispatch
from .attention import DECODE_MAX_TOKENS
from .kquant import KQuantLinear
from .quant import QuantLinear, scratch_buffer

if TYPE_CHECKING:
    from ..models.decoder import DecoderLayer, StepContext

_NO_PLAN = ()  # a layer the kernel cannot run (cached as such)


def decode_layer(
    layer: DecoderLayer, x: torch.Tensor, residual: torch.Tensor | None, step: StepContext
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(the layer's output, the residual stream after its mixer) like DecoderLayer.forward, or None."""
    plan = _layer_plan(layer)
    math = dispatch.cpu_math()
    if not plan or not dispatch.cpu_kernels_available() or (plan[2] and math == "exact"):
        return None  # exact math multiplies K-quant weights dequantized (ops/kquant.py): the layer's forward
    batch, num_new, hidden = x.shape
    kv, meta = step.cache.kv.layer(layer.layer_idx), step.attn
    tensors = (x, step.cos, step.sin) if residual is None else (x, residual, step.cos, step.sin)
    if not (num_new <= DECODE_MAX_TOKENS and not kv.quantized and kv.k.dtype == torch.float32
            and all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors)
            and meta.slot_mapping.is_contiguous() and meta.block_table.is_contiguous()
            and meta.cache_lens.dtype == torch.int64 and meta.cache_lens.is_contiguous()):
        return None
    attn = layer.self_attn
    tokens = batch * num_new
    out, residual_out = torch.empty_like(x), torch.empty_like(x)
    ext = dispatch.cpu_extension()
    scratch = scratch_buffer(ext.decode_layer_scratch(tokens, hidden, attn.num_heads, attn.num_kv_heads,
                                                      attn.head_dim, layer.mlp.down_proj.in_features),
                             torch.float32, "decode_layer")
    ext.decode_layer(plan[0], plan[1], (
        x.data_ptr(), 0 if residual is None else residual.data_ptr(), out.data_ptr(), residual_out.data_ptr(),
        step.cos.data_ptr(), step.sin.data_ptr(), kv.k.data_ptr(), kv.v.data_ptr(), meta.slot_mapping.data_ptr(),
        meta.block_table.data_ptr(), meta.cache_lens.data_ptr(), batch, num_new, kv.page_size,
        meta.block_table.shape[1], float(attn.scale), scratch.data_ptr(), dispatch.cpu_threads(),
        math == "int8", step.cos.shape[-1]))
    return out, residual_out


def _layer_plan(layer: DecoderLayer) -> tuple:
    """The kernel's layer arguments (pointers into the layer's tensors), made once per layer and
    again only when its weights were replaced; () when the kernel does not cover the layer."""
    key = layer.input_layernorm.weight.data_ptr()
    cached = layer.__dict__.get("_cpu_decode_plan")
    if cached is not None and cached[0] == key:
        return cached[1]
    plan = _make_plan(layer)
    layer.__dict__["_cpu_decode_plan"] = (key, plan)
    return plan


def _make_plan(layer: DecoderLayer) -> tuple:
    if layer.is_linear or not hasattr(layer.mlp, "gate_up_proj"):
        return _NO_PLAN
    attn, mlp = layer.self_attn, layer.mlp
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if attn.q_norm is not None:
        norms += [attn.q_norm, attn.k_norm]
    linears = [attn.qkv_proj.linear, attn.o_proj, mlp.gate_up_proj.linear, mlp.down_proj]
    if (attn.output_gate or any(n.zero_centered or not _fp32(n.weight) for n in norms)
            or not all(isinstance(m, (QuantLinear, KQuantLinear)) and m.quantized.cpu_plan is not None for m in linears)
            or any(m.bias is not None and not _fp32(m.bias) for m in linears)
            or len({n.eps for n in norms}) != 1):
        return _NO_PLAN
    weights = tuple((m.out_features, 0 if m.bias is None else m.bias.data_ptr(), isinstance(m, KQuantLinear),
                     m.quantized.cpu_plan) for m in linears)
    q_norm, k_norm = (0, 0) if attn.q_norm is None else (attn.q_norm.weight.data_ptr(), attn.k_norm.weight.data_ptr())
    return ((layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(), q_norm,
             k_norm, float(layer.input_layernorm.eps), mlp.down_proj.out_features, attn.num_heads, attn.num_kv_heads,
             attn.head_dim, mlp.down_proj.in_features), weights, any(isinstance(m, KQuantLinear) for m in linears))


def _fp32(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()

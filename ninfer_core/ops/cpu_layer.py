"""Attention decoder layers' decode step on the CPU in one kernel call (csrc/cpu/decode_layer.h):
the whole stack of a Llama-family model, or one layer; and a Qwen3.5 / 3.6 gated-attention layer's
mixer alone (`attention_mixer`: its GDN mixers and MoE layers have theirs in ops/gdn.py, ops/moe.py).

Its reference is the layers' own forward (models/decoder.py DecoderLayer over layers/attention.py
and layers/mlp.py), which calls the same CPU kernels one at a time from Python; the fused call
runs them in the same order on the same values, so the two agree to the bit. `decode_layers`
returns None whenever a layer or a step is not the plain case the kernel covers: Llama-family
attention (no output gate, plain RMSNorms, optional q/k norms and qkv bias), a dense MLP, compact
weights the CPU kernels run (K-quant blocks only with the bf16 / int8 maths: exact math multiplies
them dequantized), an fp32, bf16 or fp16 cache without scales, up to 16 new tokens per sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from . import dispatch
from .attention import CACHE_TYPES, DECODE_MAX_TOKENS
from .kquant import KQuantLinear, KQuantWeight
from .quant import CPU_GEMV_ROWS, QuantizedWeight, QuantLinear, scratch_buffer

if TYPE_CHECKING:
    from ..cache.kv_pool import KVLayer
    from ..layers.attention import Attention, AttentionMetadata
    from ..layers.norm import PendingNorm, RMSNorm
    from ..models.decoder import DecoderLayer, StepContext

_NO_PLAN = ()  # a layer the kernel cannot run (cached as such)


def decode_layers(
    layers: Sequence[DecoderLayer], x: torch.Tensor, residual: torch.Tensor | None, step: StepContext
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(the last layer's output, the residual stream after its mixer) of consecutive layers, as
    their DecoderLayer.forward calls would give, in one kernel call; or None. The decoder stack runs
    all its layers so when every one is covered (a small model's step then pays one Python call, not
    one per layer: ~40 us each on this machine), a layer on its own otherwise."""
    plans = [_layer_plan(layer) for layer in layers]
    math = dispatch.cpu_math()
    if not all(plans) or not dispatch.cpu_kernels_available() or (math == "exact" and any(p[1] for p in plans)):
        return None  # exact math multiplies K-quant weights dequantized (ops/kquant.py): the layers' forward
    batch, num_new, hidden = x.shape
    meta = step.attn
    kvs = [step.cache.kv.layer(layer.layer_idx) for layer in layers]
    tensors = (x, step.cos, step.sin) if residual is None else (x, residual, step.cos, step.sin)
    cache_dtype = kvs[0].k.dtype  # fp32, or bf16 / fp16 (the kernel rounds into it)
    if not (num_new <= DECODE_MAX_TOKENS and cache_dtype in CACHE_TYPES
            and all(not kv.quantized and kv.k.dtype == kv.v.dtype == cache_dtype for kv in kvs)
            and all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors)
            and meta.slot_mapping.is_contiguous() and meta.block_table.is_contiguous()
            and meta.cache_lens.dtype == torch.int64 and meta.cache_lens.is_contiguous()):
        return None
    tokens = batch * num_new
    pairs = [(torch.empty_like(x), torch.empty_like(x)) for _ in range(min(2, len(layers)))]
    ext = dispatch.cpu_extension()
    scratch = scratch_buffer(max(ext.decode_layer_scratch(tokens, *p[2]) for p in plans), torch.float32,
                             "decode_layer")
    (out_a, res_a), (out_b, res_b) = pairs[0], pairs[-1]
    ext.decode_layers([p[0] for p in plans], [kv.k.data_ptr() for kv in kvs], [kv.v.data_ptr() for kv in kvs], (
        x.data_ptr(), 0 if residual is None else residual.data_ptr(), out_a.data_ptr(), res_a.data_ptr(),
        out_b.data_ptr(), res_b.data_ptr(), step.cos.data_ptr(), step.sin.data_ptr(), meta.slot_mapping.data_ptr(),
        meta.block_table.data_ptr(), meta.cache_lens.data_ptr(), batch, num_new, kvs[0].page_size,
        meta.block_table.shape[1], scratch.data_ptr(), dispatch.cpu_threads(), math == "int8", step.cos.shape[-1],
        CACHE_TYPES[cache_dtype]))
    return pairs[(len(layers) - 1) % 2]


def _layer_plan(layer: DecoderLayer) -> tuple:
    """(the kernel's LayerPlan: pointers into the layer's tensors, whether it has K-quant weights,
    its scratch sizes), made once per layer and again only when its weights were replaced; () when
    the kernel does not cover the layer."""
    if layer.is_linear:
        return _NO_PLAN  # a GDN layer, whatever its weights (no key to read: a decode step asks every layer)
    key = layer.input_layernorm.weight.data_ptr()
    cached = layer.__dict__.get("_cpu_decode_plan")
    if cached is not None and cached[0] == key:
        return cached[1]
    plan = _make_plan(layer)
    layer.__dict__["_cpu_decode_plan"] = (key, plan)
    return plan


def _make_plan(layer: DecoderLayer) -> tuple:
    if not hasattr(layer.mlp, "gate_up_proj") or dispatch.cpu_extension() is None:
        return _NO_PLAN
    attn, mlp = layer.self_attn, layer.mlp
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if attn.q_norm is not None:
        norms += [attn.q_norm, attn.k_norm]
    linears = [attn.qkv_proj.linear, attn.o_proj, mlp.gate_up_proj.linear, mlp.down_proj]
    if (attn.output_gate or any(n.zero_centered or not cpu_fp32(n.weight) for n in norms)
            or not all(cpu_linear(m) for m in linears)
            or len({n.eps for n in norms}) != 1):
        return _NO_PLAN
    weights = tuple(linear_plan(m.quantized, m.bias) for m in linears)
    q_norm, k_norm = (0, 0) if attn.q_norm is None else (attn.q_norm.weight.data_ptr(), attn.k_norm.weight.data_ptr())
    hidden, intermediate = mlp.down_proj.out_features, mlp.down_proj.in_features
    plan = dispatch.cpu_extension().layer_plan(
        (layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(), q_norm, k_norm,
         float(layer.input_layernorm.eps), hidden, attn.num_heads, attn.num_kv_heads, attn.head_dim,
         float(attn.scale)), weights)
    return plan, any(isinstance(m, KQuantLinear) for m in linears), (hidden, intermediate)


def attention_mixer(
    pending: PendingNorm, attn: Attention, cos: torch.Tensor, sin: torch.Tensor, kv: KVLayer, meta: AttentionMetadata,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A decode step's gated-attention mixer (Qwen3.5 / 3.6) on the CPU in one call (csrc/cpu/decode_layer.h
    `attention_mixer`): (o_proj's output [B, T, H], x + residual) for the pending input norm's rows, k / v
    appended to the cache. None where it does not apply: the exact CPU math, not fp32, projections that are
    not compact or have a bias, a quantized or non-contiguous cache, more than DECODE_MAX_TOKENS new tokens."""
    x, residual, norm = pending.x, pending.residual, pending.norm
    batch, num_new, _ = x.shape
    qkv, o = attn.qkv_proj.linear, attn.o_proj
    head_weights = [n.weight for n in (attn.q_norm, attn.k_norm) if n is not None]
    cache_dtype = kv.k.dtype
    if not (dispatch.cpu_math() != "exact" and dispatch.cpu_kernels_available() and num_new <= DECODE_MAX_TOKENS
            and all(cpu_linear(m) and m.bias is None for m in (qkv, o))
            and all(cpu_fp32(t) for t in (x, residual, norm.weight, cos, sin, *head_weights))
            and residual.shape == x.shape and cos.shape == sin.shape == (batch, num_new, cos.shape[-1])
            and not kv.quantized and cache_dtype in CACHE_TYPES and kv.v.dtype == cache_dtype
            and kv.k.is_contiguous() and kv.v.is_contiguous()
            and meta.slot_mapping.dtype == torch.int64 and meta.slot_mapping.is_contiguous()
            and meta.block_table.dtype == torch.int32 and meta.block_table.is_contiguous()
            and meta.cache_lens.dtype == torch.int64 and meta.cache_lens.is_contiguous()):
        return None
    out, summed = torch.empty_like(x), torch.empty_like(x)
    q_norm, k_norm = (0, 0) if attn.q_norm is None else (attn.q_norm.weight.data_ptr(), attn.k_norm.weight.data_ptr())
    head_eps, head_zc = (1e-6, False) if attn.q_norm is None else (attn.q_norm.eps, attn.q_norm.zero_centered)
    tensors = (x.data_ptr(), residual.data_ptr(), summed.data_ptr(), out.data_ptr(), norm.weight.data_ptr(), q_norm,
               k_norm, *(t.data_ptr() for t in (cos, sin, kv.k, kv.v, meta.slot_mapping, meta.block_table,
                                                meta.cache_lens)))
    shape = (attn.num_heads, attn.num_kv_heads, attn.head_dim, cos.shape[-1], batch, num_new, kv.page_size,
             meta.block_table.shape[1])
    dispatch.cpu_extension().attention_mixer(
        tensors, shape, attn.output_gate, float(norm.eps), norm.zero_centered, float(head_eps), head_zc,
        float(attn.scale), CACHE_TYPES[cache_dtype], linear_plan(qkv.quantized), linear_plan(o.quantized),
        dispatch.cpu_threads(), dispatch.cpu_math() == "int8")
    return out, summed


def mlp_block(
    x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, gate_up: torch.nn.Module, down: torch.nn.Module,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A decode step's dense SwiGLU MLP block on the CPU in one call (csrc/cpu/decode_layer.h `mlp_block`):
    (down(silu(gate) * up), s) for [gate | up] = gate_up(h), (h, s) = norm.add_norm(x, residual): the
    kernels MLP.add_norm_forward's calls run, in their order, so the same bits. None where it does not
    apply: not fp32 rows on the CPU, more rows than the GEMV kernels take (CPU_GEMV_ROWS), projections
    that are not compact, K-quant weights under the exact math (those multiply dequantized)."""
    linears = (gate_up, down)
    if not (all(cpu_linear(m) for m in linears) and dispatch.cpu_kernels_available()
            and x.numel() <= CPU_GEMV_ROWS * x.shape[-1]
            and all(cpu_fp32(t) for t in (x, residual, norm.weight)) and residual.shape == x.shape
            and (dispatch.cpu_math() != "exact" or not any(isinstance(m, KQuantLinear) for m in linears))):
        return None
    out, summed = torch.empty_like(x), torch.empty_like(x)
    tokens, hidden = x.numel() // x.shape[-1], x.shape[-1]
    ext = dispatch.cpu_extension()
    scratch = scratch_buffer(ext.mlp_block_scratch(tokens, hidden, down.in_features), torch.float32, "mlp_block")
    ext.mlp_block(tuple(t.data_ptr() for t in (x, residual, summed, out, norm.weight, scratch)), tokens,
                  float(norm.eps), norm.zero_centered, *(linear_plan(m.quantized, m.bias) for m in linears),
                  dispatch.cpu_threads(), dispatch.cpu_math() == "int8")
    return out, summed


def linear_plan(w: QuantizedWeight | KQuantWeight, bias: torch.Tensor | None = None) -> tuple:
    """A compact weight as csrc/cpu/bindings.cpp's `layer_linear` takes it: (n, bias pointer or 0,
    K-quant?, its CPU plan)."""
    return w.out_features, 0 if bias is None else bias.data_ptr(), isinstance(w, KQuantWeight), w.cpu_plan


def cpu_linear(m: torch.nn.Module) -> bool:
    """Whether the one-call kernels take a projection as linear_plan gives it: compact weights the CPU
    kernels run, without a bias or with an fp32 one."""
    return (isinstance(m, (QuantLinear, KQuantLinear)) and m.quantized.cpu_plan is not None
            and (m.bias is None or cpu_fp32(m.bias)))


def cpu_fp32(t: torch.Tensor) -> bool:
    """Whether the CPU kernels read t as is: fp32, contiguous, on the CPU."""
    return t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()

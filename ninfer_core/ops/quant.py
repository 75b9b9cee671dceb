"""Weight-only quantization (int8, int4) and the quantized linear of the decode hot path.

A quantized [..., N, K] weight is w[n, k] = code * scale + offset, with one scale (and offset) per
group of G inputs of a row (`group_size`; int8 also allows 0: one per row):
  int8  qweight int8 [..., N, K]; code = the byte; offset 0 unless offsets are given.
  int4  qweight uint8 [..., N, K // 2]; byte j of a row holds input 2j in its low nibble and
        2j + 1 in its high nibble; code = the nibble (0..15); offset -8 * scale unless offsets
        are given (the symmetric grid: code = q + 8 for q in -8..7).
  scales [..., N] (int8 per row) or [..., N, K // G] in fp32 / fp16 / bf16; offsets None or the
  same shape and dtype. Leading dims "..." are expert stacks [E, N, K].
Two families of formats use this:
  GPU formats, made by `quantize` (csrc/quant_gemv.cu and the fused MoE kernel read them, so they
    are fixed): int8 per row, fp32 scale = absmax(row) / 127; int4 symmetric per group of
    G in {32, 64, 128}, scale = absmax(group) / 7 rounded to bf16 before dividing (so
    dequantization reproduces what quantization rounded to), q = clamp(round(w / scale), -8, 7).
    An all-zero row / group gets scale 1. `quantize(..., scale_dtype=torch.float16)` gives the
    same grids with fp16 scales.
  GGUF formats (weights/gguf_quant.py): llama.cpp's blocks as they are, fp16 scales, offsets
    where the block has a minimum (Q4_1, Q4_K, ...), groups of 16 or 32.
The CPU kernel (csrc/cpu/quant_matmul.h) runs every one of them; the CUDA kernels the GPU formats.

`quant_linear` runs, for up to 16 rows, csrc/quant_gemv.cu on CUDA or csrc/cpu on the CPU: they
read every weight byte once for all rows, which is what decode is bound by. The CPU kernel and the
CUDA int8 path are exact (products of the codes and fp32 activations, fp32 sums, scales applied in
fp32), except with NINFER_CPU_MATH=int8, where the CPU kernel multiplies activations quantized per
block of 32 (`quant_linear_a8_ref` is its reference); the CUDA int4 path multiplies each group's scale into the weights in the activation dtype
(tensor cores take 16-bit operands), i.e. it computes with exactly `dequantize(qw, x.dtype)`, the
weights the prefill path multiplies by. `quant_linear_ref` is the exact fp32 definition all are
tested against. `quant_linear_add_norm` is a decoder layer's input RMSNorm (with the residual add
before it) and the projection that reads its output: on CUDA at decode sizes one GEMV, bit-equal to
add_rmsnorm + quant_linear. `quant_linear_add_norm_conv` is that GEMV with a GDN decode step's conv as
its epilogue (ops/gdn.py `gdn_decode_step_folded`). A short prompt's rows by a wide weight on CUDA
take the Triton GEMM that dequantizes in registers (ops/quant_triton.py), a long prompt's a
dequantized copy and cuBLAS.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from . import dispatch, quant_triton
from .activation import row_view, sigmoid_mul, silu_mul
from .rmsnorm import add_rmsnorm, add_rmsnorm_ref

GROUP_SIZES = (32, 64, 128)
KERNEL_MAX_ROWS = 1024  # csrc/quant_gemv.h: kQuantGemvMaxRows (16 rows a block)
# Rows up to which quant_linear multiplies the quantized weight directly (the CUDA kernel; on the
# CPU without its kernels, the reference); past it a dequantized copy + GEMM, compute-bound
# prefill. On CUDA the GEMV kernel reads the weight once per 16 rows, mostly from L2, against the
# copy's write + read of twice the bytes: measured on the H200 (bench_quant.py --rows, 2026-12-02),
# the GEMV wins at every shape up to 32 rows (qkv 8192 x 2048 int8: 15.1 vs 22.1 us), is level at 48
# on the large ones (qkv 23.0 vs 22.1) and loses from 64 (qkv 25.0 vs 22.4 us; the 27B MLP down 169 vs
# 123); on the H100 (forty-eighth session) it wins at every shape at 48 rows (o_proj 13.6 vs 16.1 us,
# the 27B MLP down 97 vs 164, the shared expert's up 3.2 vs 7.7).
MAX_GEMV_ROWS = 16
CUDA_MAX_GEMV_ROWS = 48
# Past 32 rows and up to this many on CUDA, a weight whose grid fills the GPU takes the Triton GEMM that
# dequantizes in registers (ops/quant_triton.py `fits`) instead of the GEMV or the dequantized copy:
# H100, forty-eighth session, the 35B's GDN in_proj 20 / 28 us at 48 / 128 rows against the GEMV's
# 37 / 59 and the copy's 45 / 47; at 512 rows the copy + cuBLAS wins at every shape timed.
TRITON_MIN_ROWS, TRITON_MAX_ROWS = 33, 128
CPU_GEMV_ROWS = 16  # the CPU kernel up to this many rows; past it a tiled dequantize + fp32 GEMM is faster
# The add + RMSNorm a CUDA GEMV folds in front (csrc/quant_gemv.h: kQuantGemvNorm*): up to 4 rows of
# K <= 8192 (past 4 rows the fold cost more than the launch it saves).
NORM_MAX_ROWS = 4
NORM_MAX_K = 8192
CONV_MAX_TAPS = 8  # the conv epilogue's kernel width (csrc/quant_gemv.h: kQuantGemvConvMaxTaps)
CONV_MAX_ROWS = 8  # its rows without the norm folded in front (kQuantGemvConvMaxRows)
# fp32 weight rows dequantized at once on the CPU: cache-sized, and few GEMM calls per weight
# (each is a barrier of torch's thread pool, which a busy machine makes slow)
CPU_PREFILL_TILE_BYTES = 8 << 20
_CODES = {"int8": torch.int8, "int4": torch.uint8}
_GPU_SCALES = {"int8": torch.float32, "int4": torch.bfloat16}  # `quantize`'s default scale dtypes
_SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CPU_SCALE_TYPES = [torch.float32, torch.float16, torch.bfloat16]  # csrc/cpu/quant_matmul.h: ScaleType


@dataclass(frozen=True)
class QuantFormat:
    """The layout of a quantized weight's tensors (what a recipe assigns to a module before the
    weights exist). scale_dtype None: the GPU format's (fp32 for int8, bf16 for int4)."""

    kind: str
    group_size: int = 0
    scale_dtype: torch.dtype | None = None
    offsets: bool = False

    def __post_init__(self) -> None:
        if self.kind not in _CODES:
            raise ValueError(f"unknown quantization kind {self.kind!r} (use 'int8' or 'int4')")
        if self.scale_dtype is None:
            object.__setattr__(self, "scale_dtype", _GPU_SCALES[self.kind])


@dataclass
class QuantizedWeight:
    """A quantized [..., N, K] weight: codes, scales, group size and optional offsets."""

    kind: Literal["int8", "int4"]
    qweight: torch.Tensor
    scales: torch.Tensor
    group_size: int  # 0: one scale per row (int8 only)
    offsets: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.kind not in _CODES:
            raise ValueError(f"unknown quantization kind {self.kind!r} (use 'int8' or 'int4')")
        if self.qweight.dtype != _CODES[self.kind] or self.scales.dtype not in _SCALE_DTYPES:
            raise ValueError(
                f"{self.kind} weights need {_CODES[self.kind]} codes and float scales (codes / scales), "
                f"got {self.qweight.dtype} / {self.scales.dtype}"
            )
        if self.kind == "int4":
            _check_group(self.group_size, self.in_features)
        elif self.group_size and self.in_features % self.group_size:
            raise ValueError(f"int8: in_features {self.in_features} is not a multiple of group_size {self.group_size}")
        want = self.qweight.shape[:-1]
        if self.group_size:
            want = (*want, self.in_features // self.group_size)
        if tuple(self.scales.shape) != tuple(want):
            raise ValueError(
                f"{self.kind} scales have shape {tuple(self.scales.shape)}, expected {tuple(want)}"
            )
        if self.offsets is not None and (self.offsets.shape, self.offsets.dtype) != (self.scales.shape, self.scales.dtype):
            raise ValueError("offsets need the scales' shape and dtype")

    @classmethod
    def empty(cls, fmt: QuantFormat, out_features: int, in_features: int,
              device: torch.device | str | None, batch: tuple[int, ...] = ()) -> QuantizedWeight:
        """Uninitialised tensors of `fmt` for a [*batch, out_features, in_features] weight."""
        if fmt.kind == "int4":
            _check_group(fmt.group_size, in_features)
        codes = (*batch, out_features, in_features // 2 if fmt.kind == "int4" else in_features)
        scales = (*batch, out_features, *((in_features // fmt.group_size,) if fmt.group_size else ()))
        return cls(
            fmt.kind,
            torch.empty(codes, dtype=_CODES[fmt.kind], device=device),
            torch.empty(scales, dtype=fmt.scale_dtype, device=device),
            fmt.group_size,
            torch.empty(scales, dtype=fmt.scale_dtype, device=device) if fmt.offsets else None,
        )

    @property
    def format(self) -> QuantFormat:
        return QuantFormat(self.kind, self.group_size, self.scales.dtype, self.offsets is not None)

    @functools.cached_property
    def cpu_plan(self) -> tuple | None:
        """The CPU kernel's weight arguments (csrc/cpu/bindings.cpp order), None when the kernel
        cannot run this weight. Computed once: a decode step calls every weight, and Python
        overhead is what a small model's step is made of."""
        group = self.group_size or self.in_features
        tensors = [t for t in (self.qweight, self.scales, self.offsets) if t is not None]
        if not (all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)
                and group % (32 if self.kind == "int4" else 16) == 0
                and self.in_features // group <= 4096):  # csrc/cpu/quant_kernels.h: kMaxGroups
            return None
        offsets = 0 if self.offsets is None else self.offsets.data_ptr()
        return (self.qweight.data_ptr(), self.scales.data_ptr(), offsets, self.in_features, group,
                self.kind == "int4", _CPU_SCALE_TYPES.index(self.scales.dtype))

    @functools.cached_property
    def experts(self) -> tuple[QuantizedWeight, ...]:
        """Each expert's [N, K] weight of an [E, N, K] one, as views: the CPU kernels take one at a
        time (ops/moe.py), each with its own plan, made once."""
        return tuple(QuantizedWeight(self.kind, self.qweight[e], self.scales[e], self.group_size,
                                     None if self.offsets is None else self.offsets[e])
                     for e in range(self.qweight.shape[0]))

    @property
    def out_features(self) -> int:
        return self.qweight.shape[-2]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[-1] * (2 if self.kind == "int4" else 1)

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the full-precision weight this stands for."""
        return (*self.qweight.shape[:-1], self.in_features)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.offsets) if t is not None)

    @property
    def device(self) -> torch.device:
        return self.qweight.device


def _check_group(group_size: int, in_features: int) -> None:
    if group_size not in GROUP_SIZES:
        raise ValueError(f"int4 group_size must be one of {GROUP_SIZES}, got {group_size}")
    if in_features % group_size:
        raise ValueError(
            f"int4: in_features {in_features} is not a multiple of group_size {group_size}"
        )


def quantize(
    w: torch.Tensor, kind: str, group_size: int = 128, scale_dtype: torch.dtype | None = None
) -> QuantizedWeight:
    """Quantize w [..., N, K] on its own device (meta included: shapes only), fp32 math, to the
    GPU formats (scales in `scale_dtype` if given). group_size applies to int4 only."""
    if w.dim() < 2:
        raise ValueError(f"quantize needs a [..., N, K] weight, got shape {tuple(w.shape)}")
    if kind not in _CODES:
        raise ValueError(f"unknown quantization kind {kind!r} (use 'int8' or 'int4')")
    if kind == "int4":
        _check_group(group_size, w.shape[-1])
    wf = w.detach().float()
    groups = wf[..., None, :] if kind == "int8" else wf.unflatten(-1, (-1, group_size))
    amax = groups.abs().amax(-1)
    limit = 127 if kind == "int8" else 7
    # a true division on every device: CUDA divides by a Python scalar as a product with its
    # reciprocal, off by an ulp for ~4% of the values, so a GPU and a CPU load differed
    quotient = amax / torch.full_like(amax, limit)
    scales = torch.where(amax > 0, quotient, torch.ones_like(amax)).to(scale_dtype or _GPU_SCALES[kind])
    # A scale rounded to zero in a narrow dtype still divides: the smallest one it holds.
    scales = torch.where(scales > 0, scales, torch.full_like(scales, torch.finfo(scales.dtype).smallest_normal))
    q = torch.round(groups / scales.float()[..., None])
    if kind == "int8":
        return QuantizedWeight("int8", q.clamp_(-127, 127).to(torch.int8).squeeze(-2), scales.squeeze(-1), 0)
    q = q.clamp_(-8, 7).add_(8).to(torch.uint8).flatten(-2)
    return QuantizedWeight("int4", q[..., 0::2] | (q[..., 1::2] << 4), scales, group_size)


def dequantize(qw: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The [..., N, K] weight in dtype: one pass of csrc/dequant.cu on CUDA (GPU formats) or of the
    CPU kernel (the prefill GEMMs dequantize a layer's weights per call), `dequantize_ref`
    elsewhere; identical values."""
    if qw.device.type == "cpu" and qw.cpu_plan is not None and dispatch.cpu_kernels_available():
        bf16 = dtype == torch.bfloat16
        out = torch.empty(qw.shape, dtype=torch.bfloat16 if bf16 else torch.float32)
        rows = out.numel() // qw.in_features
        dispatch.cpu_extension().dequantize(out.data_ptr(), rows, 0, rows, bf16, dispatch.cpu_threads(), *qw.cpu_plan)
        return out.to(dtype)
    out_dtype_ok = dtype in (torch.float32, torch.float16, torch.bfloat16)
    k = qw.in_features
    if not (out_dtype_ok and dispatch.use_kernel(qw.scales) and qw.device == qw.scales.device and _gpu_format(qw)
            and k % 8 == 0 and qw.qweight.numel() > 0 and qw.qweight.is_contiguous() and qw.scales.is_contiguous()
            and qw.qweight.data_ptr() % 8 == 0):
        return dequantize_ref(qw, dtype)
    out = torch.empty(qw.shape, dtype=dtype, device=qw.device)
    rows = out.numel() // k  # the binding takes the weight as rows: leading dims (experts) flattened
    dispatch.extension().dequant(
        out=out.view(rows, k), qweight=qw.qweight.view(rows, -1),
        scales=qw.scales.view(rows, -1) if qw.kind == "int4" else qw.scales.view(rows),
        stream=dispatch.stream_handle(out),
    )
    return out


def _codes(qw: QuantizedWeight) -> torch.Tensor:
    """The codes [..., N, K] as stored: int8 bytes, or int4 nibbles 0..15 (uint8)."""
    if qw.kind == "int8":
        return qw.qweight
    return torch.stack((qw.qweight & 15, qw.qweight >> 4), dim=-1).flatten(-2)


def dequantize_ref(qw: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """Torch reference of `dequantize`: code * scale + offset in fp32 (a product, then a sum: what
    the kernels compute), rounded once to dtype. The product is exact for 16-bit scales."""
    codes = _codes(qw).float()
    if qw.kind == "int4" and qw.offsets is None:
        codes = codes.sub_(8)  # the symmetric grid: offset -8 * scale
    group = qw.group_size or qw.in_features
    groups = codes.unflatten(-1, (-1, group))  # in place from here on: one fp32 copy
    shape = (*groups.shape[:-1], 1)
    groups.mul_(qw.scales.float().reshape(shape))
    if qw.offsets is not None:
        groups.add_(qw.offsets.float().reshape(shape))
    return groups.flatten(-2).to(dtype)


def quant_linear_ref(
    x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) -> [..., N] in x's dtype; exact fp32 weights, fp32 accumulation."""
    _check_linear(x, qw, bias)
    out = x.float() @ dequantize_ref(qw, torch.float32).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def quantize_activations_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (K a multiple of 32) -> int8 codes [..., K] and fp32 scales [..., K / 32]: what the
    CPU kernels' int8-activation paths multiply by (csrc/cpu/quant_matmul.h, csrc/cpu/kquant.h):
    per block of 32, scale absmax / 127, code round-half-even(x * (127 / absmax)), in fp32 like
    the kernels."""
    blocks = x.float().unflatten(-1, (-1, 32))
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return torch.round(blocks * inv).to(torch.int8).flatten(-2), (amax / 127).squeeze(-1)


def quant_linear_a8_ref(
    x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Torch reference of the CPU kernel with int8 activations, in float64 -> [..., N]: the codes
    times scales multiply the quantized activations; the offsets (minimums, int4's -8 * scale)
    multiply the exact sums of x per group, as in the kernel."""
    codes, block_scales = quantize_activations_ref(x)
    xq = (codes.double().unflatten(-1, (-1, 32)) * block_scales.double()[..., None]).flatten(-2)
    group = qw.group_size or qw.in_features
    scales = qw.scales.double().reshape(qw.out_features, -1)
    weight = (_codes(qw).double().unflatten(-1, (-1, group)) * scales[..., None]).flatten(-2)
    out = xq @ weight.T
    offsets = qw.offsets.double() if qw.offsets is not None else -8 * scales if qw.kind == "int4" else None
    if offsets is not None:
        out = out + x.double().unflatten(-1, (-1, group)).sum(-1) @ offsets.reshape(qw.out_features, -1).T
    return out if bias is None else out + bias.double()


def quant_linear(
    x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None, *, cpu_gemv_rows: int = CPU_GEMV_ROWS
) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) -> [..., N] in x's dtype, for a 2-D quantized weight. On the CPU the
    GEMV kernel takes up to `cpu_gemv_rows` rows (a prefill's callers may set fewer: ops/moe.py)."""
    _check_linear(x, qw, bias)
    rows = x.numel() // qw.in_features
    if x.device.type == "cpu" and qw.cpu_plan is not None and dispatch.cpu_kernels_available():
        # a small model's decode step is ~120 of these calls: no work here beyond the kernel's
        x2 = x.reshape(rows, qw.in_features)
        out = (_cpu_tiled_linear if rows > cpu_gemv_rows else _cpu_matmul)(x2, qw, bias).view(x.shape[:-1] + (-1,))
        return out if out.dtype == x.dtype else out.to(x.dtype)
    if x.device.type == "cuda" and TRITON_MIN_ROWS <= rows <= TRITON_MAX_ROWS:
        x2 = x.reshape(rows, qw.in_features)
        if quant_triton.fits(x2, qw):
            return quant_triton.quant_gemm(x2, qw, bias).view(*x.shape[:-1], qw.out_features)
    if rows > (CUDA_MAX_GEMV_ROWS if x.device.type == "cuda" else MAX_GEMV_ROWS):
        # A long prompt: the product is compute-bound; a GEMM (cuBLAS tensor cores, or the CPU's
        # fp32 BLAS) on a transient dequantized copy beats any GEMV, and the copy costs two passes
        # over the weight, small next to the prompt's FLOPs.
        return F.linear(x, dequantize(qw, x.dtype), None if bias is None else bias.to(x.dtype))
    x2 = x.reshape(rows, qw.in_features).contiguous()
    if not _kernel_ok(x2, qw, bias):
        dispatch.fallback("quant_linear", x, qw.qweight)
        return quant_linear_ref(x, qw, bias)
    out = torch.empty(rows, qw.out_features, dtype=x.dtype, device=x.device)
    _gemv(out, x2, qw, bias)
    return out.view(*x.shape[:-1], qw.out_features)


def quant_swiglu(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T) -> [..., I] for qw = [gate; up] ([2I, K]): a SwiGLU MLP's
    first half. At decode sizes on CUDA one GEMV with the SwiGLU as its epilogue (a launch fewer
    than quant_linear + silu_mul, whose roundings it keeps); else that composition."""
    x2 = _epilogue_rows(x, qw, None)
    if x2 is None or qw.out_features % 2:
        return silu_mul(quant_linear(x, qw))
    out = torch.empty(x2.shape[0], qw.out_features // 2, dtype=x.dtype, device=x.device)
    _gemv(out, x2, qw, None, gate_up=True)
    return out.view(*x.shape[:-1], qw.out_features // 2)


def quant_linear_gated(x: torch.Tensor, qw: QuantizedWeight, gate: torch.Tensor, add: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """add + sigmoid(gate) * (x @ W^T (+ bias)), gate [..., 1] (any row stride: a column split off
    a merged projection), add [..., N]: a shared expert's down projection, its output gate and the
    routed experts' sum. At decode sizes on CUDA one GEMV with that epilogue (a launch fewer than
    quant_linear + sigmoid_mul, whose roundings it keeps); else that composition."""
    x2 = _epilogue_rows(x, qw, bias)
    gate_rows = row_view(gate, 1) if gate.shape == (*x.shape[:-1], 1) else None
    if (x2 is None or gate_rows is None or gate.dtype != x.dtype or add.dtype != x.dtype
            or add.shape != (*x.shape[:-1], qw.out_features) or not add.is_contiguous()):
        return sigmoid_mul(quant_linear(x, qw, bias), gate, add=add)
    out = torch.empty(x2.shape[0], qw.out_features, dtype=x.dtype, device=x.device)
    _gemv(out, x2, qw, bias, gate=gate_rows, add=add.view(out.shape))
    return out.view(add.shape)


def quant_linear_add_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, zero_centered: bool,
    qw: QuantizedWeight, bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `quant_linear_add_norm`: add_rmsnorm_ref, then quant_linear_ref on its rows."""
    normed, summed = add_rmsnorm_ref(x, residual, norm_weight, eps, zero_centered=zero_centered)
    return quant_linear_ref(normed, qw, bias), summed


def quant_linear_add_norm(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, zero_centered: bool,
    qw: QuantizedWeight, bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(s) @ W^T (+ bias), s) for s = x + residual, norm `add_rmsnorm`'s (norm_weight, eps,
    zero_centered): a decoder layer's input norm and its mixer's first projection. At decode sizes
    on CUDA one GEMV whose blocks add and norm the rows first (a launch fewer than add_rmsnorm +
    quant_linear; its norm bit-equal to add_rmsnorm's, its K sums split as quant_linear's unless its
    grid fits one wave only with fewer splits); else that composition."""
    _check_linear(x, qw, bias)
    rows = _norm_rows(x, residual, norm_weight, qw, bias)
    if rows is None:
        normed, summed = add_rmsnorm(x, residual, norm_weight, eps, zero_centered=zero_centered)
        return quant_linear(normed, qw, bias), summed
    x2, residual2 = rows
    out = torch.empty(x2.shape[0], qw.out_features, dtype=x.dtype, device=x.device)
    summed = torch.empty_like(x2)
    _gemv(out, x2, qw, bias, norm=_FoldedNorm(residual2, norm_weight, summed, eps, zero_centered))
    return out.view(*x.shape[:-1], qw.out_features), summed.view(x.shape)


class GemvConv(NamedTuple):
    """A GDN decode step's depthwise causal conv, for a norm GEMV to run on its first C outputs
    (`quant_linear_add_norm_conv`; csrc/quant_gemv.h GemvConvArgs)."""

    pool: torch.Tensor  # [S, C, K-1] conv states in x's dtype, advanced in place at `slots`
    weight: torch.Tensor  # [C, K]
    # [M] int64, contiguous, distinct: row m continues pool[slots[m]]. The kernel reads them before its
    # wait for the kernel launched just before it (PDL), so they are never a copy made for the call.
    slots: torch.Tensor
    zeroed: int  # int32 words the call returns zeroed (the counters of the GDN recurrent kernel after it)


def quant_linear_add_norm_conv(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, zero_centered: bool,
    qw: QuantizedWeight, bias: torch.Tensor | None, conv: GemvConv,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """`quant_linear_add_norm`'s (y, s) whose GEMV also runs a GDN decode step's conv + SiLU on the first
    C outputs of each row (the newest input of conv channel c is output c): y[..., :C] are the conv's
    outputs, rounded to x's dtype, y[..., C:] the plain outputs, and the conv states of `conv.slots`
    advance. Also returns `conv.zeroed` int32 zeros, written by the kernel (the counters of the GDN
    recurrent kernel that follows it). One launch where the GEMV and the conv kernel take two (past the
    norm's rows, up to CONV_MAX_ROWS: add_rmsnorm, then the GEMV with the conv alone); reference:
    ops/gdn.py `quant_linear_add_norm_conv_ref` (the conv's reference is the GDN layer's). None where
    the kernel does not take the call (nothing ran)."""
    _check_linear(x, qw, bias)
    if not _conv_fits(conv, x, qw):
        return None
    rows = _norm_rows(x, residual, norm_weight, qw, bias)
    if rows is not None:
        x2, residual2 = rows
        out = torch.empty(x2.shape[0], qw.out_features, dtype=x.dtype, device=x.device)
        summed = torch.empty_like(x2)
        zeroed = torch.empty(conv.zeroed, dtype=torch.int32, device=x.device)
        _gemv(out, x2, qw, bias, norm=_FoldedNorm(residual2, norm_weight, summed, eps, zero_centered), conv=conv,
              zeroed=zeroed)
        return out.view(*x.shape[:-1], qw.out_features), summed.view(x.shape), zeroed
    plain = _epilogue_rows(x, qw, bias)
    if plain is None or plain.shape[0] > CONV_MAX_ROWS or x.dtype not in (torch.float16, torch.bfloat16):
        return None
    zeroed = torch.empty(conv.zeroed, dtype=torch.int32, device=x.device)
    normed, summed = add_rmsnorm(x, residual, norm_weight, eps, zero_centered=zero_centered)
    out = torch.empty(plain.shape[0], qw.out_features, dtype=x.dtype, device=x.device)
    _gemv(out, normed.reshape(plain.shape), qw, bias, conv=conv, zeroed=zeroed)
    return out.view(*x.shape[:-1], qw.out_features), summed, zeroed


def _conv_fits(conv: GemvConv, x: torch.Tensor, qw: QuantizedWeight) -> bool:
    """Whether the GEMV of x's rows [..., K] runs `conv` as its epilogue (csrc/quant_gemv.h GemvConvArgs)."""
    pool, weight, slots, zeroed = conv
    if weight.dim() != 2 or pool.dim() != 3:
        return False
    channels, taps = weight.shape
    return (
        dispatch.use_kernel(pool, weight)
        and pool.dtype == weight.dtype == x.dtype
        and pool.device == weight.device == slots.device == x.device
        and 16 <= channels <= qw.out_features and channels % 16 == 0 and 2 <= taps <= CONV_MAX_TAPS
        and pool.shape[1:] == (channels, taps - 1) and pool.is_contiguous() and weight.is_contiguous()
        and pool.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0
        and slots.dtype == torch.int64 and slots.shape == (x.numel() // qw.in_features,) and slots.is_contiguous()
        and zeroed >= 0
    )


def _norm_rows(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, qw: QuantizedWeight,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """x and residual as the [M, K] rows of a GEMV with the norm folded in front, or None where
    add_rmsnorm + quant_linear run instead: not fp16 / bf16 on CUDA, rows past the stage's limits,
    a call the GEMV does not cover."""
    k = qw.in_features
    rows = x.numel() // k
    if not (x.dtype in (torch.float16, torch.bfloat16) and qw.qweight.dim() == 2
            and residual.shape == x.shape and residual.dtype == x.dtype
            and norm_weight.shape == (k,) and norm_weight.dtype == x.dtype and norm_weight.is_contiguous()
            and 1 <= rows <= NORM_MAX_ROWS and k <= NORM_MAX_K):
        return None
    x2, residual2 = x.reshape(rows, k).contiguous(), residual.reshape(rows, k).contiguous()
    fits = (_kernel_ok(x2, qw, bias) and dispatch.use_kernel(residual2, norm_weight)
            and residual2.device == norm_weight.device == x.device
            and residual2.data_ptr() % 16 == 0 and norm_weight.data_ptr() % 16 == 0)
    return (x2, residual2) if fits else None


def _epilogue_rows(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x as the [M, K] rows of a GEMV with an epilogue, or None where quant_linear's own path is
    the one to take: the CPU, prefill-sized row counts, a call the kernel does not cover."""
    if x.dim() == 0 or x.shape[-1] != qw.in_features or qw.qweight.dim() != 2:
        return None
    rows = x.numel() // qw.in_features
    if not 1 <= rows <= CUDA_MAX_GEMV_ROWS:
        return None
    x2 = x.reshape(rows, qw.in_features).contiguous()
    return x2 if _kernel_ok(x2, qw, bias) else None


def _gpu_format(qw: QuantizedWeight) -> bool:
    """Whether qw is one of the formats the CUDA kernels read (see the module docstring)."""
    return qw.offsets is None and qw.scales.dtype == _GPU_SCALES[qw.kind] and (qw.kind == "int4" or not qw.group_size)


def _cpu_matmul(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """The CPU kernel: [M, N] fp32 = x [M, K] (as fp32) @ W^T (+ bias); qw.cpu_plan must be set."""
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.float().contiguous()
    if bias is not None:
        bias = bias.float().contiguous()
    out = torch.empty(x.shape[0], qw.out_features)
    dispatch.cpu_extension().quant_matmul(out.data_ptr(), x.data_ptr(), 0 if bias is None else bias.data_ptr(),
                                          x.shape[0], qw.out_features, dispatch.cpu_threads(), dispatch.cpu_math() == "int8",
                                          *qw.cpu_plan)
    return out


def _cpu_tiled_linear(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """Prefill of a compact weight on the CPU (`cpu_tiled_linear` over the C++ dequantization)."""
    def dequantize_tile(out: int, first: int, count: int, bf16: bool) -> None:
        dispatch.cpu_extension().dequantize(out, qw.out_features, first, count, bf16, 1, *qw.cpu_plan)

    return cpu_tiled_linear(x, qw.out_features, dequantize_tile, bias)


def cpu_tiled_linear(x: torch.Tensor, n: int, dequantize_tile: Callable[[int, int, int, bool], None],
                     bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) -> fp32 [M, n] on the CPU, W dequantized a tile of rows at a time
    (`dequantize_tile(out pointer, first row, rows, bf16)`) into a buffer the cache holds, so the
    dense copy of the whole weight is never written out (for a 1.5B model that would be 6 GB of
    writes per chunk). In bf16 where the CPU multiplies it natively and NINFER_CPU_MATH allows
    (2-4x torch's fp32 GEMM; dispatch.py), else in fp32. Tiles are whole 16-row packs, which the
    K-quant layout (ops/kquant.py) dequantizes without decoding a pack's scales twice."""
    dtype = torch.bfloat16 if dispatch.cpu_native_bf16() and dispatch.cpu_math() != "exact" else torch.float32
    x = x.to(dtype)
    k = x.shape[-1]
    tile = min(n, max(16, CPU_PREFILL_TILE_BYTES // (4 * k) // 16 * 16))
    out = torch.empty(x.shape[0], n, dtype=dtype)  # each tile's product lands in its columns (row stride n)
    block = scratch_buffer(tile * k, dtype, "prefill tiles").view(tile, k)
    for first in range(0, n, tile):
        count = min(tile, n - first)
        # one thread: torch's GEMM runs on its own pool, and two pools taking turns spin against
        # each other on a busy machine; the dequantization is a fifth of the tile's time
        dequantize_tile(block.data_ptr(), first, count, dtype == torch.bfloat16)
        torch.mm(x, block[:count].T, out=out[:, first : first + count])
    out = out.float()
    return out if bias is None else out + bias.float()


_scratch = threading.local()


def scratch_buffer(numel: int, dtype: torch.dtype, purpose: str) -> torch.Tensor:
    """A reused CPU buffer of at least `numel` values of dtype, one per thread and purpose (a
    fresh one per call would be megabytes of page faults per GEMM, or an allocation per layer)."""
    buffers = _scratch.__dict__.setdefault("buffers", {})
    buffer = buffers.get((purpose, dtype))
    if buffer is None or buffer.numel() < numel:
        buffer = buffers[(purpose, dtype)] = torch.empty(numel, dtype=dtype)
    return buffer[:numel]


def _kernel_ok(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> bool:
    """Whether the kernel covers this call (x is [M, K] contiguous); else the reference runs."""
    tensors = (x, qw.scales) if bias is None else (x, qw.scales, bias)
    return (
        dispatch.use_kernel(*tensors)
        and _gpu_format(qw)
        and all(t.device == x.device for t in (qw.qweight, *tensors))
        and 1 <= x.shape[0] <= KERNEL_MAX_ROWS
        and qw.qweight.is_contiguous()
        and qw.scales.is_contiguous()
        and (qw.kind == "int4" or qw.in_features % 16 == 0)  # whole 16-byte loads per row
        and x.data_ptr() % 16 == 0
        and qw.qweight.data_ptr() % 16 == 0
        and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()))
    )


class _FoldedNorm(NamedTuple):
    """The add + RMSNorm a GEMV folds in front (csrc/quant_gemv.h GemvAddNormArgs)."""

    residual: torch.Tensor  # [M, K], 16-byte aligned
    weight: torch.Tensor  # [K], 16-byte aligned
    residual_out: torch.Tensor  # [M, K]: x + residual, overlapping no other operand
    eps: float
    zero_centered: bool


def _gemv(
    out: torch.Tensor, x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None, *,
    gate_up: bool = False, gate: torch.Tensor | None = None, add: torch.Tensor | None = None,
    norm: _FoldedNorm | None = None, conv: GemvConv | None = None, zeroed: torch.Tensor | None = None,
) -> int:
    """The kernel call: out [M, N] = x [M, K] @ W^T (+ bias), or an epilogue's output (gate_up:
    N = rows / 2; gate: [M, 1] rows, add: [M, N]), or with `norm` the GEMV of norm(x + residual)
    (x: the residual stream's delta), with `conv` also its conv epilogue (`zeroed`: conv.zeroed int32
    words); `_kernel_ok` must hold. Returns the K split it ran with (warps a tile): a GEMV that folds
    the norm may split K otherwise than the plain one (csrc/quant_gemv.cu split_for_norm)."""
    return dispatch.extension().quant_gemv(
        out=out,
        x=x,
        qweight=qw.qweight,
        scales=qw.scales,
        bias=bias,
        stream=dispatch.stream_handle(x),
        gate_up=gate_up,
        gate=gate,
        add=add,
        residual=None if norm is None else norm.residual,
        norm_weight=None if norm is None else norm.weight,
        residual_out=None if norm is None else norm.residual_out,
        eps=0.0 if norm is None else float(norm.eps),
        zero_centered=norm is not None and norm.zero_centered,
        # the conv's channels and taps are conv_weight's shape, the counters to zero `zeroed`'s length
        conv_pool=None if conv is None else conv.pool,
        conv_weight=None if conv is None else conv.weight,
        conv_slots=None if conv is None else conv.slots,
        zeroed=zeroed,
    )


def _check_linear(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> None:
    if qw.qweight.dim() != 2:
        raise ValueError(f"quant_linear needs a 2-D weight, got shape {qw.shape}")
    if x.dim() == 0 or x.shape[-1] != qw.in_features:
        raise ValueError(
            f"quant_linear: input shape {tuple(x.shape)} does not end in in_features {qw.in_features}"
        )
    if bias is not None and tuple(bias.shape) != (qw.out_features,):
        raise ValueError(
            f"quant_linear: bias shape {tuple(bias.shape)} is not ({qw.out_features},)"
        )


class _QuantizedBuffers(nn.Module):
    """A module over one quantized weight: `qweight` / `scales` (/ `offsets`) are buffers, so a
    model's state_dict() is the quantized artifact and load_state_dict() restores it."""

    def __init__(self, qw: QuantizedWeight) -> None:
        super().__init__()
        if qw.qweight.dim() != 2:
            raise ValueError(f"{type(self).__name__} needs a 2-D weight, got shape {qw.shape}")
        self.kind, self.group_size = qw.kind, qw.group_size
        self.register_buffer("qweight", qw.qweight)
        self.register_buffer("scales", qw.scales)
        self.register_buffer("offsets", qw.offsets)

    @property
    def quantized(self) -> QuantizedWeight:
        """The quantized weight over this module's buffers (no copy), made again only when the
        buffers were replaced (`to`, `to_empty`): it caches the CPU kernel's arguments. The buffers are
        read from `_buffers`: nn.Module.__getattr__ costs ~1 us a name on a slow host, and a CPU decode
        step asks for dozens of weights."""
        cached, buffers = self.__dict__.get("_quantized"), self._buffers
        qweight, scales, offsets = buffers["qweight"], buffers["scales"], buffers["offsets"]
        if cached is None or not (cached.qweight is qweight and cached.scales is scales and cached.offsets is offsets):
            cached = QuantizedWeight(self.kind, qweight, scales, self.group_size, offsets)
            self.__dict__["_quantized"] = cached
        return cached

    def _format_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.group_size else ""
        offsets = ", offsets" if self.offsets is not None else ""
        return f"kind={self.kind}{group}, scales={str(self.scales.dtype).removeprefix('torch.')}{offsets}"


class QuantLinear(_QuantizedBuffers):
    """nn.Linear with a quantized weight."""

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__(qw)
        self.in_features, self.out_features = qw.in_features, qw.out_features
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, kind: str, group_size: int = 128, scale_dtype: torch.dtype | None = None
    ) -> QuantLinear:
        """Quantize a Linear's weight (a meta Linear gives a meta QuantLinear: shapes only)."""
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(quantize(linear.weight, kind, group_size, scale_dtype), bias)

    @classmethod
    def empty(
        cls,
        in_features: int,
        out_features: int,
        fmt: QuantFormat,
        bias: bool,
        device: torch.device | str | None,
        dtype: torch.dtype,
    ) -> QuantLinear:
        """Uninitialised buffers of `fmt`, for a fill or load_state_dict. `dtype` is the bias's
        (the model dtype)."""
        qw = QuantizedWeight.empty(fmt, out_features, in_features, device)
        return cls(qw, torch.empty(out_features, dtype=dtype, device=device) if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quant_linear(x, self.quantized, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self._format_repr()}, "
                f"bias={self.bias is not None}")


class QuantEmbedding(_QuantizedBuffers):
    """nn.Embedding over a quantized table (a GGUF's token_embd): a lookup dequantizes only the
    rows it reads, so the table stays as compact as in the file. A tied lm_head is a QuantLinear
    over the same buffers (`tied_head`)."""

    def __init__(self, qw: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__(qw)
        self.num_embeddings, self.embedding_dim = qw.out_features, qw.in_features
        self.dtype = dtype  # of the embeddings returned

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        qw = self.quantized
        rows = QuantizedWeight(qw.kind, qw.qweight[flat], qw.scales[flat], qw.group_size,
                               None if qw.offsets is None else qw.offsets[flat])
        return dequantize_ref(rows, self.dtype).view(*ids.shape, self.embedding_dim)

    def tied_head(self) -> QuantLinear:
        """lm_head = the embedding table: a QuantLinear sharing this module's tensors."""
        return QuantLinear(self.quantized)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self._format_repr()}"

"""Weight-only quantization (int8, int4) and the quantized linear of the decode hot path.

Formats (the fused MoE kernel reads the same layout, so they are fixed):
  int8  qweight int8 [..., N, K], scales fp32 [..., N]: symmetric per output row,
        scale = absmax(row) / 127, w = q * scale.
  int4  qweight uint8 [..., N, K // 2], scales bf16 [..., N, K // G], G in {32, 64, 128}:
        symmetric per group of G inputs, scale = absmax(group) / 7 rounded to bf16 before dividing
        (so dequantization reproduces what quantization rounded to), q = clamp(round(w / scale),
        -8, 7); byte j of a row holds element 2j in its low nibble and 2j + 1 in its high nibble,
        each as q + 8. w = (nibble - 8) * scale.
An all-zero row / group gets scale 1. Leading dims "..." are expert stacks [E, N, K].

`quant_linear` runs the csrc/quant_gemv.cu kernel for up to 16 rows on CUDA: it reads every weight
byte once for all rows, which is what decode is bound by. Its int8 path is exact (products of
int8 values, fp32 sums, the row scale applied in fp32); its int4 path multiplies each group's
scale into the weights in the activation dtype (tensor cores take 16-bit operands), i.e. it
computes with exactly `dequantize(qw, x.dtype)`, the weights the prefill path multiplies by.
`quant_linear_ref` is the exact fp32 definition both are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from . import dispatch

GROUP_SIZES = (32, 64, 128)
MAX_GEMV_ROWS = 16  # csrc/quant_gemv.h: kQuantGemvMaxRows
_DTYPES = {"int8": (torch.int8, torch.float32), "int4": (torch.uint8, torch.bfloat16)}


@dataclass
class QuantizedWeight:
    """A quantized [..., N, K] weight: its codes, its scales and (int4) its group size."""

    kind: Literal["int8", "int4"]
    qweight: torch.Tensor
    scales: torch.Tensor
    group_size: int  # int4 group; 0 for int8

    def __post_init__(self) -> None:
        if self.kind not in _DTYPES:
            raise ValueError(f"unknown quantization kind {self.kind!r} (use 'int8' or 'int4')")
        if (self.qweight.dtype, self.scales.dtype) != _DTYPES[self.kind]:
            raise ValueError(
                f"{self.kind} weights need {_DTYPES[self.kind]} codes / scales, "
                f"got {self.qweight.dtype} / {self.scales.dtype}"
            )
        if self.kind == "int4":
            _check_group(self.group_size, self.in_features)
            want = (*self.qweight.shape[:-1], self.in_features // self.group_size)
        else:
            want = self.qweight.shape[:-1]
        if tuple(self.scales.shape) != tuple(want):
            raise ValueError(
                f"{self.kind} scales have shape {tuple(self.scales.shape)}, expected {tuple(want)}"
            )

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
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales))

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


def quantize(w: torch.Tensor, kind: str, group_size: int = 128) -> QuantizedWeight:
    """Quantize w [..., N, K] on its own device (meta included: shapes only), fp32 math.
    group_size applies to int4 only."""
    if w.dim() < 2:
        raise ValueError(f"quantize needs a [..., N, K] weight, got shape {tuple(w.shape)}")
    wf = w.detach().float()
    if kind == "int8":
        amax = wf.abs().amax(-1)
        scales = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
        q = torch.round(wf / scales[..., None]).clamp_(-127, 127).to(torch.int8)
        return QuantizedWeight("int8", q, scales, 0)
    if kind != "int4":
        raise ValueError(f"unknown quantization kind {kind!r} (use 'int8' or 'int4')")
    _check_group(group_size, w.shape[-1])
    groups = wf.unflatten(-1, (-1, group_size))
    amax = groups.abs().amax(-1)
    scales = torch.where(amax > 0, amax / 7, torch.ones_like(amax)).to(torch.bfloat16)
    q = torch.round(groups / scales.float()[..., None]).clamp_(-8, 7).add_(8).to(torch.uint8)
    q = q.flatten(-2)
    return QuantizedWeight("int4", q[..., 0::2] | (q[..., 1::2] << 4), scales, group_size)


def dequantize(qw: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The [..., N, K] weight in dtype: one pass of csrc/dequant.cu on CUDA (the prefill GEMMs
    dequantize a layer's weights per call), `dequantize_ref` elsewhere; identical values."""
    out_dtype_ok = dtype in (torch.float32, torch.float16, torch.bfloat16)
    k = qw.in_features
    if not (out_dtype_ok and qw.device.type == "cuda" and dispatch.kernels_available() and k % 8 == 0
            and qw.qweight.is_contiguous() and qw.scales.is_contiguous() and qw.qweight.data_ptr() % 8 == 0):
        return dequantize_ref(qw, dtype)
    out = torch.empty(qw.shape, dtype=dtype, device=qw.device)
    dispatch.extension().dequant(
        out=out.data_ptr(), qweight=qw.qweight.data_ptr(), scales=qw.scales.data_ptr(),
        rows=out.numel() // k, k=k, group_size=qw.group_size, int4=qw.kind == "int4",
        dtype=getattr(dispatch.extension().DType, {torch.float32: "F32", torch.float16: "F16",
                                                   torch.bfloat16: "BF16"}[dtype]),
        device=qw.device.index, stream=torch.cuda.current_stream(qw.device).cuda_stream,
    )
    return out


def dequantize_ref(qw: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """Torch reference of `dequantize`: q * scale in fp32, rounded once to dtype."""
    if qw.kind == "int8":
        return qw.qweight.float().mul_(qw.scales[..., None]).to(dtype)
    codes = torch.stack((qw.qweight & 15, qw.qweight >> 4), dim=-1).flatten(-2)
    groups = codes.float().sub_(8).unflatten(-1, (-1, qw.group_size))  # in place: one fp32 copy
    return groups.mul_(qw.scales.float()[..., None]).flatten(-2).to(dtype)


def quant_linear_ref(
    x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) -> [..., N] in x's dtype; exact fp32 weights, fp32 accumulation."""
    _check_linear(x, qw, bias)
    out = x.float() @ dequantize(qw, torch.float32).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def quant_linear(
    x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) -> [..., N] in x's dtype, for a 2-D quantized weight."""
    _check_linear(x, qw, bias)
    rows = x.numel() // qw.in_features
    if rows > MAX_GEMV_ROWS:
        # Prefill: with many rows the product is compute-bound; cuBLAS's tensor-core GEMM on a
        # transient dequantized copy beats any GEMV, and the copy costs two passes over the weight,
        # small next to a long prompt's FLOPs.
        return F.linear(x, dequantize(qw, x.dtype), None if bias is None else bias.to(x.dtype))
    x2 = x.reshape(rows, qw.in_features).contiguous()
    if not _kernel_ok(x2, qw, bias):
        dispatch.fallback("quant_linear", x, qw.qweight)
        return quant_linear_ref(x, qw, bias)
    out = torch.empty(rows, qw.out_features, dtype=x.dtype, device=x.device)
    _gemv(out, x2, qw, bias)
    return out.view(*x.shape[:-1], qw.out_features)


def _kernel_ok(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> bool:
    """Whether the kernel covers this call (x is [M, K] contiguous); else the reference runs."""
    tensors = (x, qw.scales) if bias is None else (x, qw.scales, bias)
    return (
        dispatch.use_kernel(*tensors)
        and all(t.device == x.device for t in (qw.qweight, *tensors))
        and 1 <= x.shape[0] <= MAX_GEMV_ROWS
        and qw.qweight.is_contiguous()
        and qw.scales.is_contiguous()
        and (qw.kind == "int4" or qw.in_features % 16 == 0)  # whole 16-byte loads per row
        and x.data_ptr() % 16 == 0
        and qw.qweight.data_ptr() % 16 == 0
        and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()))
    )


def _gemv(
    out: torch.Tensor, x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None
) -> None:
    """The kernel call: out [M, N] = x [M, K] @ W^T (+ bias); `_kernel_ok` must hold."""
    dispatch.extension().quant_gemv(
        out=out.data_ptr(),
        x=x.data_ptr(),
        qweight=qw.qweight.data_ptr(),
        scales=qw.scales.data_ptr(),
        bias=0 if bias is None else bias.data_ptr(),
        m=x.shape[0],
        n=qw.out_features,
        k=qw.in_features,
        group_size=qw.group_size,
        int4=qw.kind == "int4",
        dtype=dispatch.kernel_dtype(x),
        device=x.device.index,
        stream=dispatch.stream_handle(x),
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


class QuantLinear(nn.Module):
    """nn.Linear with a quantized weight. `qweight` / `scales` are buffers, so a model's
    state_dict() is the quantized artifact and load_state_dict() restores it."""

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if qw.qweight.dim() != 2:
            raise ValueError(f"QuantLinear needs a 2-D weight, got shape {qw.shape}")
        self.kind, self.group_size = qw.kind, qw.group_size
        self.in_features, self.out_features = qw.in_features, qw.out_features
        self.register_buffer("qweight", qw.qweight)
        self.register_buffer("scales", qw.scales)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, kind: str, group_size: int = 128) -> QuantLinear:
        """Quantize a Linear's weight (a meta Linear gives a meta QuantLinear: shapes only)."""
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(quantize(linear.weight, kind, group_size), bias)

    @classmethod
    def empty(
        cls,
        in_features: int,
        out_features: int,
        kind: str,
        group_size: int,
        bias: bool,
        device: torch.device | str | None,
        dtype: torch.dtype,
    ) -> QuantLinear:
        """Uninitialised buffers of the right shapes / dtypes, for load_state_dict to fill.
        `dtype` is the bias's (the model dtype)."""
        if kind not in _DTYPES:
            raise ValueError(f"unknown quantization kind {kind!r} (use 'int8' or 'int4')")
        codes_dtype, scales_dtype = _DTYPES[kind]
        if kind == "int4":
            _check_group(group_size, in_features)
            codes = (out_features, in_features // 2)
            scales = (out_features, in_features // group_size)
        else:
            group_size, codes, scales = 0, (out_features, in_features), (out_features,)
        qw = QuantizedWeight(
            kind,
            torch.empty(codes, dtype=codes_dtype, device=device),
            torch.empty(scales, dtype=scales_dtype, device=device),
            group_size,
        )
        return cls(qw, torch.empty(out_features, dtype=dtype, device=device) if bias else None)

    @property
    def quantized(self) -> QuantizedWeight:
        """The quantized weight over this module's buffers (no copy)."""
        return QuantizedWeight(self.kind, self.qweight, self.scales, self.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quant_linear(x, self.quantized, self.bias)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.kind == "int4" else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"kind={self.kind}{group}, bias={self.bias is not None}"
        )

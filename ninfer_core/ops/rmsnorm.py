"""RMSNorm, optionally fused with the residual add that precedes it.

Both modes normalise in fp32 and match the transformers references' rounding:
  zero_centered (Qwen3.5):  round(x * rstd * (1 + w))
  plain (Llama):            round(round(x * rstd) * w)
with rstd = rsqrt(mean(x^2) + eps). The fused form first rounds s = x + residual to the input
dtype (what a separate `residual + x` in that dtype gives), returns s as the new residual and
normalises s. Outputs always have x's dtype; the weight may be x's dtype or fp32.
"""

from __future__ import annotations

import torch

from . import dispatch


def rmsnorm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, zero_centered: bool = False
) -> torch.Tensor:
    """Torch reference of `rmsnorm` (any device, any float dtype)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        return (normed * (weight.float() + 1.0)).to(x.dtype)
    return (normed.to(x.dtype).float() * weight.float()).to(x.dtype)


def add_rmsnorm_ref(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    zero_centered: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `add_rmsnorm`: (norm(x + residual), x + residual)."""
    summed = (x.float() + residual.float()).to(x.dtype)
    return rmsnorm_ref(summed, weight, eps, zero_centered=zero_centered), summed


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    zero_centered: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """RMSNorm over the last dim of x. `out` (contiguous, may be x itself) receives the result."""
    _check(x, weight, out=out)
    if out is None and not x.is_contiguous() and _cpu_fits(weight) and x.device.type == "cpu":
        x = x.contiguous()  # a slice of a merged projection (q / k heads): a copy beats the reference's ops
    if _cpu_fits(x, weight):
        out = torch.empty_like(x) if out is None else out
        dispatch.cpu_extension().add_rmsnorm(out.data_ptr(), 0, x.data_ptr(), 0, weight.data_ptr(),
                                             x.numel() // x.shape[-1], x.shape[-1], eps, zero_centered)
        return out
    if not dispatch.use_kernel(x, weight):
        dispatch.fallback("rmsnorm", x, weight)
        return _into(out, rmsnorm_ref(x, weight, eps, zero_centered=zero_centered))
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty_like(x) if out is None else out
    _launch(out, None, x, None, weight, eps, zero_centered)
    return out


def add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    zero_centered: bool = False,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual) in one pass.

    `residual_out=residual` updates the residual stream in place; `out=x` reuses x's memory.
    """
    _check(x, weight, residual=residual, out=out, residual_out=residual_out)
    if _cpu_fits(x, residual, weight):
        out = torch.empty_like(x) if out is None else out
        residual_out = torch.empty_like(x) if residual_out is None else residual_out
        dispatch.cpu_extension().add_rmsnorm(out.data_ptr(), residual_out.data_ptr(), x.data_ptr(), residual.data_ptr(),
                                             weight.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps,
                                             zero_centered)
        return out, residual_out
    if not dispatch.use_kernel(x, residual, weight):
        dispatch.fallback("add_rmsnorm", x, residual, weight)
        normed, summed = add_rmsnorm_ref(x, residual, weight, eps, zero_centered=zero_centered)
        return _into(out, normed), _into(residual_out, summed)
    x, residual, weight = x.contiguous(), residual.contiguous(), weight.contiguous()
    out = torch.empty_like(x) if out is None else out
    residual_out = torch.empty_like(x) if residual_out is None else residual_out
    _launch(out, residual_out, x, residual, weight, eps, zero_centered)
    return out, residual_out


def _cpu_fits(*tensors: torch.Tensor) -> bool:
    """The CPU kernel (csrc/cpu/decode_ops.h) takes contiguous fp32 tensors; it computes the
    reference's fp32 math, where the reference's roundings to the input dtype are no-ops."""
    return (tensors[0].device.type == "cpu" and all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors)
            and dispatch.cpu_kernels_available())


def _launch(
    out: torch.Tensor,
    residual_out: torch.Tensor | None,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    zero_centered: bool,
) -> None:
    dispatch.extension().rmsnorm(out=out, residual_out=residual_out, x=x, residual=residual, weight=weight,
                                 eps=float(eps), zero_centered=zero_centered, stream=dispatch.stream_handle(x))


def _into(dst: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    return value if dst is None else dst.copy_(value)


def _check(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> None:
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"rmsnorm: input needs a non-empty last dim, got shape {tuple(x.shape)}")
    if weight.shape != (x.shape[-1],):
        raise ValueError(
            f"rmsnorm: weight shape {tuple(weight.shape)} does not match hidden size {x.shape[-1]}"
        )
    if weight.device != x.device or weight.dtype not in (x.dtype, torch.float32):
        raise ValueError(
            f"rmsnorm: weight is {weight.dtype} on {weight.device}; "
            f"needs {x.dtype} or torch.float32 on {x.device}"
        )
    for name, t in (("residual", residual), ("out", out), ("residual_out", residual_out)):
        if t is None:
            continue
        if t.shape != x.shape or t.dtype != x.dtype or t.device != x.device:
            raise ValueError(
                f"rmsnorm: {name} is {tuple(t.shape)} {t.dtype} on {t.device}, "
                f"input is {tuple(x.shape)} {x.dtype} on {x.device}"
            )
        if name != "residual" and not t.is_contiguous():
            raise ValueError(f"rmsnorm: {name} must be contiguous")

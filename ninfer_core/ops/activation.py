"""Fused elementwise epilogues of a decode layer: SwiGLU's `silu(gate) * up` and the sigmoid gates
(attention output gate, MoE shared-expert gate + residual add). Each is 2-3 torch kernels of a
few µs on tiny tensors; a decode step is bound by kernel count, so one launch each (csrc/activation.cu;
silu_mul also on the CPU, csrc/cpu/decode_ops.h, where each torch op costs microseconds of dispatch).

The references below are the torch expressions the model used before, with their rounding: every
intermediate is rounded to the input dtype, and the kernels round at the same points.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import dispatch


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] = [gate | up] -> silu(gate) * up [..., I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def sigmoid_mul_ref(x: torch.Tensor, gate: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
    """x * sigmoid(gate) (+ add); gate has x's shape or x's with a last dim of 1."""
    y = x * torch.sigmoid(gate) if add is None else add + torch.sigmoid(gate) * x
    return y


# Rows up to which the CPU kernel runs: it saves torch's dispatch on a decode step's few rows, but
# its scalar exp is 5x slower than torch's vectorized one on a prefill's (128 x 1536: 0.67 vs 0.13 ms).
CPU_KERNEL_MAX_ROWS = 16


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    cols = x.shape[-1] // 2
    rows = x.numel() // max(x.shape[-1], 1)
    if (x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous() and x.shape[-1] == 2 * cols
            and rows <= CPU_KERNEL_MAX_ROWS and dispatch.cpu_kernels_available()):  # csrc/cpu/decode_ops.h
        out = x.new_empty(*x.shape[:-1], cols)
        dispatch.cpu_extension().silu_mul(out.data_ptr(), x.data_ptr(), rows, cols)
        return out
    if not (dispatch.use_kernel(x) and x.is_contiguous() and x.shape[-1] == 2 * cols and x.numel() > 0):
        dispatch.fallback("silu_mul", x)
        return silu_mul_ref(x)
    out = x.new_empty(*x.shape[:-1], cols)
    dispatch.extension().silu_mul(out=out, x=x, stream=dispatch.stream_handle(x))
    return out


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
    cols = x.shape[-1]
    tensors = (x, gate) if add is None else (x, gate, add)
    gate_rows = row_view(gate, 1 if gate.shape[-1] == 1 else cols)
    if gate_rows is None and dispatch.use_kernel(gate):
        # rows a fixed stride apart is what the kernel reads; a gate split out of a batch of
        # merged projections is not (per head, then per token): one small copy beats the reference
        gate = gate.contiguous()
        gate_rows = row_view(gate, 1 if gate.shape[-1] == 1 else cols)
    fits = (
        dispatch.use_kernel(*tensors)
        and len({t.dtype for t in tensors}) == 1
        and x.is_contiguous()
        and (add is None or (add.is_contiguous() and add.shape == x.shape))
        and gate.shape[:-1] == x.shape[:-1]
        and gate.shape[-1] in (1, cols)
        and gate_rows is not None
        and x.numel() > 0
    )
    if not fits:
        dispatch.fallback("sigmoid_mul", x, gate)
        return sigmoid_mul_ref(x, gate, add)
    out = torch.empty_like(x)
    dispatch.extension().sigmoid_mul(out=out, x=x, gate=gate_rows, add=add, stream=dispatch.stream_handle(x))
    return out


def row_view(gate: torch.Tensor, cols: int) -> torch.Tensor | None:
    """gate as [rows, cols] with unit column stride and one row stride, without a copy (None: no such view)."""
    try:
        rows = gate.view(-1, cols)
    except RuntimeError:
        return None
    return rows if rows.stride(1) == 1 or cols == 1 else None

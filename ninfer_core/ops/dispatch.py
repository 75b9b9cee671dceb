"""The one place that decides between the CUDA extension and the torch reference.

Rule: the compiled extension ninfer_core._C is importable, every tensor of the call is on a CUDA
device with a kernel dtype (fp32 / fp16 / bf16), and NINFER_DISABLE_KERNELS is unset (or "0")
=> kernel; otherwise the torch reference. A missing or broken extension is logged once at debug
level and never raised: CPU-only installs simply run the references.

A call on CUDA tensors that still runs a reference (a shape or dtype the kernel does not take)
is slow without saying so: `fallback` logs it once per op, and NINFER_REQUIRE_KERNELS=1 makes it
an error (the GPU tests and benchmarks set it, so a silent fallback cannot pass for speed).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from types import ModuleType

import torch

log = logging.getLogger(__name__)

DISABLE_ENV = "NINFER_DISABLE_KERNELS"
REQUIRE_ENV = "NINFER_REQUIRE_KERNELS"
_KERNEL_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


@functools.cache
def extension() -> ModuleType | None:
    """The compiled `ninfer_core._C`, or None when it was not built or cannot load."""
    try:
        return importlib.import_module("ninfer_core._C")
    except ImportError as exc:
        log.debug("ninfer_core._C unavailable, using torch reference ops: %s", exc)
        return None


def kernels_disabled() -> bool:
    """True when NINFER_DISABLE_KERNELS asks for the torch references everywhere."""
    return os.environ.get(DISABLE_ENV, "") not in ("", "0")


def kernels_available() -> bool:
    """True when CUDA tensors would run on the extension's kernels."""
    return not kernels_disabled() and extension() is not None


def use_kernel(*tensors: torch.Tensor) -> bool:
    """Whether a call on these tensors goes to the CUDA extension (see the module docstring)."""
    if not all(t.device.type == "cuda" and t.dtype in _KERNEL_DTYPES for t in tensors):
        return False
    return kernels_available()


class KernelFallbackError(RuntimeError):
    """NINFER_REQUIRE_KERNELS is set and a CUDA call went to a torch reference."""


def fallback(op: str, activations: torch.Tensor, *tensors: torch.Tensor) -> None:
    """Called where `op` runs its torch reference: with bf16 / fp16 activations on CUDA and kernels
    available that is a fallback, logged once per op (an error under NINFER_REQUIRE_KERNELS=1).
    fp32 on CUDA (a test setting) runs references by design and is not reported."""
    if activations.device.type != "cuda" or activations.dtype not in (torch.float16, torch.bfloat16):
        return
    if not kernels_available():
        return
    tensors = (activations, *tensors)
    if os.environ.get(REQUIRE_ENV, "") not in ("", "0"):
        shapes = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in tensors)
        raise KernelFallbackError(f"{op}: no CUDA kernel for this call ({shapes}) and {REQUIRE_ENV} is set")
    _log_fallback_once(op)


@functools.cache
def _log_fallback_once(op: str) -> None:
    log.warning("%s runs its torch reference on CUDA tensors (no kernel for this shape / dtype): slow", op)


def kernel_dtype(t: torch.Tensor) -> object:
    """The extension's DType value for a tensor (only called once `use_kernel` said yes)."""
    return getattr(extension().DType, _KERNEL_DTYPES[t.dtype])


def stream_handle(t: torch.Tensor) -> int:
    """torch's current stream on t's device, so kernels order with torch ops and graph capture."""
    return torch.cuda.current_stream(t.device).cuda_stream

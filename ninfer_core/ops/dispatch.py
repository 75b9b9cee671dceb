"""The one place that decides between the compiled kernels and the torch reference.

Rule: NINFER_DISABLE_KERNELS is unset (or "0") and
- every tensor of the call is on a CUDA device with a kernel dtype (fp32 / fp16 / bf16) and the
  extension ninfer_core._C is importable => CUDA kernel;
- every tensor is on the CPU and ninfer_core._cpu is importable => CPU kernel (csrc/cpu: the
  quantized matmul, `ops/quant.py`);
otherwise the torch reference. A missing or broken extension is logged once at debug level and
never raised: an install without compiled code simply runs the references.

Compact weights on the CPU, NINFER_CPU_MATH or `--cpu-math` (KL to the exact path in docs/performance.md):
  bf16 (default)  decode weight-only with fp32 activations, except GGUF blocks kept native (Q4_K,
                  Q5_K, Q6_K, Q8_0, Q4_0, Q4_1: ops/kquant.py), whose decode quantizes activations to int8 per 32 inputs
                  as llama.cpp does; prefill GEMMs in bf16 where the CPU multiplies bf16 natively
                  (2-4x torch's fp32 GEMM), fp32 elsewhere;
  int8            also decode the other formats with activations quantized to int8 per block of
                  32, multiplied in integers (VNNI): faster where decode is arithmetic-bound;
  exact           fp32 activations everywhere (the tests that compare with references use it);
                  K-quant blocks are multiplied dequantized, gguf-py's fp32 values.
`--dtype float32` runs every weight dequantized, the exact path the transformers tests compare.

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
CPU_MATH_ENV = "NINFER_CPU_MATH"
CPU_MATHS = ("bf16", "int8", "exact")
_KERNEL_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def _load(name: str) -> ModuleType | None:
    """A compiled extension module, or None (logged at debug level) when it was not built or cannot load."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        log.debug("%s unavailable, using torch reference ops instead: %s", name, exc)
        return None


@functools.cache
def extension() -> ModuleType | None:
    """The compiled CUDA kernels `ninfer_core._C`, or None."""
    return _load("ninfer_core._C")


@functools.cache
def cpu_extension() -> ModuleType | None:
    """The compiled CPU kernels `ninfer_core._cpu`, or None."""
    return _load("ninfer_core._cpu")


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


@functools.cache
def triton_kernels(module: str) -> ModuleType | None:
    """A module of Triton kernels (`ninfer_core.ops.<module>`), imported on first use, so that
    TRITON_INTERPRET, read when triton.jit decorates, can be set by a test before; None where
    kernels are disabled, Triton is missing, or neither a GPU nor the interpreter can run them."""
    if kernels_disabled():
        return None
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "") != "1":
        return None
    try:
        return importlib.import_module(f"ninfer_core.ops.{module}")
    except ImportError as exc:
        log.debug("triton unavailable (%s): the torch paths run instead", exc)
        return None


def cpu_kernels_available() -> bool:
    """True when CPU tensors would run on the CPU extension's kernels."""
    return not kernels_disabled() and cpu_extension() is not None


def use_cpu_kernel(*tensors: torch.Tensor) -> bool:
    """Whether a call on these tensors goes to the CPU extension (see the module docstring)."""
    return all(t.device.type == "cpu" for t in tensors) and cpu_kernels_available()


def cpu_math() -> str:
    """NINFER_CPU_MATH (see the module docstring); an unknown value is an error, not a silent default."""
    value = os.environ.get(CPU_MATH_ENV) or CPU_MATHS[0]
    if value not in CPU_MATHS:
        raise ValueError(f"{CPU_MATH_ENV}={value!r}: use one of {', '.join(CPU_MATHS)}")
    return value


def set_cpu_math(value: str | None) -> None:
    """`--cpu-math`: NINFER_CPU_MATH for this process (None leaves it as it is)."""
    if value is None:
        return
    if value not in CPU_MATHS:
        raise ValueError(f"--cpu-math must be one of {', '.join(CPU_MATHS)}, got '{value}'")
    os.environ[CPU_MATH_ENV] = value


@functools.cache
def cpu_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 / AMX), where torch's bf16 GEMM
    is 2-4x its fp32 one; elsewhere bf16 is emulated and slower."""
    cpu = torch.cpu
    return bool(torch.backends.mkldnn.is_available()
                and (cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported()))


def cpu_threads() -> int:
    """Threads a CPU kernel runs on: torch's intra-op setting, so one knob sets both."""
    return torch.get_num_threads()


def kernel_dtype(t: torch.Tensor) -> object:
    """The extension's DType value for a tensor (only called once `use_kernel` said yes)."""
    return getattr(extension().DType, _KERNEL_DTYPES[t.dtype])


def upload(values: object, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values (a list, nested lists, a CPU tensor) as a tensor on `device`, without waiting
    for the GPU. `torch.tensor(values, device=cuda)` copies from pageable memory and synchronizes
    the stream, so the host stalls until every queued kernel has run and the GPU then idles while
    the host goes on; a pinned staging tensor copies without a wait (the caching host allocator
    keeps it until the copy is done)."""
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def num_sms(device: torch.device) -> int:
    """The SM count of a CUDA device (grids sized to fill it), asked of the driver once per device."""
    return _num_sms_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _num_sms_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def stream_handle(t: torch.Tensor) -> int:
    """torch's current stream on t's device, so kernels order with torch ops and graph capture."""
    return torch.cuda.current_stream(t.device).cuda_stream

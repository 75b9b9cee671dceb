"""Running an op's CUDA-kernel branch on the CPU, two ways:
- `record_kernel_calls`: a recording stand-in for the extension keeps each binding call's keyword
  arguments, so a test can check that every tensor and scalar reaches the argument it belongs to
  (a swap there only shows as wrong numbers on a GPU); runs without the extension (CI);
- `kernels_on_cpu` + `reaches_launch`: the real extension's bindings on CPU tensors, where they
  run every check of csrc/tensor_arg.h and the last one, the device check, raises DeviceError
  instead of launching; runs wherever ninfer_core._C is built, with or without a GPU."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable

import pytest

from ninfer_core.ops import dispatch


def record_kernel_calls(monkeypatch: pytest.MonkeyPatch, *bindings: str) -> list[dict[str, Any]]:
    """Route `bindings` of the extension to a recorder on CPU tensors (stream 7, dtype "bf16",
    expert kinds "int8" / "int4" / "dense"); returns the list the calls' kwargs are appended to."""
    calls: list[dict[str, Any]] = []
    fake = SimpleNamespace(
        DType=SimpleNamespace(BF16="bf16"),
        ExpertKind=SimpleNamespace(INT8="int8", INT4="int4", DENSE="dense"),
        **{name: (lambda **kw: calls.append(kw)) for name in bindings},
    )
    monkeypatch.setattr(dispatch, "extension", lambda: fake)
    monkeypatch.setattr(dispatch, "use_kernel", lambda *tensors: True)
    monkeypatch.setattr(dispatch, "stream_handle", lambda t: 7)
    monkeypatch.setattr(dispatch, "kernel_dtype", lambda t: "bf16")
    return calls


@pytest.fixture
def kernels_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ops take their CUDA-kernel path on CPU tensors, into the real extension (stream 0)."""
    if dispatch.extension() is None:
        pytest.skip("ninfer_core._C is not built")
    monkeypatch.setattr(dispatch, "use_kernel", lambda *tensors: True)
    monkeypatch.setattr(dispatch, "stream_handle", lambda t: 0)


def reaches_launch(call: Callable[[], object]) -> None:
    """`call` passes every check of the binding it reaches: only the device check stops it (a
    wrapper that fell back to its torch reference instead would return, and fail this)."""
    with pytest.raises(dispatch.extension().DeviceError, match="is not on a CUDA device"):
        call()

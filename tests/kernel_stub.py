"""A recording stand-in for the CUDA extension: runs an op's kernel branch on the CPU and keeps
each binding call's keyword arguments, so a test can check that every tensor, stride and size
reaches the argument it belongs to (a swap there only shows as wrong numbers on a GPU)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

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

"""Running an op's CUDA-kernel branch on the CPU, two ways:
- `record_kernel_calls`: a recording stand-in for the extension keeps each binding call's keyword
  arguments, so a test can check that every tensor and scalar reaches the argument it belongs to
  (a swap there only shows as wrong numbers on a GPU); runs without the extension (CI);
- `kernels_on_cpu` + `reaches_launch`: the real extension's bindings on CPU tensors, where they
  run every check of csrc/tensor_arg.h and the last one, the device check, raises DeviceError
  instead of launching; runs wherever ninfer_core._C is built, with or without a GPU;
- `engine_through_checks`: the same under a whole engine (`ChecksOnly`)."""

from __future__ import annotations

from collections import Counter
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
    """The ops take their CUDA-kernel path on CPU tensors, into the real extension (stream 0): not
    the CPU extension's kernels, which CPU tensors would take first, and with an H100 / H200's SM
    count where the split-K attention sizes its grid by it."""
    if dispatch.extension() is None:
        pytest.skip("ninfer_core._C is not built")
    monkeypatch.setattr(dispatch, "use_kernel", lambda *tensors: True)
    monkeypatch.setattr(dispatch, "stream_handle", lambda t: 0)
    monkeypatch.setattr(dispatch, "cpu_kernels_available", lambda: False)
    monkeypatch.setattr(dispatch, "num_sms", lambda device: 132)


def reaches_launch(call: Callable[[], object]) -> None:
    """`call` passes every check of the binding it reaches: only the device check stops it (a
    wrapper that fell back to its torch reference instead would return, and fail this)."""
    with pytest.raises(dispatch.extension().DeviceError, match="is not on a CUDA device"):
        call()


def rejects(call: Callable[[], object], match: str) -> None:
    """`call` fails one of its binding's checks (a ValueError matching `match`) before the device
    check, which a call passing every check would reach."""
    with pytest.raises(ValueError, match=match) as info:
        call()
    assert not isinstance(info.value, dispatch.extension().DeviceError), info.value


class ChecksOnly:
    """The real extension with each binding stopped after its checks: a call must end at the device
    check (every other check passed), then its outputs are zeroed (finite logits, in-range ids) and
    a sampler's probabilities made one-hot at token 0 (a distribution the judge can draw from) so
    the engine around it runs on; `calls` counts the calls per binding."""

    # outputs by argument name; `weights` and `logits` are outputs only of the bindings named here
    # (elsewhere inputs: the sampler's logits come from the forward as inference tensors)
    OUTPUTS = ("out", "q_out", "h", "normed", "residual_out", "probs", "threshold", "tokens", "ids",
               "sorted_slots", "block_experts", "used")
    EXTRA_OUTPUTS = {"moe_route": ("weights",), "moe_router": ("weights", "logits")}

    def __init__(self, ext: Any) -> None:
        self.ext, self.calls = ext, Counter()

    def __getattr__(self, name: str) -> Any:
        binding = getattr(self.ext, name)
        if isinstance(binding, type) or not callable(binding) or name == "decode_attention_max_splits":
            return binding
        outputs = self.OUTPUTS + self.EXTRA_OUTPUTS.get(name, ())

        def checked(**kwargs: Any) -> None:
            with pytest.raises(self.ext.DeviceError, match="is not on a CUDA device"):
                binding(**kwargs)
            self.calls[name] += 1
            for key in outputs:
                if kwargs.get(key) is not None:
                    kwargs[key].zero_()
            if kwargs.get("probs") is not None:
                kwargs["probs"][:, 0] = 1.0

        return checked


@pytest.fixture
def engine_through_checks(kernels_on_cpu: None, monkeypatch: pytest.MonkeyPatch) -> ChecksOnly:
    """Whole-engine runs on CPU tensors whose every op takes its CUDA-kernel path into `ChecksOnly`:
    the model's real shapes, views and dtypes meet the bindings' checks (no GPU needed)."""
    proxy = ChecksOnly(dispatch.extension())
    monkeypatch.setattr(dispatch, "extension", lambda: proxy)
    return proxy

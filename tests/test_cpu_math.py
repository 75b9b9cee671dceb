"""NINFER_CPU_MATH on the real SmolLM2 (its Q4_1 / Q8_0 GGUF, compact weights): the bf16 prefill and
the int8-activation decode against the exact math of the same weights, teacher-forced. The bounds
hold the values measured in docs/performance.md with a margin; an error in the kernels (a wrong
lane scale, a misplaced activation) gives KL in the nats."""

from __future__ import annotations

import pytest
import torch

from ninfer_core.cache import CacheManager
from ninfer_core.models.base import ForwardBatch
from ninfer_core.models.loader import load_model
from ninfer_core.ops import dispatch

TEXT = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France.\n"
        "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n")

pytestmark = pytest.mark.skipif(dispatch.cpu_extension() is None, reason="ninfer_core._cpu not built")


@torch.inference_mode()
def _log_probs(loaded, ids: list[int], one_by_one: bool) -> torch.Tensor:
    cache = CacheManager(loaded.config, max_tokens=len(ids), max_seqs=1, dtype=loaded.dtype, device="cpu")
    seq = cache.allocate()
    cache.reserve(seq, len(ids))
    out = []
    for start, end in [(i, i + 1) for i in range(len(ids))] if one_by_one else [(0, len(ids))]:
        batch = ForwardBatch(input_ids=torch.tensor([ids[start:end]]), positions=torch.arange(start, end)[None],
                             cache_lens=torch.tensor([start]), slots=torch.tensor([seq.slot]),
                             block_table=cache.block_table([seq]), logits="all")
        out.append(loaded.model.forward(batch, cache.cache).logits[0].double())
    return torch.cat(out).log_softmax(-1)


def _kl(reference: torch.Tensor, ours: torch.Tensor) -> torch.Tensor:
    return (reference.exp() * (reference - ours)).sum(-1)


@pytest.fixture(scope="module")
def smollm(smollm_path):
    loaded = load_model(str(smollm_path), "cpu")
    return loaded, loaded.tokenizer.encode(TEXT)[:64]


@pytest.mark.parametrize("math, one_by_one, bound", [("bf16", False, 5e-3), ("int8", True, 5e-2)])
def test_faster_cpu_math_stays_close_to_exact(smollm, monkeypatch, math, one_by_one, bound):
    loaded, ids = smollm
    monkeypatch.setenv(dispatch.CPU_MATH_ENV, "exact")
    exact = _log_probs(loaded, ids, one_by_one)
    monkeypatch.setenv(dispatch.CPU_MATH_ENV, math)
    ours = _log_probs(loaded, ids, one_by_one)
    kl = _kl(exact, ours)
    if math == "bf16" and not dispatch.cpu_native_bf16():
        assert torch.equal(ours, exact)  # no bf16 arithmetic here: the prefill stays fp32
        return
    assert 0 < kl.mean() < bound  # it did run another math, and a close one
    assert (exact.argmax(-1) == ours.argmax(-1)).double().mean() >= 0.85


def test_an_unknown_cpu_math_is_an_error(monkeypatch):
    monkeypatch.setenv(dispatch.CPU_MATH_ENV, "fast")
    with pytest.raises(ValueError, match="NINFER_CPU_MATH='fast': use one of bf16, int8, exact"):
        dispatch.cpu_math()


def test_the_cpu_math_flag_sets_it_for_the_process(monkeypatch):
    from ninfer_app.engine_flags import apply_cpu_runtime
    from ninfer_core.errors import NinferError

    monkeypatch.setenv(dispatch.CPU_MATH_ENV, "exact")
    apply_cpu_runtime(None, None)  # no flag: the environment's stays
    assert dispatch.cpu_math() == "exact"
    apply_cpu_runtime(None, "int8")
    assert dispatch.cpu_math() == "int8"
    with pytest.raises(NinferError, match="--cpu-math must be one of bf16, int8, exact"):
        apply_cpu_runtime(None, "fast")

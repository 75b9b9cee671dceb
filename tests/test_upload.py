"""dispatch.upload: host values to the device without waiting for the queued GPU work.

CPU: the values and dtype of torch.tensor. CUDA: behind a kernel that sleeps ~0.3 s, `upload`
returns at once where `torch.tensor(values, device="cuda")` (a pageable copy) waits the kernel
out; the values arrive in stream order.
"""

from __future__ import annotations

import time

import pytest
import torch

from ninfer_core.ops.dispatch import upload


def test_cpu_values_and_dtypes():
    cases = (([1, 2, 3], torch.long), ([[0.5, 1.5], [2.0, -1.0]], torch.float64), ([True, False], torch.bool))
    for values, dtype in cases:
        got = upload(values, dtype, torch.device("cpu"))
        assert got.dtype == dtype and torch.equal(got, torch.tensor(values, dtype=dtype))
    stacked = upload(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.float64, torch.device("cpu"))
    assert stacked.dtype == torch.float64 and stacked.tolist() == [[1.0, 2.0], [3.0, 4.0]]


def _returns_within(fn, seconds: float) -> tuple[bool, torch.Tensor]:
    torch.cuda.synchronize()
    torch.cuda._sleep(500_000_000)  # cycles: ~0.3 s at the H100's ~1.7 GHz
    start = time.perf_counter()
    out = fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed < seconds, out


@pytest.mark.cuda
def test_upload_does_not_wait_for_the_gpu():
    values = list(range(1000))
    quick, out = _returns_within(lambda: upload(values, torch.long, torch.device("cuda")), 0.1)
    assert quick and out.tolist() == values
    blocking, _ = _returns_within(lambda: torch.tensor(values, device="cuda"), 0.1)
    assert not blocking  # the pageable form waits: the check above can fail

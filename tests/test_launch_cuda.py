"""csrc/launch.cuh's NINFER_ABLATE: a named launch is skipped (its output is left as it was), other
launches and unset runs go ahead. Read at every launch, so one process can switch it."""

import pytest
import torch

from ninfer_core.ops import dispatch, rmsnorm, rmsnorm_ref

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("names", ["rmsnorm", "quant_gemv+rmsnorm", "+rmsnorm kernel"])
def test_ablated_launch_is_skipped(monkeypatch: pytest.MonkeyPatch, names: str) -> None:
    if dispatch.extension() is None:
        pytest.skip("needs the CUDA extension")
    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    monkeypatch.delenv("NINFER_ABLATE", raising=False)
    expected = rmsnorm(x, weight, 1e-6)
    torch.testing.assert_close(expected, rmsnorm_ref(x, weight, 1e-6), rtol=2e-2, atol=2e-2)
    out = torch.full_like(x, 7.0)
    monkeypatch.setenv("NINFER_ABLATE", names)
    rmsnorm(x, weight, 1e-6, out=out)
    torch.cuda.synchronize()
    assert bool((out == 7.0).all()), "the ablated launch ran"
    monkeypatch.setenv("NINFER_ABLATE", "quant_gemv+sampling")
    rmsnorm(x, weight, 1e-6, out=out)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    monkeypatch.delenv("NINFER_ABLATE")
    out.fill_(7.0)
    rmsnorm(x, weight, 1e-6, out=out)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)

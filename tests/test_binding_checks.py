"""The CUDA extension's bindings (rmsnorm, the activations; the other families have their own
test_binding_checks_*.py) check shapes, strides and dtypes in C++ (csrc/tensor_arg.h) before
anything launches. Runs wherever ninfer_core._C is built, GPU or not: with CPU tensors a binding
goes through every check and its last one, the device check, raises DeviceError instead of
launching. So each op's wrapper, routed to its kernel path on CPU tensors (`kernels_on_cpu`), must
reach DeviceError (the arguments it builds pass the binding's checks), and a wrong argument handed
to the binding must be a ValueError that names it.
"""

from __future__ import annotations

import pytest
import torch

from ninfer_core.ops import dispatch
from ninfer_core.ops.activation import sigmoid_mul, silu_mul
from ninfer_core.ops.rmsnorm import add_rmsnorm, rmsnorm

from kernel_stub import kernels_on_cpu, reaches_launch  # noqa: F401 - kernels_on_cpu is a fixture

ext = dispatch.extension()
# The extension is built only where CUDA is: `cuda` too, so the device's `pytest -m cuda` runs them.
pytestmark = [pytest.mark.skipif(ext is None, reason="ninfer_core._C is not built"), pytest.mark.cuda]

BF16 = torch.bfloat16


@pytest.mark.parametrize("shape", [(1, 64), (3, 5, 64), (7, 48)])
@pytest.mark.parametrize("weight_dtype", [BF16, torch.float32])
def test_rmsnorm_wrappers_pass_the_checks(kernels_on_cpu, shape, weight_dtype):
    x, residual = torch.randn(shape, dtype=BF16), torch.randn(shape, dtype=BF16)
    weight = torch.randn(shape[-1], dtype=weight_dtype)
    reaches_launch(lambda: rmsnorm(x, weight, 1e-6))
    reaches_launch(lambda: add_rmsnorm(x, residual, weight, 1e-6, residual_out=residual))


def test_rmsnorm_rejects_what_the_kernel_cannot_take():
    x = torch.randn(4, 64, dtype=BF16)
    out, weight = torch.empty_like(x), torch.randn(64, dtype=BF16)
    with pytest.raises(ValueError, match=r"rmsnorm: weight has shape \(32,\), expected \(64,\)"):
        ext.rmsnorm(out, None, x, None, weight[:32], 1e-6, False, 0)
    with pytest.raises(ValueError, match="rmsnorm: out has shape \\(4, 32\\), x \\(4, 64\\)"):
        ext.rmsnorm(out[:, :32], None, x, None, weight, 1e-6, False, 0)
    with pytest.raises(ValueError, match="rmsnorm: x must be contiguous"):
        ext.rmsnorm(out, None, torch.randn(64, 4, dtype=BF16).t(), None, weight, 1e-6, False, 0)
    with pytest.raises(ValueError, match="rmsnorm: weight is float16, expected bfloat16 or float32"):
        ext.rmsnorm(out, None, x, None, weight.half(), 1e-6, False, 0)
    with pytest.raises(ValueError, match="rmsnorm: x is int64, expected a float dtype"):
        ext.rmsnorm(out, None, x.long(), None, weight, 1e-6, False, 0)
    with pytest.raises(ValueError, match="residual and residual_out go together"):
        ext.rmsnorm(out, None, x, x, weight, 1e-6, False, 0)
    for rows, hidden in ((1, 2**30 + 8), (2**31, 8)):  # past the kernel's range: meta tensors, shapes without memory
        big = torch.empty(rows, hidden, dtype=BF16, device="meta")
        with pytest.raises(ValueError, match=rf"rmsnorm: x has shape \({rows}, {hidden}\), out of the kernel's range"):
            ext.rmsnorm(torch.empty_like(big), None, big, None, torch.empty(hidden, dtype=BF16, device="meta"), 1e-6,
                        False, 0)
    with pytest.raises(TypeError):  # the raw-pointer interface is gone: an address is not a tensor
        ext.rmsnorm(out.data_ptr(), None, x, None, weight, 1e-6, False, 0)


def test_device_check_comes_last_and_names_the_tensor():
    x = torch.randn(2, 8, dtype=BF16)
    with pytest.raises(ext.DeviceError, match="rmsnorm: x is not on a CUDA device"):
        ext.rmsnorm(torch.empty_like(x), None, x, None, torch.ones(8, dtype=BF16), 1e-6, False, 0)
    assert issubclass(ext.DeviceError, ValueError)


@pytest.mark.parametrize("shape", [(1, 2, 96), (5, 64)])
def test_activation_wrappers_pass_the_checks(kernels_on_cpu, shape):
    x = torch.randn(shape, dtype=BF16)
    reaches_launch(lambda: silu_mul(x))
    gate_full, gate_row = torch.randn(shape, dtype=BF16), torch.randn(*shape[:-1], 1, dtype=BF16)
    reaches_launch(lambda: sigmoid_mul(x, gate_full))
    reaches_launch(lambda: sigmoid_mul(x, gate_row, torch.randn(shape, dtype=BF16)))
    # a gate sliced out of a wider projection: rows a fixed stride apart, read in place
    merged = torch.randn(*shape[:-1], 3 * shape[-1], dtype=BF16)
    reaches_launch(lambda: sigmoid_mul(x, merged[..., shape[-1]:2 * shape[-1]]))


def test_activation_rejects_what_the_kernel_cannot_take():
    x = torch.randn(4, 64, dtype=BF16)
    with pytest.raises(ValueError, match="silu_mul: x needs an even, non-empty last axis"):
        ext.silu_mul(torch.empty(4, 32, dtype=BF16), torch.randn(4, 63, dtype=BF16), 0)
    with pytest.raises(ValueError, match="silu_mul: out has 256 elements, expected 128"):
        ext.silu_mul(torch.empty(4, 64, dtype=BF16), x, 0)
    with pytest.raises(ValueError, match="silu_mul: out is float32, expected bfloat16"):
        ext.silu_mul(torch.empty(4, 32), x, 0)
    gate = torch.randn(4, 64, dtype=BF16)
    with pytest.raises(ValueError, match=r"sigmoid_mul: gate has shape \(3, 64\), expected \(4, \*\)"):
        ext.sigmoid_mul(torch.empty_like(x), x, gate[:3], None, 0)
    with pytest.raises(ValueError, match="sigmoid_mul: gate has 2 columns, expected 1 or 64"):
        ext.sigmoid_mul(torch.empty_like(x), x, gate[:, :2], None, 0)
    with pytest.raises(ValueError, match="sigmoid_mul: gate needs a contiguous last axis"):
        ext.sigmoid_mul(torch.empty_like(x), x, torch.randn(64, 4, dtype=BF16).t(), None, 0)
    with pytest.raises(ValueError, match="sigmoid_mul: add has shape \\(4, 32\\), x \\(4, 64\\)"):
        ext.sigmoid_mul(torch.empty_like(x), x, gate, x[:, :32], 0)

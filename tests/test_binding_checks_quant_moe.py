"""The quant and MoE bindings (quant_gemv, moe_grouped_gemv, dequant; moe_route, moe_router,
moe_align, moe_combine, moe_decode) check shapes, strides and dtypes in C++ (csrc/tensor_arg.h) before anything
launches; see tests/test_binding_checks.py. Each op's wrapper, routed to its kernel path on CPU
tensors, must reach the device check (DeviceError) for the shapes the GPU tests run (batch 1 and 8,
int8 and int4 in every group size, every epilogue, grouped and shared experts, the router with the
norm folded in), and a wrong argument handed to a binding must be a ValueError that names it.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from ninfer_core.ops import dispatch, moe, moe_align, quant
from ninfer_core.ops.moe_align import align_by_expert_ref
from ninfer_core.ops.quant import quantize

from kernel_stub import kernels_on_cpu, reaches_launch, rejects  # noqa: F401 - kernels_on_cpu is a fixture

ext = dispatch.extension()
# The extension is built only where CUDA is: `cuda` too, so the device's `pytest -m cuda` runs them.
pytestmark = [pytest.mark.skipif(ext is None, reason="ninfer_core._C is not built"), pytest.mark.cuda]

BF16 = torch.bfloat16
I32 = torch.int32
QUANT = [("int8", 0), ("int4", 32), ("int4", 64), ("int4", 128)]


def _randn(*shape, seed=0, dtype=BF16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


@functools.cache  # quantizing on the CPU is most of these tests' time; no call writes the weights
def _weight(n, k, kind, group, seed=0):
    return quantize(_randn(n, k, seed=seed, dtype=torch.float32) / math.sqrt(k), kind, group or 128)


def _misaligned(*shape, dtype=BF16):
    """A contiguous view starting one element past an aligned address."""
    return torch.zeros(math.prod(shape) + 1, dtype=dtype)[1:].view(shape)


def _transposed(*shape, dtype=BF16):
    """A non-contiguous tensor of `shape`."""
    return torch.zeros(*reversed(shape), dtype=dtype).t()


# ---------------------------------------------------------------- the wrappers pass the checks


@pytest.mark.parametrize("kind, group", QUANT)
@pytest.mark.parametrize("rows", [1, 3, 8, 16, 32])  # 32: the CUDA GEMV's last, past the CPU's 16
@pytest.mark.parametrize("dtype", [BF16, torch.float16, torch.float32], ids=str)
def test_quant_linear_and_its_epilogues_pass_the_checks(kernels_on_cpu, kind, group, rows, dtype):
    qw = _weight(256, 512, kind, group)
    x = _randn(rows, 512, seed=1, dtype=dtype)
    bias = _randn(256, seed=2, dtype=dtype)
    reaches_launch(lambda: quant.quant_linear(x, qw))
    reaches_launch(lambda: quant.quant_linear(x[None], qw, bias))  # leading dims
    reaches_launch(lambda: quant.quant_swiglu(x, qw))  # [gate; up]: out [rows, 128]
    merged = _randn(rows, 257, seed=3, dtype=dtype)
    add = _randn(rows, 256, seed=4, dtype=dtype)
    # the gate a strided column of the router's output (rows 257 apart), with and without a bias
    reaches_launch(lambda: quant.quant_linear_gated(x, qw, merged[:, 256:], add))
    reaches_launch(lambda: quant.quant_linear_gated(x[None], qw, merged[None, :, 256:], add[None], bias))


@pytest.mark.parametrize("kind, group", QUANT)
@pytest.mark.parametrize("rows, k", [(1, 512), (3, 2048), (4, 8192)])
@pytest.mark.parametrize("dtype", [BF16, torch.float16], ids=str)
def test_quant_linear_add_norm_passes_the_checks(kernels_on_cpu, monkeypatch, kind, group, rows, k, dtype):
    qw = _weight(64, k, kind, group)
    x, residual = _randn(rows, k, seed=1, dtype=dtype), _randn(rows, k, seed=2, dtype=dtype)
    weight = _randn(k, seed=3, dtype=dtype)
    bias = _randn(64, seed=4, dtype=dtype)
    # the folded norm reaches the GEMV, not the separate add_rmsnorm
    monkeypatch.setattr(quant, "add_rmsnorm", lambda *a, **kw: pytest.fail("the norm was not folded"))
    reaches_launch(lambda: quant.quant_linear_add_norm(x, residual, weight, 1e-6, True, qw))
    reaches_launch(lambda: quant.quant_linear_add_norm(x[None], residual[None], weight, 1e-6, False, qw, bias))


@pytest.mark.parametrize("kind, group", QUANT)
@pytest.mark.parametrize("dtype", [BF16, torch.float16, torch.float32], ids=str)
def test_dequantize_passes_the_checks(kernels_on_cpu, kind, group, dtype):
    qw = quantize(_randn(3, 40, 256, dtype=torch.float32), kind, group or 128)  # an expert stack
    reaches_launch(lambda: quant.dequantize(qw, dtype))
    # past the GEMV's rows, quant_linear multiplies a dequantized copy
    reaches_launch(lambda: quant.quant_linear(_randn(quant.MAX_GEMV_ROWS + 1, 256, dtype=dtype),
                                              _weight(64, 256, kind, group)))


@pytest.mark.parametrize("dtype", [torch.float32, BF16, torch.float16], ids=str)
@pytest.mark.parametrize("tokens, experts, top_k", [(1, 8, 2), (5, 64, 8), (3, 300, 1), (2, 512, 10), (4, 128, 40),
                                                    (300, 256, 8)])
def test_moe_route_passes_the_checks(kernels_on_cpu, dtype, tokens, experts, top_k):
    logits = _randn(tokens, experts, dtype=dtype)
    reaches_launch(lambda: moe.moe_route(logits, top_k, True))
    reaches_launch(lambda: moe.moe_route(_randn(tokens, experts + 3, dtype=dtype)[:, :experts], top_k, False))
    reaches_launch(lambda: moe.moe_route(logits, top_k, True, torch.zeros(tokens, dtype=torch.long)))


@pytest.mark.parametrize("dtype", [BF16, torch.float16], ids=str)
@pytest.mark.parametrize("experts, rows, hidden, top_k", [(256, 257, 2048, 8), (8, 8, 64, 2), (64, 66, 520, 4),
                                                          (128, 129, 4096, 8)])
@pytest.mark.parametrize("tokens", [1, 8])
def test_moe_router_passes_the_checks(kernels_on_cpu, dtype, experts, rows, hidden, top_k, tokens):
    x, w = _randn(tokens, hidden, dtype=dtype), _randn(rows, hidden, seed=1, dtype=dtype)
    reaches_launch(lambda: moe.moe_router(x, w, experts, top_k, True))


@pytest.mark.parametrize("dtype", [BF16, torch.float16], ids=str)
@pytest.mark.parametrize("experts, rows, hidden, top_k", [(256, 257, 2048, 8), (8, 8, 256, 2), (64, 66, 1536, 4)])
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_moe_add_norm_router_passes_the_checks(kernels_on_cpu, dtype, experts, rows, hidden, top_k, tokens):
    x, residual = _randn(tokens, hidden, dtype=dtype), _randn(tokens, hidden, seed=1, dtype=dtype)
    w = _randn(rows, hidden, seed=2, dtype=dtype)
    norm = moe.RouterNorm(residual, _randn(hidden, seed=3, dtype=dtype), 1e-6, True)
    reaches_launch(lambda: moe.moe_add_norm_router(x, norm, w, experts, top_k, True))


@functools.cache
def _experts(num_experts, hidden, inter, fmt, group, dtype=BF16, seed=0):
    gate_up = _randn(num_experts, 2 * inter, hidden, seed=seed, dtype=torch.float32) / math.sqrt(hidden)
    down = _randn(num_experts, hidden, inter, seed=seed + 1, dtype=torch.float32) / math.sqrt(inter)
    if fmt == "dense":
        return gate_up.to(dtype), down.to(dtype)
    return quantize(gate_up, fmt, group), quantize(down, fmt, group)


def _routing(tokens, num_experts, top_k, dtype=BF16, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)]).to(I32)
    return (torch.rand(tokens, top_k, generator=g) + 0.05).to(dtype), ids


@pytest.mark.parametrize("fmt", ["dense", "int8", "int4"])
@pytest.mark.parametrize("hidden, inter, group", [(64, 32, 32), (384, 128, 64), (2048, 512, 128)])
@pytest.mark.parametrize("tokens, top_k", [(1, 2), (8, 8), (16, 8)])
@pytest.mark.parametrize("dtype", [BF16, torch.float32], ids=str)
def test_moe_decode_passes_the_checks(kernels_on_cpu, fmt, hidden, inter, group, tokens, top_k, dtype):
    gate_up, down = _experts(8, hidden, inter, fmt, group, dtype)
    weights, ids = _routing(tokens, 8, top_k, dtype)
    x = _randn(tokens, hidden, seed=2, dtype=dtype)
    plan = moe._decode_plan(x, gate_up, down, weights, ids, max_tokens=tokens)
    assert plan is not None
    reaches_launch(lambda: moe._decode(x, plan, weights, ids))


@pytest.mark.parametrize("fmt, shared_fmt", [("int4", "int8"), ("int4", "int4"), ("int8", "int8")])
@pytest.mark.parametrize("hidden, inter, shared_inter", [(64, 32, 64), (2048, 512, 512), (256, 64, 128)])
@pytest.mark.parametrize("tokens", [1, 3, 4])
@pytest.mark.parametrize("dtype", [BF16, torch.float16], ids=str)
def test_moe_decode_with_shared_expert_passes_the_checks(kernels_on_cpu, fmt, shared_fmt, hidden, inter,
                                                         shared_inter, tokens, dtype):
    gate_up, down = _experts(16, hidden, inter, fmt, min(128, inter))
    weights, ids = _routing(tokens, 16, 4, dtype)
    x = _randn(tokens, hidden, seed=2, dtype=dtype)
    group = min(128, shared_inter)
    router = _randn(tokens, 257, seed=3, dtype=dtype)  # the gate: its last column, rows 257 apart
    shared = moe.SharedExpert(_weight(2 * shared_inter, hidden, shared_fmt, group, seed=4),
                              _weight(hidden, shared_inter, shared_fmt, group, seed=5), router[:, 256:])
    reaches_launch(lambda: moe.moe_experts_with_shared(x, gate_up, down, weights, ids, shared))


def _each_launch(monkeypatch) -> list[str]:
    """The op's every launch runs the real binding's checks: each one's DeviceError (all checks
    passed) is noted and the op goes on, so that a later launch's arguments are checked too.
    Returns the bindings that passed, in order."""
    passed = []

    class EveryLaunch:
        def __getattr__(self, name):
            binding = getattr(ext, name)
            if isinstance(binding, type):
                return binding

            def launch(**kwargs):
                with pytest.raises(ext.DeviceError, match="is not on a CUDA device"):
                    binding(**kwargs)
                passed.append(name)
            return launch

    monkeypatch.setattr(dispatch, "extension", lambda: EveryLaunch())
    return passed


@pytest.mark.parametrize("fmt, group", QUANT)
@pytest.mark.parametrize("tokens, block_m", [(1, None), (3, 8), (8, 16), (37, 32), (300, None)])
@pytest.mark.parametrize("dtype", [BF16, torch.float16], ids=str)
def test_grouped_gemv_and_align_pass_the_checks(kernels_on_cpu, monkeypatch, fmt, group, tokens, block_m, dtype):
    gate_up, down = _experts(16, 384, 128, fmt, group or 128)
    weights, ids = _routing(tokens, 16, 4, dtype)
    x = _randn(tokens, 384, seed=2, dtype=dtype)
    for block in (8, 16, 32, 64, 128):  # the grouping's kernel (on CPU, align_by_expert takes the reference)
        reaches_launch(lambda: moe_align._align_kernel(ids, 16, block))
    launched = _each_launch(monkeypatch)
    out = moe.moe_experts_grouped_gemv(x, gate_up, down, weights, ids, block_m)
    # gate_up, down, then the slots' weighted sum
    assert launched == ["moe_grouped_gemv", "moe_grouped_gemv", "moe_combine"] and out.shape == x.shape


# ---------------------------------------------------------------- each wrong argument is named


def _gemv_args(m=3, n=48, k=64, kind="int4", group=32, **changes) -> dict:
    """quant_gemv's arguments for x [m, k] @ W [n, k]^T (int4: qweight [n, k / 2], scales [n, k / 32]),
    every check passing, then `changes`."""
    qw = _weight(n, k, kind, group)
    return dict(out=torch.empty(m, n, dtype=BF16), x=_randn(m, k), qweight=qw.qweight, scales=qw.scales, bias=None,
                stream=0) | changes


def _norm_args(m=3, k=64, **changes) -> dict:
    """The same with the add + RMSNorm folded in front."""
    return _gemv_args(m=m, k=k, residual=_randn(m, k, seed=5), norm_weight=_randn(k, seed=6),
                      residual_out=torch.empty(m, k, dtype=BF16), eps=1e-6) | changes


def _huge_k_gemv_args() -> dict:
    """quant_gemv's int4 arguments with k past 2^30: meta tensors (shapes without memory)."""
    k, meta = 2**30 + 128, dict(device="meta")
    return dict(out=torch.empty(3, 48, dtype=BF16, **meta), x=torch.empty(3, k, dtype=BF16, **meta),
                qweight=torch.empty(48, k // 2, dtype=torch.uint8, **meta),
                scales=torch.empty(48, k // 32, dtype=BF16, **meta), bias=None, stream=0)


def _with(args: dict, **changes) -> dict:
    """args with `changes(args)`: a change made of the arguments' own tensors."""
    return args | {name: change(args) for name, change in changes.items()}


U8 = torch.uint8
GEMV_CASES = {  # name: (the arguments, the error)
    "x rank": (lambda: _gemv_args(x=_randn(1, 3, 64)), r"x has shape \(1, 3, 64\), expected \(\*, \*\)"),
    "x dtype": (lambda: _gemv_args(x=torch.ones(3, 64, dtype=torch.long)), "x is int64, expected a float dtype"),
    "x strides": (lambda: _gemv_args(x=_transposed(3, 64)), "x must be contiguous"),
    "x aligned": (lambda: _gemv_args(x=_misaligned(3, 64)), "x must start at a 16-byte aligned address"),
    "no rows": (lambda: _gemv_args(m=0), "rows m=0 must be in 1..1024"),
    "rows past the limit": (lambda: _gemv_args(m=1025), "rows m=1025 must be in 1..1024"),
    "no columns": (lambda: _gemv_args(kind="int8", x=torch.empty(3, 0, dtype=BF16),
                                      qweight=torch.zeros(48, 0, dtype=torch.int8)), "x has no columns"),
    "qweight dtype": (lambda: _gemv_args(qweight=torch.zeros(48, 16, dtype=torch.int16)),
                      "qweight is int16, expected int8 or uint8"),
    "qweight k": (lambda: _gemv_args(qweight=torch.zeros(48, 16, dtype=U8)),
                  r"qweight has shape \(48, 16\), expected \(48, 32\)"),
    "qweight strides": (lambda: _gemv_args(qweight=_transposed(48, 32, dtype=U8)), "qweight must be contiguous"),
    "qweight aligned": (lambda: _gemv_args(qweight=_misaligned(48, 32, dtype=U8)),
                        "qweight must start at a 16-byte aligned address"),
    "int4 scales dtype": (lambda: _gemv_args(scales=torch.ones(48, 2)), "scales is float32, expected bfloat16"),
    "scales rows": (lambda: _gemv_args(scales=_randn(40, 2)), r"scales has shape \(40, 2\), expected \(48, \*\)"),
    "scales strides": (lambda: _gemv_args(scales=_transposed(48, 2)), "scales must be contiguous"),
    "groups not dividing k": (lambda: _gemv_args(scales=_randn(48, 3)),
                              "scales has 3 groups, which do not divide k=64"),
    "int4 group size": (lambda: _gemv_args(scales=_randn(48, 4)), "int4 group_size must be 32, 64 or 128, got 16"),
    "int8 scales dtype": (lambda: _gemv_args(kind="int8", scales=_randn(48)), "scales is bfloat16, expected float32"),
    "int8 scales shape": (lambda: _gemv_args(kind="int8", scales=torch.ones(48, 1)),
                          r"scales has shape \(48, 1\), expected \(48,\)"),
    "int8 k": (lambda: _gemv_args(kind="int8", k=40), "int8 needs k % 16 == 0"),
    "k past the kernels' range": (lambda: _huge_k_gemv_args(), r"n=48 / k=1073741952 past the kernels' range"),
    "out shape": (lambda: _gemv_args(out=torch.empty(3, 24, dtype=BF16)),
                  r"out has shape \(3, 24\), expected \(3, 48\)"),
    "out dtype": (lambda: _gemv_args(out=torch.empty(3, 48)), "out is float32, expected bfloat16"),
    "out strides": (lambda: _gemv_args(out=_transposed(3, 48)), "out must be contiguous"),
    "bias shape": (lambda: _gemv_args(bias=_randn(24)), r"bias has shape \(24,\), expected \(48,\)"),
    "bias dtype": (lambda: _gemv_args(bias=torch.ones(48)), "bias is float32, expected bfloat16"),
    "gate_up width": (lambda: _gemv_args(gate_up=True), r"out has shape \(3, 48\), expected \(3, 24\)"),
    "gate_up odd rows": (lambda: _gemv_args(n=49, gate_up=True), "qweight has 49 rows, gate_up needs an even count"),
    "gate_up bias": (lambda: _gemv_args(gate_up=True, out=torch.empty(3, 24, dtype=BF16), bias=_randn(24)),
                     "gate_up takes no bias, gate or add"),
    "gate shape": (lambda: _gemv_args(gate=_randn(3, 2)), r"gate has shape \(3, 2\), expected \(3, 1\)"),
    "gate dtype": (lambda: _gemv_args(gate=torch.ones(3, 1)), "gate is float32, expected bfloat16"),
    "gate stride": (lambda: _gemv_args(gate=_randn(1, 1).expand(3, 1)), "gate needs rows a positive stride apart"),
    "add shape": (lambda: _gemv_args(add=_randn(1, 3, 48)), r"add has shape \(1, 3, 48\), expected \(3, 48\)"),
    "add strides": (lambda: _gemv_args(add=_transposed(3, 48)), "add must be contiguous"),
    "norm parts": (lambda: _gemv_args(residual=_randn(3, 64)), "residual, norm_weight and residual_out go together"),
    "norm fp32": (lambda: _norm_args(x=_randn(3, 64, dtype=torch.float32), out=torch.empty(3, 48)),
                  "the folded norm needs fp16 / bf16 x"),
    "norm and gate_up": (lambda: _norm_args(gate_up=True, out=torch.empty(3, 24, dtype=BF16)),
                         "the folded norm takes no gate_up, gate or add"),
    "norm rows": (lambda: _norm_args(m=5), "the folded norm takes m <= 4 rows of k <= 8192, got m=5, k=64"),
    "norm width": (lambda: _norm_args(m=1, k=8320), "the folded norm takes m <= 4 rows of k <= 8192, got m=1, k=8320"),
    "norm eps": (lambda: _norm_args(eps=-1.0), "eps must be >= 0"),
    "residual shape": (lambda: _norm_args(residual=_randn(3, 32)), r"residual has shape \(3, 32\), x \(3, 64\)"),
    "residual aligned": (lambda: _norm_args(residual=_misaligned(3, 64)),
                         "residual must start at a 16-byte aligned address"),
    "norm_weight dtype": (lambda: _norm_args(norm_weight=torch.ones(64)), "norm_weight is float32, expected bfloat16"),
    "norm_weight shape": (lambda: _norm_args(norm_weight=_randn(32)),
                          r"norm_weight has shape \(32,\), expected \(64,\)"),
    "residual_out strides": (lambda: _norm_args(residual_out=_transposed(3, 64)), "residual_out must be contiguous"),
    "residual_out on x": (lambda: _with(_norm_args(), residual_out=lambda a: a["x"]), "residual_out overlaps x"),
    "out on the residual": (lambda: _with(_norm_args(), out=lambda a: a["residual"].view(-1)[:144].view(3, 48)),
                            "out overlaps residual"),
}


def test_quant_gemv_arguments_pass():
    reaches_launch(lambda: ext.quant_gemv(**_gemv_args()))
    reaches_launch(lambda: ext.quant_gemv(**_gemv_args(kind="int8", group=0, bias=_randn(48))))
    reaches_launch(lambda: ext.quant_gemv(**_norm_args()))


@pytest.mark.parametrize("case", GEMV_CASES)
def test_quant_gemv_rejects_what_the_kernel_cannot_take(case):
    args, match = GEMV_CASES[case]
    rejects(lambda: ext.quant_gemv(**args()), "quant_gemv: " + match)


def _grouped_args(gate_up=True, kind="int4", group=32, **changes) -> dict:
    """moe_grouped_gemv's arguments: 3 tokens, top_k 2 over 8 experts (hidden 256, inter 128) in
    blocks of 8 slots; gate_up: x [3, 256] -> out [6, 128], down: h [6, 128] -> out [6, 256]."""
    weights = _experts(8, 256, 128, kind, group or 128)[0 if gate_up else 1]
    slots, block_experts, used = align_by_expert_ref(_routing(3, 8, 2)[1], 8, 8)
    x, n = (_randn(3, 256), 128) if gate_up else (_randn(6, 128), 256)
    out = torch.empty(6, n, dtype=BF16)
    return dict(out=out, x=x, qweight=weights.qweight, scales=weights.scales, sorted_slots=slots,
                block_experts=block_experts, used=used, block_m=8, gate_up=gate_up, stream=0) | changes


GROUPED_CASES = {
    "x dtype": (lambda: _grouped_args(x=torch.ones(3, 256)), "x is float32, expected float16 or bfloat16"),
    "x aligned": (lambda: _grouped_args(x=_misaligned(3, 256)), "x must start at a 16-byte aligned address"),
    "slots per x row": (lambda: _grouped_args(out=torch.empty(5, 128, dtype=BF16)),
                        "out has 5 rows of 128, needs rows a multiple of x's 3"),
    "no columns": (lambda: _grouped_args(x=torch.empty(3, 0, dtype=BF16)), "x has no columns"),
    "slots past 2^31": (lambda: _grouped_args(out=torch.empty(3 * 2**30, 128, dtype=BF16, device="meta")),
                        r"out has 3221225472 rows, past the kernels' 2\^31 - 1"),
    "out dtype": (lambda: _grouped_args(out=torch.empty(6, 128, dtype=torch.float16)),
                  "out is float16, expected bfloat16"),
    "block_m": (lambda: _grouped_args(block_m=64), "block_m must be 8, 16 or 32, got 64"),
    "sorted_slots length": (lambda: _with(_grouped_args(), sorted_slots=lambda a: a["sorted_slots"][:-8]),
                            r"sorted_slots has shape \(\d+,\), expected \(\d+,\)"),
    "sorted_slots dtype": (lambda: _with(_grouped_args(), sorted_slots=lambda a: a["sorted_slots"].long()),
                           "sorted_slots is int64, expected int32"),
    "block_experts rank": (lambda: _with(_grouped_args(), block_experts=lambda a: a["block_experts"][None]),
                           r"block_experts has shape \(1, \d+\), expected \(\*,\)"),
    "blocks past the grid": (lambda: _grouped_args(block_experts=torch.zeros(65536, dtype=I32),
                                                   sorted_slots=torch.zeros(8 * 65536, dtype=I32)),
                             "block_experts has 65536 blocks, at most 65535"),
    "used": (lambda: _grouped_args(used=torch.zeros(2, dtype=I32)), r"used has shape \(2,\), expected \(1,\)"),
    "qweight not a stack": (lambda: _with(_grouped_args(), qweight=lambda a: a["qweight"][0]),
                            r"qweight has shape \(256, 128\), expected \(256, 256, 128\)"),
    "down weights for gate_up": (lambda: _grouped_args(gate_up=False) | {"gate_up": True},
                                 r"qweight has shape \(8, 256, 64\), expected \(8, 512, 64\)"),
    "scales experts": (lambda: _with(_grouped_args(), scales=lambda a: a["scales"][:4]),
                       r"scales has shape \(4, 256, 8\), expected \(8, 256, \*\)"),
    "int8 scales": (lambda: _with(_grouped_args(kind="int8", group=0), scales=lambda a: a["scales"].bfloat16()),
                    "scales is bfloat16, expected float32"),
    "int4 group size": (lambda: _grouped_args(scales=_randn(8, 256, 16)),
                        "int4 group_size must be 32, 64 or 128, got 16"),
}


def test_moe_grouped_gemv_arguments_pass():
    for gate_up in (True, False):
        for kind, group in QUANT:
            reaches_launch(lambda: ext.moe_grouped_gemv(**_grouped_args(gate_up, kind, group)))


@pytest.mark.parametrize("case", GROUPED_CASES)
def test_moe_grouped_gemv_rejects_what_the_kernel_cannot_take(case):
    args, match = GROUPED_CASES[case]
    rejects(lambda: ext.moe_grouped_gemv(**args()), "moe_grouped_gemv: " + match)


def _dequant_args(kind="int4", group=32, rows=32, k=64, dtype=BF16, **changes) -> dict:
    """dequant's arguments: a weight of `rows` rows (leading dims flattened) of k inputs."""
    qw = _weight(rows, k, kind, group)
    return dict(out=torch.empty(rows, k, dtype=dtype), qweight=qw.qweight, scales=qw.scales, stream=0) | changes


DEQUANT_CASES = {
    "out dtype": (lambda: _dequant_args(out=torch.empty(32, 64, dtype=torch.long)),
                  "out is int64, expected a float dtype"),
    "out rank": (lambda: _dequant_args(out=torch.empty(2, 16, 64, dtype=BF16)),
                 r"out has shape \(2, 16, 64\), expected \(\*, \*\)"),
    "out aligned": (lambda: _dequant_args(out=_misaligned(32, 64)), "out must start at a 16-byte aligned address"),
    "out strides": (lambda: _dequant_args(out=_transposed(32, 64)), "out must be contiguous"),
    "k": (lambda: _dequant_args(out=torch.empty(32, 60, dtype=BF16)),
          "out has 32 rows of k=60, needs rows >= 1 and k a multiple of 8"),
    "qweight shape": (lambda: _dequant_args(qweight=torch.zeros(32, 16, dtype=U8)),
                      r"qweight has shape \(32, 16\), expected \(32, 32\)"),
    "qweight aligned": (lambda: _dequant_args(qweight=_misaligned(32, 32, dtype=U8)),
                        "qweight must start at a 8-byte aligned address"),
    "int4 scales dtype": (lambda: _dequant_args(scales=torch.ones(32, 2)), "scales is float32, expected bfloat16"),
    "groups not dividing k": (lambda: _dequant_args(scales=_randn(32, 3)),
                              "scales has 3 groups, which do not divide k=64"),
    "groups of 12": (lambda: _dequant_args(kind="int8", k=72, qweight=torch.zeros(32, 36, dtype=U8),
                                           scales=_randn(32, 6)),
                     "int4 groups of 12 are not a multiple of 8"),
    "int8 scales shape": (lambda: _dequant_args(kind="int8", scales=torch.ones(32, 1)),
                          r"scales has shape \(32, 1\), expected \(32,\)"),
}


def test_dequant_arguments_pass():
    for kind, group in QUANT:
        for dtype in (BF16, torch.float16, torch.float32):
            reaches_launch(lambda: ext.dequant(**_dequant_args(kind, group, k=256, dtype=dtype)))
    reaches_launch(lambda: ext.dequant(**_dequant_args("int8", 0, k=40)))  # any k % 8 == 0


@pytest.mark.parametrize("case", DEQUANT_CASES)
def test_dequant_rejects_what_the_kernel_cannot_take(case):
    args, match = DEQUANT_CASES[case]
    rejects(lambda: ext.dequant(**args()), "dequant: " + match)


def _route_args(tokens=5, experts=64, top_k=8, **changes) -> dict:
    return dict(weights=torch.empty(tokens, top_k, dtype=BF16), ids=torch.empty(tokens, top_k, dtype=I32),
                logits=_randn(tokens, experts), rows=None, renormalize=True, stream=0) | changes


ROUTE_CASES = {
    "logits dtype": (lambda: _route_args(logits=torch.ones(5, 64, dtype=torch.long)),
                     "logits is int64, expected a float dtype"),
    "logits rank": (lambda: _route_args(logits=_randn(5, 64)[None]),
                    r"logits has shape \(1, 5, 64\), expected \(\*, \*\)"),
    "logits strides": (lambda: _route_args(logits=_transposed(5, 64)), "logits must be contiguous"),
    "weights dtype": (lambda: _route_args(weights=torch.empty(5, 8)), "weights is float32, expected bfloat16"),
    "weights tokens": (lambda: _route_args(weights=torch.empty(4, 8, dtype=BF16)),
                       r"weights has shape \(4, 8\), expected \(5, \*\)"),
    "ids shape": (lambda: _route_args(ids=torch.empty(5, 7, dtype=I32)), r"ids has shape \(5, 7\), expected \(5, 8\)"),
    "ids dtype": (lambda: _route_args(ids=torch.empty(5, 8, dtype=torch.long)), "ids is int64, expected int32"),
    "rows dtype": (lambda: _route_args(rows=torch.zeros(5, dtype=I32)), "rows is int32, expected int64"),
    "rows shape": (lambda: _route_args(rows=torch.zeros(4, dtype=torch.long)),
                   r"rows has shape \(4,\), expected \(5,\)"),
    "experts past a warp's registers": (lambda: _route_args(experts=600), r"experts 600 / top_k 8 out of range"),
    "top_k past the limit": (lambda: _route_args(experts=128, top_k=65), r"experts 128 / top_k 65 out of range"),
    "top_k past the experts": (lambda: _route_args(experts=4), r"experts 4 / top_k 8 out of range"),
    "tokens past 2^31": (lambda: _route_args(**{name: torch.empty(2**31, n, dtype=dtype, device="meta")
                                                for name, n, dtype in (("logits", 64, BF16), ("weights", 8, BF16),
                                                                       ("ids", 8, I32))}),
                         r"logits has 2147483648 rows, past the kernel's 2\^31 - 1"),
}


@pytest.mark.parametrize("case", ROUTE_CASES)
def test_moe_route_rejects_what_the_kernel_cannot_take(case):
    reaches_launch(lambda: ext.moe_route(**_route_args()))
    args, match = ROUTE_CASES[case]
    rejects(lambda: ext.moe_route(**args()), "moe_route: " + match)


def _router_args(tokens=3, hidden=256, rows=9, experts=8, top_k=2, norm=False, **changes) -> dict:
    """moe_router's arguments (x [tokens, hidden] @ w [rows, hidden]^T, `experts` routed columns);
    norm: with the add + RMSNorm folded in front."""
    args = dict(logits=torch.empty(tokens, rows, dtype=BF16), weights=torch.empty(tokens, top_k, dtype=BF16),
                ids=torch.empty(tokens, top_k, dtype=I32), done=torch.zeros(1, dtype=I32), x=_randn(tokens, hidden),
                w=_randn(rows, hidden, seed=1), experts=experts, renormalize=True, stream=0)
    if norm:
        args |= dict(residual=_randn(tokens, hidden, seed=2), norm_weight=_randn(hidden, seed=3),
                     normed=torch.empty(tokens, hidden, dtype=BF16),
                     residual_out=torch.empty(tokens, hidden, dtype=BF16),
                     eps=1e-6, zero_centered=True)
    return args | changes


ROUTER_CASES = {
    "x dtype": (lambda: _router_args(x=torch.ones(3, 256)), "x is float32, expected float16 or bfloat16"),
    "x aligned": (lambda: _router_args(x=_misaligned(3, 256)), "x must start at a 16-byte aligned address"),
    "tokens": (lambda: _router_args(tokens=9), "tokens 9 must be in 1..8"),
    "hidden vectors": (lambda: _router_args(hidden=260), "hidden 260 must be a multiple of 8 up to 4096"),
    "hidden past the limit": (lambda: _router_args(hidden=4104), "hidden 4104 must be a multiple of 8 up to 4096"),
    "w width": (lambda: _router_args(w=_randn(9, 128)), r"w has shape \(9, 128\), expected \(\*, 256\)"),
    "w dtype": (lambda: _router_args(w=_randn(9, 256, dtype=torch.float16)), "w is float16, expected bfloat16"),
    "w strides": (lambda: _router_args(w=_transposed(9, 256)), "w must be contiguous"),
    "experts past the rows": (lambda: _router_args(experts=10), "w has 9 rows for 10 experts"),
    "logits shape": (lambda: _router_args(logits=torch.empty(3, 8, dtype=BF16)),
                     r"logits has shape \(3, 8\), expected \(3, 9\)"),
    "weights dtype": (lambda: _router_args(weights=torch.empty(3, 2)), "weights is float32, expected bfloat16"),
    "ids shape": (lambda: _router_args(ids=torch.empty(3, 3, dtype=I32)), r"ids has shape \(3, 3\), expected \(3, 2\)"),
    "done dtype": (lambda: _router_args(done=torch.zeros(1)), "done is float32, expected int32"),
    "top_k past the experts": (lambda: _router_args(top_k=9), r"experts 8 / top_k 9 out of range"),
    "norm parts": (lambda: _router_args(residual=_randn(3, 256)),
                   "residual, norm_weight, normed and residual_out go together"),
    "norm width": (lambda: _router_args(hidden=264, norm=True),
                   "a folded norm needs hidden a multiple of 256, at most 2048, got 264"),
    "norm past its width": (lambda: _router_args(hidden=2304, norm=True),
                            "a folded norm needs hidden a multiple of 256, at most 2048, got 2304"),
    "norm eps": (lambda: _router_args(norm=True, eps=-1.0), "eps must be >= 0"),
    "residual shape": (lambda: _router_args(norm=True, residual=_randn(2, 256)),
                       r"residual has shape \(2, 256\), x \(3, 256\)"),
    "norm_weight dtype": (lambda: _router_args(norm=True, norm_weight=torch.ones(256)),
                          "norm_weight is float32, expected bfloat16"),
    "normed strides": (lambda: _router_args(norm=True, normed=_transposed(3, 256)), "normed must be contiguous"),
    "residual_out aligned": (lambda: _router_args(norm=True, residual_out=_misaligned(3, 256)),
                             "residual_out must start at a 16-byte aligned address"),
    "live dtype": (lambda: _router_args(live=torch.ones(1, dtype=torch.long)), "live is int64, expected int32"),
    "live shape": (lambda: _router_args(live=torch.ones(2, dtype=I32)), r"live has shape \(2,\), expected \(1,\)"),
    "normed on x": (lambda: _with(_router_args(norm=True), normed=lambda a: a["x"]), "normed overlaps x"),
    "logits on w": (lambda: _with(_router_args(), logits=lambda a: a["w"].view(-1)[:27].view(3, 9)),
                    "logits overlaps w"),
}


@pytest.mark.parametrize("case", ROUTER_CASES)
def test_moe_router_rejects_what_the_kernel_cannot_take(case):
    reaches_launch(lambda: ext.moe_router(**_router_args()))
    reaches_launch(lambda: ext.moe_router(**_router_args(norm=True)))
    reaches_launch(lambda: ext.moe_router(**_router_args(norm=True, live=torch.ones(1, dtype=I32))))
    args, match = ROUTER_CASES[case]
    rejects(lambda: ext.moe_router(**args()), "moe_router: " + match)


def _align_args(slots=6, experts=8, block_m=8, **changes) -> dict:
    capacity = moe_align.align_capacity(slots, experts, block_m)  # 48 for the defaults
    return dict(sorted_slots=torch.empty(capacity, dtype=I32),
                block_experts=torch.empty(capacity // block_m, dtype=I32),
                used=torch.empty(1, dtype=I32), ids=torch.zeros(slots, dtype=I32), experts=experts, block_m=block_m,
                stream=0) | changes


ALIGN_CASES = {
    "ids dtype": (lambda: _align_args(ids=torch.zeros(6, dtype=torch.long)), "ids is int64, expected int32"),
    "ids strides": (lambda: _align_args(ids=_transposed(3, 2, dtype=I32)), "ids must be contiguous"),
    "no experts": (lambda: _align_args(experts=0), "slots 6 / experts 0 out of range"),
    "experts past shared memory": (lambda: _align_args(experts=5000, sorted_slots=torch.empty(48, dtype=I32)),
                                   "slots 6 / experts 5000 out of range"),
    "block_m": (lambda: _align_args(block_m=12), "block_m must be 8, 16, 32, 64 or 128, got 12"),
    "capacity short": (lambda: _align_args(sorted_slots=torch.empty(40, dtype=I32)),
                       "sorted_slots has 40 positions, needs a multiple of block_m of at least 48"),
    "capacity not whole blocks": (lambda: _align_args(sorted_slots=torch.empty(52, dtype=I32)),
                                  "sorted_slots has 52 positions, needs a multiple of block_m of at least 48"),
    "block_experts": (lambda: _align_args(block_experts=torch.empty(5, dtype=I32)),
                      r"block_experts has shape \(5,\), expected \(6,\)"),
    "used": (lambda: _align_args(used=torch.empty(1, dtype=torch.long)), "used is int64, expected int32"),
}


@pytest.mark.parametrize("case", ALIGN_CASES)
def test_moe_align_rejects_what_the_kernel_cannot_take(case):
    reaches_launch(lambda: ext.moe_align(**_align_args()))
    reaches_launch(lambda: ext.moe_align(**_align_args(ids=torch.zeros(3, 2, dtype=I32))))  # any shape of ids
    args, match = ALIGN_CASES[case]
    rejects(lambda: ext.moe_align(**args()), "moe_align: " + match)


def _combine_args(tokens=3, top_k=4, hidden=64, **changes) -> dict:
    return dict(out=torch.empty(tokens, hidden, dtype=BF16), y=_randn(tokens * top_k, hidden),
                weights=_randn(tokens, top_k, seed=1, dtype=torch.float32), stream=0) | changes


COMBINE_CASES = {
    "y dtype": (lambda: _combine_args(y=torch.ones(12, 64)), "y is float32, expected float16 or bfloat16"),
    "y aligned": (lambda: _combine_args(y=_misaligned(12, 64)), "y must start at a 16-byte aligned address"),
    "y strides": (lambda: _combine_args(y=_transposed(12, 64)), "y must be contiguous"),
    "y rows": (lambda: _combine_args(y=_randn(11, 64)), r"y has shape \(11, 64\), expected \(12, 64\)"),
    "hidden": (lambda: _combine_args(y=_randn(12, 60), out=torch.empty(3, 60, dtype=BF16)),
               "y has 60 columns, not a multiple of 8"),
    "top_k": (lambda: _combine_args(weights=_randn(1, 65), y=_randn(65, 64), out=torch.empty(1, 64, dtype=BF16)),
              r"top_k 65 out of range \(1 .. 64\)"),
    "weights dtype": (lambda: _combine_args(weights=torch.ones(3, 4, dtype=I32)), "weights is int32, expected a float dtype"),
    "weights strides": (lambda: _combine_args(weights=_transposed(3, 4)), "weights must be contiguous"),
    "out shape": (lambda: _combine_args(out=torch.empty(4, 64, dtype=BF16)), r"out has shape \(4, 64\), expected \(3, 64\)"),
    "out dtype": (lambda: _combine_args(out=torch.empty(3, 64, dtype=torch.float16)), "out is float16, expected bfloat16"),
    "out aligned": (lambda: _combine_args(out=_misaligned(3, 64)), "out must start at a 16-byte aligned address"),
}


@pytest.mark.parametrize("case", COMBINE_CASES)
def test_moe_combine_rejects_what_the_kernel_cannot_take(case):
    reaches_launch(lambda: ext.moe_combine(**_combine_args()))
    reaches_launch(lambda: ext.moe_combine(**_combine_args(weights=_randn(3, 4), y=_randn(12, 64, dtype=torch.float16),
                                                            out=torch.empty(3, 64, dtype=torch.float16))))
    args, match = COMBINE_CASES[case]
    rejects(lambda: ext.moe_combine(**args()), "moe_combine: " + match)


def _decode_args(fmt="int4", hidden=64, inter=32, tokens=2, top_k=2, shared=False, **changes) -> dict:
    """moe_decode's arguments: 8 routed experts in `fmt` (int4 in groups of 32); shared: an int8
    shared expert's gate_up [192, 64] and an int4 down [64, 96], its gate a column of the router's
    output (rows 9 apart)."""
    gate_up, down = _experts(8, hidden, inter, fmt, 32)
    weights, ids = _routing(tokens, max(8, top_k), top_k)  # an id past the experts contributes nothing
    args = dict(out=torch.empty(tokens, hidden, dtype=BF16), h=torch.empty(tokens, top_k * inter, dtype=BF16),
                x=_randn(tokens, hidden), weights=weights, ids=ids, stream=0)
    for name, w in (("gate_up", gate_up), ("down", down)):
        args |= {name: w, f"{name}_scales": None} if fmt == "dense" else {name: w.qweight, f"{name}_scales": w.scales}
    if shared:
        sgu, sdn = _weight(192, hidden, "int8", 0, seed=4), _weight(hidden, 96, "int4", 32, seed=5)
        args |= dict(h=torch.empty(tokens, top_k * inter + 96, dtype=BF16), shared_gate_up=sgu.qweight,
                     shared_gate_up_scales=sgu.scales, shared_down=sdn.qweight, shared_down_scales=sdn.scales,
                     shared_gate=_randn(tokens, 9)[:, 8:])
    return args | changes


DECODE_CASES = {
    "x dtype": (lambda: _decode_args(x=torch.ones(2, 64, dtype=torch.long)), "x is int64, expected a float dtype"),
    "x aligned": (lambda: _decode_args(x=_misaligned(2, 64)), "x must start at a 16-byte aligned address"),
    "x strides": (lambda: _decode_args(x=_transposed(2, 64)), "x must be contiguous"),
    "ids tokens": (lambda: _decode_args(ids=torch.zeros(3, 2, dtype=I32)),
                   r"ids has shape \(3, 2\), expected \(2, \*\)"),
    "ids dtype": (lambda: _decode_args(ids=torch.zeros(2, 2, dtype=torch.long)), "ids is int64, expected int32"),
    "weights shape": (lambda: _decode_args(weights=_randn(2, 3)), r"weights has shape \(2, 3\), expected \(2, 2\)"),
    "weights dtype": (lambda: _decode_args(weights=torch.ones(2, 2, dtype=I32)),
                      "weights is int32, expected a float dtype"),
    "out shape": (lambda: _decode_args(out=torch.empty(2, 32, dtype=BF16)), r"out has shape \(2, 32\), x \(2, 64\)"),
    "gate_up rank": (lambda: _with(_decode_args(), gate_up=lambda a: a["gate_up"][0]),
                     r"gate_up has shape \(64, 32\), expected \(\*, \*, \*\)"),
    "gate_up hidden": (lambda: _decode_args(x=_randn(2, 128), out=torch.empty(2, 128, dtype=BF16)),
                       r"gate_up has shape \(8, 64, 32\), expected \(8, 64, 64\)"),
    "down experts": (lambda: _with(_decode_args(), down=lambda a: a["down"][:4]),
                     r"down has shape \(4, 64, 16\), expected \(8, 64, 16\)"),
    "gate_up strides": (lambda: _with(_decode_args(), gate_up=lambda a: a["gate_up"].transpose(0, 1).contiguous()
                                      .transpose(0, 1)), "gate_up must be contiguous"),
    "scales missing": (lambda: _decode_args(gate_up_scales=None), "gate_up_scales missing for quantized gate_up"),
    "scales of dense experts": (lambda: _decode_args("dense", gate_up_scales=torch.ones(8, 64)),
                                "gate_up_scales given for dense gate_up"),
    "dense dtype": (lambda: _with(_decode_args("dense"), gate_up=lambda a: a["gate_up"].half()),
                    "gate_up is float16, expected int8 or uint8 or bfloat16"),
    "int4 scales dtype": (lambda: _with(_decode_args(), gate_up_scales=lambda a: a["gate_up_scales"].float()),
                          "gate_up_scales is float32, expected bfloat16"),
    "int8 scales shape": (lambda: _with(_decode_args("int8"), down_scales=lambda a: a["down_scales"][..., None]),
                          r"down_scales has shape \(8, 64, 1\), expected \(8, 64\)"),
    "int4 group size": (lambda: _decode_args(down_scales=_randn(8, 64, 2)),
                        "down_scales has 2 groups of 32 columns: int4 groups must be a power of two >= 32"),
    "16-byte loads": (lambda: _decode_args("dense", hidden=60), "gate_up has 60 columns, not a multiple of 8"),
    "top_k past the limit": (lambda: _decode_args("dense", tokens=1, top_k=65),
                             "tokens 1 / top_k 65 / hidden 64 / inter 32 / shared_inter 0 out of range"),
    "shared memory": (lambda: _decode_args("dense", tokens=1, top_k=64, inter=192),
                      "tokens 1 / top_k 64 / hidden 64 / inter 192 / shared_inter 0 out of range"),
    "h shape": (lambda: _decode_args(h=torch.empty(2, 63, dtype=BF16)), r"h has shape \(2, 63\), expected \(2, 64\)"),
    "h aligned": (lambda: _decode_args(h=_misaligned(2, 64)), "h must start at a 16-byte aligned address"),
    "shared parts": (lambda: _decode_args(shared=True, shared_gate=None),
                     "shared_gate_up, shared_down, shared_gate and their scales go together"),
    "shared scales alone": (lambda: _decode_args(shared_down_scales=_randn(64, 3)),
                            "shared_gate_up, shared_down, shared_gate and their scales go together"),
    "shared beside dense experts": (lambda: _decode_args("dense", shared=True),
                                    "a shared expert needs fp16 / bf16 x and quantized routed experts"),
    "shared dense weights": (lambda: _decode_args(shared=True, shared_gate_up=_randn(192, 64)),
                             "shared_gate_up is bfloat16, expected int8 or uint8"),
    "shared down shape": (lambda: _with(_decode_args(shared=True), shared_down=lambda a: a["shared_down"][:32]),
                          r"shared_down has shape \(32, 48\), expected \(64, 48\)"),
    "shared gate shape": (lambda: _decode_args(shared=True, shared_gate=_randn(2, 2)),
                          r"shared_gate has shape \(2, 2\), expected \(2, 1\)"),
    "shared gate stride": (lambda: _decode_args(shared=True, shared_gate=_randn(1, 1).expand(2, 1)),
                           "shared_gate needs rows a positive stride apart"),
    "h without the shared rows": (lambda: _decode_args(shared=True, h=torch.empty(2, 64, dtype=BF16)),
                                  r"h has shape \(2, 64\), expected \(2, 160\)"),
}


def test_moe_decode_arguments_pass():
    for fmt in ("dense", "int8", "int4"):
        reaches_launch(lambda: ext.moe_decode(**_decode_args(fmt)))
    reaches_launch(lambda: ext.moe_decode(**_decode_args(shared=True)))
    reaches_launch(lambda: ext.moe_decode(**_decode_args(shared=True, tokens=1)))


@pytest.mark.parametrize("case", DECODE_CASES)
def test_moe_decode_rejects_what_the_kernel_cannot_take(case):
    args, match = DECODE_CASES[case]
    rejects(lambda: ext.moe_decode(**args()), "moe_decode: " + match)

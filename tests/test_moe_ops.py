"""ninfer_core.ops.moe: routing and the routed experts (decode kernels, grouped path, reference).

CPU tests check the torch references (and the grouped path's loop, which CPU runs) against
independent float64 formulations, and the Experts module's quantized state. `cuda` tests check
the kernels and the grouped GEMM path against the references and float64 on fresh random inputs,
with every allocation of the op poisoned (NaN / -1) so each output element must be written, and
replay them inside CUDA graphs; they need ninfer_core._C built (scripts/gpu_check.sh).
"""

from __future__ import annotations

import contextlib
import functools
import math

import pytest
import torch
import torch.nn.functional as F

from ninfer_core.engine.graph_capture import capture
from ninfer_core.layers.moe import Experts
from ninfer_core.ops import dispatch, moe, moe_align
from ninfer_core.ops.rmsnorm import add_rmsnorm, add_rmsnorm_ref
from ninfer_core.ops.activation import sigmoid_mul, silu_mul
from ninfer_core.ops.quant import QuantFormat, QuantizedWeight, dequantize, quant_linear, quantize
from kernel_stub import record_kernel_calls

FORMATS = ["bf16", "int8", "int4"]


# ---------------------------------------------------------------- problems and float64 math


def _experts(
    num_experts, hidden, inter, fmt, *, device="cpu", dtype=torch.bfloat16, group=128, seed=0
):
    """(gate_up, down) with unit-scale outputs: bf16 / fp16 / fp32 tensors or quantized."""
    g = torch.Generator(device).manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g, device=device) / math.sqrt(
        hidden
    )
    down = torch.randn(num_experts, hidden, inter, generator=g, device=device) / math.sqrt(inter)
    gate_up, down = gate_up.to(dtype), down.to(dtype)
    if fmt in ("int8", "int4"):
        gate_up, down = quantize(gate_up, fmt, group), quantize(down, fmt, group)
    return gate_up, down


@functools.cache
def _cached_experts(num_experts, hidden, inter, fmt, group):
    """The 35B-shaped expert sets are 0.4-1.5 GB: built once per format on the GPU."""
    return _experts(num_experts, hidden, inter, fmt, device="cuda", group=group)


def _routing(tokens, num_experts, top_k, *, device="cpu", dtype=torch.bfloat16, seed=0):
    """Distinct experts per token (repeated across tokens), positive weights."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g) + 0.05
    return weights.to(dtype).to(device), ids.to(torch.int32).to(device)


def _inputs(tokens, hidden, *, device="cpu", dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device).manual_seed(seed + 1000)
    return torch.randn(tokens, hidden, generator=g, device=device).to(dtype)


def _expert64(w, e: int) -> torch.Tensor:
    """Expert e in float64, decoded from the documented format (not through quant.dequantize)."""
    if isinstance(w, torch.Tensor):
        return w[e].double()
    if w.kind == "int8":
        return w.qweight[e].double() * w.scales[e].double()[:, None]
    b = w.qweight[e].long()
    codes = torch.stack([b & 15, b >> 4], dim=-1).flatten(-2) - 8
    return codes.double() * w.scales[e].double().repeat_interleave(w.group_size, dim=-1)


def _expected(x, gate_up, down, weights, ids, rows=None) -> torch.Tensor:
    """float64, token by token: out[n] = sum_j w[n, j] * down_e @ (silu(g) * u) with
    [g | u] = gate_up_e @ x[n]; only `rows` of x when given."""
    rows = range(x.shape[0]) if rows is None else rows
    inter = down.shape[-1]
    out = torch.zeros(len(rows), x.shape[1], dtype=torch.float64, device=x.device)
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for i, n in enumerate(rows):
        for j, e in enumerate(ids[n].tolist()):
            if e not in cache:
                cache[e] = _expert64(gate_up, e), _expert64(down, e)
            gu, dn = cache[e]
            v = gu @ x[n].double()
            out[i] += weights[n, j].double() * (dn @ (F.silu(v[:inter]) * v[inter:]))
    return out


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """Relative to the output's scale: the norm of the error, and its largest element."""
    err = actual.double() - expected.double()
    scale = expected.double().abs().max().item()
    rel = (err.norm() / expected.double().norm()).item()
    worst = err.abs().max().item() / scale
    assert rel < tol and worst < 4 * tol, (
        f"relative error {rel:.2e}, worst element {worst:.2e} (tol {tol})"
    )


# bf16 rounds g, u, silu, h and the output (the reference also every product / partial sum).
TOL = {torch.bfloat16: 1e-2, torch.float16: 4e-3, torch.float32: 1e-5}


def _route_rtol(dtype: torch.dtype) -> float:
    """One ulp of a 16-bit dtype (fp32 sums in another order may round the other way); fp32
    itself differs from torch / float64 by a few ulps of exp and the sums."""
    return 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps


@contextlib.contextmanager
def _poisoned_allocations():
    """torch.empty / empty_like hand out NaN (floats) or -1 (ints): unwritten outputs show."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan") if t.is_floating_point() else -1)

    torch.empty = lambda *a, **kw: poison(real_empty(*a, **kw))
    torch.empty_like = lambda *a, **kw: poison(real_empty_like(*a, **kw))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real_empty, real_empty_like


def _distinct_logits(tokens, num_experts, dtype, device, seed=0) -> torch.Tensor:
    """No two logits of a row equal (each (i - E/2) / 32 is exact in bf16): no top-k ties."""
    g = torch.Generator().manual_seed(seed)
    rows = [
        (torch.randperm(num_experts, generator=g) - num_experts // 2) / 32 for _ in range(tokens)
    ]
    return torch.stack(rows).to(dtype).to(device)


def _route64(logits, top_k, renormalize):
    probs = torch.softmax(logits.double(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


# ---------------------------------------------------------------- CPU: references


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("shape", [(1, 8, 2), (7, 64, 8), (5, 256, 8), (3, 300, 1)], ids=str)
def test_route_reference_matches_float64(dtype, renormalize, shape):
    tokens, num_experts, top_k = shape
    logits = _distinct_logits(tokens, num_experts, dtype, "cpu", seed=tokens)
    weights, ids = moe.moe_route(logits, top_k, renormalize)  # CPU: the reference
    want_w, want_ids = _route64(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == dtype
    assert torch.equal(ids.long(), want_ids)
    rtol = _route_rtol(dtype)
    torch.testing.assert_close(weights.double(), want_w, rtol=rtol, atol=rtol * 1e-3)


def test_padding_route_rows_route_padding_as_real_tokens_of_its_row():
    """Hand-worked: row 0 has 3 real tokens of 5, row 1 all 5, row 2 one: padding takes the real
    tokens of its own row in turn."""
    rows = moe.padding_route_rows(torch.tensor([3, 5, 1]), 5)
    assert rows.tolist() == [0, 1, 2, 0, 1, 5, 6, 7, 8, 9, 10, 10, 10, 10, 10]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_route_reference_with_rows_routes_each_token_as_its_row(dtype):
    logits = _distinct_logits(6, 64, dtype, "cpu", seed=5)
    rows = torch.tensor([0, 1, 2, 0, 1, 2])
    weights, ids = moe.moe_route(logits, 8, True, rows)  # CPU: the reference
    want_w, want_ids = _route64(logits[rows], 8, True)
    assert torch.equal(ids.long(), want_ids) and torch.equal(ids[3:], ids[:3])
    rtol = _route_rtol(dtype)
    torch.testing.assert_close(weights.double(), want_w, rtol=rtol, atol=rtol * 1e-3)


@pytest.mark.parametrize("fmt", ["bf16", "fp32", "int8", "int4"])
def test_experts_reference_matches_float64(fmt):
    dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
    gate_up, down = _experts(8, 64, 32, "bf16" if fmt == "fp32" else fmt, dtype=dtype, group=32)
    weights, ids = _routing(11, 8, 3, dtype=dtype)
    ids[3] = ids[0]  # the same experts for two tokens
    x = _inputs(11, 64, dtype=dtype)
    out = moe.moe_experts_ref(x, gate_up, down, weights, ids)
    assert out.dtype == dtype and out.shape == x.shape
    _assert_close(out, _expected(x, gate_up, down, weights, ids), 1e-5 if fmt == "fp32" else 2e-2)


@pytest.mark.parametrize("fmt", ["bf16", "fp32", "int8", "int4"])
def test_grouped_path_matches_float64_and_reference(fmt):
    """On CPU the grouped path runs its per-expert loop: sorting, bounds and un-sorting."""
    dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
    gate_up, down = _experts(
        16, 64, 32, "bf16" if fmt == "fp32" else fmt, dtype=dtype, group=32, seed=1
    )
    weights, ids = _routing(40, 12, 4, dtype=dtype, seed=1)  # experts 12..15 are never hit
    ids[5] = ids[2]
    x = _inputs(40, 64, dtype=dtype, seed=1)
    out = moe.moe_experts_grouped(x, gate_up, down, weights, ids)
    assert out.dtype == dtype and out.shape == x.shape
    tol = 1e-5 if fmt == "fp32" else 2e-2
    _assert_close(out, _expected(x, gate_up, down, weights, ids), tol)
    _assert_close(out, moe.moe_experts_ref(x, gate_up, down, weights, ids), tol)


class _FakeExtension:
    def __getattr__(self, name):
        raise AssertionError(f"kernel {name} called")


def test_cpu_tensors_never_reach_the_extension(monkeypatch):
    monkeypatch.delenv(dispatch.DISABLE_ENV, raising=False)
    monkeypatch.setattr(dispatch, "extension", lambda: _FakeExtension())
    logits = _distinct_logits(2, 8, torch.bfloat16, "cpu")
    weights, ids = moe.moe_route(logits, 2, True)
    gate_up, down = _experts(8, 64, 32, "bf16", group=32)
    x = _inputs(2, 64)
    assert torch.equal(
        moe.moe_experts(x, gate_up, down, weights, ids),
        moe.moe_experts_ref(x, gate_up, down, weights, ids),
    )


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("tokens", [1, 40])  # a decode step's GEMVs; a prompt's GEMMs past CPU_GEMV_ROWS rows
def test_cpu_experts_run_on_the_quant_kernels(cpu_calls, fmt, tokens):
    """Quantized experts on the CPU: a decode step's rows in one call, a prompt's each hit expert's two
    projections on the quant kernels' tiles (never the whole expert dequantized, as the reference
    does); the reference's sums to fp32 accuracy against float64."""
    gate_up, down = _experts(8, 64, 32, fmt, dtype=torch.float32, group=32, seed=2)
    weights, ids = _routing(tokens, 8, 2, dtype=torch.float32, seed=2)
    ids[:] = ids[0]  # a prompt's 40 rows on the same two experts: their GEMMs over dequantized tiles
    x = _inputs(tokens, 64, dtype=torch.float32, seed=2)
    out = moe.moe_experts(x, gate_up, down, weights, ids)
    assert cpu_calls == (["moe_experts"] if tokens == 1 else ["dequantize"] * 4)  # 2 experts, 2 projections
    _assert_close(out, _expected(x, gate_up, down, weights, ids), 1e-5)
    _assert_close(out, moe.moe_experts_ref(x, gate_up, down, weights, ids), 1e-5)


@pytest.fixture
def cpu_calls(monkeypatch) -> list[str]:
    """The CPU extension's matmul / dequantize / moe_experts calls, passed on to it."""
    monkeypatch.delenv(dispatch.DISABLE_ENV, raising=False)
    real, calls = dispatch.cpu_extension(), []

    class Recording:
        def __getattr__(self, name):
            if name in ("quant_matmul", "dequantize", "moe_experts"):
                calls.append(name)
            return getattr(real, name)

    monkeypatch.setattr(dispatch, "cpu_extension", lambda: Recording())
    return calls


def _python_loop(x, gate_up, down, weights, ids) -> torch.Tensor:
    """The loop over hit experts with each projection on the quant kernels, from Python."""
    return moe._hit_experts(x, weights, ids, lambda e, rows: quant_linear(
        silu_mul(quant_linear(rows, gate_up.experts[e])), down.experts[e]))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("tokens", [1, 3, 16])
def test_cpu_experts_in_one_call_are_the_python_loop(cpu_calls, fmt, tokens):
    """The decode rows' one call (csrc/cpu/moe_step.h) runs the loop's GEMVs in its order: the same
    bits, experts hit by several tokens included; with the shared expert, the composition of the
    layer (MLP.gated: routed + sigmoid(gate) * shared(x)) to the bit as well."""
    gate_up, down = _experts(8, 64, 32, fmt, dtype=torch.float32, group=32, seed=3)
    weights, ids = _routing(tokens, 8, 3, dtype=torch.float32, seed=tokens)
    x = _inputs(tokens, 64, dtype=torch.float32, seed=3)
    out = moe.moe_experts(x, gate_up, down, weights, ids)
    assert cpu_calls == ["moe_experts"]
    assert torch.equal(out, _python_loop(x, gate_up, down, weights, ids))
    shared_gate_up, shared_down = (quantize(torch.randn(shape, generator=torch.Generator().manual_seed(4)) / 8, fmt,
                                            32) for shape in ((64, 64), (64, 32)))
    gate = torch.randn(tokens, 3)[:, 2:]  # a column of the router's output: rows 3 floats apart
    shared = moe.SharedExpert(shared_gate_up, shared_down, gate)
    cpu_calls.clear()
    with_shared = moe.moe_experts_with_shared(x, gate_up, down, weights, ids, shared)
    assert cpu_calls == ["moe_experts"]
    composed = sigmoid_mul(quant_linear(silu_mul(quant_linear(x, shared_gate_up)), shared_down), gate, add=out)
    assert torch.equal(with_shared, composed)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("tokens, renormalize, with_shared", [(1, True, True), (3, False, True), (2, True, False)])
def test_cpu_moe_layer_is_the_composition(monkeypatch, fmt, tokens, renormalize, with_shared):
    """cpu_moe_layer (the CPU's bf16 math): the add + norm, the router's logits, the top-k and the
    experts of a decode step in one call give add_rmsnorm's new residual to the bit, and the output
    of the composition (add_rmsnorm, torch's router GEMM, moe_route_ref, the experts' call with the
    shared expert gated by the router's last row) within fp32 rounding; that composition's routing is
    the float64 softmax's top-k of the same rows (no near-ties to flip)."""
    if not dispatch.cpu_kernels_available():
        pytest.skip("the CPU extension is not built")
    monkeypatch.setenv(dispatch.CPU_MATH_ENV, "bf16")
    num_experts, hidden, inter, top_k = 16, 64, 32, 4
    gate_up, down = _experts(num_experts, hidden, inter, fmt, dtype=torch.float32, group=32, seed=tokens)
    g = torch.Generator().manual_seed(tokens + 7)
    router = torch.randn(num_experts + with_shared, hidden, generator=g) / 2
    x, residual = torch.randn(tokens, hidden, generator=g), torch.randn(tokens, hidden, generator=g)
    norm = moe.RouterNorm(residual, torch.randn(hidden, generator=g) * 0.1, 1e-6, True)
    shared = (quantize(torch.randn(2 * inter, hidden, generator=g) / 8, fmt, 32),
              quantize(torch.randn(hidden, inter, generator=g) / 6, fmt, 32)) if with_shared else None
    out, summed = moe.cpu_moe_layer(x, norm, router, top_k, renormalize, gate_up, down, shared)
    h, want_summed = add_rmsnorm(x, residual, norm.weight, 1e-6, zero_centered=True)
    assert torch.equal(summed, want_summed)
    logits = h @ router.T
    weights, ids = moe.moe_route_ref(logits[:, :num_experts], top_k, renormalize)
    exact = torch.softmax((h.double() @ router.double().T)[:, :num_experts], dim=-1).topk(top_k)
    assert torch.equal(ids.long(), exact.indices)
    if with_shared:
        want = moe.moe_experts_with_shared(h, gate_up, down, weights, ids,
                                           moe.SharedExpert(*shared, logits[:, num_experts:]))
    else:
        want = moe.moe_experts(h, gate_up, down, weights, ids)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_cpu_moe_layer_declines_what_it_does_not_take(monkeypatch):
    """None (the caller composes): the exact CPU math, fp64 rows, a router without the shared gate's row,
    top_k past the experts, dense experts."""
    monkeypatch.setenv(dispatch.CPU_MATH_ENV, "bf16")
    gate_up, down = _experts(8, 64, 32, "int8", dtype=torch.float32, group=32)
    x, residual, router = torch.randn(1, 64), torch.randn(1, 64), torch.randn(8, 64)
    norm = moe.RouterNorm(residual, torch.ones(64), 1e-6, False)
    shared = (quantize(torch.randn(64, 64), "int8"), quantize(torch.randn(64, 32), "int8"))
    args = (2, True, gate_up, down, None)
    if dispatch.cpu_kernels_available():
        assert moe.cpu_moe_layer(x, norm, router, *args) is not None
    assert moe.cpu_moe_layer(x.double(), norm, router, *args) is None
    assert moe.cpu_moe_layer(x, norm, router, 2, True, gate_up, down, shared) is None  # no row for its gate
    assert moe.cpu_moe_layer(x, norm, router, 9, True, gate_up, down, None) is None
    assert moe.cpu_moe_layer(x, norm, router, 2, True, *_experts(8, 64, 32, "fp32", dtype=torch.float32), None) is None
    monkeypatch.setenv(dispatch.CPU_MATH_ENV, "exact")
    assert moe.cpu_moe_layer(x, norm, router, *args) is None
    if dispatch.cpu_kernels_available():  # the binding's own check: a router row for a shared gate it lacks
        plan = moe._cpu_expert_plan(gate_up), moe._cpu_expert_plan(down)
        with pytest.raises(ValueError, match="moe_layer: top_k in 1..num_experts and router rows"):
            dispatch.cpu_extension().moe_layer(tuple(range(10)), 1e-6, False, 9, True, 1, 2, 8, *plan, None, 1, False)


def test_sparse_moe_runs_the_cpu_layer_call_under_the_default_math(monkeypatch):
    """SparseMoE.add_norm_forward on the CPU (int8 experts and shared expert, bf16 math): one
    `cpu_moe_layer` call, whose output and residual stream are those of its composition (the same
    layer with that call declining) to fp32 rounding."""
    if not dispatch.cpu_kernels_available():
        pytest.skip("the CPU extension is not built")
    from hf_reference import ninfer_config, tiny_qwen3_5_config

    from ninfer_core.layers import moe as moe_layers
    from ninfer_core.layers.norm import RMSNorm
    from ninfer_core.ops.quant import QuantLinear

    monkeypatch.setenv(dispatch.CPU_MATH_ENV, "bf16")
    torch.manual_seed(0)
    config = ninfer_config(tiny_qwen3_5_config(moe=True))
    layer = moe_layers.SparseMoE(config).to(torch.float32)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    layer.experts.quantize_(QuantFormat("int8"))
    mlp = layer.shared_expert
    mlp.gate_up_proj.linear = QuantLinear(quantize(mlp.gate_up_proj.linear.weight.detach(), "int8"))
    mlp.down_proj = QuantLinear(quantize(mlp.down_proj.weight.detach(), "int8"))
    norm = RMSNorm(config.hidden_size, 1e-6, True)
    torch.nn.init.normal_(norm.weight, std=0.1)
    x, residual = torch.randn(2, 1, config.hidden_size), torch.randn(2, 1, config.hidden_size)
    calls = []
    real = moe_layers.cpu_moe_layer
    monkeypatch.setattr(moe_layers, "cpu_moe_layer", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        out, summed = layer.add_norm_forward(x, residual, norm)
        assert calls == [1]
        monkeypatch.setattr(moe_layers, "cpu_moe_layer", lambda *a: None)
        want, want_summed = layer.add_norm_forward(x, residual, norm)
    assert out.shape == x.shape and torch.equal(summed, want_summed)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_cpu_prompt_experts_past_a_few_rows_take_the_tiled_gemm(cpu_calls):
    """A prompt's hit experts (more tokens than a decode step's one call takes) run the GEMV kernel up
    to CPU_PREFILL_EXPERT_GEMV_ROWS rows and the tiled GEMM past them; the sums stay the reference's."""
    gate_up, down = _experts(4, 64, 32, "int4", dtype=torch.float32, group=32, seed=5)
    weights, _ = _routing(20, 4, 2, dtype=torch.float32, seed=5)
    few = moe.CPU_PREFILL_EXPERT_GEMV_ROWS
    # expert 0 in every row; expert 1 in `few` rows, expert 3 in the other 20 - few (> few)
    ids = torch.tensor([[0, 1 if t < few else 3] for t in range(20)], dtype=torch.int32)
    x = _inputs(20, 64, dtype=torch.float32, seed=5)
    out = moe.moe_experts(x, gate_up, down, weights, ids)
    tiled, gemv = ["dequantize"] * 2, ["quant_matmul"] * 2  # gate_up, then down
    assert cpu_calls == tiled + gemv + tiled
    _assert_close(out, _expected(x, gate_up, down, weights, ids), 1e-5)


def test_cpu_experts_call_rejects_bad_ids():
    """An expert id past the experts raises before anything runs (the Python loop's IndexError)."""
    gate_up, down = _experts(8, 64, 32, "int8", dtype=torch.float32, group=32)
    weights, ids = _routing(2, 8, 2, dtype=torch.float32)
    ids[1, 1] = 8
    with pytest.raises(IndexError, match="out of range"):
        moe.moe_experts(_inputs(2, 64, dtype=torch.float32), gate_up, down, weights, ids)


def test_quantized_experts_keep_one_weight_object():
    """Experts gives the same QuantizedWeight while its buffers stay (its per-expert CPU plans are
    made once), a new one after they are replaced."""
    experts = Experts(4, 64, 32)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.05)
    experts.quantize_(QuantFormat("int8"))
    first = experts.gate_up
    assert experts.gate_up is first and experts.down is not first
    experts.gate_up_scales = experts.gate_up_scales.clone()  # a buffer replaced (as a load or .to() does)
    assert experts.gate_up is not first and experts.gate_up.scales is experts.gate_up_scales


def test_bad_shapes_raise():
    gate_up, down = _experts(4, 64, 32, "bf16")
    weights, ids = _routing(3, 4, 2)
    x = _inputs(3, 64)
    with pytest.raises(ValueError, match="do not fit"):
        moe.moe_experts(x[:, :32], gate_up, down, weights, ids)
    with pytest.raises(ValueError, match="do not fit"):
        moe.moe_experts(x, gate_up, down[:, :, :16], weights, ids)
    with pytest.raises(ValueError, match="must both be"):
        moe.moe_experts(x, gate_up, down, weights[:, :1], ids)


@pytest.mark.parametrize("kind,group", [("int4", 32), ("int4", 128), ("int8", 0)])
def test_experts_quantize_state_dict_round_trip(kind, group):
    torch.manual_seed(0)
    source = Experts(6, 256, 128)
    with torch.no_grad():
        for p in source.parameters():
            p.normal_(0, 0.05)
    dense_gate_up = source.gate_up.detach().clone()
    fmt = QuantFormat(kind, group)
    assert not source.formats and isinstance(source.gate_up, torch.Tensor)
    source.quantize_(fmt)
    assert list(source.parameters()) == []
    state = source.state_dict()
    assert set(state) == {"gate_up_qweight", "gate_up_scales", "down_qweight", "down_scales"}
    assert isinstance(source.gate_up, QuantizedWeight) and source.gate_up.kind == kind
    assert source.gate_up.shape == dense_gate_up.shape and source.down.shape == (6, 256, 128)
    assert torch.equal(source.gate_up.qweight, quantize(dense_gate_up, kind, group).qweight)
    with pytest.raises(ValueError, match="already quantized"):
        source.quantize_(fmt)

    with torch.device("meta"):  # what the loader does: shapes first, then the artifact
        target = Experts(6, 256, 128)
    target.quantize_(fmt)
    assert target.gate_up_qweight.is_meta and target.formats == source.formats == {"gate_up": fmt, "down": fmt}
    target.to_empty(device="cpu")
    target.load_state_dict(state)
    for name, t in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], t)
    weights, ids = _routing(5, 6, 2)
    x = _inputs(5, 256)
    assert torch.equal(
        moe.moe_experts(x, target.gate_up, target.down, weights, ids),
        moe.moe_experts(x, source.gate_up, source.down, weights, ids),
    )


# ---------------------------------------------------------------- GPU: kernels and grouped path


@pytest.fixture
def cuda_kernels(monkeypatch):
    monkeypatch.delenv(dispatch.DISABLE_ENV, raising=False)
    assert dispatch.extension() is not None, (
        "CUDA is available but ninfer_core._C is not built: run scripts/gpu_check.sh"
    )


def _route_uses_kernel(logits, top_k):
    return dispatch.use_kernel(logits) and top_k <= logits.shape[1]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize(
    "shape", [(1, 8, 2), (5, 64, 8), (16, 256, 8), (64, 256, 8), (3, 300, 1), (2, 512, 10), (4, 128, 40), (300, 256, 8),
              (2048, 256, 8)], ids=str
)
def test_route_kernel_matches_reference(cuda_kernels, dtype, renormalize, shape):
    tokens, num_experts, top_k = shape
    logits = _distinct_logits(tokens, num_experts, dtype, "cuda", seed=tokens + num_experts)
    assert _route_uses_kernel(logits, top_k)
    with _poisoned_allocations():
        weights, ids = moe.moe_route(logits, top_k, renormalize)
    ref_w, ref_ids = moe.moe_route_ref(logits, top_k, renormalize)
    want_w, want_ids = _route64(logits.cpu(), top_k, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == dtype
    assert torch.equal(ids, ref_ids) and torch.equal(ids.long().cpu(), want_ids)
    rtol = _route_rtol(dtype)
    torch.testing.assert_close(weights, ref_w, rtol=rtol, atol=rtol * 1e-3)
    torch.testing.assert_close(weights.double().cpu(), want_w, rtol=rtol, atol=rtol * 1e-3)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_route_kernel_takes_rows(cuda_kernels, dtype):
    """A 37-token prompt padded to 48: the padding tokens routed by `padding_route_rows` get the
    real tokens' ids and weights bit for bit, the real ones their own."""
    logits = _distinct_logits(48, 256, dtype, "cuda", seed=48)
    rows = moe.padding_route_rows(torch.tensor([37], device="cuda"), 48)
    with _poisoned_allocations():
        weights, ids = moe.moe_route(logits, 8, True, rows)
    own_w, own_ids = moe.moe_route(logits, 8, True)
    ref_w, ref_ids = moe.moe_route_ref(logits, 8, True, rows)
    want_w, want_ids = _route64(logits[rows].cpu(), 8, True)
    assert torch.equal(ids, ref_ids) and torch.equal(ids.long().cpu(), want_ids)
    assert torch.equal(ids[:37], own_ids[:37]) and torch.equal(weights[:37], own_w[:37])
    assert torch.equal(ids[37:], own_ids[:11]) and torch.equal(weights[37:], own_w[:11])
    rtol = _route_rtol(dtype)
    torch.testing.assert_close(weights.double().cpu(), want_w, rtol=rtol, atol=rtol * 1e-3)


@pytest.mark.cuda
def test_route_kernel_with_ties(cuda_kernels):
    """bf16 logits of 256 experts repeat: any tie order is valid, the chosen values are not."""
    g = torch.Generator("cuda").manual_seed(3)
    logits = torch.randn(16, 256, generator=g, device="cuda").to(torch.bfloat16)
    weights, ids = moe.moe_route(logits, 8, True)
    ref_w, ref_ids = moe.moe_route_ref(logits, 8, True)
    probs = torch.softmax(logits.double(), dim=-1)
    assert torch.equal(probs.gather(1, ids.long()), probs.gather(1, ref_ids.long()))
    assert all(len(set(row)) == 8 for row in ids.tolist())
    torch.testing.assert_close(weights, ref_w, rtol=0.008, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("shape", [(256, 257, 2048, 8), (8, 8, 64, 2), (64, 66, 520, 4), (128, 129, 4096, 8)], ids=str)
@pytest.mark.parametrize("tokens", [1, 2, 4, 8])
def test_router_kernel_matches_the_gemm_and_route(cuda_kernels, tokens, shape, renormalize, dtype):
    """moe_router: the logits (extra rows past the experts included) within an ulp of the float64
    product and of cuBLAS, the routing that of moe_route over the kernel's own logits, the
    completion counter back at 0 after every launch and graph replay."""
    experts, rows, hidden, top_k = shape
    g = torch.Generator("cuda").manual_seed(tokens + rows)
    x = _inputs(tokens, hidden, device="cuda", dtype=dtype, seed=rows)
    w = (torch.randn(rows, hidden, generator=g, device="cuda") / math.sqrt(hidden)).to(dtype)
    with _poisoned_allocations():
        logits, weights, ids = moe.moe_router(x, w, experts, top_k, renormalize)
    eps = torch.finfo(dtype).eps
    exact = x.double() @ w.double().T
    for want in (exact, F.linear(x, w).double()):
        torch.testing.assert_close(logits.double(), want, rtol=eps, atol=eps * exact.abs().max().item())
    ref_w, ref_ids = moe.moe_route_ref(logits[:, :experts], top_k, renormalize)
    probs = torch.softmax(logits[:, :experts].double(), dim=-1)
    assert torch.equal(probs.gather(1, ids.long()), probs.gather(1, ref_ids.long()))  # ties in any order
    assert all(len(set(row)) == top_k for row in ids.tolist())
    torch.testing.assert_close(weights, ref_w, rtol=eps, atol=eps * 1e-3)
    done = moe._router_done[(x.device, w.data_ptr())]
    assert done.item() == 0
    graph, out = capture(lambda: moe.moe_router(x, w, experts, top_k, renormalize))
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert done.item() == 0
        assert all(torch.equal(a, b) for a, b in zip(out, (logits, weights, ids)))


def test_router_call_passes_each_tensor_in_its_place(monkeypatch):
    """moe_router's kernel call on the CPU against a recording stand-in extension; and the cases
    it leaves to the GEMM + moe_route."""
    calls = record_kernel_calls(monkeypatch, "moe_router")
    x = _inputs(3, 64)
    w = torch.randn(9, 64).to(torch.bfloat16)
    logits, weights, ids = moe.moe_router(x, w, 8, 2, True)
    (kw,) = calls
    assert all(kw[name] is t for name, t in zip(("logits", "weights", "ids", "x", "w"), (logits, weights, ids, x, w)))
    assert (kw["experts"], kw["renormalize"]) == (8, True)
    assert logits.shape == (3, 9) and weights.shape == ids.shape == (3, 2) and kw["stream"] == 7
    assert kw["done"] is moe._router_done[(x.device, w.data_ptr())]
    assert kw.get("residual") is None and kw["live"] is None
    live = torch.tensor([2], dtype=torch.int32)
    moe.moe_router(x, w, 8, 2, True, live)
    assert calls.pop()["live"] is live
    many = moe.ROUTER_KERNEL_MAX_TOKENS + 1
    assert moe.moe_router(_inputs(many, 64), w, 8, 2, True) is None
    assert moe.moe_router(x.float(), w.float(), 8, 2, True) is None
    assert moe.moe_router(x, w, 10, 2, True) is None  # more experts than rows
    wide = moe.ROUTER_KERNEL_MAX_HIDDEN + 8  # past the vectors a thread of the kernel holds
    assert moe.moe_router(_inputs(1, wide), torch.randn(9, wide).to(torch.bfloat16), 8, 2, True) is None
    assert len(calls) == 1


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("zero_centered", [True, False])
# 8 tokens of a hidden <= 2048: a thread holds one 16-byte vector of a row (the 35B's batch 8), else two
@pytest.mark.parametrize("shape", [(256, 257, 2048, 8), (8, 8, 256, 2), (64, 66, 1536, 4)], ids=str)
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_add_norm_router_is_bit_equal_to_add_rmsnorm_then_router(cuda_kernels, tokens, shape, zero_centered, dtype):
    """moe_add_norm_router: the normed rows and sums exactly add_rmsnorm's (the rmsnorm kernel, whose
    sum-of-squares order the fold repeats), the logits / weights / ids exactly moe_router's on those
    rows; the completion counter back at 0 after graph replays, which give the same outputs."""
    experts, rows, hidden, top_k = shape
    g = torch.Generator("cuda").manual_seed(tokens + hidden)
    x = _inputs(tokens, hidden, device="cuda", dtype=dtype, seed=rows)
    residual = (torch.randn(tokens, hidden, generator=g, device="cuda") * 3).to(dtype)
    norm_w = (torch.randn(hidden, generator=g, device="cuda") * 0.2 + (0 if zero_centered else 1)).to(dtype)
    w = (torch.randn(rows, hidden, generator=g, device="cuda") / math.sqrt(hidden)).to(dtype)
    norm = moe.RouterNorm(residual, norm_w, 1e-6, zero_centered)
    with _poisoned_allocations():
        got = moe.moe_add_norm_router(x, norm, w, experts, top_k, True)
    assert got is not None
    want_normed, want_summed = add_rmsnorm(x, residual, norm_w, 1e-6, zero_centered=zero_centered)
    ref_normed, ref_summed = add_rmsnorm_ref(x, residual, norm_w, 1e-6, zero_centered=zero_centered)
    torch.testing.assert_close(want_normed, ref_normed, rtol=2 * torch.finfo(dtype).eps, atol=1e-3)
    want = (want_normed, want_summed, *moe.moe_router(want_normed, w, experts, top_k, True))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    done = moe._router_done[(x.device, w.data_ptr())]
    assert done.item() == 0
    graph, out = capture(lambda: moe.moe_add_norm_router(x, norm, w, experts, top_k, True))
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert done.item() == 0
        assert all(torch.equal(a, b) for a, b in zip(out, want))


@pytest.mark.cuda
@pytest.mark.parametrize("fold", [False, True], ids=["router", "add_norm_router"])
@pytest.mark.parametrize("tokens,live", [(4, 3), (8, 5), (2, 0), (3, 3)])
def test_router_kernel_routes_the_spare_rows_dead(cuda_kernels, tokens, live, fold):
    """`live` (a decode graph's real tokens): rows before it routed bit for bit as without it, the
    rest dead (ids -1, weights 0), the logits of all rows as before; a graph replay reads the value
    `live` holds then (the engine sets it when the batch size changes)."""
    experts, rows, hidden, top_k = 256, 257, 2048, 8
    g = torch.Generator("cuda").manual_seed(tokens + live)
    x = _inputs(tokens, hidden, device="cuda", seed=tokens)
    w = (torch.randn(rows, hidden, generator=g, device="cuda") / math.sqrt(hidden)).to(torch.bfloat16)
    norm = moe.RouterNorm(_inputs(tokens, hidden, device="cuda", seed=tokens + 1),
                          (torch.randn(hidden, generator=g, device="cuda") * 0.2).to(torch.bfloat16), 1e-6, True)

    def route(live_tokens):
        if fold:
            return moe.moe_add_norm_router(x, norm, w, experts, top_k, True, live_tokens)[2:]
        return moe.moe_router(x, w, experts, top_k, True, live_tokens)

    logits, weights, ids = route(None)
    count = torch.tensor([live], dtype=torch.int32, device="cuda")
    got = route(count)
    assert torch.equal(got[0], logits)
    assert torch.equal(got[1][:live], weights[:live]) and torch.equal(got[2][:live], ids[:live])
    assert (got[2][live:] == -1).all() and (got[1][live:] == 0).all()
    graph, out = capture(lambda: route(count))
    count.fill_(tokens)  # a full batch: every row routed
    graph.replay()
    assert torch.equal(out[1], weights) and torch.equal(out[2], ids)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt,group,tokens", [("int4", 128, 8), ("int4", 128, 3), ("int8", 128, 6)],
                         ids=["int4_mma_decode", "int4_3_tokens", "int8_grouped_gemv"])
def test_dead_rows_leave_the_live_rows_and_stay_finite(cuda_kernels, fmt, group, tokens):
    """Rows routed dead (ids -1, weights 0: a graph's spare rows, `moe_router`'s `live`) in the paths
    a decode graph's MoE takes (the tensor-core decode kernels to 8 tokens for int4 in groups of 128,
    the grouped GEMV for int8 past 4): the live rows' outputs bit for bit those of the routing
    without dead rows, the dead rows finite (the grouped path leaves their slots unwritten: the
    combine skips zero weights)."""
    gate_up, down = _cached_experts(256, 2048, 512, fmt, group)
    x = _inputs(tokens, 2048, device="cuda", seed=tokens)
    weights, ids = _routing(tokens, 256, 8, device="cuda", seed=tokens)
    live = tokens - 1 if tokens > 3 else 1
    dead_w, dead_ids = weights.clone(), ids.clone()
    dead_w[live:], dead_ids[live:] = 0, -1
    want = moe.moe_experts(x, gate_up, down, weights, ids)
    with _poisoned_allocations():
        got = moe.moe_experts(x, gate_up, down, dead_w, dead_ids)
    assert torch.equal(got[:live], want[:live])
    assert torch.isfinite(got).all()


def test_add_norm_router_call_and_the_shapes_it_leaves(monkeypatch):
    """moe_add_norm_router's kernel call (recording stand-in): the norm's tensors in their places,
    fresh outputs; None for widths the fold does not take, so the caller runs add_rmsnorm."""
    calls = record_kernel_calls(monkeypatch, "moe_router")
    x, residual = _inputs(2, 256), _inputs(2, 256, seed=1)
    norm_w = torch.randn(256).to(torch.bfloat16)
    w = torch.randn(9, 256).to(torch.bfloat16)
    normed, summed, logits, weights, ids = moe.moe_add_norm_router(
        x, moe.RouterNorm(residual, norm_w, 1e-5, True), w, 8, 2, False)
    (kw,) = calls
    assert all(kw[name] is t for name, t in zip(("residual", "norm_weight", "normed", "residual_out", "x", "w"),
                                                (residual, norm_w, normed, summed, x, w)))
    assert (kw["eps"], kw["zero_centered"], kw["experts"]) == (1e-5, True, 8)
    assert normed.shape == summed.shape == x.shape and logits.shape == (2, 9)
    assert len({normed.data_ptr(), summed.data_ptr(), x.data_ptr(), residual.data_ptr()}) == 4
    wide = _inputs(2, 264)
    assert moe.moe_add_norm_router(wide, moe.RouterNorm(wide, torch.zeros(264).to(torch.bfloat16), 1e-5, True),
                                   torch.randn(9, 264).to(torch.bfloat16), 8, 2, False) is None
    assert moe.moe_add_norm_router(x, moe.RouterNorm(residual.float(), norm_w, 1e-5, True), w, 8, 2, False) is None
    assert len(calls) == 1


def test_moe_layer_uses_the_folded_norm_outputs(monkeypatch):
    """SparseMoE.add_norm_forward with the folded router (here a torch stand-in of the kernel) gives
    what the norm then the layer give, the residual stream included; without it, the same."""
    from hf_reference import ninfer_config, tiny_qwen3_5_config

    from ninfer_core.layers import moe as moe_layer
    from ninfer_core.layers.norm import RMSNorm

    torch.manual_seed(0)
    config = ninfer_config(tiny_qwen3_5_config(moe=True))
    layer = moe_layer.SparseMoE(config).to(torch.float32)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    norm = RMSNorm(config.hidden_size, 1e-6, True)
    torch.nn.init.normal_(norm.weight, std=0.1)
    x, residual = torch.randn(3, config.hidden_size), torch.randn(3, config.hidden_size)
    with torch.no_grad():
        h, summed = norm.add_norm(x, residual)
        want = layer(h)
        out, res = layer.add_norm_forward(x, residual, norm)  # CPU: the kernel declines
        assert torch.equal(out, want) and torch.equal(res, summed)
        seen = []

        def folded(x_, norm_, weight, experts, top_k, renormalize, live):
            assert live is None  # an eager forward: no graph's spare rows
            seen.append(norm_)
            n, s = norm.add_norm(x_, norm_.residual)
            logits = torch.nn.functional.linear(n, weight)
            return (n, s, logits, *moe.moe_route(logits[:, :experts], top_k, renormalize))

        monkeypatch.setattr(moe_layer, "moe_add_norm_router", folded)
        out, res = layer.add_norm_forward(x, residual, norm)
    assert len(seen) == 1 and seen[0].weight is norm.weight and seen[0].eps == norm.eps
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(res, summed)


def _decode_check(
    tokens, num_experts, top_k, hidden, inter, fmt, *, dtype=torch.bfloat16, group=128, ids=None
):
    if dtype == torch.bfloat16:
        gate_up, down = _cached_experts(num_experts, hidden, inter, fmt, group)
    else:
        gate_up, down = _experts(
            num_experts, hidden, inter, fmt, device="cuda", dtype=dtype, group=group
        )
    weights, routed = _routing(tokens, num_experts, top_k, device="cuda", dtype=dtype, seed=tokens)
    ids = routed if ids is None else ids
    x = _inputs(tokens, hidden, device="cuda", dtype=dtype, seed=tokens)
    plan = moe._decode_plan(x, gate_up, down, weights, ids, max_tokens=tokens)  # the kernels' own limits
    assert plan is not None, "the decode kernels do not cover this"
    with _poisoned_allocations():
        out = moe._decode(x, plan, weights, ids)
    assert out.dtype == dtype and out.shape == x.shape and not out.isnan().any()
    _assert_close(out, moe.moe_experts_ref(x, gate_up, down, weights, ids), TOL[dtype])
    _assert_close(out, _expected(x, gate_up, down, weights, ids), TOL[dtype])


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dims", [(64, 32), (2048, 512)], ids=lambda d: f"H{d[0]}xI{d[1]}")
@pytest.mark.parametrize("top_k", [2, 8])
@pytest.mark.parametrize("num_experts", [8, 256])
@pytest.mark.parametrize("tokens", [1, 2, 4, 8, 16])
def test_decode_kernels_match_reference(cuda_kernels, tokens, num_experts, top_k, dims, fmt):
    hidden, inter = dims
    _decode_check(tokens, num_experts, top_k, hidden, inter, fmt, group=min(128, inter))


def test_shared_expert_call_passes_each_tensor_in_its_place(monkeypatch):
    """moe_experts_with_shared's CUDA branch on the CPU against a stand-in extension that records
    the call: the shared expert's weights, formats, size and gate column reach their arguments."""
    calls = record_kernel_calls(monkeypatch, "moe_decode")
    hidden, inter, shared_inter = 64, 32, 96
    gate_up, down = _experts(8, hidden, inter, "int4", group=32)
    weights, ids = _routing(2, 8, 2)
    x = _inputs(2, hidden)
    router = torch.randn(2, 9).to(torch.bfloat16)
    shared = moe.SharedExpert(quantize(torch.randn(2 * shared_inter, hidden), "int8"),
                              quantize(torch.randn(hidden, shared_inter), "int4", 32), router[:, 8:])
    out = moe.moe_experts_with_shared(x, gate_up, down, weights, ids, shared)
    (kw,) = calls
    assert out.shape == x.shape and kw["out"] is out and kw["x"] is x
    assert kw["weights"] is weights and kw["ids"] is ids and kw["stream"] == 7
    # the binding reads each format off its tensors: the codes' dtype, the group size from the scales' shape
    passed = {"gate_up": gate_up, "down": down, "shared_gate_up": shared.gate_up, "shared_down": shared.down}
    for name, qw in passed.items():
        assert kw[name] is qw.qweight and kw[f"{name}_scales"] is qw.scales, name
    assert kw["shared_gate_up"].dtype == torch.int8 and kw["shared_down"].dtype == torch.uint8
    g = kw["shared_gate"]
    assert (g.data_ptr(), g.shape, g.stride(0)) == (router[:, 8:].data_ptr(), (2, 1), 9)
    assert kw["h"].shape == (2, 2 * inter + shared_inter)  # tokens, top_k routed rows then the shared one


def _shared_expert(hidden, inter, fmt, tokens, dtype, seed):
    """A quantized shared expert [2I, H] / [H, I] and its gate logits as the last column of a
    router-shaped output (row stride 257)."""
    g = torch.Generator("cuda").manual_seed(seed)
    gate_up = torch.randn(2 * inter, hidden, generator=g, device="cuda") / math.sqrt(hidden)
    down = torch.randn(hidden, inter, generator=g, device="cuda") / math.sqrt(inter)
    router = torch.randn(tokens, 257, generator=g, device="cuda").to(dtype)
    group = min(128, inter)
    return moe.SharedExpert(quantize(gate_up, fmt, group), quantize(down, fmt, group), router[:, 256:])


def _shared64(x, shared) -> torch.Tensor:
    """float64: sigmoid(gate) * down @ (silu(g) * u), [g | u] = gate_up @ x."""
    gu, dn = (_expert64(QuantizedWeight(w.kind, w.qweight[None], w.scales[None], w.group_size), 0)
              for w in (shared.gate_up, shared.down))
    v = x.double() @ gu.T
    inter = dn.shape[1]
    return torch.sigmoid(shared.gate.double()) * ((F.silu(v[:, :inter]) * v[:, inter:]) @ dn.T)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt, shared_fmt", [("int4", "int8"), ("int4", "int4"), ("int8", "int8")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("dims", [(64, 32, 64), (2048, 512, 512), (256, 64, 128)], ids=lambda d: "x".join(map(str, d)))
@pytest.mark.parametrize("tokens", [1, 3, 4])
def test_decode_kernels_take_the_shared_expert(cuda_kernels, tokens, dims, dtype, fmt, shared_fmt):
    """moe_experts_with_shared: the shared expert's rows ride along in the decode kernels; equal to
    the composition (routed experts, then the shared MLP gated and added) up to fp32 summation
    order, and close to float64."""
    hidden, inter, shared_inter = dims
    gate_up, down = _experts(16, hidden, inter, fmt, device="cuda", dtype=dtype, group=min(128, inter))
    weights, ids = _routing(tokens, 16, 4, device="cuda", dtype=dtype, seed=tokens)
    x = _inputs(tokens, hidden, device="cuda", dtype=dtype, seed=tokens)
    shared = _shared_expert(hidden, shared_inter, shared_fmt, tokens, dtype, seed=tokens + hidden)
    with _poisoned_allocations():
        out = moe.moe_experts_with_shared(x, gate_up, down, weights, ids, shared)
    assert out is not None and out.dtype == dtype and out.shape == x.shape and not out.isnan().any()
    routed = moe.moe_experts(x, gate_up, down, weights, ids)
    composed = sigmoid_mul(silu_mul(quant_linear(x, shared.gate_up)) @ dequantize(shared.down, dtype).T,
                           shared.gate, add=routed)
    _assert_close(out, composed, TOL[dtype])
    _assert_close(out, _expected(x, gate_up, down, weights, ids) + _shared64(x, shared), TOL[dtype])


@pytest.mark.cuda
def test_decode_kernels_leave_what_they_do_not_take_to_the_composition(cuda_kernels):
    """None (the caller composes) for fp32 activations, bf16 experts, a batch past the decode
    kernels and a gate of the wrong shape."""
    hidden, inter = 64, 32
    shared = _shared_expert(hidden, 64, "int8", 2, torch.bfloat16, seed=1)
    weights, ids = _routing(2, 8, 2, device="cuda", seed=2)
    x = _inputs(2, hidden, device="cuda")
    quantized = _experts(8, hidden, inter, "int4", device="cuda", group=32)
    dense = _experts(8, hidden, inter, "bf16", device="cuda")
    assert moe.moe_experts_with_shared(x, *quantized, weights, ids, shared) is not None
    assert moe.moe_experts_with_shared(x, *dense, weights, ids, shared) is None
    assert moe.moe_experts_with_shared(x.float(), *quantized, weights.float(), ids, shared) is None
    wide = moe.SharedExpert(shared.gate_up, shared.down, shared.gate.expand(2, 2))
    assert moe.moe_experts_with_shared(x, *quantized, weights, ids, wide) is None
    many = moe.QUANTIZED_DECODE_MAX_TOKENS + 1
    w_many, ids_many = _routing(many, 8, 2, device="cuda")
    gate_many = _shared_expert(hidden, 64, "int8", many, torch.bfloat16, seed=3)
    assert moe.moe_experts_with_shared(_inputs(many, hidden, device="cuda"), *quantized, w_many, ids_many,
                                       gate_many) is None


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("tokens", [33, 64])
def test_decode_kernels_quantized_up_to_64_tokens(cuda_kernels, tokens, fmt):
    _decode_check(tokens, 256, 8, 2048, 512, fmt)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_kernels_all_tokens_on_the_same_experts(cuda_kernels, fmt):
    ids = torch.tensor([[5, 0, 255, 17, 3, 128, 64, 200]] * 16, dtype=torch.int32, device="cuda")
    _decode_check(16, 256, 8, 2048, 512, fmt, ids=ids)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("group", [32, 64])
def test_decode_kernels_other_dtypes_and_groups(cuda_kernels, dtype, fmt, group):
    """fp16 / fp32 activations (dense experts in that dtype), int4 groups of 32 and 64, H != 2^n."""
    _decode_check(3, 16, 4, 384, 128, fmt, dtype=dtype, group=group)


@pytest.mark.cuda
def test_decode_kernels_unsupported_shapes_fall_back(cuda_kernels):
    """H not a multiple of 8 (bf16 vectors): no kernel, the grouped path answers correctly."""
    gate_up, down = _experts(8, 60, 32, "bf16", device="cuda")
    weights, ids = _routing(3, 8, 2, device="cuda")
    x = _inputs(3, 60, device="cuda")
    assert moe._decode_plan(x, gate_up, down, weights, ids) is None
    out = moe.moe_experts(x, gate_up, down, weights, ids)
    _assert_close(out, _expected(x, gate_up, down, weights, ids), TOL[torch.bfloat16])


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_decode_step_replays_in_cuda_graph(cuda_kernels, fmt):
    """Routing + experts read ids on the device: capture once, replay with new inputs."""
    gate_up, down = _cached_experts(256, 2048, 512, fmt, 128)
    g = torch.Generator("cuda").manual_seed(7)
    x = torch.randn(4, 2048, generator=g, device="cuda").bfloat16()
    logits = torch.randn(4, 256, generator=g, device="cuda").bfloat16()

    def step():
        weights, ids = moe.moe_route(logits, 8, True)
        return moe.moe_experts(x, gate_up, down, weights, ids)

    graph, out = capture(step)
    for seed in (1, 2):
        x.copy_(_inputs(4, 2048, device="cuda", seed=seed))
        logits.copy_(_distinct_logits(4, 256, torch.bfloat16, "cuda", seed=seed))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        weights, ids = moe.moe_route_ref(logits, 8, True)
        _assert_close(out, moe.moe_experts_ref(x, gate_up, down, weights, ids), TOL[torch.bfloat16])


def _grouped_gemv_check(tokens, num_experts, top_k, hidden, inter, fmt, *, dtype=torch.bfloat16, group=128,
                        ids=None, block_m=None):
    if dtype == torch.bfloat16:
        gate_up, down = _cached_experts(num_experts, hidden, inter, fmt, group)
    else:
        gate_up, down = _experts(num_experts, hidden, inter, fmt, device="cuda", dtype=dtype, group=group)
    weights, routed = _routing(tokens, num_experts, top_k, device="cuda", dtype=dtype, seed=tokens)
    ids = routed if ids is None else ids
    x = _inputs(tokens, hidden, device="cuda", dtype=dtype, seed=tokens)
    assert moe.grouped_gemv_fits(x, gate_up, down)
    with _poisoned_allocations():
        out = moe.moe_experts_grouped_gemv(x, gate_up, down, weights, ids, block_m)
    assert out.dtype == dtype and out.shape == x.shape and not out.isnan().any()
    _assert_close(out, moe.moe_experts_ref(x, gate_up, down, weights, ids), TOL[dtype])
    rows = list(range(tokens)) if tokens <= 40 else [0, 1, tokens // 2, tokens - 1]
    _assert_close(out[rows], _expected(x, gate_up, down, weights, ids, rows=rows), TOL[dtype])


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("block_m", [None, 8, 16, 32])
@pytest.mark.parametrize("tokens", [1, 3, 8, 37, 300])
def test_grouped_gemv_matches_reference(cuda_kernels, tokens, block_m, fmt):
    """The 35B expert shape; every slot-block size at every token count (several blocks per expert)."""
    _grouped_gemv_check(tokens, 256, 8, 2048, 512, fmt, block_m=block_m)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("group", [32, 64])
def test_grouped_gemv_other_dtypes_groups_and_shapes(cuda_kernels, fmt, dtype, group):
    """fp16, int4 groups of 32 / 64, small and odd shapes (tiles past the row ends)."""
    _grouped_gemv_check(11, 16, 4, 384, 128, fmt, dtype=dtype, group=group)
    _grouped_gemv_check(5, 8, 2, 64, 32, fmt, dtype=dtype, group=32)


@pytest.mark.cuda
def test_grouped_gemv_two_tiles_a_warp(cuda_kernels):
    """bf16 16-slot blocks in grids large enough for split 1, where a warp computes two row tiles
    together (quant_gemv.cu kSets): int4 groups of 32 (the weights scaled before the MMAs), int8 experts
    whose down has an odd tile count (129: the last warp's second tile has no rows) and K tails (2,064
    and 144); fp16 keeps a tile a warp."""
    for dtype in (torch.bfloat16, torch.float16):
        _grouped_gemv_check(64, 256, 8, 2048, 512, "int4", dtype=dtype, group=32, block_m=16)
        _grouped_gemv_check(400, 16, 4, 2064, 144, "int8", dtype=dtype, block_m=16)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_grouped_gemv_all_tokens_on_the_same_experts(cuda_kernels, fmt):
    """64 slots per expert: several full blocks of one expert."""
    ids = torch.tensor([[5, 0, 255, 17, 3, 128, 64, 200]] * 64, dtype=torch.int32, device="cuda")
    _grouped_gemv_check(64, 256, 8, 2048, 512, fmt, ids=ids, block_m=16)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("weights_fp32", [False, True])
@pytest.mark.parametrize("tokens, top_k, hidden", [(1, 1, 8), (3, 4, 384), (37, 8, 2048), (64, 8, 2048)])
def test_combine_slots_kernel_matches_float64(cuda_kernels, monkeypatch, dtype, weights_fp32, tokens, top_k, hidden):
    """Each token's slot rows weighted and summed: the weights rounded to the rows' dtype, the sum
    exact (float64), one rounding; the kernel's fp32 sum may land one ulp away, or a few fp32 ulps of
    the terms where they cancel. Through the wrapper, on the kernel (each call counted)."""
    g = torch.Generator(device="cuda").manual_seed(tokens * top_k)
    y = torch.randn(tokens * top_k, hidden, generator=g, device="cuda").to(dtype)
    weights = torch.rand(tokens, top_k, generator=g, device="cuda").to(torch.float32 if weights_fp32 else dtype)
    calls = []
    real = moe_align._combine_kernel
    monkeypatch.setattr(moe_align, "_combine_kernel", lambda *a: calls.append(1) or real(*a))
    out = moe_align.combine_slots(weights, y)
    assert calls and out.dtype == dtype and out.shape == (tokens, hidden)
    terms = weights.to(dtype).double().unsqueeze(-1) * y.double().view(tokens, top_k, hidden)
    exact = terms.sum(1)
    bound = torch.finfo(dtype).eps * exact.abs() + 2.0**-20 * terms.abs().sum(1)
    assert ((out.double() - exact).abs() <= bound).all()
    _assert_close(out, moe_align.combine_slots_ref(weights, y), TOL[dtype])


@pytest.mark.cuda
def test_moe_experts_takes_the_grouped_gemv_and_replays_it_in_a_graph(cuda_kernels, monkeypatch):
    gate_up, down = _cached_experts(256, 2048, 512, "int4", 128)
    tokens = moe.MMA_DECODE_MAX_TOKENS + 1  # int4 g128: the tensor-core decode kernels' limit
    assert tokens <= moe.GROUPED_GEMV_MAX_TOKENS
    calls = []
    real = moe.moe_experts_grouped_gemv
    monkeypatch.setattr(moe, "moe_experts_grouped_gemv", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x = _inputs(tokens, 2048, device="cuda", seed=1)
    logits = _distinct_logits(tokens, 256, torch.bfloat16, "cuda", seed=1)

    def step():
        weights, ids = moe.moe_route(logits, 8, True)
        return moe.moe_experts(x, gate_up, down, weights, ids)

    graph, out = capture(step)
    assert calls, "moe_experts did not take the grouped GEMV"
    for seed in (2, 3):
        x.copy_(_inputs(tokens, 2048, device="cuda", seed=seed))
        logits.copy_(_distinct_logits(tokens, 256, torch.bfloat16, "cuda", seed=seed))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        weights, ids = moe.moe_route_ref(logits, 8, True)
        _assert_close(out, moe.moe_experts_ref(x, gate_up, down, weights, ids), TOL[torch.bfloat16])


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS)
def test_grouped_path_matches_reference(cuda_kernels, monkeypatch, fmt):
    """N = 300 (prefill): sorted pairs + torch._grouped_mm on sm90+ (int4: the Triton kernels);
    float64 on a few tokens."""
    gate_up, down = _cached_experts(256, 2048, 512, fmt, 128)
    weights, ids = _routing(300, 256, 8, device="cuda", seed=300)
    x = _inputs(300, 2048, device="cuda", seed=300)
    assert moe._decode_plan(x, gate_up, down, weights, ids) is None
    monkeypatch.setattr(moe, "_grouped_mm_works", None)  # this call finds out, whatever ran before
    with _poisoned_allocations():
        out = moe.moe_experts(x, gate_up, down, weights, ids)
    assert not out.isnan().any()
    if not moe._grouped_quantized(x, gate_up, down) and torch.cuda.get_device_capability() >= (9, 0):
        assert moe._grouped_mm_works, "torch._grouped_mm should run on sm90+"
    _assert_close(out, moe.moe_experts_ref(x, gate_up, down, weights, ids), TOL[torch.bfloat16])
    rows = [0, 1, 2, 150, 299]
    _assert_close(
        out[rows], _expected(x, gate_up, down, weights, ids, rows=rows), TOL[torch.bfloat16]
    )


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_grouped_path_loop_fallback(cuda_kernels, monkeypatch, fmt):
    """Without torch._grouped_mm: one F.linear per hit expert, same results."""
    monkeypatch.setattr(moe, "_grouped_mm_works", False)
    gate_up, down = _experts(64, 256, 128, fmt, device="cuda", group=64)
    weights, ids = _routing(100, 64, 4, device="cuda", seed=5)
    x = _inputs(100, 256, device="cuda", seed=5)
    out = moe.moe_experts_grouped(x, gate_up, down, weights, ids)
    _assert_close(out, _expected(x, gate_up, down, weights, ids), TOL[torch.bfloat16])


@pytest.mark.cuda
def test_grouped_path_bf16_replays_in_cuda_graph(cuda_kernels):
    """bf16 experts past the decode kernels' 16 tokens (decode graph buckets up to 64): the
    grouped path keeps the expert bounds on the device, so it captures too."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch._grouped_mm needs sm90+ here; the loop fallback syncs")
    gate_up, down = _cached_experts(256, 2048, 512, "bf16", 128)
    weights, ids = _routing(32, 256, 8, device="cuda", seed=32)
    x = _inputs(32, 2048, device="cuda", seed=32)
    assert moe._decode_plan(x, gate_up, down, weights, ids) is None
    graph, out = capture(lambda: moe.moe_experts(x, gate_up, down, weights, ids))
    new_weights, new_ids = _routing(32, 256, 8, device="cuda", seed=33)
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    x.copy_(_inputs(32, 2048, device="cuda", seed=33))
    graph.replay()
    torch.cuda.synchronize()
    _assert_close(out, moe.moe_experts_ref(x, gate_up, down, weights, ids), TOL[torch.bfloat16])


@pytest.mark.cuda
@pytest.mark.parametrize("staged", [True, False], ids=["default", "NINFER_MOE_DOWN_STAGED=0"])
@pytest.mark.parametrize("tokens", [2, 3, 8])
def test_decode_kernels_down_staged_past_two_tokens(cuda_kernels, monkeypatch, tokens, staged):
    """The decode down staged through shared memory past 2 tokens (the register kernel at 1-2, and past 2
    under NINFER_MOE_DOWN_STAGED=0: GPUs where two staged blocks do not fit an SM), with and without the
    shared expert; NINFER_ABLATE shows which kernel ran."""
    if not staged:
        monkeypatch.setenv("NINFER_MOE_DOWN_STAGED", "0")
    _decode_check(tokens, 256, 8, 2048, 512, "int4")
    shared = _shared_expert(2048, 512, "int8", tokens, torch.bfloat16, seed=tokens)
    weights, ids = _routing(tokens, 256, 8, device="cuda", seed=tokens)
    x = _inputs(tokens, 2048, device="cuda", seed=tokens)
    gate_up, down = _cached_experts(256, 2048, 512, "int4", 128)
    out = moe.moe_experts_with_shared(x, gate_up, down, weights, ids, shared)
    assert out is not None
    _assert_close(out, _expected(x, gate_up, down, weights, ids) + _shared64(x, shared), TOL[torch.bfloat16])
    monkeypatch.setenv("NINFER_ABLATE", "down (tensor cores, staged)")  # its rows stay NaN where it ran
    with _poisoned_allocations():
        out = moe.moe_experts_with_shared(x, gate_up, down, weights, ids, shared)
    assert bool(out.isnan().any()) == (staged and tokens > 2)

"""The GDN decode conv folded into in_proj's GEMV (ops/quant.py quant_linear_add_norm_conv, ops/gdn.py
gdn_decode_step_folded): the GEMV's epilogue runs the conv, the recurrent kernel follows alone.

CPU tests: the new op's reference against float64 (conv outputs, advanced states, plain columns and
the zeroed counters); the folded step's reference composition equal, bit for bit, to the unfolded one
(projection, then the steps with their conv); the layer takes the fold exactly where the GEMV takes the
conv and gives the unfolded results; the kernel calls carry each tensor, stride and size in its place;
calls the conv epilogue cannot run are declined. `cuda` tests: the GEMV with the conv equal, bit for
bit, to the GEMV without it followed by the prefill conv kernel (same FMA order and roundings), over
block row counts 16 to 128 and 2 / 4 / 8 taps; the folded step equal, bit for bit, to
quant_linear_add_norm + gdn_decode_step (the same roundings and sums: the recurrent kernel's l2 norm
repeats the conv kernel's reduction order) and close to the references; CUDA graph replays (the
counters zeroed every step). They need ninfer_core._C built (scripts/gpu_check.sh).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F

from ninfer_core.layers.gdn import GatedDeltaNet
from ninfer_core.layers.norm import PendingNorm, RMSNorm
from ninfer_core.ops import dispatch, quant
from ninfer_core.ops import gdn as gdn_ops
from ninfer_core.ops.quant import GemvConv, QuantizedWeight, QuantLinear, quantize
from kernel_stub import kernels_on_cpu, reaches_launch, record_kernel_calls  # noqa: F401 - a fixture
from test_gdn_decode import EPS, OUT_TOL, SHAPE_35B, SMALL_ODD, _config, make_case, with_pool_copies

torch.set_num_threads(1)  # small tensors: thread start-up dominates and cores are shared

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
ext = dispatch.extension()
needs_ext = pytest.mark.skipif(ext is None, reason="ninfer_core._C is not built")


def fold_case(shape, batch: int, dtype: torch.dtype, device="cpu", kind: str = "int8", group: int = 128,
              hidden: int = 256, seed: int = 0) -> dict:
    """make_case's pools, (contiguous) slots and GDN weights, an in_proj [qkv | z | b | a] x hidden
    quantized as `kind`, and a pending norm's rows x, residual [B, 1, hidden] and zero-centred RMSNorm."""
    case = make_case(shape, batch, dtype, device, seed=seed)
    case["slots"] = case["slots"].contiguous()  # the fold's GEMV reads them before its PDL wait: no copies
    hk, hv, dk, dv, _ = shape
    rows = 2 * hk * dk + hv * dv + hv * dv + 2 * hv
    gen = torch.Generator().manual_seed(seed + 100)
    norm = RMSNorm(hidden, EPS, zero_centered=True)
    with torch.no_grad():
        norm.weight.normal_(0.0, 0.2, generator=gen)
    return {
        "x": (torch.randn(batch, 1, hidden, generator=gen) * 0.5).to(dtype).to(device),
        "residual": (torch.randn(batch, 1, hidden, generator=gen) * 2).to(dtype).to(device),
        "norm": norm.to(dtype).to(device),
        "qw": quantize((torch.randn(rows, hidden, generator=gen) / hidden**0.5).to(device), kind, group),
        **{name: case[name] for name in ("conv_pool", "state_pool", "slots", "w")},
    }


def pending(case: dict) -> PendingNorm:
    return PendingNorm(case["x"], case["residual"], case["norm"])


def conv_of(case: dict, zeroed: int = 0) -> GemvConv:
    return GemvConv(case["conv_pool"], case["w"].conv_weight, case["slots"], zeroed)


def norm_args(case: dict) -> tuple:
    """quant_linear_add_norm's arguments of a fold case."""
    norm = case["norm"]
    return case["x"], case["residual"], norm.weight, norm.eps, norm.zero_centered, case["qw"]


def split(y: torch.Tensor, w: gdn_ops.GDNWeights) -> tuple[torch.Tensor, ...]:
    """qkv, z, b, a of in_proj's output [B, 1, N], one token dropped: [B, width] each."""
    hv = w.A_log.shape[0]
    return y[:, 0].split([w.conv_weight.shape[0], hv * w.head_v_dim, hv, hv], dim=-1)


def unfolded_step(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, summed) of quant_linear_add_norm + gdn_decode_step: the path the fold replaces."""
    y, summed = quant.quant_linear_add_norm(*norm_args(case))
    qkv, z, b, a = split(y, case["w"])
    out = gdn_ops.gdn_decode_step(qkv, a, b, z, case["conv_pool"], case["state_pool"], case["slots"], case["w"])
    return out, summed


def folded_step(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, summed) of gdn_decode_step_folded, which must take the call."""
    rows = pending(case)
    out = gdn_ops.gdn_decode_step_folded(rows, case["qw"], None, case["conv_pool"], case["state_pool"],
                                         case["slots"], case["w"])
    assert out is not None and rows.summed is not None, "the GEMV did not take the conv"
    return out, rows.summed


def assert_same_pools(case: dict, other: dict) -> None:
    assert torch.equal(case["conv_pool"], other["conv_pool"])
    assert torch.equal(case["state_pool"], other["state_pool"])


# ---------------------------------------------------------------- CPU: references


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("taps", [2, 4])
def test_conv_gemv_reference_matches_float64(dtype, taps):
    """quant_linear_add_norm_conv_ref: the plain projection past C; below it the conv over [state |
    projection rounded to the dtype] in float64 up to the output's rounding; the states of the rows'
    slots drop their oldest input for the projection, other slots untouched; the counters zeroed."""
    shape = (*SMALL_ODD[:4], taps)
    case = fold_case(shape, 3, dtype, seed=taps)
    before = case["conv_pool"].clone()
    plain, want_summed = quant.quant_linear_add_norm_ref(*norm_args(case))
    y, summed, zeroed = gdn_ops.quant_linear_add_norm_conv_ref(*norm_args(case), None, conv_of(case, 7))
    channels = case["w"].conv_weight.shape[0]
    assert torch.equal(summed, want_summed) and y.shape == plain.shape and y.dtype == dtype
    assert torch.equal(y[..., channels:], plain[..., channels:])
    assert zeroed.dtype == torch.int32 and torch.equal(zeroed, torch.zeros(7, dtype=torch.int32))
    slots, new = case["slots"], plain[:, 0, :channels]
    window = torch.cat((before[slots].double(), new.double()[..., None]), dim=-1)  # [B, C, K]
    want = F.silu((window * case["w"].conv_weight.double()).sum(-1))
    tol = 1e-6 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(y[:, 0, :channels].double(), want, rtol=tol, atol=tol)
    assert torch.equal(case["conv_pool"][slots], torch.cat((before[slots][..., 1:], new[..., None]), dim=-1))
    untouched = torch.ones(before.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(case["conv_pool"][untouched], before[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [SMALL_ODD, (1, 3, 16, 8, 3)], ids=str)
def test_folded_reference_is_the_unfolded_composition(shape, dtype):
    """gdn_decode_step_folded_ref (conv in the projection, then the steps without it) = the projection,
    then gdn_decode_step_ref with its conv: outputs, new residual and pools bit for bit."""
    case = fold_case(shape, 3, dtype, seed=sum(shape))
    folded = with_pool_copies(case)
    y, summed = quant.quant_linear_add_norm_ref(*norm_args(case))
    qkv, z, b, a = split(y, case["w"])
    want = gdn_ops.gdn_decode_step_ref(qkv, a, b, z, case["conv_pool"], case["state_pool"], case["slots"], case["w"])
    rows = pending(folded)
    got = gdn_ops.gdn_decode_step_folded_ref(rows, folded["qw"], None, folded["conv_pool"], folded["state_pool"],
                                             folded["slots"], folded["w"])
    assert torch.equal(got, want) and torch.equal(rows.summed, summed)
    assert_same_pools(folded, case)


# ---------------------------------------------------------------- CPU: dispatch and kernel calls


def _quant_layer(shape, dtype: torch.dtype, hidden: int = 48) -> GatedDeltaNet:
    """A GDN layer whose in_proj is int8 (random parameters)."""
    torch.manual_seed(sum(shape))
    layer = GatedDeltaNet(_config(shape, hidden))
    with torch.no_grad():
        for p in (layer.A_log, layer.dt_bias, layer.norm.weight):
            p.normal_(0.5, 0.5)
    layer = layer.to(dtype)  # before quantizing: the int8 scales stay fp32
    layer.in_proj.linear = QuantLinear.from_linear(layer.in_proj.linear, "int8")
    return layer


@pytest.mark.parametrize("takes", [True, False], ids=["folded", "declined"])
def test_layer_decode_folds_where_the_gemv_takes_the_conv(monkeypatch, takes):
    """A decode forward with the input norm pending and a quantized in_proj asks for the fold (the
    stand-in GEMV here: the reference, or a decline); either way the results are the unfolded
    path's bit for bit (references throughout)."""
    monkeypatch.setenv(dispatch.DISABLE_ENV, "1")
    asked: list[GemvConv] = []

    def gemv(*args):
        asked.append(args[-1])
        return gdn_ops.quant_linear_add_norm_conv_ref(*args) if takes else None

    shape, dtype = SMALL_ODD, torch.bfloat16
    layer = _quant_layer(shape, dtype)
    case = make_case(shape, 3, dtype, seed=3)
    x, residual = torch.randn(3, 1, 48).to(dtype), torch.randn(3, 1, 48).to(dtype)
    norm = RMSNorm(48, EPS, zero_centered=True).to(dtype)
    plain = with_pool_copies(case)
    with torch.no_grad():
        want_rows = PendingNorm(x, residual, norm)
        want = layer(want_rows, plain["conv_pool"], plain["state_pool"], plain["slots"])
        monkeypatch.setattr(quant, "quant_linear_add_norm_conv", gemv)
        rows = PendingNorm(x, residual, norm)
        got = layer(rows, case["conv_pool"], case["state_pool"], case["slots"])
        layer(x, with_pool_copies(case)["conv_pool"], case["state_pool"].clone(), case["slots"])  # normed rows
    (conv,) = asked  # once, for the pending rows only
    assert conv.pool is case["conv_pool"] and conv.weight.data_ptr() == layer.conv1d.weight.data_ptr()
    assert torch.equal(conv.slots, case["slots"]) and conv.zeroed == 3 * shape[1]
    assert torch.equal(got, want) and torch.equal(rows.summed, want_rows.summed)
    assert_same_pools(case, plain)


def test_folded_kernel_calls_pass_each_tensor_in_its_place(monkeypatch):
    """The fold's two kernel calls (recording stand-in): the GEMV gets the rows, the norm, in_proj and
    the conv's pool / weight / slots as they are (the binding reads C and K off the weight) and the
    B * Hv int32 counters to zero; the recurrent step reads in_proj's output in place (qkv, z, b, a
    the views at their column offsets, one row stride), conv_done, those counters as its scratch."""
    calls = record_kernel_calls(monkeypatch, "quant_gemv", "gdn_steps")
    monkeypatch.setattr(gdn_ops, "_kernel_applies", lambda step, w: True)
    case = fold_case(SMALL_ODD, 2, torch.bfloat16, seed=5)
    bias = torch.randn(case["qw"].out_features).to(torch.bfloat16)
    rows = pending(case)
    out = gdn_ops.gdn_decode_step_folded(rows, case["qw"], bias, case["conv_pool"], case["state_pool"],
                                         case["slots"], case["w"])
    gemv, steps = calls
    w, qw = case["w"], case["qw"]
    hk, hv, dk, dv, taps = SMALL_ODD
    channels, n, hidden = 2 * hk * dk + hv * dv, qw.out_features, case["x"].shape[-1]
    # the GEMV: the pending rows [B, hidden] (views, no copies), the norm, in_proj, the new residual
    assert tuple(gemv[name].data_ptr() for name in ("x", "residual", "residual_out")) == tuple(
        t.data_ptr() for t in (case["x"], case["residual"], rows.summed))
    assert gemv["x"].shape == gemv["residual"].shape == gemv["residual_out"].shape == (2, hidden)
    assert gemv["norm_weight"] is case["norm"].weight and gemv["bias"] is bias
    assert gemv["qweight"] is qw.qweight and gemv["scales"] is qw.scales
    assert (gemv["eps"], gemv["zero_centered"], gemv["gate_up"], gemv["stream"]) == (EPS, True, False, 7)
    assert gemv["gate"] is None and gemv["add"] is None
    y = gemv["out"]
    assert y.shape == (2, n) and y.dtype == torch.bfloat16 and y.is_contiguous()
    # the conv: pool, weight [C, K] and slots as given (the slots never a copy: read before the PDL wait)
    assert gemv["conv_pool"] is case["conv_pool"] and gemv["conv_weight"] is w.conv_weight
    assert gemv["conv_slots"] is case["slots"] and w.conv_weight.shape == (channels, taps)
    zeroed = gemv["zeroed"]
    assert zeroed.dtype == torch.int32 and zeroed.shape == (2 * hv,) and zeroed.is_contiguous()
    # the steps: in_proj's output [B, 1, N] in place, qkv | z | b | a at their column offsets
    widths = {"qkv": channels, "z": hv * dv, "b": hv, "a": hv}
    offset = 0
    for name, width in widths.items():
        t = steps[name]
        assert (t.data_ptr(), t.shape, t.stride()) == (y.data_ptr() + 2 * offset, (2, 1, width), (n, n, 1)), name
        offset += width
    assert steps["conv_done"] is True and steps["write_state"] is True and steps["scratch"] is zeroed
    assert steps["slots"] is case["slots"]
    assert (steps["counts"], steps["offsets"], steps["fork_slots"], steps["width"]) == (None, None, None, None)
    assert steps["conv_pool"] is case["conv_pool"] and steps["state_pool"] is case["state_pool"]
    for name in ("conv_weight", "A_log", "dt_bias", "norm_weight"):
        assert steps[name] is getattr(w, name), name
    assert steps["out"].shape == (2, 1, hv * dv) and steps["out"].data_ptr() == out.data_ptr()
    assert out.shape == (2, hv * dv)
    assert (steps["q_scale"], steps["eps"], steps["stream"]) == (dk**-0.5, EPS, 7)


def test_unfolded_calls_pass_no_conv(monkeypatch):
    """The paths the fold leaves alone: quant_linear_add_norm's GEMV passes no conv operands, and the
    decode step runs its own conv (conv_done False, fp32 scratch for the activations and counters)."""
    calls = record_kernel_calls(monkeypatch, "quant_gemv", "gdn_steps")
    monkeypatch.setattr(gdn_ops, "_kernel_applies", lambda step, w: True)
    case = fold_case(SMALL_ODD, 2, torch.bfloat16, seed=8)
    unfolded_step(case)
    gemv, steps = calls
    assert all(gemv[name] is None for name in ("conv_pool", "conv_weight", "conv_slots", "zeroed"))
    assert steps["conv_done"] is False and steps["scratch"].dtype == torch.float32


def test_conv_fold_declines_what_the_gemv_cannot_run(monkeypatch):
    """quant_linear_add_norm_conv returns None (no kernel call) past the conv's rows, for fp32, for a
    conv the epilogue does not take (C % 16, 9 taps, a misaligned or strided pool, another dtype,
    int32 or strided slots: a copy would be written by the launch just before); 4 rows of 16-bit
    activations run it in one call (the norm folded), 5 and 8 rows in two (the norm's kernel first)."""
    calls = record_kernel_calls(monkeypatch, "quant_gemv", "rmsnorm")
    case = fold_case(SMALL_ODD, 9, torch.bfloat16, seed=6)
    x, residual, weight, eps, zc, qw = norm_args(case)
    pool, conv = case["conv_pool"], conv_of(case)
    shifted = torch.empty(pool.numel() + 8, dtype=pool.dtype)[1 : pool.numel() + 1].view(pool.shape)
    cases = {  # name: (x, residual, norm weight, conv, calls made)
        "4 rows": (x[:4], residual[:4], weight, conv._replace(slots=conv.slots[:4]), 1),
        "5 rows": (x[:5], residual[:5], weight, conv._replace(slots=conv.slots[:5]), 2),
        "8 rows": (x[:8], residual[:8], weight, conv._replace(slots=conv.slots[:8]), 2),
        "9 rows": (x, residual, weight, conv, 0),
        "fp32": (x[:2].float(), residual[:2].float(), weight.float(),
                 conv._replace(pool=pool.float(), weight=conv.weight.float(), slots=conv.slots[:2]), 0),
        "C % 16": (x[:2], residual[:2], weight, conv._replace(pool=pool[:, 8:].contiguous(), weight=conv.weight[8:],
                                                               slots=conv.slots[:2]), 0),
        "9 taps": (x[:2], residual[:2], weight, conv._replace(pool=pool.repeat(1, 1, 3)[..., :8].contiguous(),
                                                               weight=conv.weight.repeat(1, 3)[:, :9].contiguous(),
                                                               slots=conv.slots[:2]), 0),
        "misaligned pool": (x[:2], residual[:2], weight, conv._replace(pool=shifted, slots=conv.slots[:2]), 0),
        "strided pool": (x[:2], residual[:2], weight, conv._replace(pool=pool[::2], slots=conv.slots[:2] // 2), 0),
        "fp16 pool": (x[:2], residual[:2], weight, conv._replace(pool=pool.half(), slots=conv.slots[:2]), 0),
        "int32 slots": (x[:2], residual[:2], weight, conv._replace(slots=conv.slots[:2].int()), 0),
        "strided slots": (x[:2], residual[:2], weight, conv._replace(slots=conv.slots[:4:2]), 0),
    }
    for name, (x_, residual_, weight_, conv_, made) in cases.items():
        calls.clear()
        got = quant.quant_linear_add_norm_conv(x_, residual_, weight_, eps, zc, qw, None, conv_)
        assert (got is not None, len(calls)) == (made > 0, made), name
        if made == 2:  # add_rmsnorm's kernel, then the GEMV with the conv alone, reading its output
            norm_call, gemv = calls
            assert "qweight" not in norm_call and gemv["residual"] is None and gemv["norm_weight"] is None
            assert gemv["conv_pool"] is conv_.pool and gemv["conv_slots"] is conv_.slots
            assert gemv["x"].data_ptr() == norm_call["out"].data_ptr() and gemv["x"].shape == (x_.shape[0], 256)


def test_fold_checks_its_inputs():
    """in_proj rows that are not [qkv | z | b | a], steps after the conv past a decode step's contract,
    or without the GEMV's counters raise."""
    case = fold_case(SMALL_ODD, 2, torch.float32)
    short = QuantizedWeight("int8", case["qw"].qweight[:-1], case["qw"].scales[:-1], 0)
    with pytest.raises(ValueError, match="in_proj has"):
        gdn_ops.gdn_decode_step_folded(pending(case), short, None, case["conv_pool"], case["state_pool"],
                                       case["slots"], case["w"])
    y, _ = quant.quant_linear_add_norm_ref(*norm_args(case))
    step = gdn_ops._folded_step(y, case["conv_pool"], case["state_pool"], case["slots"], case["w"])
    with pytest.raises(ValueError, match="counters"):
        gdn_ops._steps("folded", step, True, case["w"], None)
    two = torch.cat((y, y), dim=1)  # two tokens
    step = gdn_ops._folded_step(two, case["conv_pool"], case["state_pool"], case["slots"], case["w"])
    with pytest.raises(ValueError, match="decode step"):
        gdn_ops._steps("folded", step, True, case["w"], None, torch.zeros(2 * 6, dtype=torch.int32))


# ---------------------------------------------------------------- the bindings' checks (where _C is built)
# As tests/test_binding_checks_quant_moe.py and test_binding_checks_attention_gdn.py: with CPU tensors a
# binding runs every check and stops at the last, the device check (DeviceError); so the fold's calls
# must reach it, and each argument the kernels cannot take must be a ValueError naming it.


FOLD_SHAPES = [SMALL_ODD, (1, 2, 32, 224, 8), (3, 3, 160, 32, 2)]  # 4, 8 and 2 taps


@needs_ext
@pytest.mark.parametrize("kind, group", [("int8", 0), ("int4", 32), ("int4", 128)])
@pytest.mark.parametrize("dtype", [BF16, F16], ids=str)
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("shape", FOLD_SHAPES, ids=str)
def test_conv_gemv_reaches_launch(kernels_on_cpu, shape, batch, dtype, kind, group):
    """quant_linear_add_norm_conv's GEMV call (norm and conv epilogue, with and without a bias) passes
    every check of quant_gemv."""
    case = fold_case(shape, batch, dtype, kind=kind, group=group or 128, seed=batch)
    bias = torch.randn(case["qw"].out_features).to(dtype)
    conv = conv_of(case, batch * shape[1])
    reaches_launch(lambda: quant.quant_linear_add_norm_conv(*norm_args(case), None, conv))
    reaches_launch(lambda: quant.quant_linear_add_norm_conv(*norm_args(case), bias, conv._replace(zeroed=0)))


@needs_ext
@pytest.mark.parametrize("dtype", [BF16, F16], ids=str)
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("shape", FOLD_SHAPES, ids=str)
def test_steps_after_the_conv_reach_launch(kernels_on_cpu, shape, batch, dtype):
    """The fold's second call: gdn_steps with conv_done on in_proj's output [B, 1, N] read in place,
    the GEMV's B * Hv int32 counters as scratch."""
    case = fold_case(shape, batch, dtype, seed=batch)
    y, _ = quant.quant_linear_add_norm_ref(*norm_args(case))  # [B, 1, qkv | z | b | a], as the GEMV writes it
    step = gdn_ops._folded_step(y, case["conv_pool"], case["state_pool"], case["slots"], case["w"])
    counters = torch.zeros(batch * shape[1], dtype=torch.int32)
    reaches_launch(lambda: gdn_ops._steps("gdn_decode_step_folded", step, True, case["w"], None, counters))


@needs_ext
def test_layer_decode_takes_the_fold_to_launch(kernels_on_cpu, monkeypatch):
    """GatedDeltaNet's decode forward with the norm pending and an int8 in_proj asks quant_gemv for
    the conv epilogue, and that call passes the binding's checks."""
    layer = _quant_layer(SMALL_ODD, BF16)
    case = make_case(SMALL_ODD, 3, BF16, seed=3)
    slots = case["slots"].contiguous()
    convs: list[GemvConv | None] = []
    gemv = quant._gemv

    def spy(*args, **kwargs):
        convs.append(kwargs.get("conv"))
        return gemv(*args, **kwargs)

    monkeypatch.setattr(quant, "_gemv", spy)
    x, residual = torch.randn(3, 1, 48).to(BF16), torch.randn(3, 1, 48).to(BF16)
    norm = RMSNorm(48, EPS, zero_centered=True).to(BF16)
    with torch.no_grad():
        reaches_launch(lambda: layer(PendingNorm(x, residual, norm), case["conv_pool"], case["state_pool"], slots))
    (conv,) = convs
    assert conv is not None and conv.pool is case["conv_pool"] and conv.slots is slots
    assert conv.zeroed == 3 * SMALL_ODD[1]


def _bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(BF16)


def _misaligned(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    """A contiguous view starting one element past an aligned address."""
    return torch.zeros(math.prod(shape) + 1, dtype=dtype)[1:].view(shape)


@functools.cache  # no call writes the weight
def _int4_weight(n: int, k: int) -> QuantizedWeight:
    return quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) / k**0.5, "int4", 32)


def _conv_gemv_kwargs(m: int = 3, channels: int = 32, taps: int = 4, n: int = 48, k: int = 64) -> dict:
    """quant_gemv's arguments with the norm and the conv epilogue, every check passing: x [m, k], an
    int4 W [n, k] (groups of 32), the conv on outputs < `channels` of 5 pooled states, 2 m counters."""
    qw = _int4_weight(n, k)
    return dict(out=torch.empty(m, n, dtype=BF16), x=_bf16(m, k), qweight=qw.qweight, scales=qw.scales, bias=None,
                stream=0, residual=_bf16(m, k), norm_weight=_bf16(k), residual_out=torch.empty(m, k, dtype=BF16),
                eps=1e-6, zero_centered=True, conv_pool=_bf16(5, channels, taps - 1),
                conv_weight=_bf16(channels, taps), conv_slots=torch.tensor([4, 0, 2, 1][:m]),
                zeroed=torch.empty(2 * m, dtype=torch.int32))


def _with(kwargs: dict, **changes) -> dict:
    """kwargs with `changes(kwargs)`: changes made of the arguments' own tensors."""
    return kwargs | {name: change(kwargs) for name, change in changes.items()}


def _rejects(binding, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        binding(**kwargs)
    assert not isinstance(info.value, ext.DeviceError), "every check passed: the change was not caught"


NO_CONV = dict(conv_pool=None, conv_weight=None, conv_slots=None)
CONV_GEMV_CASES = {  # name: (the arguments, the error)
    "pool alone": (lambda: _conv_gemv_kwargs() | dict(conv_slots=None),
                   "conv_pool, conv_weight and conv_slots go together"),
    "weight alone": (lambda: _conv_gemv_kwargs() | dict(conv_pool=None, conv_slots=None),
                     "conv_pool, conv_weight and conv_slots go together"),
    "zeroed alone": (lambda: _conv_gemv_kwargs() | NO_CONV, "zeroed goes with the conv"),
    "no norm past 8 rows": (lambda: _conv_gemv_kwargs(m=9) | dict(residual=None, norm_weight=None, residual_out=None),
                            "the conv epilogue without the norm takes m <= 8 rows, got m=9"),
    "gate_up": (lambda: _conv_gemv_kwargs() | dict(gate_up=True, out=torch.empty(3, 24, dtype=BF16), residual=None,
                                                   norm_weight=None, residual_out=None),
                "the conv epilogue takes no gate_up, gate or add"),
    "weight dtype": (lambda: _with(_conv_gemv_kwargs(), conv_weight=lambda kw: kw["conv_weight"].float()),
                     "conv_weight is float32, expected bfloat16"),
    "weight rank": (lambda: _with(_conv_gemv_kwargs(), conv_weight=lambda kw: kw["conv_weight"][None]),
                    r"conv_weight has shape \(1, 32, 4\), expected \(\*, \*\)"),
    "weight strides": (lambda: _conv_gemv_kwargs() | dict(conv_weight=_bf16(4, 32).t()),
                       "conv_weight must be contiguous"),
    "weight aligned": (lambda: _conv_gemv_kwargs() | dict(conv_weight=_misaligned(32, 4)),
                       "conv_weight must start at a 16-byte aligned address"),
    "channels % 16": (lambda: _conv_gemv_kwargs(channels=40),
                      r"conv_weight has 40 channels, expected a multiple of 16 in 16\.\.48"),
    "channels past n": (lambda: _conv_gemv_kwargs(channels=64),
                        r"conv_weight has 64 channels, expected a multiple of 16 in 16\.\.48 \(out's columns\)"),
    "9 taps": (lambda: _conv_gemv_kwargs(taps=9), r"conv_weight has 9 taps, expected 2\.\.8"),
    "1 tap": (lambda: _conv_gemv_kwargs(taps=1), r"conv_weight has 1 taps, expected 2\.\.8"),
    "pool channels": (lambda: _conv_gemv_kwargs() | dict(conv_pool=_bf16(5, 16, 3)),
                      r"conv_pool has shape \(5, 16, 3\), expected \(\*, 32, 3\)"),
    "pool taps": (lambda: _conv_gemv_kwargs() | dict(conv_pool=_bf16(5, 32, 2)),
                  r"conv_pool has shape \(5, 32, 2\), expected \(\*, 32, 3\)"),
    "pool dtype": (lambda: _with(_conv_gemv_kwargs(), conv_pool=lambda kw: kw["conv_pool"].half()),
                   "conv_pool is float16, expected bfloat16"),
    "pool strides": (lambda: _with(_conv_gemv_kwargs(), conv_pool=lambda kw: kw["conv_pool"].repeat(2, 1, 1)[::2]),
                     "conv_pool must be contiguous"),
    "pool aligned": (lambda: _conv_gemv_kwargs() | dict(conv_pool=_misaligned(5, 32, 3)),
                     "conv_pool must start at a 16-byte aligned address"),
    "slots dtype": (lambda: _with(_conv_gemv_kwargs(), conv_slots=lambda kw: kw["conv_slots"].int()),
                    "conv_slots is int32, expected int64"),
    "slots per row": (lambda: _with(_conv_gemv_kwargs(), conv_slots=lambda kw: kw["conv_slots"][:2]),
                      r"conv_slots has shape \(2,\), expected \(3,\)"),
    "slots strides": (lambda: _conv_gemv_kwargs() | dict(conv_slots=torch.arange(6)[::2]),
                      "conv_slots must be contiguous"),
    "zeroed dtype": (lambda: _with(_conv_gemv_kwargs(), zeroed=lambda kw: kw["zeroed"].long()),
                     "zeroed is int64, expected int32"),
    "zeroed rank": (lambda: _with(_conv_gemv_kwargs(), zeroed=lambda kw: kw["zeroed"].view(2, 3)),
                    r"zeroed has shape \(2, 3\), expected \(\*,\)"),
    "zeroed strides": (lambda: _conv_gemv_kwargs() | dict(zeroed=torch.zeros(12, dtype=torch.int32)[::2]),
                       "zeroed must be contiguous"),
    "pool in out": (lambda: _with(_conv_gemv_kwargs(), conv_pool=lambda kw: kw["out"].view(-1)[:96].view(1, 32, 3)),
                    "conv_pool overlaps out"),
    "pool in residual_out": (lambda: _with(_conv_gemv_kwargs(),
                                           conv_pool=lambda kw: kw["residual_out"].view(-1)[:96].view(1, 32, 3)),
                             "conv_pool overlaps residual_out"),
    "weight in pool": (lambda: _with(_conv_gemv_kwargs(),
                                     conv_weight=lambda kw: kw["conv_pool"].view(-1)[:128].view(32, 4)),
                       "conv_pool overlaps conv_weight"),
    "zeroed in pool": (lambda: _with(_conv_gemv_kwargs(),
                                     zeroed=lambda kw: kw["conv_pool"].view(-1)[:12].view(torch.int32)),
                       "zeroed overlaps conv_pool"),
    "zeroed in out": (lambda: _with(_conv_gemv_kwargs(), zeroed=lambda kw: kw["out"].view(-1)[:12].view(torch.int32)),
                      "zeroed overlaps out"),
    "weight in out": (lambda: _with(_conv_gemv_kwargs(), conv_weight=lambda kw: kw["out"].view(-1)[:128].view(32, 4)),
                      "out overlaps conv_weight"),
    "slots in residual_out": (lambda: _with(_conv_gemv_kwargs(),
                                            conv_slots=lambda kw: kw["residual_out"].view(-1)[:12].view(torch.int64)),
                              "residual_out overlaps conv_slots"),
}


@needs_ext
def test_conv_gemv_binding_takes_valid_arguments():
    kw = _conv_gemv_kwargs()
    reaches_launch(lambda: ext.quant_gemv(**kw))
    reaches_launch(lambda: ext.quant_gemv(**(kw | {"bias": _bf16(48)})))
    reaches_launch(lambda: ext.quant_gemv(**(kw | {"zeroed": None})))  # no counters to zero
    reaches_launch(lambda: ext.quant_gemv(**_conv_gemv_kwargs(m=1, channels=48, taps=8)))  # every output a channel
    reaches_launch(lambda: ext.quant_gemv(**_conv_gemv_kwargs(m=4, channels=16, taps=2)))
    with pytest.raises(TypeError):  # the raw-pointer interface is gone: an address is not a tensor
        ext.quant_gemv(**(kw | {"conv_pool": kw["conv_pool"].data_ptr()}))
    with pytest.raises(TypeError):  # sizes come from the tensors
        ext.quant_gemv(**kw, conv_channels=32)


@needs_ext
@pytest.mark.parametrize("case", CONV_GEMV_CASES)
def test_conv_gemv_rejects_what_the_epilogue_cannot_take(case):
    kwargs, match = CONV_GEMV_CASES[case]
    _rejects(ext.quant_gemv, kwargs(), "quant_gemv: " + match)


def _conv_done_kwargs(batch: int = 2, tokens: int = 1, dtype: torch.dtype = BF16) -> dict:
    """gdn_steps' arguments after the conv (Hk 2, Hv 4, dk 32, dv 64, 4 taps), every check passing: a
    decode step reading qkv | z | b | a in place from one [B, T, N] projection, the B Hv counters
    (int32) as scratch."""
    hk, hv, dk, dv, taps = 2, 4, 32, 64, 4
    channels, slots = 2 * hk * dk + hv * dv, 2 * batch + 1
    x = lambda *shape: torch.randn(*shape).to(dtype)  # noqa: E731
    qkv, z, b, a = x(batch, tokens, channels + hv * dv + 2 * hv).split([channels, hv * dv, hv, hv], dim=-1)
    return dict(qkv=qkv, a=a, b=b, z=z, conv_pool=x(slots, channels, taps - 1),
                state_pool=torch.randn(slots, hv, dk, dv), slots=torch.arange(batch), counts=None, offsets=None,
                fork_slots=None, width=None, conv_done=True, out=torch.empty(batch, tokens, hv * dv, dtype=dtype),
                scratch=torch.zeros(batch * hv, dtype=torch.int32), conv_weight=x(channels, taps), A_log=x(hv),
                dt_bias=x(hv), norm_weight=x(dv), write_state=True, q_scale=dk**-0.5, eps=1e-6, stream=0)


DECODE_ONLY = "conv_done is a decode step's: 1 token, out, write_state, no counts, offsets or fork_slots"
CONV_DONE_CASES = {  # name: (the arguments, the error)
    "fp32": (lambda: _conv_done_kwargs(dtype=F32), "conv_done needs fp16 / bf16 qkv"),
    "2 tokens": (lambda: _conv_done_kwargs(tokens=2), DECODE_ONLY),
    "no state write": (lambda: _conv_done_kwargs() | dict(write_state=False), DECODE_ONLY),
    "no out": (lambda: _conv_done_kwargs() | dict(out=None, z=None), DECODE_ONLY),
    "counts": (lambda: _conv_done_kwargs() | dict(counts=torch.ones(2, dtype=torch.long)), DECODE_ONLY),
    "offsets": (lambda: _conv_done_kwargs() | dict(offsets=torch.zeros(2, dtype=torch.long), width=1), DECODE_ONLY),
    "fork slots": (lambda: _conv_done_kwargs() | dict(fork_slots=torch.tensor([3, 4])), DECODE_ONLY),
    "fp32 scratch": (lambda: _conv_done_kwargs() | dict(scratch=torch.zeros(8)), "scratch is float32, expected int32"),
    "scratch short": (lambda: _with(_conv_done_kwargs(), scratch=lambda kw: kw["scratch"][:-1]),
                      r"scratch has shape \(7,\), expected \(8,\)"),
    "scratch strides": (lambda: _conv_done_kwargs() | dict(scratch=torch.zeros(16, dtype=torch.int32)[::2]),
                        "scratch must be contiguous"),
    # without conv_done (its default) the counters alone are no scratch: the conv's activations go first
    "conv not done": (lambda: _conv_done_kwargs() | dict(conv_done=False), "scratch is int32, expected float32"),
}


@needs_ext
def test_conv_done_binding_takes_valid_arguments():
    for dtype in (BF16, F16):
        for batch in (1, 8):
            kw = _conv_done_kwargs(batch, dtype=dtype)
            reaches_launch(lambda: ext.gdn_steps(**kw))
    kw = _conv_done_kwargs()
    unfolded = {k: v for k, v in kw.items() if k != "conv_done"}  # conv_done defaults to False
    reaches_launch(lambda: ext.gdn_steps(**(unfolded | {"scratch": torch.empty(2 * (384 + 4))})))


@needs_ext
@pytest.mark.parametrize("case", CONV_DONE_CASES)
def test_conv_done_rejects_what_the_recurrent_kernel_cannot_take(case):
    kwargs, match = CONV_DONE_CASES[case]
    _rejects(ext.gdn_steps, kwargs(), "gdn_steps: " + match)


# ---------------------------------------------------------------- GPU: the kernels


@pytest.fixture
def cuda_kernels(monkeypatch):
    monkeypatch.delenv(dispatch.DISABLE_ENV, raising=False)
    assert dispatch.extension() is not None, (
        "CUDA is available but ninfer_core._C is not built: run scripts/gpu_check.sh"
    )


def _poison_allocations(monkeypatch) -> None:
    """torch.empty hands out NaN (floats) or -1 (integers): outputs or counters left unwritten show."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else -1)

    monkeypatch.setattr(torch, "empty", poisoned)


# (C, in_proj rows, hidden) and the blocks they get on an H200: split 1 (8 tiles, 128 rows a block),
# the 35B's in_proj (split 4: 32 rows), split 8 (16 rows), split 16 (16-warp blocks of one tile)
CONV_GEMV_SHAPES = [(1024, 1040, 256), (8192, 12352, 2048), (512, 4608, 2048), (224, 256, 5120)]


@pytest.mark.cuda
@pytest.mark.parametrize("kind, group", [("int8", 0), ("int4", 32), ("int4", 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", CONV_GEMV_SHAPES, ids=str)
def test_conv_gemv_equals_gemv_then_conv_kernel(cuda_kernels, monkeypatch, shape, dtype, kind, group):
    """Rows 1..8 (odd counts with a bias; past 4 the norm runs first and the GEMV takes the conv
    alone): the outputs past C and the new residual are quant_linear_add_norm's, the first C the
    prefill conv kernel's over those projections (the same FMA order and roundings), and the pools
    that kernel's, all bit for bit; every counter zeroed."""
    channels, n, hidden = shape
    gen = torch.Generator().manual_seed(n + hidden)
    qw = quantize((torch.randn(n, hidden, generator=gen) / hidden**0.5).cuda(), kind, group)
    weight = (torch.randn(channels, 4, generator=gen) * 0.5).to(dtype).cuda()
    pool = torch.randn(9, channels, 3, generator=gen).to(dtype).cuda()
    bias = torch.randn(n, generator=gen).to(dtype).cuda()
    norm_weight = (torch.randn(hidden, generator=gen) * 0.2).to(dtype).cuda()
    for rows in range(1, quant.CONV_MAX_ROWS + 1):
        x = torch.randn(rows, 1, hidden, generator=gen).to(dtype).cuda()
        residual = (torch.randn(rows, 1, hidden, generator=gen) * 2).to(dtype).cuda()
        slots = torch.tensor([7, 2, 4, 0, 8, 1, 5, 3][:rows], device="cuda")
        b = bias if rows % 2 else None
        plain, want_summed = quant.quant_linear_add_norm(x, residual, norm_weight, EPS, True, qw, b)
        want_pool = pool.clone()
        want = torch.cat(gdn_ops.conv_prefill(plain[..., :channels], want_pool, slots, weight, channels // 4), -1)
        got_pool = pool.clone()
        with monkeypatch.context() as poison:
            _poison_allocations(poison)
            got = quant.quant_linear_add_norm_conv(x, residual, norm_weight, EPS, True, qw, b,
                                                   GemvConv(got_pool, weight, slots, 5 * rows))
        assert got is not None
        y, summed, zeroed = got
        assert torch.equal(summed, want_summed) and torch.equal(zeroed, torch.zeros_like(zeroed)), rows
        assert torch.equal(y[..., channels:], plain[..., channels:]), f"plain outputs differ at {rows} rows"
        assert torch.equal(y[..., :channels], want), f"conv outputs differ at {rows} rows"
        assert torch.equal(got_pool, want_pool), f"conv states differ at {rows} rows"


@pytest.mark.cuda
@pytest.mark.parametrize("taps", [2, 8])
def test_conv_gemv_other_widths_match_reference(cuda_kernels, taps):
    """2 and 8 taps against the torch reference (close: its conv sums in another order) and the
    prefill conv kernel (bit for bit)."""
    case = fold_case((2, 4, 64, 64, taps), 3, torch.bfloat16, "cuda", hidden=1024, seed=taps)
    start = case["conv_pool"].clone()
    ref_case = with_pool_copies(case)
    y, summed, _ = quant.quant_linear_add_norm_conv(*norm_args(case), None, conv_of(case, 12))
    ref_y, ref_summed, _ = gdn_ops.quant_linear_add_norm_conv_ref(*norm_args(ref_case), None, conv_of(ref_case, 12))
    assert torch.equal(summed, ref_summed)
    tol = OUT_TOL[torch.bfloat16]
    torch.testing.assert_close(y, ref_y, rtol=tol, atol=tol)
    plain, _ = quant.quant_linear_add_norm(*norm_args(case))
    channels = case["w"].conv_weight.shape[0]
    prefill = gdn_ops.conv_prefill(plain[..., :channels], start, case["slots"], case["w"].conv_weight, channels // 4)
    assert torch.equal(torch.cat(prefill, -1), y[..., :channels])
    assert torch.equal(start, case["conv_pool"])


@pytest.mark.cuda
def test_conv_gemv_rejects_what_it_cannot_run(cuda_kernels):
    case = fold_case(SMALL_ODD, 2, torch.bfloat16, "cuda")
    x, residual, weight, eps, zc, qw = norm_args(case)
    out, summed = torch.empty(2, qw.out_features, dtype=x.dtype, device="cuda"), torch.empty_like(x[:, 0])
    norm = quant._FoldedNorm(residual[:, 0], weight, summed, eps, zc)
    conv = conv_of(case)._replace(slots=case["slots"].contiguous())
    with pytest.raises(ValueError, match="quant_gemv: conv_weight has 312 channels"):
        quant._gemv(out, x[:, 0], qw, None, norm=norm, conv=conv._replace(pool=conv.pool[:, 8:].contiguous(),
                                                                          weight=conv.weight[8:].contiguous()))
    nine = fold_case(SMALL_ODD, 9, torch.bfloat16, "cuda")
    with pytest.raises(ValueError, match="quant_gemv: the conv epilogue without the norm takes m <= 8 rows, got m=9"):
        quant._gemv(torch.empty(9, qw.out_features, dtype=x.dtype, device="cuda"), nine["x"][:, 0], nine["qw"], None,
                    conv=conv_of(nine))


@pytest.mark.cuda
@pytest.mark.parametrize("kind, group", [("int8", 0), ("int4", 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [SHAPE_35B, SMALL_ODD, (1, 3, 64, 96, 3), (2, 4, 256, 256, 4),
                                   (3, 3, 160, 32, 2), (1, 2, 32, 224, 8)], ids=str)
def test_folded_step_equals_unfolded_kernels(cuda_kernels, shape, dtype, kind, group):
    """gdn_decode_step_folded against quant_linear_add_norm + gdn_decode_step, batches 1..8 (past 4
    the norm first, the conv still in the GEMV): outputs, new residual, conv and recurrent pools bit
    for bit; close to the reference composition."""
    hidden = 2048 if shape == SHAPE_35B else 512
    for batch in range(1, quant.CONV_MAX_ROWS + 1):
        case = fold_case(shape, batch, dtype, "cuda", kind, group, hidden, seed=batch + sum(shape))
        before, unfolded, ref_case = (with_pool_copies(case) for _ in range(3))
        out, summed = folded_step(case)
        want, want_summed = unfolded_step(unfolded)
        assert not out.isnan().any()
        assert torch.equal(out, want), f"outputs differ at batch {batch}"
        assert torch.equal(summed, want_summed)
        assert_same_pools(case, unfolded)
        ref_out = gdn_ops.gdn_decode_step_folded_ref(pending(ref_case), ref_case["qw"], None, ref_case["conv_pool"],
                                                     ref_case["state_pool"], ref_case["slots"], ref_case["w"])
        torch.testing.assert_close(out, ref_out, rtol=OUT_TOL[dtype], atol=OUT_TOL[dtype])
        untouched = torch.ones(before["state_pool"].shape[0], dtype=torch.bool, device="cuda")
        untouched[case["slots"]] = False
        assert torch.equal(case["conv_pool"][untouched], before["conv_pool"][untouched])
        assert torch.equal(case["state_pool"][untouched], before["state_pool"][untouched])


@pytest.mark.cuda
@pytest.mark.parametrize("batch", [1, 4])
def test_folded_step_replays_in_cuda_graph(cuda_kernels, batch):
    """Captured once, replayed for 6 tokens on fresh rows: each step equals the unfolded kernels' step
    from the same pools bit for bit (the recurrent kernel's counters must be zeroed by every replay's
    GEMV, or its heads' last blocks would not be found)."""
    from ninfer_core.engine.graph_capture import capture

    dtype = torch.bfloat16
    case = fold_case(SHAPE_35B, batch, dtype, "cuda", hidden=2048, seed=70 + batch)
    graph, (out, summed) = capture(lambda: folded_step(case))
    gen = torch.Generator().manual_seed(71)
    for _ in range(6):
        case["x"].copy_(torch.randn(case["x"].shape, generator=gen).to(dtype))
        case["residual"].copy_((torch.randn(case["x"].shape, generator=gen) * 2).to(dtype))
        unfolded = with_pool_copies(case)
        want, want_summed = unfolded_step(unfolded)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want) and torch.equal(summed, want_summed)
        assert_same_pools(case, unfolded)


@pytest.mark.cuda
def test_layer_decode_folds_on_cuda(cuda_kernels, monkeypatch):
    """GatedDeltaNet's decode forward with the norm pending and an int8 in_proj takes the fold and
    gives the unfolded forward's results bit for bit."""
    shape, dtype = SHAPE_35B, torch.bfloat16
    layer = _quant_layer(shape, dtype, hidden=2048).cuda()
    case = make_case(shape, 3, dtype, "cuda", seed=81)
    case["slots"] = case["slots"].contiguous()
    folded = gdn_ops.gdn_decode_step_folded
    taken: list[bool] = []

    def spy(*args):
        out = folded(*args)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(gdn_ops, "gdn_decode_step_folded", spy)
    x, residual = ((torch.randn(3, 1, 2048, device="cuda") * s).to(dtype) for s in (0.5, 2.0))
    norm = RMSNorm(2048, EPS, zero_centered=True).to(dtype).cuda()
    unfolded = with_pool_copies(case)
    with torch.no_grad():
        rows = PendingNorm(x, residual, norm)
        got = layer(rows, case["conv_pool"], case["state_pool"], case["slots"])
        monkeypatch.setattr(gdn_ops, "gdn_decode_step_folded", lambda *args: None)
        want_rows = PendingNorm(x, residual, norm)
        want = layer(want_rows, unfolded["conv_pool"], unfolded["state_pool"], unfolded["slots"])
    assert taken == [True], "the layer did not fold the conv"
    assert torch.equal(got, want) and torch.equal(rows.summed, want_rows.summed)
    assert_same_pools(case, unfolded)


# ---------------------------------------------------------------- CPU: the decode mixer in one call


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("ordered", [False, True], ids=["", "out-order"])
def test_cpu_mixer_in_one_call_is_the_layer_one_call_at_a_time(monkeypatch, kind, ordered):
    """Under the CPU's bf16 math a decode forward with the input norm pending runs the mixer as one
    call (ops/gdn.py `cpu_gdn_mixer`): out, the new residual and both pools are those of the same
    layer's calls one by one (add_rmsnorm, in_proj, the fused steps, out_proj over out_input_order's
    permutation where set) bit for bit."""
    if not dispatch.cpu_kernels_available():
        pytest.skip("the CPU extension is not built")
    monkeypatch.setenv(dispatch.CPU_MATH_ENV, "bf16")
    shape, hidden = SMALL_ODD, 64
    torch.manual_seed(5)
    layer = GatedDeltaNet(_config(shape, hidden))
    with torch.no_grad():
        for p in (layer.A_log, layer.dt_bias, layer.norm.weight):
            p.normal_(0.5, 0.5)
    layer.in_proj.linear = QuantLinear.from_linear(layer.in_proj.linear, kind, 32)
    layer.out_proj = QuantLinear.from_linear(layer.out_proj, kind, 32)
    if ordered:
        layer.set_input_order("out_proj", torch.randperm(layer.value_dim))
    case = make_case(shape, 3, F32, seed=4)
    case["slots"] = case["slots"].contiguous()
    x, residual = torch.randn(3, 1, hidden), torch.randn(3, 1, hidden)
    norm = RMSNorm(hidden, EPS, zero_centered=True)
    with torch.no_grad():
        norm.weight.normal_(0.0, 0.1)
    calls = []
    real = gdn_ops.cpu_gdn_mixer
    monkeypatch.setattr(gdn_ops, "cpu_gdn_mixer", lambda *a: calls.append(1) or real(*a))
    plain = with_pool_copies(case)
    with torch.no_grad():
        rows = PendingNorm(x, residual, norm)
        got = layer(rows, case["conv_pool"], case["state_pool"], case["slots"])
        assert calls == [1]
        monkeypatch.setattr(gdn_ops, "cpu_gdn_mixer", lambda *a: None)
        want_rows = PendingNorm(x, residual, norm)
        want = layer(want_rows, plain["conv_pool"], plain["state_pool"], plain["slots"])
    assert got.shape == (3, 1, hidden)
    assert torch.equal(got, want) and torch.equal(rows.summed, want_rows.summed)
    assert_same_pools(case, plain)


def test_cpu_mixer_declines_what_it_does_not_take(monkeypatch):
    """None (the layer's calls one by one): the exact CPU math, bf16 rows, two new tokens."""
    monkeypatch.setenv(dispatch.CPU_MATH_ENV, "bf16")
    layer = GatedDeltaNet(_config(SMALL_ODD, 64))
    in_proj, out_proj = (quantize(m.weight.detach(), "int8") for m in (layer.in_proj.linear, layer.out_proj))
    case = make_case(SMALL_ODD, 2, F32, seed=6)
    slots = case["slots"].contiguous()
    norm = RMSNorm(64, EPS, zero_centered=False)

    def call(x: torch.Tensor) -> tuple | None:
        return gdn_ops.cpu_gdn_mixer(PendingNorm(x, torch.randn_like(x), norm), in_proj, out_proj, None,
                                     case["conv_pool"], case["state_pool"], slots, layer.weights)

    assert (call(torch.randn(2, 1, 64)) is not None) == dispatch.cpu_kernels_available()
    assert call(torch.randn(2, 2, 64)) is None
    assert call(torch.randn(2, 1, 64).to(BF16)) is None
    monkeypatch.setenv(dispatch.CPU_MATH_ENV, "exact")
    assert call(torch.randn(2, 1, 64)) is None

"""ops.gdn: the fused Gated DeltaNet steps (decode, verify, commit) and the fla prefill path.

CPU tests: the decode reference is the layer's former T = 1 path bit for bit and agrees with a
float64 re-derivation written token by token and head by head, as do the verify / commit
references (commit = that many decode steps); bad shapes raise; CPU never touches the
extension or fla. `cuda` verify / commit tests: kernels against references and float64 with
per-row counts 0..T, the kernel's commit equal to its own decode steps bit for bit, a captured
verify + commit replayed. `cuda` tests: the kernel against the torch reference (and float64) over several shapes,
batches and dtypes, with non-contiguous slots, untouched slots left alone, outputs poisoned with
NaN, 20 steps replayed from a CUDA graph; fla's chunked kernel against `gated_delta_rule_chunked`
(skipped where fla is not importable). They need ninfer_core._C built (scripts/gpu_check.sh).

The conv inputs are multiples of 1/16 (weights of 1/32) in a small range: every conv sum is exact
in fp32 whatever its order, so kernel and reference round the same conv outputs to the model dtype
and differences stay at fp32 rounding instead of an occasional bf16 step in v.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from ninfer_core.layers.gdn import (
    GatedDeltaNet,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
    heads_and_gates,
    qkv_parts,
    l2norm,
)
from ninfer_core.ops import dispatch
from ninfer_core.ops import gdn as gdn_ops
from kernel_stub import record_kernel_calls
from test_cpu_kernels import isa  # noqa: F401  (the fixture: every instruction set)

torch.set_num_threads(1)  # small tensors: thread start-up dominates and cores are shared

EPS = 1e-6
SHAPE_35B = (16, 32, 128, 128, 4)  # (Hk, Hv, dk, dv, K)
SHAPE_27B = (16, 48, 128, 128, 4)
SMALL_ODD = (2, 6, 32, 32, 4)
# Output tolerance, kernel vs reference: o rounds to the dtype before three more roundings in the
# norm, so an fp32-level difference in o can end a few ulps apart. fp32 rounds nothing.
OUT_TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}


def _grid(gen: torch.Generator, shape: tuple[int, ...], step: float, limit: float) -> torch.Tensor:
    """Random nonzero multiples of `step` in [-limit, limit] (exactly representable in bf16)."""
    units = (torch.randn(shape, generator=gen) * (limit / 2 / step)).round().clamp(-limit / step, limit / step)
    return torch.where(units == 0, 1.0, units) * step


def step_inputs(shape, batch: int, dtype: torch.dtype, device, gen: torch.Generator,
                tokens: int | None = None) -> dict[str, torch.Tensor]:
    """The projections qkv, a, b, z of one token ([B, ...]) or of `tokens` tokens ([B, T, ...])."""
    hk, hv, dk, dv, _ = shape
    lead = (batch,) if tokens is None else (batch, tokens)
    return {
        "qkv": _grid(gen, (*lead, 2 * hk * dk + hv * dv), 1 / 16, 4).to(dtype).to(device),
        "a": torch.randn(*lead, hv, generator=gen).to(dtype).to(device),
        "b": torch.randn(*lead, hv, generator=gen).to(dtype).to(device),
        "z": torch.randn(*lead, hv * dv, generator=gen).to(dtype).to(device),
    }


def make_case(shape, batch: int, dtype: torch.dtype, device="cpu", seed: int = 0, tokens: int | None = None) -> dict:
    """The ops' arguments (qkv, a, b, z, pools, slots, w): pools of 2B + 3 slots, B distinct
    unordered slots taken as a stride-2 view (non-contiguous), random weights, fp32 state; one
    token ([B, ...], gdn_decode_step) or `tokens` ([B, T, ...], gdn_verify / gdn_commit)."""
    hk, hv, dk, dv, taps = shape
    channels = 2 * hk * dk + hv * dv
    num_slots = 2 * batch + 3
    gen = torch.Generator().manual_seed(seed)

    def param(x: torch.Tensor) -> torch.Tensor:
        return x.to(dtype).to(device)

    return {
        **step_inputs(shape, batch, dtype, device, gen, tokens),
        "conv_pool": param(_grid(gen, (num_slots, channels, taps - 1), 1 / 16, 4)),
        "state_pool": (torch.randn(num_slots, hv, dk, dv, generator=gen) * 0.5).to(device),
        "slots": torch.randperm(num_slots, generator=gen).to(device)[: 2 * batch : 2],
        "w": gdn_ops.GDNWeights(
            conv_weight=param(_grid(gen, (channels, taps), 1 / 32, 1)),
            A_log=param(torch.randn(hv, generator=gen) * 0.5),
            dt_bias=param(torch.randn(hv, generator=gen) * 0.5),
            norm_weight=param(1 + 0.2 * torch.randn(dv, generator=gen)),
            eps=EPS, num_k_heads=hk, head_k_dim=dk, head_v_dim=dv,
        ),
    }


def with_pool_copies(case: dict) -> dict:
    return {**case, "conv_pool": case["conv_pool"].clone(), "state_pool": case["state_pool"].clone()}


def without_z(case: dict) -> dict:
    """gdn_commit's arguments: the case without z (counts added by the caller)."""
    return {k: v for k, v in case.items() if k != "z"}


def steps_f64(case: dict, counts: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, new conv pool, new state pool) in float64, token by token and one value head at a
    time: out has every token's output (from the state advanced through all tokens); row b's
    pools advance through counts[b] tokens (all by default). One-token cases ([B, C]) give out
    [B, Hv*dv], multi-token ones [B, T, Hv*dv].

    Rounds only where the op defines it: the SiLU output (fp32) goes to the model dtype."""
    one = case["qkv"].dim() == 2
    dtype = case["qkv"].dtype
    w = case["w"]
    hk, dk, dv = w.num_k_heads, w.head_k_dim, w.head_v_dim
    qkv, a, b, z = (case[n].detach().double().cpu() for n in ("qkv", "a", "b", "z"))
    if one:
        qkv, a, b, z = (t[:, None] for t in (qkv, a, b, z))
    conv_w, A_log, dt_bias, norm_w = (t.detach().double().cpu() for t in (w.conv_weight, w.A_log, w.dt_bias,
                                                                          w.norm_weight))
    slots = case["slots"].cpu()
    conv_pool, state_pool = case["conv_pool"].double().cpu(), case["state_pool"].double().cpu()
    batch, tokens, hv = a.shape
    counts = [tokens] * batch if counts is None else counts
    conv, state = conv_pool[slots], state_pool[slots]
    new_conv, new_state = conv.clone(), state.clone()
    out = torch.empty(batch, tokens, hv, dv, dtype=torch.float64)
    for t in range(tokens):
        window = torch.cat((conv, qkv[:, t, :, None]), dim=-1)  # [B, C, K]
        conv = window[:, :, 1:]
        mixed = F.silu((window * conv_w).sum(-1).float()).to(dtype).double()
        q, k = (mixed[:, i * hk * dk : (i + 1) * hk * dk].reshape(batch, hk, dk) for i in (0, 1))
        q = q / (q.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt() / dk**0.5
        k = k / (k.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
        v = mixed[:, 2 * hk * dk :].reshape(batch, hv, dv)
        decay = torch.exp(-A_log.exp() * torch.log1p((a[:, t] + dt_bias).exp()))
        beta = 1 / (1 + (-b[:, t]).exp())
        for h in range(hv):
            kh = h // (hv // hk)
            s = state[:, h] * decay[:, h, None, None]
            u = beta[:, h, None] * (v[:, h] - torch.einsum("bkv,bk->bv", s, k[:, kh]))
            s = s + k[:, kh, :, None] * u[:, None, :]
            state[:, h] = s
            o = torch.einsum("bkv,bk->bv", s, q[:, kh])
            gate = z[:, t].reshape(batch, hv, dv)[:, h]
            out[:, t, h] = (o / (o.pow(2).mean(-1, keepdim=True) + w.eps).sqrt() * norm_w * gate
                            * torch.sigmoid(gate))
        for r in range(batch):
            if counts[r] == t + 1:
                new_conv[r], new_state[r] = conv[r], state[r]
    conv_pool[slots], state_pool[slots] = new_conv, new_state
    out = out.reshape(batch, tokens, -1)
    return (out[:, 0] if one else out), conv_pool, state_pool


def assert_rel(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """max |actual - expected| <= tol * max |expected|."""
    err = (actual.double().cpu() - expected.double().cpu()).abs().max().item()
    scale = expected.double().abs().max().item()
    assert err <= tol * scale, f"max abs error {err:.3g} > {tol} * scale {scale:.3g}"


def _config(shape, hidden: int = 48) -> SimpleNamespace:
    hk, hv, dk, dv, taps = shape
    return SimpleNamespace(
        linear_num_key_heads=hk,
        linear_num_value_heads=hv,
        linear_key_head_dim=dk,
        linear_value_head_dim=dv,
        linear_conv_kernel_dim=taps,
        hidden_size=hidden,
        rms_eps=EPS,
    )


# ---------------------------------------------------------------- CPU: the reference


def test_layer_weights_are_made_once_and_again_after_a_move():
    """`weights` (the ops' view of the parameters) is one object while they stay where they are, and
    is made again when a parameter's data moves: `to` swaps a Parameter's data in place, so a cached
    view of the conv weight would keep reading the old tensor."""
    layer = GatedDeltaNet(_config((2, 4, 16, 8, 4)))
    first = layer.weights
    assert layer.weights is first
    layer.to(torch.float64)
    moved = layer.weights
    assert moved is not first and moved.conv_weight.dtype == torch.float64
    assert moved.conv_weight.data_ptr() == layer.conv1d.weight.data_ptr()
    assert torch.equal(moved.conv_weight, layer.conv1d.weight[:, 0]) and moved.A_log is layer.A_log
    assert moved.norm_weight is layer.norm.weight and moved.dt_bias is layer.dt_bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reference_is_the_layer_t1_path(dtype, monkeypatch):
    """forward(T=1) now goes through ops.gdn.gdn_decode_step: bit for bit the former path (the
    reference's; the CPU kernel, fp32, is tested against it below)."""
    monkeypatch.setenv(dispatch.DISABLE_ENV, "1")
    torch.manual_seed(0)
    shape = (2, 4, 16, 8, 4)
    layer = GatedDeltaNet(_config(shape)).to(dtype)
    with torch.no_grad():
        for p in (layer.A_log, layer.dt_bias, layer.norm.weight):
            p.normal_(0.5, 0.5)
    case = make_case(shape, 3, dtype)
    conv_pool, state_pool, slots = case["conv_pool"], case["state_pool"], case["slots"]
    x = torch.randn(3, 1, 48).to(dtype)
    with torch.no_grad():
        want_pool = conv_pool.clone()
        want, want_state = layer._mix(x, want_pool, slots, state_pool[slots], delta_rule=gated_delta_rule_recurrent)
        want_conv = want_pool[slots]
        before_conv, before_state = conv_pool.clone(), state_pool.clone()
        got = layer(x, conv_pool, state_pool, slots)
    assert torch.equal(got, want)
    assert torch.equal(conv_pool[slots], want_conv) and torch.equal(state_pool[slots], want_state)
    untouched = torch.ones(conv_pool.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(conv_pool[untouched], before_conv[untouched])
    assert torch.equal(state_pool[untouched], before_state[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [SMALL_ODD, (1, 3, 16, 8, 3), (2, 2, 32, 64, 2)], ids=str)
def test_reference_matches_float64(shape, dtype):
    case = make_case(shape, 3, dtype, seed=sum(shape))
    want_out, want_conv, want_state = steps_f64(case)
    out = gdn_ops.gdn_decode_step_ref(**case)
    assert out.dtype == dtype and out.shape == want_out.shape
    assert torch.equal(case["conv_pool"].double(), want_conv)
    assert_rel(case["state_pool"], want_state, 1e-5)
    if dtype == torch.float32:
        assert_rel(out, want_out, 1e-5)
    else:
        torch.testing.assert_close(out.double(), want_out, rtol=2e-2, atol=2e-2)


def test_op_on_cpu_is_the_reference(monkeypatch):
    """CPU tensors run the reference even with an extension around (a stand-in that fails if called)."""
    monkeypatch.delenv(dispatch.DISABLE_ENV, raising=False)
    monkeypatch.setattr(dispatch, "extension", lambda: pytest.fail("extension used for CPU tensors"))
    case = make_case(SMALL_ODD, 2, torch.bfloat16)
    ref = with_pool_copies(case)
    out = torch.full((2, 6 * 32), float("nan"), dtype=torch.bfloat16)
    assert gdn_ops.gdn_decode_step(**case, out=out) is out
    assert torch.equal(out, gdn_ops.gdn_decode_step_ref(**ref))
    assert torch.equal(case["state_pool"], ref["state_pool"]) and torch.equal(case["conv_pool"], ref["conv_pool"])


def test_kernel_call_passes_each_tensor_in_its_place(monkeypatch):
    """The CUDA branch of the dispatch, run on the CPU against a stand-in extension that records
    the call: every tensor reaches the binding argument it belongs to, the inputs as the views they
    are (the binding reads sizes and strides from them; a swap here would only show as wrong
    numbers on a GPU)."""
    calls = record_kernel_calls(monkeypatch, "gdn_steps")
    monkeypatch.setattr(gdn_ops, "_kernel_applies", lambda step, w: True)
    case = make_case(SMALL_ODD, 2, torch.bfloat16, tokens=3)
    counts = torch.tensor([1, 3])
    gdn_ops.gdn_commit(case["qkv"], case["a"], case["b"], case["conv_pool"], case["state_pool"], case["slots"],
                       counts, case["w"])
    out = gdn_ops.gdn_verify(case["qkv"], case["a"], case["b"], case["z"], case["conv_pool"], case["state_pool"],
                             case["slots"], case["w"])
    commit, verify = calls
    for kw in calls:
        for name in ("qkv", "a", "b", "conv_pool", "state_pool"):
            assert kw[name] is case[name], name
        for name in ("conv_weight", "A_log", "dt_bias", "norm_weight"):
            assert kw[name] is getattr(case["w"], name), name
        # the slots, a strided view, as a contiguous int64 copy (the kernel indexes them)
        assert kw["slots"].is_contiguous() and torch.equal(kw["slots"], case["slots"])
        assert kw["offsets"] is None and kw["fork_slots"] is None and kw["width"] is None
        assert kw["q_scale"] == SMALL_ODD[2] ** -0.5 and kw["eps"] == EPS and kw["stream"] == 7
        scratch = kw["scratch"]
        assert scratch.dtype == torch.float32 and scratch.numel() == 2 * (3 * case["qkv"].shape[-1] + 6)
    assert commit["write_state"] and commit["out"] is None and commit["z"] is None
    assert commit["counts"] is counts and verify["counts"] is None
    assert not verify["write_state"] and verify["out"] is out and verify["z"] is case["z"]


def test_bad_shapes_raise():
    case = make_case(SMALL_ODD, 2, torch.float32)
    with pytest.raises(ValueError, match="qkv width"):
        gdn_ops.gdn_decode_step(**{**case, "w": replace(case["w"], head_k_dim=16)})
    with pytest.raises(ValueError, match="not a multiple"):
        gdn_ops.gdn_decode_step(**{**case, "w": replace(case["w"], num_k_heads=4)})
    with pytest.raises(ValueError, match="z has shape"):
        gdn_ops.gdn_decode_step(**{**case, "z": case["z"][:, :-1]})
    with pytest.raises(ValueError, match="state_pool has shape"):
        gdn_ops.gdn_decode_step(**{**case, "state_pool": case["state_pool"][:-1]})
    with pytest.raises(ValueError, match="slots has shape"):
        gdn_ops.gdn_decode_step(**{**case, "slots": case["slots"][:1]})
    with pytest.raises(ValueError, match="out must be"):
        gdn_ops.gdn_decode_step(**case, out=torch.empty(2, 6 * 32, dtype=torch.float16))


def test_prefill_on_cpu_is_the_reference(monkeypatch):
    monkeypatch.setattr(gdn_ops, "_fla_chunk", lambda: pytest.fail("fla looked up for CPU tensors"))
    q, k, v, g, beta, state = _prefill_inputs((2, 4, 16, 8), 70, torch.float32, "cpu")
    got = gdn_ops.gated_delta_rule_prefill(q, k, v, g, beta, state)
    want = gated_delta_rule_chunked(q, k, v, g, beta, state)
    assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))


# ---------------------------------------------------------------- CPU: verify / commit references

COUNTS = [0, 1, 3, 5]  # tokens kept per row after a 5-token verify: none, some, all


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [SMALL_ODD, (1, 3, 16, 8, 3)], ids=str)
def test_verify_and_commit_references_match_float64(shape, dtype):
    case = make_case(shape, 4, dtype, seed=11, tokens=5)
    before = with_pool_copies(case)
    out = gdn_ops.gdn_verify_ref(**case)
    assert torch.equal(case["conv_pool"], before["conv_pool"]) and torch.equal(case["state_pool"], before["state_pool"])
    want_out, want_conv, want_state = steps_f64(before, COUNTS)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), want_out, rtol=tol, atol=tol)
    gdn_ops.gdn_commit_ref(**without_z(case), counts=torch.tensor(COUNTS))
    assert torch.equal(case["conv_pool"].double(), want_conv)
    assert_rel(case["state_pool"], want_state, 1e-5)


def _decoded_through_counts(case: dict, decode_step) -> dict:
    """A copy of a multi-token case whose pools went through row r's first COUNTS[r] tokens by
    `decode_step` calls, one token at a time."""
    decoded = with_pool_copies(case)
    for t in range(case["qkv"].shape[1]):
        rows = [r for r, n in enumerate(COUNTS) if n > t]
        one = {n: decoded[n][rows, t] for n in ("qkv", "a", "b", "z")}
        decode_step(**{**decoded, **one, "slots": decoded["slots"][rows]})
    return decoded


def test_verify_recorded_keeps_no_activations_off_the_cuda_kernel():
    """Off the CUDA kernel (the CPU's kernel or the reference) a verify has no kernel activations to keep:
    the recorded verify is the plain one, and its commit recomputes the conv (`act` None)."""
    case = make_case(SMALL_ODD, 2, torch.float32, seed=9, tokens=3)
    again = with_pool_copies(case)
    out, act = gdn_ops.gdn_verify_recorded(**case)
    assert act is None and torch.equal(out, gdn_ops.gdn_verify(**again))


def test_commit_reference_is_decode_steps():
    """Committing n tokens = n decode steps of the reference (up to fp32 rounding: one pass over the
    tokens vs one call per token); other slots untouched."""
    case = make_case(SMALL_ODD, 4, torch.float32, seed=12, tokens=5)
    decoded = _decoded_through_counts(case, gdn_ops.gdn_decode_step_ref)
    before = with_pool_copies(case)
    gdn_ops.gdn_commit_ref(**without_z(case), counts=torch.tensor(COUNTS))
    assert torch.equal(case["conv_pool"], decoded["conv_pool"])
    torch.testing.assert_close(case["state_pool"], decoded["state_pool"], atol=1e-6, rtol=1e-6)
    assert not torch.equal(case["state_pool"], before["state_pool"])


def test_verify_and_commit_check_shapes():
    case = make_case(SMALL_ODD, 2, torch.float32, tokens=3)
    with pytest.raises(ValueError, match="z has shape"):
        gdn_ops.gdn_verify(**{**case, "z": case["z"][:, :2]})
    with pytest.raises(ValueError, match="counts has shape"):
        gdn_ops.gdn_commit(**without_z(case), counts=torch.tensor([1]))
    with pytest.raises(ValueError, match="token axis"):
        gdn_ops.gdn_verify(**{**case, "qkv": case["qkv"][:, 0]})


# ---------------------------------------------------------------- CPU: the CPU kernel (fp32)

cpu_kernel = pytest.mark.skipif(dispatch.cpu_extension() is None, reason="ninfer_core._cpu not built")
CPU_SHAPES = [SHAPE_35B, SMALL_ODD, (1, 3, 16, 8, 3), (2, 4, 256, 256, 4), (1, 2, 32, 224, 8), (3, 3, 40, 20, 2)]


@pytest.fixture
def cpu_gdn_calls(monkeypatch) -> list[tuple]:
    """The CPU extension's gdn_steps calls (passed on to it): a test sees that the kernel ran."""
    monkeypatch.delenv(dispatch.DISABLE_ENV, raising=False)
    ext, calls = dispatch.cpu_extension(), []

    def gdn_steps(*args):
        calls.append(args)
        return ext.gdn_steps(*args)

    monkeypatch.setattr(dispatch, "cpu_extension", lambda: SimpleNamespace(gdn_steps=gdn_steps))
    return calls


def _merged(case: dict) -> dict:
    """case's qkv / z / b / a as slices of one projection [B, (T,) C + Hv*dv + 2 Hv] (in_proj's output),
    which the kernel reads in place."""
    names = ("qkv", "z", "b", "a")
    views = torch.cat([case[n] for n in names], dim=-1).split([case[n].shape[-1] for n in names], dim=-1)
    return {**case, **dict(zip(names, views, strict=True))}


@cpu_kernel
@pytest.mark.usefixtures("isa")
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("shape", CPU_SHAPES, ids=str)
def test_cpu_kernel_decode_matches_reference_and_float64(cpu_gdn_calls, shape, batch):
    case = _merged(make_case(shape, batch, torch.float32, seed=batch))
    before, ref = with_pool_copies(case), with_pool_copies(case)
    out = torch.full(case["z"].shape, float("nan"))
    assert gdn_ops.gdn_decode_step(**case, out=out) is out
    assert len(cpu_gdn_calls) == 1
    assert [cpu_gdn_calls[0][i] for i in (1, 2, 3, 4)] == [case[n].data_ptr() for n in ("qkv", "a", "b", "z")]
    _check_step(case, before, out, ref, gdn_ops.gdn_decode_step_ref(**ref))


@cpu_kernel
@pytest.mark.usefixtures("isa")
@pytest.mark.parametrize("shape", [SHAPE_35B, SMALL_ODD, (1, 3, 16, 8, 3), (3, 3, 40, 20, 2)], ids=str)
def test_cpu_kernel_verify_and_commit(cpu_gdn_calls, shape):
    """A 5-token verify leaves the pools; a commit of 0 / 1 / 3 / 5 tokens per row advances each row
    that far (float64 and the references), other slots untouched."""
    case = _merged(make_case(shape, 4, torch.float32, seed=3, tokens=5))
    before, ref = with_pool_copies(case), with_pool_copies(case)
    out = gdn_ops.gdn_verify(**case)
    assert torch.equal(case["conv_pool"], before["conv_pool"])
    assert torch.equal(case["state_pool"], before["state_pool"])
    want_out, want_conv, want_state = steps_f64(before, COUNTS)
    assert_rel(out, want_out, 1e-5)
    assert_rel(out, gdn_ops.gdn_verify_ref(**ref), 1e-5)
    counts = torch.tensor(COUNTS)
    gdn_ops.gdn_commit(**without_z(case), counts=counts)
    gdn_ops.gdn_commit_ref(**without_z(ref), counts=counts)
    assert len(cpu_gdn_calls) == 2
    assert torch.equal(case["conv_pool"], ref["conv_pool"]) and torch.equal(case["conv_pool"].double(), want_conv)
    assert_rel(case["state_pool"], want_state, 1e-5)
    assert_rel(case["state_pool"], ref["state_pool"], 1e-5)
    untouched = torch.ones(case["state_pool"].shape[0], dtype=torch.bool)
    untouched[case["slots"]] = False
    assert torch.equal(case["state_pool"][untouched], before["state_pool"][untouched])


@cpu_kernel
def test_cpu_kernel_commit_is_its_decode_steps(cpu_gdn_calls):
    """Committing n tokens = n decode steps of the kernel, to the bit (the same per-token math)."""
    case = make_case(SMALL_ODD, 4, torch.float32, seed=12, tokens=5)
    decoded = _decoded_through_counts(case, gdn_ops.gdn_decode_step)
    gdn_ops.gdn_commit(**without_z(case), counts=torch.tensor(COUNTS))
    assert len(cpu_gdn_calls) == 6
    assert torch.equal(case["conv_pool"], decoded["conv_pool"])
    assert torch.equal(case["state_pool"], decoded["state_pool"])


@cpu_kernel
@pytest.mark.usefixtures("isa")
def test_cpu_stepped_prefill_matches_float64(cpu_gdn_calls):
    """A 40-token prefill of 2 rows as fused steps (16 tokens a call, cut at checkpoints 7 and 40):
    float64's outputs and pools, each checkpoint's slots holding the pools after its tokens."""
    case = make_case(SMALL_ODD, 2, torch.float32, seed=9, tokens=40)
    before = with_pool_copies(case)
    fork_slots = {7: torch.tensor([5, 6]), 40: torch.tensor([0, 1])}  # 7 slots, the rows' 2 and 4
    assert case["slots"].tolist() == [2, 4]
    args = {k: case[k] for k in ("qkv", "a", "b", "z", "conv_pool", "state_pool", "slots", "w")}
    out = gdn_ops.gdn_prefill_stepped(**args, cuts=list(fork_slots.items()))
    assert len(cpu_gdn_calls) == len(sorted({0, 7, 16, 32, 40})) - 1
    want_out, want_conv, want_state = steps_f64(before)
    assert_rel(out, want_out, 1e-5)
    assert torch.equal(case["conv_pool"][case["slots"]].double(), want_conv[case["slots"]])
    assert_rel(case["state_pool"][case["slots"]], want_state[case["slots"]], 1e-5)
    for at, slots in fork_slots.items():
        _, at_conv, at_state = steps_f64(before, [at, at])
        assert torch.equal(case["conv_pool"][slots].double(), at_conv[case["slots"]])
        assert_rel(case["state_pool"][slots], at_state[case["slots"]], 1e-5)


@cpu_kernel
def test_cpu_kernel_threads_give_the_same_bits(cpu_gdn_calls):
    """Work items do not depend on the thread count (a conv block, a value head: each on one thread)."""
    results = []
    for threads in (1, 2, 3):
        case = make_case(SHAPE_35B, 2, torch.float32, seed=5, tokens=3)
        with torch.inference_mode():
            torch.set_num_threads(threads)
            try:
                results.append((gdn_ops.gdn_verify(**case), case["state_pool"]))
                gdn_ops.gdn_commit(**without_z(case), counts=torch.tensor([2, 3]))
            finally:
                torch.set_num_threads(1)
    assert all(torch.equal(r[0], results[0][0]) and torch.equal(r[1], results[0][1]) for r in results)
    assert [call[-1] for call in cpu_gdn_calls] == [1, 1, 2, 2, 3, 3]  # the threads argument


@cpu_kernel
def test_cpu_kernel_takes_only_fp32_decode_verify_commit(cpu_gdn_calls):
    """bf16 models and a forked prefill's tail run the reference on the CPU; the binding rejects
    what its stack buffers cannot hold."""
    case = make_case(SMALL_ODD, 2, torch.bfloat16)
    gdn_ops.gdn_decode_step(**case)
    case = make_case(SMALL_ODD, 2, torch.float32, tokens=4)
    out = torch.zeros_like(case["z"])
    gdn_ops.gdn_prefill_tail(case["qkv"], case["a"], case["b"], case["z"], case["conv_pool"], case["state_pool"],
                             case["slots"], case["w"], offsets=torch.tensor([1, 0]), counts=torch.tensor([3, 2]),
                             fork_slots=torch.tensor([0, 1]), width=3, out=out)
    assert cpu_gdn_calls == []
    with pytest.raises(ValueError, match="1-16 tokens"):
        dispatch.cpu_extension().gdn_steps(*[0] * 13, 1, 17, 2, 6, 32, 32, 4, 1, 1, 1, 0.1, 1e-6, True, 1)


# ---------------------------------------------------------------- GPU: the CUDA kernel

GPU_SHAPES = [
    SHAPE_35B,
    SHAPE_27B,
    SMALL_ODD,
    (1, 3, 64, 96, 3),  # dk != dv, a whole head of 12 warps a block, odd K
    (2, 4, 256, 256, 4),  # largest heads: 16 rows per lane, 8 column blocks
    (3, 3, 160, 32, 2),  # rows per lane not a power of two, one column block (the whole head), K = 2
    (1, 2, 32, 224, 8),  # widest conv (8 taps), 7 column blocks (a head wider than a block)
]


@pytest.fixture
def cuda_kernels(monkeypatch):
    monkeypatch.delenv(dispatch.DISABLE_ENV, raising=False)
    assert dispatch.extension() is not None, (
        "CUDA is available but ninfer_core._C is not built: run scripts/gpu_check.sh"
    )


def _kernel_args(case: dict) -> tuple:
    """_kernel_applies' arguments for a one-token case."""
    qkv, a, b, z = (case[n][:, None] for n in ("qkv", "a", "b", "z"))
    return gdn_ops.GDNStepInputs(qkv, a, b, z, case["conv_pool"], case["state_pool"], case["slots"]), case["w"]


def _check_step(case: dict, before: dict, out: torch.Tensor, ref_case: dict, ref_out: torch.Tensor) -> None:
    """Kernel step (case's pools, out) against the reference step (ref_case's pools, ref_out) and
    float64 from the pools before the step; slots outside case["slots"] keep their contents."""
    dtype = out.dtype
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref_out, rtol=OUT_TOL[dtype], atol=OUT_TOL[dtype])
    assert torch.equal(case["conv_pool"], ref_case["conv_pool"])  # exact copies of bf16 inputs
    torch.testing.assert_close(
        case["state_pool"], ref_case["state_pool"], rtol=1e-5, atol=1e-5 * ref_case["state_pool"].abs().max().item()
    )
    untouched = torch.ones(case["state_pool"].shape[0], dtype=torch.bool, device=out.device)
    untouched[case["slots"]] = False
    assert torch.equal(case["state_pool"][untouched], before["state_pool"][untouched])
    assert torch.equal(case["conv_pool"][untouched], before["conv_pool"][untouched])
    # float64: the reference rounds SiLU outputs on the GPU, float64 on the CPU; a rare one-ulp
    # difference there moves a state column by ~1e-3 of the scale, hence the looser bounds.
    want_out, _, want_state = steps_f64(before)
    assert_rel(case["state_pool"], want_state, 1e-5 if dtype == torch.float32 else 2e-3)
    torch.testing.assert_close(out.double().cpu(), want_out, rtol=2 * OUT_TOL[dtype], atol=2 * OUT_TOL[dtype])


@pytest.mark.cuda
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_kernel_matches_reference(cuda_kernels, shape, batch):
    _run_kernel_case(shape, batch, torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [SHAPE_35B, SMALL_ODD], ids=str)
def test_kernel_other_dtypes(cuda_kernels, shape, dtype):
    _run_kernel_case(shape, 3, dtype)


@pytest.mark.cuda
def test_kernel_batch_64(cuda_kernels):
    _run_kernel_case(SHAPE_35B, 64, torch.bfloat16)


def whole_head_batch(shape) -> int:
    """The smallest batch whose B * Hv heads fill the GPU's SMs: the recurrent kernel's blocks then
    hold whole heads (where dk, dv <= 128) and apply the gated norm in shared memory."""
    return -(-torch.cuda.get_device_properties(0).multi_processor_count // shape[1])


@pytest.mark.cuda
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_kernel_at_batches_that_fill_the_sms(cuda_kernels, shape):
    _run_kernel_case(shape, whole_head_batch(shape), torch.bfloat16)


def _run_kernel_case(shape, batch: int, dtype: torch.dtype) -> None:
    case = make_case(shape, batch, dtype, "cuda", seed=batch + sum(shape))
    assert not case["slots"].is_contiguous() or batch == 1
    assert gdn_ops._kernel_applies(*_kernel_args(case))
    before, ref_case = with_pool_copies(case), with_pool_copies(case)
    out = torch.full_like(case["z"], float("nan"))
    assert gdn_ops.gdn_decode_step(**case, out=out) is out
    ref_out = gdn_ops.gdn_decode_step_ref(**ref_case)
    _check_step(case, before, out, ref_case, ref_out)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [SHAPE_35B, SMALL_ODD], ids=str)
def test_kernel_steps_in_cuda_graph(cuda_kernels, shape):
    """Captured once, replayed for 20 tokens with fresh inputs: each step and the pools after it
    stay close to the reference stepping its own copy of the pools."""
    batch, dtype = 3, torch.bfloat16
    case = make_case(shape, batch, dtype, "cuda", seed=5)
    ref_case = with_pool_copies(case)
    out = torch.empty_like(case["z"])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside capture: the first of the steps
        gdn_ops.gdn_decode_step(**case, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    torch.testing.assert_close(out, gdn_ops.gdn_decode_step_ref(**ref_case), rtol=OUT_TOL[dtype], atol=OUT_TOL[dtype])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gdn_ops.gdn_decode_step(**case, out=out)
    gen = torch.Generator().manual_seed(6)
    for _ in range(20):
        fresh = step_inputs(shape, batch, dtype, "cuda", gen)
        for name, value in fresh.items():
            case[name].copy_(value)
            ref_case[name] = value
        before = with_pool_copies(case)
        out.fill_(float("nan"))
        graph.replay()
        ref_out = gdn_ops.gdn_decode_step_ref(**ref_case)
        torch.cuda.synchronize()
        _check_step(case, before, out, ref_case, ref_out)
        ref_case = with_pool_copies(case)  # next step from the same pools: per-step errors only


@pytest.mark.cuda
def test_kernel_state_drift_over_20_steps(cuda_kernels):
    """Kernel and reference each advance their own pools for 20 tokens: the states stay close."""
    batch, dtype = 8, torch.bfloat16
    case = make_case(SHAPE_35B, batch, dtype, "cuda", seed=7)
    ref_case = with_pool_copies(case)
    gen = torch.Generator().manual_seed(8)
    for _ in range(20):
        fresh = step_inputs(SHAPE_35B, batch, dtype, "cuda", gen)
        out = gdn_ops.gdn_decode_step(**{**case, **fresh})
        ref_out = gdn_ops.gdn_decode_step_ref(**{**ref_case, **fresh})
        torch.testing.assert_close(out, ref_out, rtol=OUT_TOL[dtype], atol=OUT_TOL[dtype])
    assert torch.equal(case["conv_pool"], ref_case["conv_pool"])
    assert_rel(case["state_pool"], ref_case["state_pool"], 1e-4)


@pytest.mark.cuda
def test_unsupported_shapes_fall_back(cuda_kernels):
    """No kernel for dk = 48 or float64: the op runs the reference instead of failing."""
    for shape, dtype in (((2, 4, 48, 32, 4), torch.bfloat16), (SMALL_ODD, torch.float64)):
        case = make_case(shape, 3, dtype, "cuda")
        if dtype == torch.float64:
            case["state_pool"] = case["state_pool"].double()
        assert not gdn_ops._kernel_applies(*_kernel_args(case))
        ref_case = with_pool_copies(case)
        assert torch.equal(gdn_ops.gdn_decode_step(**case), gdn_ops.gdn_decode_step_ref(**ref_case))
        assert torch.equal(case["state_pool"], ref_case["state_pool"])


# ---------------------------------------------------------------- GPU: verify / commit kernels


@pytest.mark.cuda
@pytest.mark.parametrize("fill", [False, True], ids=["batch4", "fill_sms"])
@pytest.mark.parametrize("tokens", [2, 4, 16])
@pytest.mark.parametrize("shape", [SHAPE_35B, SMALL_ODD, (1, 3, 64, 96, 3), (2, 4, 256, 256, 4)], ids=str)
def test_verify_and_commit_kernels(cuda_kernels, shape, tokens, fill):
    """Verify: every token's output against the reference and float64, pools untouched (bitwise).
    Commit with per-row counts (0, 1, some, all): pools against the reference and float64. At 4
    rows, and at a batch that fills the SMs (whole-head blocks)."""
    batch, dtype = max(4, whole_head_batch(shape)) if fill else 4, torch.bfloat16
    case = make_case(shape, batch, dtype, "cuda", seed=tokens + sum(shape), tokens=tokens)
    before, ref_case = with_pool_copies(case), with_pool_copies(case)
    out = gdn_ops.gdn_verify(**case)
    assert torch.equal(case["conv_pool"], before["conv_pool"]) and torch.equal(case["state_pool"], before["state_pool"])
    assert not out.isnan().any()
    torch.testing.assert_close(out, gdn_ops.gdn_verify_ref(**ref_case), rtol=OUT_TOL[dtype], atol=OUT_TOL[dtype])
    counts = [0, 1, tokens // 2 + 1] + [tokens] * (batch - 3)
    want_out, want_conv, want_state = steps_f64(before, counts)
    torch.testing.assert_close(out.double().cpu(), want_out, rtol=2 * OUT_TOL[dtype], atol=2 * OUT_TOL[dtype])
    device_counts = torch.tensor(counts, device="cuda")
    gdn_ops.gdn_commit(**without_z(case), counts=device_counts)
    gdn_ops.gdn_commit_ref(**without_z(ref_case), counts=device_counts)
    assert torch.equal(case["conv_pool"], ref_case["conv_pool"])
    assert torch.equal(case["conv_pool"].double().cpu(), want_conv)
    assert_rel(case["state_pool"], ref_case["state_pool"], 1e-5)
    assert_rel(case["state_pool"], want_state, 2e-3)
    untouched = torch.ones(case["state_pool"].shape[0], dtype=torch.bool, device="cuda")
    untouched[case["slots"][1:]] = False  # row 0 keeps 0 tokens: its slot is untouched too
    assert torch.equal(case["state_pool"][untouched], before["state_pool"][untouched])
    assert torch.equal(case["conv_pool"][untouched], before["conv_pool"][untouched])


@pytest.mark.cuda
@pytest.mark.parametrize("fill", [False, True], ids=["batch4", "fill_sms"])
@pytest.mark.parametrize("tokens", [2, 4, 16])
@pytest.mark.parametrize("shape", [SHAPE_35B, SMALL_ODD, (1, 3, 64, 96, 3), (2, 4, 256, 256, 4)], ids=str)
def test_commit_from_the_verify_activations_is_the_recomputing_commit(cuda_kernels, shape, tokens, fill):
    """A commit given its verify's activations (`gdn_verify_recorded`) runs the recurrent kernel alone,
    which also moves the conv states on: the pools bit-equal to those of the commit that runs the conv
    again, per-row counts 0, 1, some, all; the verify's outputs the same as `gdn_verify`'s."""
    from torch.profiler import ProfilerActivity, profile

    batch = max(4, whole_head_batch(shape)) if fill else 4
    case = make_case(shape, batch, torch.bfloat16, "cuda", seed=tokens + sum(shape) + 1, tokens=tokens)
    case["slots"] = case["slots"].contiguous()  # as the engine's: no index copy beside the counted kernel
    again = with_pool_copies(case)
    out, act = gdn_ops.gdn_verify_recorded(**case)
    assert act is not None and torch.equal(out, gdn_ops.gdn_verify(**again))
    counts = torch.tensor([0, 1, tokens // 2 + 1] + [tokens] * (batch - 3), device="cuda")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        gdn_ops.gdn_commit(**without_z(case), counts=counts, act=act)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1 and "gdn_recurrent_kernel" in kernels[0], kernels
    gdn_ops.gdn_commit(**without_z(again), counts=counts)
    assert torch.equal(case["conv_pool"], again["conv_pool"])
    assert torch.equal(case["state_pool"], again["state_pool"])


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("tokens", [None, 4], ids=["decode", "verify"])
@pytest.mark.parametrize("shape", [SHAPE_35B, (2, 4, 64, 64, 4)], ids=str)
def test_split_head_norm_equals_whole_head_norm_bitwise(cuda_kernels, shape, tokens, rows):
    """A head split over blocks of 32 columns gets its gated norm from a thread block cluster (sm_90+,
    a grid of at most one block an SM: the 35B's batch 1) or from its last block (the 35B's batch 3,
    older GPUs): either way bit-equal to a block holding the whole head, so a sequence's outputs and
    state do not depend on the batch it decodes in."""
    batch = whole_head_batch(shape)
    full = make_case(shape, batch, torch.bfloat16, "cuda", seed=5, tokens=tokens)
    few = with_pool_copies({**full, **{n: full[n][:rows] for n in ("qkv", "a", "b", "z", "slots")}})
    step = gdn_ops.gdn_decode_step if tokens is None else gdn_ops.gdn_verify
    whole, split = step(**full), step(**few)
    assert not split.isnan().any()
    assert torch.equal(split, whole[:rows])
    kept = few["slots"]
    assert torch.equal(few["state_pool"][kept], full["state_pool"][kept])


@pytest.mark.cuda
@pytest.mark.parametrize("fill", [False, True], ids=["batch3", "fill_sms"])
def test_kernel_commit_is_kernel_decode_bitwise(cuda_kernels, fill):
    """The kernel's verify outputs and committed states equal its own decode steps bit for bit:
    the same per-token math, so speculation changes no GDN rounding (with blocks of 32 columns, and
    of whole heads)."""
    tokens, dtype = 4, torch.bfloat16
    batch = whole_head_batch(SHAPE_35B) if fill else 3
    case = make_case(SHAPE_35B, batch, dtype, "cuda", seed=21, tokens=tokens)
    decoded = with_pool_copies(case)
    out = gdn_ops.gdn_verify(**case)
    for t in range(tokens):
        one = {n: decoded[n][:, t].contiguous() for n in ("qkv", "a", "b", "z")}
        assert torch.equal(gdn_ops.gdn_decode_step(**{**decoded, **one}), out[:, t])
    gdn_ops.gdn_commit(**without_z(case), counts=torch.full((batch,), tokens, device="cuda"))
    assert torch.equal(case["conv_pool"], decoded["conv_pool"])
    assert torch.equal(case["state_pool"], decoded["state_pool"])


@pytest.mark.cuda
@pytest.mark.parametrize("tokens", [None, 1, 4])
def test_kernel_reads_merged_projection_slices_in_place(cuda_kernels, tokens):
    """qkv | z | b | a as column slices of one [B, T, W] tensor (what MergedLinear returns): no
    copy, the same results bit for bit as contiguous inputs."""
    case = make_case(SHAPE_35B, 3, torch.bfloat16, "cuda", seed=41, tokens=tokens)
    names = ("qkv", "z", "b", "a")
    merged = torch.cat([case[n] for n in names], dim=-1)
    sliced = dict(zip(names, merged.split([case[n].shape[-1] for n in names], dim=-1)))
    assert not sliced["qkv"].is_contiguous()
    plain, strided = with_pool_copies(case), {**with_pool_copies(case), **sliced}
    if tokens is None:
        assert torch.equal(gdn_ops.gdn_decode_step(**strided), gdn_ops.gdn_decode_step(**plain))
    else:
        assert torch.equal(gdn_ops.gdn_verify(**strided), gdn_ops.gdn_verify(**plain))
        counts = torch.tensor([1, tokens, 0], device="cuda")
        gdn_ops.gdn_commit(**without_z(strided), counts=counts)
        gdn_ops.gdn_commit(**without_z(plain), counts=counts)
    assert torch.equal(strided["state_pool"], plain["state_pool"])
    assert torch.equal(strided["conv_pool"], plain["conv_pool"])


@pytest.mark.cuda
def test_verify_and_commit_replay_in_cuda_graph(cuda_kernels):
    """Verify + commit captured once, replayed with new inputs and counts: each round matches the
    reference round from the same pools."""
    from ninfer_core.engine.graph_capture import capture

    batch, tokens, dtype = 2, 4, torch.bfloat16
    case = make_case(SHAPE_35B, batch, dtype, "cuda", seed=31, tokens=tokens)
    counts = torch.zeros(batch, dtype=torch.long, device="cuda")

    def round_trip() -> torch.Tensor:
        out, act = gdn_ops.gdn_verify_recorded(**case)  # the commit reads the verify's activations
        gdn_ops.gdn_commit(**without_z(case), counts=counts, act=act)
        return out

    graph, out = capture(round_trip)
    gen = torch.Generator().manual_seed(32)
    for kept in ([1, 4], [3, 0], [2, 2]):
        fresh = step_inputs(SHAPE_35B, batch, dtype, "cuda", gen, tokens)
        for name, value in fresh.items():
            case[name].copy_(value)
        counts.copy_(torch.tensor(kept))
        ref_case = with_pool_copies(case)
        graph.replay()
        ref_out = gdn_ops.gdn_verify_ref(**ref_case)
        gdn_ops.gdn_commit_ref(**without_z(ref_case), counts=counts)
        torch.testing.assert_close(out, ref_out, rtol=OUT_TOL[dtype], atol=OUT_TOL[dtype])
        assert torch.equal(case["conv_pool"], ref_case["conv_pool"])
        assert_rel(case["state_pool"], ref_case["state_pool"], 1e-5)


# ---------------------------------------------------------------- GPU: fla prefill


def _prefill_inputs(shape, seq_len: int, dtype: torch.dtype, device, batch: int = 2) -> tuple:
    """q, k (normalised, q scaled; fp32 holding `dtype` values), v in `dtype`, g, beta, state (fp32)."""
    hk, hv, dk, dv = shape
    gen = torch.Generator().manual_seed(seq_len + dk)
    q = (l2norm(torch.randn(batch, seq_len, hk, dk, generator=gen)) * dk**-0.5).to(dtype).float()
    k = l2norm(torch.randn(batch, seq_len, hk, dk, generator=gen)).to(dtype).float()
    v = torch.randn(batch, seq_len, hv, dv, generator=gen).to(dtype)
    g = -F.softplus(torch.randn(batch, seq_len, hv, generator=gen))
    beta = torch.sigmoid(torch.randn(batch, seq_len, hv, generator=gen))
    state = torch.randn(batch, hv, dk, dv, generator=gen) * 0.5
    return tuple(t.to(device) for t in (q, k, v, g, beta, state))


def assert_rms_rel(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """||actual - expected|| <= tol * ||expected|| (fla's own tests bound this ratio, 0.005 for fp16)."""
    err = (actual.double() - expected.double()).norm().item()
    scale = expected.double().norm().item()
    assert err <= tol * scale, f"error norm {err:.3g} > {tol} * norm {scale:.3g}"


@pytest.fixture
def fla_available(monkeypatch):
    monkeypatch.delenv(dispatch.DISABLE_ENV, raising=False)
    if gdn_ops._fla_chunk() is None:
        pytest.skip("flash-linear-attention (fla >= 0.6 + triton) is not importable")


@pytest.mark.cuda
@pytest.mark.parametrize("seq_len", [1, 63, 200])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(2, 6, 32, 32), (16, 32, 128, 128)], ids=str)
def test_fla_matches_chunked_reference(fla_available, shape, dtype, seq_len):
    """fla (intermediates in the model dtype) vs the fp32 reference on the same rounded inputs,
    from a nonzero fp32 state, value heads grouped over key heads."""
    q, k, v, g, beta, state = _prefill_inputs(shape, seq_len, dtype, "cuda")
    want_out, want_state = gated_delta_rule_chunked(q, k, v.float(), g, beta, state)
    out, final = gdn_ops.gated_delta_rule_fla(q, k, v, g, beta, state)
    assert out.dtype == dtype and out.shape == want_out.shape
    assert final.dtype == torch.float32 and final.shape == state.shape
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    assert_rms_rel(out, want_out, tol)
    assert_rms_rel(final, want_state, tol)
    assert_rel(out, want_out, 5 * tol)
    assert_rel(final, want_state, 5 * tol)


@pytest.mark.cuda
def test_prefill_selection_on_cuda(fla_available):
    """The layer's prefill: fla for bf16 / fp16 models, the exact reference for fp32 ones."""
    fp32 = _prefill_inputs((2, 6, 32, 32), 100, torch.float32, "cuda")
    got = gdn_ops.gated_delta_rule_prefill(*fp32)
    assert all(torch.equal(x, y) for x, y in zip(got, gated_delta_rule_chunked(*fp32), strict=True))
    bf16 = _prefill_inputs((2, 6, 32, 32), 100, torch.bfloat16, "cuda")
    got = gdn_ops.gated_delta_rule_prefill(*bf16)
    assert got[0].dtype == torch.bfloat16
    assert all(torch.equal(x, y) for x, y in zip(got, gdn_ops.gated_delta_rule_fla(*bf16), strict=True))


def _conv_output_case(shape, seq_len: int, dtype: torch.dtype, device, padded: bool) -> tuple:
    """A prefill's conv output (q, k, v parts of [2, T, C]), raw gate inputs a, b [2, T, Hv], the
    layer's weights, valid tokens (row 1 three short when padded) and an fp32 state."""
    hk, hv, dk, dv = shape
    gen = torch.Generator().manual_seed(seq_len + dk)
    mixed = torch.randn(2, seq_len, 2 * hk * dk + hv * dv, generator=gen).to(dtype)
    a, b = (torch.randn(2, seq_len, hv, generator=gen).to(dtype) for _ in range(2))
    a_log, dt_bias = ((torch.randn(hv, generator=gen) * 0.5).to(device) for _ in range(2))
    w = gdn_ops.GDNWeights(conv_weight=torch.empty(0), A_log=a_log, dt_bias=dt_bias, norm_weight=torch.empty(0),
                           eps=EPS, num_k_heads=hk, head_k_dim=dk, head_v_dim=dv)
    valid = torch.tensor([seq_len, seq_len - 3], device=device) if padded else None
    state = torch.randn(2, hv, dk, dv, generator=gen) * 0.5
    return qkv_parts(mixed.to(device), hk * dk), a.to(device), b.to(device), w, valid, state.to(device)


def _each(parts: tuple, fn) -> tuple:
    return tuple(fn(p) for p in parts)


def _fla_contract(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                  use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel):
    """fla 0.6's chunk_gated_delta_rule with its in-kernel options as its docstring defines them
    (l2norm of q and k, g = -exp(A_log) softplus(g + dt_bias), beta = sigmoid(beta)), in float64."""
    assert use_qk_l2norm_in_kernel and use_gate_in_kernel and use_beta_sigmoid_in_kernel and output_final_state
    g = -A_log.double().exp() * F.softplus(g.double() + dt_bias.double())
    return gated_delta_rule_recurrent(l2norm(q.double()) * scale, l2norm(k.double()), v.double(), g,
                                      torch.sigmoid(beta.double()), initial_state.double())


@pytest.mark.parametrize("padded", [False, True])
def test_fla_call_with_gates_in_kernel_gets_them_raw(monkeypatch, padded):
    """The fused fla call's arguments, checked on the CPU against fla's contract: q / k / v as the
    conv output's heads, q's dk^-1/2 as the scale, a / b raw with A_log and dt_bias, and padding
    tokens whose raw gates leave the state exactly as it was (row 1's last three)."""
    monkeypatch.setattr(gdn_ops, "_fla_chunk", lambda: _fla_contract)
    monkeypatch.setattr(gdn_ops, "_fla_applies", lambda q, v, state: True)
    parts, a, b, w, valid, state = _conv_output_case((2, 4, 16, 8), 11, torch.float32, "cpu", padded)
    out, final = gdn_ops.gated_delta_rule_from_conv(parts, a, b, w, valid, state)
    q, k, v, g, beta = heads_and_gates(_each(parts, torch.Tensor.double), a.double(), b.double(), w, valid,
                                       torch.float64)
    want_out, want_state = gated_delta_rule_recurrent(q, k, v, g, beta, state.double())
    # (the torch gates are fp32, the contract's float64: 5e-5 apart)
    torch.testing.assert_close(out, want_out, rtol=2e-4, atol=1e-6)
    torch.testing.assert_close(final, want_state, rtol=2e-4, atol=1e-6)
    if padded:  # the state after row 1's real tokens alone
        q, k, v, g, beta = heads_and_gates(_each(parts, lambda p: p[1:, :8].double()), a[1:, :8].double(),
                                           b[1:, :8].double(), w, None,
                                           torch.float64)
        torch.testing.assert_close(final[1:], gated_delta_rule_recurrent(q, k, v, g, beta, state[1:].double())[1],
                                   rtol=2e-4, atol=1e-6)


def test_prefill_from_conv_on_cpu_is_the_reference(monkeypatch):
    monkeypatch.setattr(gdn_ops, "_fla_chunk", lambda: pytest.fail("fla looked up for CPU tensors"))
    parts, a, b, w, valid, state = _conv_output_case((2, 4, 16, 8), 70, torch.float32, "cpu", True)
    got = gdn_ops.gated_delta_rule_from_conv(parts, a, b, w, valid, state)
    want = gated_delta_rule_chunked(*heads_and_gates(parts, a, b, w, valid, torch.float32), state)
    assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("seq_len,padded", [(37, True), (48, False), (200, True)])
def test_fla_with_gates_in_kernel_matches_the_torch_gates(fla_available, dtype, seq_len, padded):
    """fla with l2norm, gates and beta's sigmoid inside against the fp32 reference of the torch gates
    (the 35B's heads: 16 key heads, 32 value heads of 128), padding included."""
    parts, a, b, w, valid, state = _conv_output_case((16, 32, 128, 128), seq_len, dtype, "cuda", padded)
    out, final = gdn_ops.gated_delta_rule_from_conv(parts, a, b, w, valid, state)
    q, k, v, g, beta = heads_and_gates(parts, a, b, w, valid, torch.float32)
    want_out, want_state = gated_delta_rule_chunked(q, k, v.float(), g, beta, state)
    assert out.dtype == dtype and final.dtype == torch.float32
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    assert_rms_rel(out, want_out, tol)
    assert_rms_rel(final, want_state, tol)


# ---------------------------------------------------------------- prefill conv (csrc/gdn_conv.cu)


def _conv_case(batch: int, tokens: int, channels: int, taps: int, dtype: torch.dtype, seed: int):
    """Pool of 5 slots, `batch` of them used (not in order), qkv a slice of a wider projection."""
    g = torch.Generator().manual_seed(seed)
    wide = (torch.randint(-24, 25, (batch, tokens, channels + 40), generator=g) / 16).to(dtype).cuda()
    pool = (torch.randint(-24, 25, (5, channels, taps - 1), generator=g) / 16).to(dtype).cuda()
    weight = (torch.randint(-16, 17, (channels, taps), generator=g) / 32).to(dtype).cuda()
    slots = torch.tensor([3, 0, 4][:batch], device="cuda")
    return wide[..., 8 : 8 + channels], pool, slots, weight


def _conv64(qkv, state, weight, valid):
    """float64: out[b, t, c] = silu(sum_j w[c, j] window[c, t + j]); new state ends at valid[b]."""
    window = torch.cat((state.double(), qkv.double().transpose(1, 2)), dim=-1)
    taps = weight.shape[-1]
    out = sum(weight.double()[None, :, j, None] * window[:, :, j : j + qkv.shape[1]] for j in range(taps))
    out = F.silu(out).transpose(1, 2)
    new = torch.stack([window[b, :, n : n + taps - 1] for b, n in enumerate(valid.tolist())])
    return out, new


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("tokens,taps,padded", [(1, 4, False), (3, 4, True), (37, 4, True), (64, 4, False),
                                                (65, 2, True), (200, 8, True), (517, 4, False)])
def test_conv_prefill_kernel_matches_reference_and_float64(cuda_kernels, dtype, tokens, taps, padded):
    batch, channels = 3, 200
    qkv, pool, slots, weight = _conv_case(batch, tokens, channels, taps, dtype, seed=tokens + taps)
    valid = torch.tensor([tokens, 0, max(tokens - 2, 1)][:batch], device="cuda") if padded else None
    counts = valid if padded else torch.full((batch,), tokens, device="cuda")
    want64, want_state = _conv64(qkv, pool[slots], weight, counts)
    ref_pool = pool.clone()
    ref = gdn_ops.conv_prefill_ref(qkv, ref_pool, slots, weight, valid)
    before = pool.clone()
    parts = gdn_ops.conv_prefill(qkv, pool, slots, weight, 48, valid)  # q, k, v: 48, 48, 104 channels
    assert [p.shape for p in parts] == [(batch, tokens, w) for w in (48, 48, 104)]
    assert all(p.dtype == dtype and p.is_contiguous() for p in parts)
    got = torch.cat(parts, -1)
    assert torch.equal(pool, ref_pool)  # state entries are copies of inputs: exact
    assert torch.equal(pool[slots].double(), want_state)
    untouched = [1, 2]
    assert torch.equal(pool[untouched], before[untouched])
    ulp = torch.finfo(dtype).eps * (8 if dtype == torch.float32 else 1)
    # exact conv sums (multiples of 1/512), so only SiLU's fp32 rounding and the final rounding differ
    torch.testing.assert_close(got.double(), want64, rtol=ulp, atol=ulp)
    torch.testing.assert_close(got, ref, rtol=ulp, atol=ulp)


@pytest.mark.cuda
def test_conv_prefill_replays_in_cuda_graph(cuda_kernels):
    qkv, pool, slots, weight = _conv_case(2, 48, 256, 4, torch.bfloat16, seed=1)
    valid = torch.tensor([48, 30], device="cuda")
    start = pool.clone()
    graph = torch.cuda.CUDAGraph()
    gdn_ops.conv_prefill(qkv, pool.clone(), slots, weight, 64, valid)  # warm-up outside the graph
    with torch.cuda.graph(graph):
        parts = gdn_ops.conv_prefill(qkv, pool, slots, weight, 64, valid)
    for seed in (2, 3):
        fresh, _, _, _ = _conv_case(2, 48, 256, 4, torch.bfloat16, seed=seed)
        qkv.copy_(fresh)
        pool.copy_(start)
        graph.replay()
        torch.cuda.synchronize()
        ref_pool = start.clone()
        ref = gdn_ops.conv_prefill_ref(qkv, ref_pool, slots, weight, valid)
        assert torch.equal(pool, ref_pool)
        torch.testing.assert_close(torch.cat(parts, -1), ref, rtol=torch.finfo(torch.bfloat16).eps, atol=1e-3)


def _tail_case(device: str, dtype: torch.dtype) -> tuple[dict, dict]:
    """A forked prefill chunk's tail: 3 rows of 40 tokens, tails of 1, 10 and 16 tokens from
    different offsets, fork slots beside the rows' own."""
    case = make_case(SHAPE_35B, 3, dtype, device, seed=61, tokens=40)
    free = [s for s in range(case["state_pool"].shape[0]) if s not in case["slots"].tolist()]
    tail = {"offsets": torch.tensor([39, 30, 24], device=device), "counts": torch.tensor([1, 10, 16], device=device),
            "fork_slots": torch.tensor(free[:3], device=device), "width": 16,
            "out": torch.randn(3, 40, case["z"].shape[-1], dtype=dtype).to(device)}
    return case, tail


def test_prefill_tail_passes_offsets_and_fork_slots(monkeypatch):
    """The tail's kernel call: offsets, fork slots and counts as given, qkv with the chunk's rows per
    sequence, `width` tokens, the outputs into the chunk's own buffer."""
    calls = record_kernel_calls(monkeypatch, "gdn_steps")
    monkeypatch.setattr(gdn_ops, "_kernel_applies", lambda step, w: True)
    case, tail = _tail_case("cpu", torch.bfloat16)
    gdn_ops.gdn_prefill_tail(**case, **tail)
    (kw,) = calls
    for name in ("offsets", "fork_slots", "counts", "out"):
        assert kw[name] is tail[name], name
    assert kw["qkv"] is case["qkv"] and kw["qkv"].shape[1] == 40  # the chunk's rows per sequence
    assert (kw["width"], kw["write_state"]) == (16, True)


@pytest.mark.cuda
def test_prefill_tail_kernel_matches_reference(cuda_kernels):
    """Kernel against the reference: the fork slots get the rows' states as they were (bitwise),
    the kept rows' outputs and the advanced pools match, every other row of out is untouched."""
    dtype = torch.bfloat16
    case, tail = _tail_case("cuda", dtype)
    ref_case, ref_tail = with_pool_copies(case), {**tail, "out": tail["out"].clone()}
    before = with_pool_copies(case)
    out_before = tail["out"].clone()
    gdn_ops.gdn_prefill_tail(**case, **tail)
    step = gdn_ops.GDNStepInputs(*(ref_case[n] for n in ("qkv", "a", "b", "z", "conv_pool", "state_pool", "slots")),
                                 counts=tail["counts"], offsets=tail["offsets"], fork_slots=tail["fork_slots"],
                                 width=tail["width"])
    gdn_ops._tail_ref(step, ref_case["w"], ref_tail["out"])
    slots, forks = case["slots"], tail["fork_slots"]
    assert torch.equal(case["state_pool"][forks], before["state_pool"][slots])
    assert torch.equal(case["conv_pool"][forks], before["conv_pool"][slots])
    assert torch.equal(case["conv_pool"], ref_case["conv_pool"])
    assert_rel(case["state_pool"], ref_case["state_pool"], 1e-5)
    kept = torch.zeros(3, 40, dtype=torch.bool, device="cuda")
    for row, (offset, count) in enumerate(zip(tail["offsets"].tolist(), tail["counts"].tolist())):
        kept[row, offset : offset + count] = True
    assert torch.equal(tail["out"][~kept], out_before[~kept])
    torch.testing.assert_close(tail["out"][kept], ref_tail["out"][kept], rtol=OUT_TOL[dtype], atol=OUT_TOL[dtype])

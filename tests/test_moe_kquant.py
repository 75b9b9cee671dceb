"""Routed experts kept as a GGUF's K-quant blocks on the CPU (ops/kquant.py KQuantExperts): each
expert packed on its own from the file's [E, rows, bytes] halves, the decode step's one C++ call
(csrc/cpu/moe_step.cpp over K-quant linears, the shared expert too) against a float64 reference of
the kernel's math, and the prompt path against the dequantized weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from hf_reference import assert_close_rel
from test_gguf_quant import random_blocks
from test_moe_ops import cpu_calls  # noqa: F401  (fixture)

from ninfer_core.layers.moe import Experts
from ninfer_core.models.quantize import _packed_experts
from ninfer_core.ops import dispatch, moe
from ninfer_core.ops.kquant import KQuantExperts, KQuantFormat, KQuantWeight, kquant_linear_a8_ref
from ninfer_core.ops.kquant import dequantize_ref as kquant_dequantize_ref
from ninfer_core.ops.quant import QuantFormat
from ninfer_core.weights.kquant_layout import block_type, pack_rows

pytestmark = pytest.mark.skipif(dispatch.cpu_extension() is None, reason="the CPU extension is not built")

E, H, INTER = 5, 256, 256  # K-quant rows take inputs in whole super-blocks of 256


def file_experts(parts: list[tuple[Q, int]], cols: int, seed: int) -> list[np.ndarray]:
    """The file's halves: per part, [E, rows, bytes] of random blocks in file order."""
    return [np.stack([random_blocks(q, rows, cols, seed + 97 * e + j) for e in range(E)])
            for j, (q, rows) in enumerate(parts)]


def kquant_experts(parts: list[tuple[Q, int]], cols: int, seed: int) -> tuple[KQuantExperts, list[np.ndarray]]:
    halves = file_experts(parts, cols, seed)
    layout = tuple((block_type(q), rows) for q, rows in parts)
    return KQuantExperts(torch.from_numpy(_packed_experts(halves, layout)), layout, cols), halves


@pytest.fixture(scope="module")
def experts():
    """gate_up with a Q4_K gate and a Q6_K up half (a mix a file may hold), a Q4_K down."""
    gate_up, halves = kquant_experts([(Q.Q4_K, INTER), (Q.Q6_K, INTER)], H, seed=1)
    down, _ = kquant_experts([(Q.Q4_K, H)], INTER, seed=2)
    return gate_up, down, halves


@pytest.fixture
def kernel_math(monkeypatch):
    """The CPU's default math (tests run exact, conftest.py): K-quant products with int8 activations."""
    monkeypatch.setenv(dispatch.CPU_MATH_ENV, "bf16")


def _inputs(tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(tokens)]).int()
    weights = torch.rand(tokens, 2, generator=g)
    return x, weights, ids


def test_each_expert_is_its_file_blocks(experts):
    gate_up, _, halves = experts
    assert gate_up.shape == (E, 2 * INTER, H)
    for e in range(E):
        want = np.concatenate([gguf_dequantize(h[e], q).reshape(-1, H) for h, q in zip(halves, (Q.Q4_K, Q.Q6_K))])
        assert torch.equal(kquant_dequantize_ref(gate_up.experts[e], torch.float32), torch.from_numpy(want))
    # each expert packed on its own: expert 1's bytes are its halves' packs, in turn
    packed = np.concatenate([pack_rows(halves[0][1], "q4_k"), pack_rows(halves[1][1], "q6_k")])
    assert np.array_equal(gate_up.blocks[1].numpy(), packed)


def _a8_reference(x, gate_up, down, weights, ids, shared=None) -> torch.Tensor:
    """The kernel's math in float64: activations quantized per 32 for every product."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = kquant_linear_a8_ref(x[t : t + 1], gate_up.experts[e])
            act = (F.silu(h[:, :INTER]) * h[:, INTER:]).float()
            out[t] += weights[t, j].double() * kquant_linear_a8_ref(act, down.experts[e])[0]
    if shared is not None:
        h = kquant_linear_a8_ref(x, shared.gate_up)
        inter = h.shape[1] // 2
        act = (F.silu(h[:, :inter]) * h[:, inter:]).float()
        out += torch.sigmoid(shared.gate.double()) * kquant_linear_a8_ref(act, shared.down)
    return out


def test_decode_step_is_one_call_of_the_kernels_math(experts, cpu_calls, kernel_math):  # noqa: F811
    gate_up, down, _ = experts
    x, weights, ids = _inputs(3)
    got = moe.moe_experts(x, gate_up, down, weights, ids)
    assert cpu_calls == ["moe_experts"]
    assert_close_rel(got, _a8_reference(x, gate_up, down, weights, ids).float(), 2e-3)


def test_shared_expert_rides_along(experts, cpu_calls, kernel_math):  # noqa: F811
    gate_up, down, _ = experts
    shared_gate_up = KQuantWeight(torch.from_numpy(pack_rows(random_blocks(Q.Q4_K, 2 * INTER, H, 7), "q4_k")),
                                  (("q4_k", 2 * INTER),), H)
    shared_down = KQuantWeight(torch.from_numpy(pack_rows(random_blocks(Q.Q6_K, H, INTER, 8), "q6_k")),
                               (("q6_k", H),), INTER)
    x, weights, ids = _inputs(2, seed=3)
    shared = moe.SharedExpert(shared_gate_up, shared_down, torch.randn(2, 1))
    got = moe.moe_experts_with_shared(x, gate_up, down, weights, ids, shared)
    assert cpu_calls == ["moe_experts"]
    assert_close_rel(got, _a8_reference(x, gate_up, down, weights, ids, shared).float(), 2e-3)


def test_prompt_rows_take_the_one_call_too(experts, cpu_calls, kernel_math, monkeypatch):  # noqa: F811
    """A prompt's 24 rows go through the same call (K-quant products beat dequantized tiles at a
    prompt's rows an expert); with NINFER_CPU_MATH=exact they multiply the dequantized experts,
    the fp32 reference's values."""
    gate_up, down, _ = experts
    x, weights, ids = _inputs(24, seed=5)
    got = moe.moe_experts(x, gate_up, down, weights, ids)
    assert cpu_calls == ["moe_experts"]
    assert_close_rel(got, _a8_reference(x, gate_up, down, weights, ids).float(), 2e-3)
    monkeypatch.setenv(dispatch.CPU_MATH_ENV, "exact")
    cpu_calls.clear()
    exact = moe.moe_experts(x, gate_up, down, weights, ids)
    assert "moe_experts" not in cpu_calls
    assert_close_rel(exact, moe.moe_experts_ref(x, gate_up, down, weights, ids), 1e-5)


def test_experts_module_holds_k_quant_blocks():
    with torch.device("meta"):
        module = Experts(E, H, INTER)
    gate_up_fmt = KQuantFormat((("q4_k", INTER), ("q6_k", INTER)))
    module.quantize_(gate_up_fmt, QuantFormat("int8"))
    assert module.gate_up_blocks.shape == (E, gate_up_fmt.nbytes(H)) and module.gate_up_blocks.is_meta
    assert set(module.state_dict()) == {"gate_up_blocks", "down_qweight", "down_scales"}
    materialized = Experts(E, H, INTER)
    with pytest.raises(ValueError, match="GGUF file only"):
        materialized.quantize_(gate_up_fmt)


def test_threads_give_the_same_bits(experts, kernel_math, monkeypatch):
    """Each expert's matmuls split over the threads: at 1, 2 and 4 threads the outputs are the same
    bits, shared expert included, for 1 and 3 tokens and a prompt's rows (24)."""
    gate_up, down, _ = experts
    shared = moe.SharedExpert(
        KQuantWeight(torch.from_numpy(pack_rows(random_blocks(Q.Q4_K, 2 * INTER, H, 7), "q4_k")),
                     (("q4_k", 2 * INTER),), H),
        KQuantWeight(torch.from_numpy(pack_rows(random_blocks(Q.Q6_K, H, INTER, 8), "q6_k")), (("q6_k", H),), INTER),
        torch.randn(24, 1))
    before = torch.get_num_threads()
    try:
        for tokens in (1, 3, 24):
            x, weights, ids = _inputs(tokens, seed=tokens)
            runs = []
            for threads in (1, 2, 4):
                torch.set_num_threads(threads)
                gate = moe.SharedExpert(shared.gate_up, shared.down, shared.gate[:tokens])
                runs.append(moe.moe_experts_with_shared(x, gate_up, down, weights, ids, gate))
            assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2]), tokens
    finally:
        torch.set_num_threads(before)

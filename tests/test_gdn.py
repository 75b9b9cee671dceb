"""Gated DeltaNet math: chunked (WY) form and recurrent step against a float64 definition loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ninfer_core.layers.gdn import causal_conv1d_silu, gated_delta_rule_chunked, gated_delta_rule_recurrent, l2norm

torch.set_num_threads(1)  # tiny tensors: thread start-up dominates and cores are shared

B, HK, HV, DK, DV = 2, 2, 4, 8, 6


def make_inputs(seq_len: int, seed: int, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = l2norm(randn(B, seq_len, HK, DK)) * DK**-0.5
    k = l2norm(randn(B, seq_len, HK, DK))
    v = randn(B, seq_len, HV, DV)
    # Log-decays from ~0 (no forgetting) down to -20 (forget everything), betas over (0, 1).
    g = -torch.exp(randn(B, seq_len, HV) * 2.0).clamp(max=20.0)
    beta = torch.sigmoid(randn(B, seq_len, HV) * 2.0)
    state = randn(B, HV, DK, DV)
    return [t.to(dtype) for t in (q, k, v, g, beta)] + [state.to(dtype)]


def definition(q, k, v, g, beta, state):
    """The delta rule written out per token, value head j reading key head j // (HV / HK)."""
    key_head = torch.arange(HV) // (HV // HK)
    q, k = q[:, :, key_head], k[:, :, key_head]
    state = state.clone()
    out = torch.zeros(B, q.shape[1], HV, DV, dtype=state.dtype)
    for t in range(q.shape[1]):
        for h in range(HV):
            s = state[:, h] * torch.exp(g[:, t, h])[:, None, None]
            kt, qt = k[:, t, h], q[:, t, h]
            u = beta[:, t, h, None] * (v[:, t, h] - torch.einsum("bkv,bk->bv", s, kt))
            s = s + kt[:, :, None] * u[:, None, :]
            out[:, t, h] = torch.einsum("bkv,bk->bv", s, qt)
            state[:, h] = s
    return out, state


def test_recurrent_matches_definition():
    inputs = make_inputs(seq_len=9, seed=0)
    out, state = gated_delta_rule_recurrent(*inputs)
    ref_out, ref_state = definition(*inputs)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, ref_state, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seq_len", [1, 5, 63, 64, 65, 150])
@pytest.mark.parametrize("chunk_size", [64, 16])
def test_chunked_equals_recurrence_fp64(seq_len, chunk_size):
    inputs = make_inputs(seq_len, seed=seq_len)
    out, state = gated_delta_rule_chunked(*inputs, chunk_size=chunk_size)
    ref_out, ref_state = gated_delta_rule_recurrent(*inputs)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state, ref_state, rtol=1e-10, atol=1e-10)


def test_chunked_from_zero_state_matches_definition():
    q, k, v, g, beta, state = make_inputs(70, seed=3)
    zero = torch.zeros_like(state)
    out, final = gated_delta_rule_chunked(q, k, v, g, beta, zero)
    ref_out, ref_final = definition(q, k, v, g, beta, zero)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, ref_final, rtol=1e-10, atol=1e-10)


def test_split_prefill_continues_from_state():
    """Any split of the sequence, each part starting from the previous part's state, equals one pass."""
    q, k, v, g, beta, state = make_inputs(150, seed=7)
    ref_out, ref_state = gated_delta_rule_chunked(q, k, v, g, beta, state)
    outs, s, start = [], state, 0
    for size in (37, 64, 1, 48):
        part = slice(start, start + size)
        o, s = gated_delta_rule_chunked(q[:, part], k[:, part], v[:, part], g[:, part], beta[:, part], s)
        outs.append(o)
        start += size
    torch.testing.assert_close(torch.cat(outs, dim=1), ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s, ref_state, rtol=1e-10, atol=1e-10)


def test_fp32_state_stays_close_to_fp64():
    """The production precision (fp32 state and math) tracks the float64 result."""
    inputs64 = make_inputs(200, seed=11)
    inputs32 = [t.float() for t in inputs64]
    ref_out, ref_state = gated_delta_rule_recurrent(*inputs64)
    for rule in (gated_delta_rule_chunked, gated_delta_rule_recurrent):
        out, state = rule(*inputs32)
        assert out.dtype == torch.float32 and state.dtype == torch.float32
        assert (out.double() - ref_out).abs().max() <= 1e-4 * ref_out.abs().max()
        assert (state.double() - ref_state).abs().max() <= 1e-4 * ref_state.abs().max()


def test_conv_streaming_equals_full_conv():
    """Feeding the sequence in pieces through the K-1 input state equals one zero-padded causal conv."""
    gen = torch.Generator().manual_seed(0)
    channels, kernel, seq_len = 10, 4, 23
    x = torch.randn(B, seq_len, channels, generator=gen, dtype=torch.float64)
    weight = torch.randn(channels, kernel, generator=gen, dtype=torch.float64)
    full = F.silu(F.conv1d(F.pad(x.transpose(1, 2), (kernel - 1, 0)), weight[:, None], groups=channels))
    state = torch.zeros(B, channels, kernel - 1, dtype=torch.float64)
    outs, start = [], 0
    for size in (1, 2, 7, 1, 12):
        y, state = causal_conv1d_silu(x[:, start : start + size], state, weight)
        outs.append(y)
        start += size
    torch.testing.assert_close(torch.cat(outs, dim=1), full.transpose(1, 2), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, x[:, -(kernel - 1) :].transpose(1, 2))

"""A GDN state checkpoint inside a prompt chunk (`ForwardBatch.fork`, layers/gdn.py `_forked`).

Layer level (fp32): one forward of n tokens that forks after c of them gives the outputs and the
pooled state of two forwards (c tokens, then the other n - c), and the fork slot holds the state
after the first c (the chunked form and the token loop differ by fp32 rounding only), for both
kinds of fork (the last <= 16 tokens through the fused steps; the chunked rule twice, for a fork
anywhere); padded rows (valid_tokens) and rows without a fork (tokens == valid, a scratch slot)
too. The engine's prompts run in one chunk per fork (tests/test_prefix_cache.py has the hits)."""

from __future__ import annotations

import pytest
import torch

from ninfer_core.engine.fork_windows import step_windows
from ninfer_core.models.base import StateFork, StepWindows
from ninfer_core.ops import dispatch
from ninfer_core.ops import gdn as gdn_ops
from test_speculative_rollback import gdn_layer_and_pools

torch.set_num_threads(1)


def _two_forwards(layer, x, conv, state, slots, cuts):
    """Row by row: the forward of tokens [0, cut) then of [cut, n) (the split the fork replaces)."""
    outs, after_cut = [], []
    for row, (cut, n) in enumerate(cuts):
        slot = slots[row : row + 1]
        first = layer(x[row : row + 1, :cut], conv, state, slot)
        after_cut.append((conv[slot].clone(), state[slot].clone()))
        rest = [layer(x[row : row + 1, cut:n], conv, state, slot)] if n > cut else []
        outs.append(torch.cat([first, *rest], dim=1))
    return outs, after_cut


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("tail", [True, False], ids=["fused_tail", "chunked_twice"])
def test_a_forked_forward_equals_the_split_and_keeps_the_state_at_the_fork(padded, tail):
    layer, conv, state, gen = gdn_layer_and_pools(3)
    conv, state = torch.cat([conv, conv]), torch.cat([state, state])  # 6 slots: 0-2 rows, 3-5 forks
    num_new = 24 if tail else 40
    x = torch.randn(3, num_new, 24, generator=gen)
    valid = torch.tensor([num_new, num_new - 4 if padded else num_new, num_new])
    # the last-but-one token, 6 before the end (padded: 6 of 20), none; chunked: also far from the end, and 2 in
    forks = torch.tensor([23, 14, 24]) if tail else torch.tensor([7, 2 if padded else 30, 40])
    slots = torch.tensor([2, 0, 1])
    fork_slots = torch.tensor([3, 4, 5])
    state0 = state.clone()
    with torch.no_grad():
        want, at_fork = _two_forwards(layer, x, conv.clone(), state.clone(), slots,
                                      [(int(f), int(v)) for f, v in zip(forks, valid)])
        conv_split, state_split = conv.clone(), state.clone()
        _two_forwards(layer, x, conv_split, state_split, slots, [(int(f), int(v)) for f, v in zip(forks, valid)])
        got = layer(x, conv, state, slots, valid if padded else None, StateFork(forks, fork_slots, tail))
    for row in range(3):
        n = int(valid[row])
        torch.testing.assert_close(got[row, :n], want[row][0], atol=2e-5, rtol=2e-5)
        slot, fork_slot = int(slots[row]), int(fork_slots[row])
        torch.testing.assert_close(conv[slot], conv_split[slot], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(state[slot], state_split[slot], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(conv[fork_slot], at_fork[row][0][0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(state[fork_slot], at_fork[row][1][0], atol=2e-5, rtol=2e-5)
    assert not torch.equal(state[3], state0[3])  # the fork slots were written


@pytest.mark.parametrize("form", ["chunked", "windows"])
@pytest.mark.parametrize("padded", [False, True])
def test_two_forks_in_one_chunk(padded, form):
    """A chunked fork with a second one near the end (`StateFork.then`: a chat's history end and
    answer start), or the same two forks as the fused steps' windows after one chunked run
    (`StateFork.steps`, engine/fork_windows.py): the outputs and pooled state of three forwards,
    each fork slot holding its state; a row whose second fork is at its end has none."""
    layer, conv, state, gen = gdn_layer_and_pools(4)
    conv, state = torch.cat([conv, conv, conv]), torch.cat([state, state, state])  # 9 slots: rows, forks, thens
    num_new = 40
    x = torch.randn(3, num_new, 24, generator=gen)
    valid = torch.tensor([40, 36 if padded else 40, 40])
    firsts, seconds = torch.tensor([7, 2, 20]), torch.tensor([37, 30, 40])  # row 2: no second fork
    slots, fork_slots, then_slots = torch.tensor([2, 0, 1]), torch.tensor([3, 4, 5]), torch.tensor([6, 7, 8])
    fork = StateFork(firsts, fork_slots, tail=False, then=StateFork(seconds, then_slots))
    if form == "windows":  # rows of 30, 28 and 20 tokens to the second fork: two windows, then its own
        rows = [step_windows([int(firsts[r]), int(seconds[r])], [int(fork_slots[r]), int(then_slots[r])],
                             int(valid[r]) if padded else num_new, int(slots[r])) for r in range(3)]
        assert all(r is not None and r[1][2] == int(valid[i] if padded else num_new) - int(seconds[i])
                   for i, r in enumerate(rows))
        fork = StateFork(firsts, fork_slots, steps=StepWindows(*(torch.tensor(part).T for part in zip(*rows))))
    with torch.no_grad():
        want_conv, want_state, wants = conv.clone(), state.clone(), []
        for row in range(3):
            slot = slots[row : row + 1]
            cuts = [0, int(firsts[row]), int(seconds[row]), int(valid[row])]
            outs = []
            for i, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
                if hi > lo:
                    outs.append(layer(x[row : row + 1, lo:hi], want_conv, want_state, slot))
                if i < 2:  # the state at each fork goes to that fork's slot
                    target = (fork_slots if i == 0 else then_slots)[row]
                    want_conv[target], want_state[target] = want_conv[slot[0]], want_state[slot[0]]
            wants.append(torch.cat(outs, dim=1))
        got = layer(x, conv, state, slots, valid if padded else None, fork)
    for row in range(3):
        n = int(valid[row])
        torch.testing.assert_close(got[row, :n], wants[row][0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(conv, want_conv, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(state, want_state, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("second", [None, 37], ids=["one_fork", "then_tail"])
def test_an_eager_row_with_host_positions_runs_each_side_alone(second, monkeypatch):
    """One unpadded row whose fork positions are known on the host (`StateFork.host_tokens`, an
    eager prompt chunk) runs the chunked rule over each side's own tokens, not the whole chunk
    twice: the same outputs, pooled state and fork slots as the masked runs (which match the split)."""
    layer, conv, state, gen = gdn_layer_and_pools(1)
    conv, state = torch.cat([conv, conv, conv]), torch.cat([state, state, state])  # row 0, fork 1, then 2
    x = torch.randn(1, 40, 24, generator=gen)
    slots = torch.tensor([0])

    def fork(host: bool) -> StateFork:
        then = None if second is None else StateFork(torch.tensor([second]), torch.tensor([2]),
                                                     host_tokens=second if host else None)
        return StateFork(torch.tensor([11]), torch.tensor([1]), tail=False, then=then, host_tokens=11 if host else None)

    lengths = []  # the tokens each run of the rule reads
    rule = gdn_ops.gated_delta_rule_prefill
    monkeypatch.setattr(gdn_ops, "gated_delta_rule_prefill", lambda q, *rest: lengths.append(q.shape[1]) or rule(q, *rest))
    monkeypatch.setattr(gdn_ops, "cpu_steps_apply", lambda *args: False)  # the chunked rule (the stepped one: below)
    with torch.no_grad():
        conv_masked, state_masked = conv.clone(), state.clone()
        want = layer(x, conv_masked, state_masked, slots, None, fork(False))
        got = layer(x, conv, state, slots, None, fork(True))
    assert lengths == [40, 40, 11, (second or 40) - 11]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(conv, conv_masked, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(state, state_masked, atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(dispatch.cpu_extension() is None, reason="ninfer_core._cpu not built")
@pytest.mark.parametrize("second", [None, 37], ids=["one_fork", "then_tail"])
def test_a_cpu_row_with_host_positions_runs_the_fused_steps(second, monkeypatch):
    """On the CPU (fp32, the CPU kernel) a row with host fork positions, or none, runs the fused steps
    16 tokens a call, cut at the forks (ops/gdn.py gdn_prefill_stepped): the chunked rule's outputs,
    pooled state and fork slots (the masked runs: device positions), without the rule."""
    monkeypatch.delenv(dispatch.DISABLE_ENV, raising=False)
    layer, conv, state, gen = gdn_layer_and_pools(1)
    conv, state = torch.cat([conv, conv, conv]), torch.cat([state, state, state])  # row 0, fork 1, then 2
    x = torch.randn(1, 40, 24, generator=gen)
    slots = torch.tensor([0])
    then = None if second is None else StateFork(torch.tensor([second]), torch.tensor([2]), host_tokens=second)
    host = StateFork(torch.tensor([11]), torch.tensor([1]), tail=False, then=then, host_tokens=11)
    device = StateFork(torch.tensor([11]), torch.tensor([1]), tail=False,
                       then=None if second is None else StateFork(torch.tensor([second]), torch.tensor([2])))
    lengths, pieces = [], []  # tokens of each chunked rule's run, of each fused steps' call
    rule, steps = gdn_ops.gated_delta_rule_prefill, gdn_ops._steps
    monkeypatch.setattr(gdn_ops, "gated_delta_rule_prefill",
                        lambda q, *rest: lengths.append(q.shape[1]) or rule(q, *rest))
    monkeypatch.setattr(gdn_ops, "_steps",
                        lambda name, step, *rest: pieces.append(step.num_tokens) or steps(name, step, *rest))
    with torch.no_grad():
        conv_masked, state_masked = conv.clone(), state.clone()
        want = layer(x, conv_masked, state_masked, slots, None, device)
        assert lengths == [40, 40] and pieces == ([] if second is None else [16])  # the masked runs: its tail's width
        pieces.clear()
        got = layer(x, conv, state, slots, None, host)
    assert lengths == [40, 40]  # nothing more of the chunked rule
    assert pieces == ([11, 5, 16, 8] if second is None else [11, 5, 16, 5, 3])  # cut at 11 (and 37), 16 a call
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(conv, conv_masked, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(state, state_masked, atol=2e-5, rtol=2e-5)


def test_step_windows_cover_each_fork_to_the_next_in_windows_of_the_fused_steps():
    """Hand-worked (engine/fork_windows.py): a chat's checkpoints 27 and 3 tokens before a 37-token
    chunk's end; one fork 27 before it; a second fork at the end (a copy, no token); a lone fork near
    the end (the plain tail: None); one too far for three windows (the chunked rule: None)."""
    assert step_windows([10, 34], [7, 8], 37, 3) == ([10, 26, 34], [16, 8, 3], [7, 3, 8])
    assert step_windows([10], [7], 37, 3) == ([10, 26, 37], [16, 11, 0], [7, 3, 3])
    assert step_windows([10, 37], [7, 8], 37, 3) == ([10, 26, 37], [16, 11, 0], [7, 3, 8])
    assert step_windows([30], [7], 37, 3) is None
    assert step_windows([0], [7], 49, 3) is None and step_windows([0], [7], 48, 3) is not None

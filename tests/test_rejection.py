"""Speculative rejection sampling on the device (ops/rejection.py): the torch reference against a
plain per-sequence loop over Python numbers (exact integers for the fixed-point masses), then the
CUDA kernel against the reference, bit for bit. That the rule keeps the target distribution is
test_speculative_sampling.py's (chi-square over many rounds)."""

from __future__ import annotations

import pytest
import torch

from ninfer_core.ops import dispatch
from ninfer_core.ops.rejection import MAX_DRAFTS, fixed_point_scale, judge, judge_ref

cuda = pytest.mark.skipif(not (torch.cuda.is_available() and dispatch.kernels_available()),
                          reason="needs CUDA and the extension")


def loop_judge(p, q, drafts, u, meta, finite) -> list[int]:
    """The rule one sequence at a time (csrc/sampling.h `JudgeArgs`)."""
    p, q = p.double().tolist(), (q.double().tolist() if q is not None else [])
    drafts, u, meta = drafts.tolist(), u.tolist(), meta.tolist()
    scale, vocab = fixed_point_scale(len(p[0])), len(p[0])
    counts, tokens = [], []
    for b, (k, p0, q0) in enumerate(meta):
        n = k
        for t in range(k):
            d = drafts[b][t]
            q_d = q[q0 + t][d] if q0 >= 0 else 1.0
            if u[b][t] * q_d >= p[p0 + t][d]:
                n = t
                break
        p_n = p[p0 + n]
        q_n = [0.0] * vocab
        if n < k:
            q_n = q[q0 + n] if q0 >= 0 else [1.0 if i == drafts[b][n] else 0.0 for i in range(vocab)]
        mass = [round(max(a - c, 0.0) * scale) for a, c in zip(p_n, q_n)]
        if sum(mass) == 0:
            mass = [round(a * scale) for a in p_n]
        total = sum(mass)
        token = -1
        if total:
            target, run = min(int(min(max(u[b][k], 0.0), 1.0) * float(total)), total - 1), 0
            token = next(i for i, m in enumerate(mass) if (run := run + m) > target)
        if finite is not None and not all(finite[p0 + t] for t in range(n + 1)):
            n, token = 0, -1
        counts.append(n)
        tokens.append(token)
    return counts + tokens


def make_round(gen: torch.Generator, ks: list[int], vocab: int, drawn: list[bool], peaked: bool = False):
    """A batch's inputs: p rows back to back, q rows for the drawn sequences, drafts from q (or any
    token), uniforms; every third drawn sequence's first q a hair above its p everywhere, its first
    uniform just below 1: rejected with an empty residual, so the last token comes from p itself."""
    width = max(ks, default=0)
    logits = torch.randn(sum(ks) + len(ks), vocab, generator=gen, dtype=torch.float64) * (6 if peaked else 1.5)
    p = torch.softmax(logits, -1).float()
    q_rows, drafts, meta, p_row, q_row = [], torch.zeros(len(ks), width, dtype=torch.long), [], 0, 0
    for b, (k, has_q) in enumerate(zip(ks, drawn)):
        if has_q and k:
            q = torch.softmax(torch.randn(k, vocab, generator=gen, dtype=torch.float64) * 1.5, -1).float()
            if b % 3 == 0:
                q[0] = p[p_row] * (1 + 2**-20)
            q_rows.append(q)
            drafts[b, :k] = torch.multinomial(q.double(), 1, generator=gen)[:, 0]
        elif k:
            drafts[b, :k] = torch.randint(0, vocab, (k,), generator=gen)
        meta.append([k, p_row, q_row if has_q and k else -1])
        p_row += k + 1
        q_row += k if has_q and k else 0
    u = torch.rand(len(ks), width + 1, generator=gen, dtype=torch.float64)
    for b, (k, has_q) in enumerate(zip(ks, drawn)):
        if has_q and k and b % 3 == 0:
            u[b, 0] = 1 - 2**-53
    u[0, -1] = 0.0
    u[-1, -1] = 1 - 2**-53
    return p, (torch.cat(q_rows) if q_rows else None), drafts, u, torch.tensor(meta)


ROUNDS = [([3, 0, 2, 1, 3], [True, False, True, False, True]), ([0, 0], [False, False]),
          ([15, 7], [True, False]), ([1] * 9, [True] * 9)]


@pytest.mark.parametrize("vocab", [1, 6, 300])
def test_reference_is_the_rule_one_sequence_at_a_time(vocab):
    gen = torch.Generator().manual_seed(vocab)
    for trial in range(30):
        for ks, drawn in ROUNDS:
            p, q, drafts, u, meta = make_round(gen, ks, vocab, drawn, peaked=trial % 2 == 1)
            finite = None
            if trial % 3 == 2:
                finite = torch.rand(p.shape[0], generator=gen) > 0.2
            got = judge_ref(p, q, drafts, u, meta, finite).tolist()
            assert got == loop_judge(p, q, drafts, u, meta, finite)
            assert judge(p, q, drafts, u, meta, finite).tolist() == got  # the CPU: the reference


def test_the_empty_residual_draws_from_p():
    """The first sequence's first draft is rejected with q above p everywhere: its token is p's draw."""
    gen = torch.Generator().manual_seed(8)
    p, q, drafts, u, meta = make_round(gen, [2], 50, [True])
    n, token = judge_ref(p, q, drafts, u, meta).tolist()
    alone = judge_ref(p[:1], None, drafts[:, :0], u[:, 2:], torch.tensor([[0, 0, -1]]))  # p_0's own draw
    assert n == 0 and token == alone[1].item() >= 0


def test_scale_leaves_a_row_room_in_64_bits():
    for vocab in (1, 2, 5, 248320, 2**20):
        assert vocab * fixed_point_scale(vocab) <= 2.0**62 < 2 * vocab * fixed_point_scale(vocab)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("vocab", [6, 4099, 248320])
def test_kernel_equals_the_reference(vocab):
    gen = torch.Generator().manual_seed(vocab)
    for trial in range(6 if vocab > 5000 else 20):
        for ks, drawn in ROUNDS + [([MAX_DRAFTS], [True])]:
            p, q, drafts, u, meta = make_round(gen, ks, vocab, drawn, peaked=trial % 2 == 1)
            finite = (torch.rand(p.shape[0], generator=gen) > 0.2) if trial % 3 == 2 else None
            want = judge_ref(p, q, drafts, u, meta, finite)
            dev = [None if t is None else t.cuda() for t in (p, q, drafts, u, meta, finite)]
            assert torch.equal(judge(*dev).cpu(), want), (vocab, trial, ks)


@cuda
@pytest.mark.cuda
def test_kernel_replays_in_a_cuda_graph():
    gen = torch.Generator().manual_seed(2)
    p, q, drafts, u, meta = (t.cuda() for t in make_round(gen, [3, 2, 0], 1000, [True, False, True]))
    want = judge_ref(p, q, drafts, u, meta)
    judge(p, q, drafts, u, meta)  # outside capture first: the workspace's allocation
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = judge(p, q, drafts, u, meta)
    for _ in range(2):
        graph.replay()
        assert torch.equal(out, want)

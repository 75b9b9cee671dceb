"""The penalties kernel (csrc/penalties.cu) against its torch reference (ops/penalties.py), bit for
bit: fp32 logits with negatives, zeros, -inf and NaN, tables with counts from 0 to large, rows read
through an index (slots in any order, one slot for several rows) or in place, neutral rows; and the
engine's tables through it against the host-history reference (apply_penalties). The reference
itself is checked against apply_penalties in test_scheduler.py. Then the tables' update for
generated tokens (`record_tokens`): the reference against a loop, the kernel against the reference."""

from __future__ import annotations

import pytest
import torch

from ninfer_core.engine.penalties import PenaltyTables
from ninfer_core.engine.sampling import SamplingParams, TokenHistory, apply_penalties
from ninfer_core.ops import dispatch
from ninfer_core.ops.penalties import penalise, penalise_ref, record_ref, record_tokens

cuda = pytest.mark.skipif(not (torch.cuda.is_available() and dispatch.kernels_available()),
                          reason="needs CUDA and the extension")


def tables(slots: int, vocab: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.randint(0, 4, (slots, vocab), generator=gen, dtype=torch.int32)
    counts[:, :7] = torch.tensor([0, 1, 2, 100, 5000, 1 << 20, 3], dtype=torch.int32)  # large counts too
    seen = (counts > 0) | (torch.rand(slots, vocab, generator=gen) < 0.2)  # prompt tokens: seen, no count
    return seen, counts


def logits_with_specials(rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, vocab, generator=gen) * 5
    x[:, 7:12] = torch.tensor([0.0, -0.0, float("-inf"), float("nan"), 1e-30])
    return x


def columns(rows: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rep = torch.rand(rows, generator=gen) * 2 + 0.3
    presence, frequency = torch.randn(rows, generator=gen), torch.randn(rows, generator=gen)
    rep[0], presence[0], frequency[0] = 1.0, 0.0, 0.0  # a neutral row: unchanged
    rep[1] = 1.0  # presence / frequency alone
    return rep, presence, frequency


def test_the_cpu_path_reads_the_rows_through_the_index():
    gen = torch.Generator().manual_seed(0)
    seen, counts = tables(6, 50, gen)
    x, rows = logits_with_specials(4, 50, gen), torch.tensor([5, 0, 5, 2])
    cols = columns(4, gen)
    got = penalise(x, seen, counts, *cols, rows=rows)
    want = penalise_ref(x, seen[rows], counts[rows], *cols)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(got[0].nan_to_num(), x[0].nan_to_num())  # the neutral row comes back as it was


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("vocab", [1, 1000, 248_320])
@pytest.mark.parametrize("indexed", [True, False])
def test_kernel_equals_the_reference_bit_for_bit(vocab, indexed):
    gen = torch.Generator().manual_seed(vocab)
    rows = 5
    seen, counts = tables(7 if indexed else rows, max(vocab, 12), gen)
    seen, counts = seen[:, :vocab].contiguous(), counts[:, :vocab].contiguous()
    x = logits_with_specials(rows, max(vocab, 12), gen)[:, :vocab].contiguous()
    index = torch.tensor([6, 0, 6, 3, 1]) if indexed else None
    cols = columns(rows, gen)
    dev = [t.cuda() for t in (x, seen, counts, *cols)]
    got = penalise(*dev, rows=index.cuda() if indexed else None).cpu()
    want = penalise_ref(x, seen[index] if indexed else seen, counts[index] if indexed else counts, *cols)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(got[0].nan_to_num(), x[0].nan_to_num())  # the neutral row comes back as it was


@cuda
@pytest.mark.cuda
def test_engine_tables_on_the_kernel_equal_the_host_histories():
    """PenaltyTables.apply (the plain sampled step: rows through the slots) on the kernel equals
    apply_penalties over each sequence's host history."""
    gen = torch.Generator().manual_seed(3)
    vocab = 997
    params = [SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25),
              SamplingParams(presence_penalty=-1.0), SamplingParams(repetition_penalty=0.7), SamplingParams()]
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (5, 9, 1, 30)]
    outputs = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (0, 3, 12, 7)]
    table = PenaltyTables(6, vocab, torch.device("cuda"))
    slots = [4, 0, 2, 5]
    for slot, prompt, out in zip(slots, prompts, outputs):
        table.reset(slot, prompt, out)
    logits = torch.randn(4, vocab, generator=gen) * 3
    got = table.apply(logits.cuda(), torch.tensor(slots).cuda(), params).cpu()
    want = apply_penalties(logits, params, [TokenHistory(p, o) for p, o in zip(prompts, outputs)])
    assert torch.equal(got, want)


def record_inputs(gen: torch.Generator, vocab: int) -> tuple[torch.Tensor, ...]:
    """Tables of 5 rows; 40 entries with pairs repeated, rows in any order, and -1s (no token) in
    rows that hold no token 0."""
    seen, counts = tables(5, vocab, gen)
    rows = torch.randint(0, 5, (40,), generator=gen)
    ids = torch.randint(1, vocab, (40,), generator=gen)
    ids[:6] = ids[6:12]  # repeated pairs where the rows match too
    rows[:6] = rows[6:12]
    ids[20:25] = -1
    rows[20:25] = torch.tensor([0, 1, 1, 3, 4])
    ids[30] = 0  # a token 0, in a row without a -1
    rows[30] = 2
    return seen, counts, rows, ids


def test_record_reference_counts_every_token_and_skips_the_missing():
    gen = torch.Generator().manual_seed(5)
    seen, counts, rows, ids = record_inputs(gen, 60)
    want_seen, want_counts = seen.clone(), counts.clone()
    for r, i in zip(rows.tolist(), ids.tolist()):
        if i >= 0:
            want_counts[r, i] += 1
            want_seen[r, i] = True
    record_ref(seen, counts, rows, ids)
    assert torch.equal(counts, want_counts) and torch.equal(seen, want_seen)
    record_tokens(seen, counts, rows[:0], ids[:0])  # nothing: nothing changes
    assert torch.equal(counts, want_counts)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("vocab", [60, 248_320])
def test_record_kernel_equals_the_reference(vocab):
    gen = torch.Generator().manual_seed(vocab)
    seen, counts, rows, ids = record_inputs(gen, vocab)
    dev = [t.cuda() for t in (seen, counts, rows, ids)]
    record_tokens(*dev)
    record_ref(seen, counts, rows, ids)
    assert torch.equal(dev[0].cpu(), seen) and torch.equal(dev[1].cpu(), counts)
    # entries out of range are skipped on the device (the reference raises)
    before = [t.clone() for t in dev[:2]]
    outside = torch.tensor([0, 9, -1, 2], device="cuda"), torch.tensor([vocab, 1, 1, -7], device="cuda")
    record_tokens(dev[0], dev[1], *outside)
    assert torch.equal(dev[0], before[0]) and torch.equal(dev[1], before[1])


@cuda
@pytest.mark.cuda
def test_record_kernel_replays_in_a_cuda_graph():
    gen = torch.Generator().manual_seed(1)
    seen, counts, rows, ids = (t.cuda() for t in record_inputs(gen, 300))
    want_seen, want_counts = seen.clone(), counts.clone()
    for _ in range(2):
        record_ref(want_seen, want_counts, rows, ids)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        record_tokens(seen, counts, rows, ids)
    graph.replay()
    graph.replay()
    assert torch.equal(seen, want_seen) and torch.equal(counts, want_counts)

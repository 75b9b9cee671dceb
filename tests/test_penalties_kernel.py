"""The penalties kernel (csrc/penalties.cu) against its torch reference (ops/penalties.py), bit for
bit: fp32 logits with negatives, zeros, -inf and NaN, tables with counts from 0 to large, rows read
through an index (slots in any order, one slot for several rows) or in place, neutral rows; and the
engine's tables through it against the host-history reference (apply_penalties). The reference
itself is checked against apply_penalties in test_scheduler.py."""

from __future__ import annotations

import pytest
import torch

from ninfer_core.engine.penalties import PenaltyTables
from ninfer_core.engine.sampling import SamplingParams, TokenHistory, apply_penalties
from ninfer_core.ops import dispatch
from ninfer_core.ops.penalties import penalise, penalise_ref

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

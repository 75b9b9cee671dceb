"""The per-forward tables: `ops.rope.rotary_tables` (cos / sin of the positions) and
`ops.attention.kv_slots` (the KV rows of the new tokens, the clamped int32 block table).

CPU: each torch reference against a formulation written from the definitions (float64 angles;
a Python loop over rows and tokens with Python's floor division), and the dispatchers run the
references off CUDA. `cuda`: the kernels (csrc/step_tables.cu) equal the references bit for bit
(tables with entries out of range, int32 and int64, a strided table, padded chunks), replay in a
CUDA graph, and the bindings reject what they cannot run.
"""

from __future__ import annotations

import pytest
import torch

from ninfer_core.layers.rope import RotaryEmbedding
from ninfer_core.ops import dispatch
from ninfer_core.ops.attention import kv_slots, kv_slots_ref
from ninfer_core.ops.rope import rotary_tables, rotary_tables_ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _inv_freq(rotary: int, theta: float, device) -> torch.Tensor:
    return RotaryEmbedding(rotary, theta).inv_freq(torch.device(device))


def _positions(batch: int, tokens: int, seed: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 262_144, (batch, tokens), generator=g).to(device)


def _slots_loop(table: torch.Tensor, lens: torch.Tensor, tokens: int, page_size: int, num_pages: int,
                valid: torch.Tensor | None, pad_row: int) -> tuple[list[list[int]], list[list[int]]]:
    """The definition, one row and token at a time in Python integers."""
    clamped = [[min(max(int(p), 0), num_pages - 1) for p in row] for row in table.tolist()]
    slots = []
    for b, row in enumerate(clamped):
        out = []
        for t in range(tokens):
            index = int(lens[b]) + t
            if valid is not None and t >= int(valid[b]):
                out.append(pad_row)
                continue
            page = row[min(index // page_size, len(row) - 1)]
            out.append(page * page_size + index % page_size)
        slots.append(out)
    return slots, clamped


def _slot_case(batch: int, width: int, tokens: int, page_size: int, num_pages: int, seed: int, device,
               dtype=torch.int32):
    """A table with entries below 0 and past the pages (clamped), lengths reaching past the table's
    last column (the last column is reused), and per-row valid counts."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(-3, num_pages + 3, (batch, width), generator=g).to(dtype)
    lens = torch.randint(0, width * page_size + 2 * page_size, (batch,), generator=g)
    valid = torch.randint(0, tokens + 1, (batch,), generator=g)
    return table.to(device), lens.to(device), valid.to(device)


def test_rotary_tables_ref_matches_float64():
    positions = _positions(3, 5, 0, "cpu")
    inv_freq = _inv_freq(64, 10_000_000.0, "cpu")
    cos, sin = rotary_tables_ref(positions, inv_freq, torch.float32)
    angles = positions.double()[..., None] * inv_freq.double()
    want = torch.cat((angles, angles), dim=-1)
    # the fp32 angle of a position near 2^18 is off by up to half an ulp of 2^18 * f: 2^-6 rad
    assert cos.shape == sin.shape == (3, 5, 64)
    torch.testing.assert_close(cos.double(), want.cos(), atol=0.02, rtol=0)
    torch.testing.assert_close(sin.double(), want.sin(), atol=0.02, rtol=0)
    small = torch.arange(8)[None]
    cos, sin = rotary_tables_ref(small, inv_freq, torch.float32)
    angles = small.double()[..., None] * inv_freq.double()
    torch.testing.assert_close(cos.double(), torch.cat((angles, angles), -1).cos(), atol=1e-6, rtol=0)
    torch.testing.assert_close(sin.double(), torch.cat((angles, angles), -1).sin(), atol=1e-6, rtol=0)


def test_rotary_embedding_plain_positions_are_the_tables():
    rope = RotaryEmbedding(64, 10_000_000.0, [11, 11, 10])
    positions = _positions(2, 7, 1, "cpu")
    for got, want in zip(rope(positions, torch.bfloat16), rotary_tables_ref(positions, rope.inv_freq(positions.device),
                                                                            torch.bfloat16)):
        assert torch.equal(got, want)
    # three equal mRoPE axes are plain RoPE
    for got, want in zip(rope(positions.expand(3, -1, -1), torch.bfloat16), rope(positions, torch.bfloat16)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("tokens", [1, 16])
def test_kv_slots_ref_matches_the_definition(tokens):
    for seed, (batch, width, page_size, num_pages) in enumerate([(1, 4, 16, 9), (5, 7, 8, 30), (3, 1, 256, 2)]):
        table, lens, valid = _slot_case(batch, width, tokens, page_size, num_pages, seed, "cpu")
        for valid_tokens, pad_row in ((None, 0), (valid, 77)):
            slots, table32 = kv_slots_ref(table, lens, tokens, page_size, num_pages, valid_tokens, pad_row)
            want_slots, want_table = _slots_loop(table, lens, tokens, page_size, num_pages, valid_tokens, pad_row)
            assert slots.dtype == torch.int64 and table32.dtype == torch.int32
            assert slots.tolist() == want_slots and table32.tolist() == want_table


def test_the_dispatchers_run_the_references_off_cuda():
    table, lens, valid = _slot_case(2, 5, 3, 16, 12, 3, "cpu")
    for got, want in zip(kv_slots(table, lens, 3, 16, 12, valid, 5), kv_slots_ref(table, lens, 3, 16, 12, valid, 5)):
        assert torch.equal(got, want)
    positions, inv_freq = _positions(2, 3, 4, "cpu"), _inv_freq(32, 1e6, "cpu")
    for got, want in zip(rotary_tables(positions, inv_freq, torch.bfloat16),
                         rotary_tables_ref(positions, inv_freq, torch.bfloat16)):
        assert torch.equal(got, want)


@pytest.fixture
def cuda_kernels(monkeypatch):
    monkeypatch.delenv(dispatch.DISABLE_ENV, raising=False)
    assert dispatch.extension() is not None, "CUDA is available but ninfer_core._C is not built: run scripts/gpu_check.sh"


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rotary,theta", [(64, 10_000_000.0), (128, 1_000_000.0), (32, 10_000.0)])
@pytest.mark.parametrize("batch,tokens", [(1, 1), (8, 1), (2, 16), (1, 4099)])
def test_rotary_tables_kernel_is_bit_equal(cuda_kernels, dtype, rotary, theta, batch, tokens):
    positions = _positions(batch, tokens, batch * tokens + rotary, "cuda")
    positions[0, 0] = 0
    inv_freq = _inv_freq(rotary, theta, "cuda")
    cos, sin = rotary_tables(positions, inv_freq, dtype)
    want_cos, want_sin = rotary_tables_ref(positions, inv_freq, dtype)
    assert cos.shape == (batch, tokens, rotary) and cos.dtype == dtype
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)


@pytest.mark.cuda
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("batch,width,tokens,page_size", [(1, 1, 1, 16), (8, 300, 1, 16), (4, 33, 16, 8),
                                                         (2, 5000, 5, 256), (3, 6, 512, 64)])
def test_kv_slots_kernel_is_bit_equal(cuda_kernels, index_dtype, batch, width, tokens, page_size):
    num_pages = 97
    table, lens, valid = _slot_case(batch, width, tokens, page_size, num_pages, width + tokens, "cuda", index_dtype)
    for valid_tokens, pad_row in ((None, 0), (valid, 12_345)):
        got = kv_slots(table, lens, tokens, page_size, num_pages, valid_tokens, pad_row)
        want = kv_slots_ref(table, lens, tokens, page_size, num_pages, valid_tokens, pad_row)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and torch.equal(g, w)
    # a table read in place from a wider one (the graphs' static table, sliced to the batch)
    wide = torch.randint(-2, num_pages + 2, (batch, width + 9), device="cuda", dtype=index_dtype)
    got = kv_slots(wide[:, :width], lens, tokens, page_size, num_pages)
    want = kv_slots_ref(wide[:, :width], lens, tokens, page_size, num_pages)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.cuda
def test_step_tables_replay_in_cuda_graph(cuda_kernels):
    positions = torch.zeros(4, 1, dtype=torch.long, device="cuda")
    lens = torch.zeros(4, dtype=torch.long, device="cuda")
    table = torch.zeros(4, 64, dtype=torch.int32, device="cuda")
    inv_freq = _inv_freq(64, 10_000_000.0, "cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        rotary_tables(positions, inv_freq, torch.bfloat16)  # warm-up outside the capture
        kv_slots(table, lens, 1, 16, 200)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            cos, sin = rotary_tables(positions, inv_freq, torch.bfloat16)
            slots, table32 = kv_slots(table, lens, 1, 16, 200)
    torch.cuda.current_stream().wait_stream(stream)
    for seed in range(3):
        positions.copy_(_positions(4, 1, seed, "cuda"))
        lens.copy_(torch.randint(0, 64 * 16, (4,)))
        table.copy_(torch.randint(-1, 220, (4, 64), dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        want_cos, want_sin = rotary_tables_ref(positions, inv_freq, torch.bfloat16)
        want_slots, want_table = kv_slots_ref(table, lens, 1, 16, 200)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
        assert torch.equal(slots, want_slots) and torch.equal(table32, want_table)


@pytest.mark.cuda
def test_step_table_bindings_reject_what_they_cannot_run(cuda_kernels):
    ext = dispatch.extension()
    stream = torch.cuda.current_stream().cuda_stream
    positions = torch.zeros(3, dtype=torch.long, device="cuda")
    inv_freq = torch.ones(16, device="cuda")
    cos = torch.empty(3, 32, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="positions"):
        ext.rotary_tables(cos=cos, sin=torch.empty_like(cos), positions=positions.int(), inv_freq=inv_freq, stream=stream)
    with pytest.raises(ValueError, match="cos"):
        ext.rotary_tables(cos=cos[:, :16], sin=torch.empty_like(cos), positions=positions, inv_freq=inv_freq,
                          stream=stream)
    with pytest.raises(ValueError, match="sin"):
        ext.rotary_tables(cos=cos, sin=cos, positions=positions, inv_freq=inv_freq, stream=stream)
    table = torch.zeros(2, 8, dtype=torch.int32, device="cuda")
    lens = torch.zeros(2, dtype=torch.long, device="cuda")
    slots = torch.empty(2, 1, dtype=torch.long, device="cuda")
    table32 = torch.empty(2, 8, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="cache_lens"):
        ext.kv_slots(slots=slots, table_out=table32, block_table=table, cache_lens=lens.int(), valid_tokens=None,
                     page_size=16, num_pages=4, pad_row=0, stream=stream)
    with pytest.raises(ValueError, match="table_out"):
        ext.kv_slots(slots=slots, table_out=table32[:, :4], block_table=table, cache_lens=lens, valid_tokens=None,
                     page_size=16, num_pages=4, pad_row=0, stream=stream)
    with pytest.raises(ValueError, match="page_size"):
        ext.kv_slots(slots=slots, table_out=table32, block_table=table, cache_lens=lens, valid_tokens=None,
                     page_size=0, num_pages=4, pad_row=0, stream=stream)
    with pytest.raises(ValueError, match="CUDA device"):
        ext.kv_slots(slots=slots, table_out=table32, block_table=table, cache_lens=lens.cpu(), valid_tokens=None,
                     page_size=16, num_pages=4, pad_row=0, stream=stream)

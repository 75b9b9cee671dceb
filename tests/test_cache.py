"""CacheManager bookkeeping (slots, pages, block tables, capacity) and GDN state snapshots."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ninfer_core.cache import CacheManager, KVPool
from ninfer_core.cache.state_pool import StatePool
from ninfer_core.config import ModelConfig
from ninfer_core.errors import ContextLengthError, NinferError

# 3 GDN layers + 1 attention layer; sizes chosen so every byte count below is easy to check by hand.
CONFIG = ModelConfig(
    arch="qwen3_5",
    vocab_size=10,
    hidden_size=8,
    num_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    linear_num_key_heads=1,
    linear_num_value_heads=2,
    linear_key_head_dim=3,
    linear_value_head_dim=5,
    linear_conv_kernel_dim=4,
)


def make(max_tokens=64, max_seqs=3, page_size=4) -> CacheManager:
    return CacheManager(CONFIG, max_tokens=max_tokens, max_seqs=max_seqs, page_size=page_size, dtype=torch.float16)


def test_pool_shapes_and_bytes():
    m = make(max_tokens=62)  # rounds up to 16 pages of 4
    cache = m.cache
    assert cache.page_size == 4 and m.capacity_tokens == 64
    assert set(cache.kv.k) == {3} and set(cache.state.conv) == {0, 1, 2}
    assert cache.kv.k[3].shape == (16, 4, 1, 4) and cache.kv.k[3].dtype == torch.float16
    conv_dim = 2 * 1 * 3 + 2 * 5
    assert cache.state.conv[0].shape == (3, conv_dim, 3) and cache.state.conv[0].dtype == torch.float16
    assert cache.state.recurrent[0].shape == (3, 2, 3, 5) and cache.state.recurrent[0].dtype == torch.float32
    # KV: k + v, 1 layer, 64 tokens, 1 head x 4 dims, 2 bytes.
    assert m.kv_bytes == 2 * 1 * 64 * 4 * 2
    # State: 3 layers x 3 slots x (conv 16 x 3 fp16 + recurrent 2 x 3 x 5 fp32).
    assert m.state_bytes == 3 * 3 * (conv_dim * 3 * 2 + 30 * 4)
    assert m.total_bytes == m.kv_bytes + m.state_bytes


def test_reserve_pages_and_block_table():
    m = make()
    a, b = m.allocate(), m.allocate()
    assert a.slot != b.slot and a.pages == [] and m.num_free_slots == 1
    m.reserve(a, 9)  # 3 pages
    m.reserve(b, 4)  # 1 page
    m.reserve(a, 12)  # still 3 pages
    assert len(a.pages) == 3 and len(b.pages) == 1 and m.capacity(a) == 12
    assert len(set(a.pages) | set(b.pages)) == 4
    assert m.free_tokens == 64 - 16
    table = m.block_table([b, a])
    assert table.dtype == torch.int32 and table.shape == (2, 3)
    assert table[0].tolist() == b.pages + [0, 0] and table[1].tolist() == a.pages


def test_exhausted_capacity_raises_context_length_error_and_allocates_nothing():
    m = make(max_tokens=16)
    a, b = m.allocate(), m.allocate()
    m.reserve(a, 10)
    assert not m.can_reserve(b, 7) and m.can_reserve(b, 4)
    with pytest.raises(ContextLengthError) as exc:
        m.reserve(b, 7)
    assert exc.value.prompt_tokens == 7 and exc.value.limit == 4
    assert b.pages == [] and m.free_tokens == 4


def test_slots_exhausted():
    m = make(max_seqs=1)
    m.allocate()
    with pytest.raises(NinferError, match="slots"):
        m.allocate()


def test_free_and_truncate_return_pages():
    m = make()
    a = m.allocate()
    m.reserve(a, 20)  # 5 pages
    first_pages = list(a.pages)
    m.truncate(a, 9)  # keeps 3 pages
    assert a.pages == first_pages[:3] and m.free_tokens == 64 - 12
    m.truncate(a, 12)
    assert len(a.pages) == 3
    m.free(a)
    assert m.free_tokens == 64 and m.num_free_slots == 3
    with pytest.raises(ValueError):
        m.free(a)


def test_allocate_zeroes_a_reused_slot():
    m = make(max_seqs=1)
    a = m.allocate()
    m.cache.state.recurrent[1][a.slot].fill_(3.0)
    m.cache.state.conv[2][a.slot].fill_(1.0)
    m.free(a)
    b = m.allocate()
    assert b.slot == a.slot
    assert not m.cache.state.recurrent[1][b.slot].any() and not m.cache.state.conv[2][b.slot].any()


def test_snapshot_restore_and_copy_state():
    m = make()
    a, b = m.allocate(), m.allocate()
    gen = torch.Generator().manual_seed(0)
    for i in m.cache.state.layers:
        m.cache.state.recurrent[i][a.slot] = torch.randn(2, 3, 5, generator=gen)
        m.cache.state.conv[i][a.slot] = torch.randn(16, 3, generator=gen).half()
    before = {i: m.cache.state.recurrent[i][a.slot].clone() for i in m.cache.state.layers}
    snap = m.snapshot(a.slot)
    for i in m.cache.state.layers:
        m.cache.state.recurrent[i][a.slot].add_(1.0)
        m.cache.state.conv[i][a.slot].zero_()
    m.restore(a.slot, snap)
    for i in m.cache.state.layers:
        assert torch.equal(m.cache.state.recurrent[i][a.slot], before[i])
        assert torch.equal(m.cache.state.conv[i][a.slot], snap.conv[i])
    m.copy_state(a.slot, b.slot)
    for i in m.cache.state.layers:
        assert torch.equal(m.cache.state.recurrent[i][b.slot], before[i])
        assert torch.equal(m.cache.state.conv[i][b.slot], snap.conv[i])


def test_state_slot_ops_without_gdn_layers():
    """A model without GDN layers (Llama): its state pool holds nothing, and zeroing, restoring or
    copying a slot does nothing (the foreach ops it uses take no empty list)."""
    pool = StatePool([], num_slots=2, conv_dim=16, conv_kernel=4, num_v_heads=2, head_k_dim=3, head_v_dim=5,
                     dtype=torch.float16, device="cpu")
    pool.reset(1)
    pool.restore(0, pool.snapshot(1))
    pool.copy(0, 1)
    assert pool.nbytes == 0 and pool.snapshot(0).conv == {}


def test_invalid_sizes_rejected():
    with pytest.raises(NinferError):
        make(max_tokens=0)


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the resident set size from /proc")
def test_cpu_kv_pages_take_memory_only_once_written():
    """Issue 17 item 3: a CPU server sized for 8 x 8192 tokens held 3 GB of KV from the start."""
    before = _rss()
    pool = KVPool([0, 1], num_pages=4096, page_size=16, num_kv_heads=8, head_dim=128, dtype=torch.float32,
                  device="cpu")
    assert pool.nbytes == 2**30
    assert _rss() - before < 64 << 20  # 1 GiB of pages, almost none of it resident
    pool.k[0][:64] = 1.0  # the K pages of a 1024-token sequence in one layer: 4 MiB
    assert _rss() - before >= 3 << 20
    assert pool.k[0][63].eq(1).all() and pool.k[0][64].eq(0).all() and pool.v[1][4095].eq(0).all()


def test_resident_kv_bytes_follow_the_highest_page_handed_out():
    cache = make(max_tokens=64, max_seqs=3, page_size=4)  # 16 pages
    per_page = cache.cache.kv.bytes_per_token * 4
    assert cache.resident_kv_bytes == 0
    a, b = cache.allocate(), cache.allocate()
    cache.reserve(a, 8)
    cache.reserve(b, 5)
    assert cache.resident_kv_bytes == 4 * per_page  # pages 0-3
    cache.free(a)
    cache.reserve(b, 9)  # reuses a freed low page: no new memory
    assert cache.resident_kv_bytes == 4 * per_page

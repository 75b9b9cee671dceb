"""ops/moe_align.py: the slots of a routing grouped by expert. The torch reference is checked
against the layout's definition; the CUDA kernel (csrc/moe.cu) against the reference: the same
used count and block experts, the same slots in every block (their order inside an expert's rows
is free)."""

from __future__ import annotations

import pytest
import torch

from ninfer_core.ops import dispatch
from ninfer_core.ops.moe_align import align_by_expert, align_by_expert_ref, align_capacity

CASES = [(1, 1, 4, 16), (7, 2, 6, 16), (40, 8, 16, 32), (300, 8, 64, 64), (1, 8, 256, 8), (8, 8, 256, 8),
         (48, 8, 256, 16), (512, 8, 256, 32), (4096, 8, 256, 64), (8192, 8, 256, 128)]


def _ids(tokens: int, top_k: int, experts: int, device: str = "cpu", seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(tokens * 31 + experts + 7919 * seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    return ids.to(device, torch.int32)


def _check_layout(ids: torch.Tensor, experts: int, block_m: int, aligned) -> None:
    slots, block_experts, used = (t.cpu() for t in aligned)
    n = ids.numel()
    assert slots.dtype == block_experts.dtype == used.dtype == torch.int32
    assert slots.numel() == align_capacity(n, experts, block_m) and slots.numel() % block_m == 0
    assert block_experts.numel() == slots.numel() // block_m
    real = slots[slots < n]
    assert sorted(real.tolist()) == list(range(n))  # every slot exactly once
    assert (slots[slots >= n] == n).all()  # the rest is padding
    flat = ids.reshape(-1).long().cpu()
    counts = torch.bincount(flat, minlength=experts)
    assert int(used) == int(((counts + block_m - 1) // block_m * block_m).sum()) <= slots.numel()
    for b, expert in enumerate(block_experts.tolist()):
        block = slots[b * block_m : (b + 1) * block_m]
        block = block[block < n]
        if b * block_m < int(used):
            assert block.numel() > 0 and (flat[block.long()] == expert).all()
        else:
            assert block.numel() == 0 and expert == experts - 1


@pytest.mark.parametrize("tokens,top_k,experts,block_m", CASES)
def test_reference_groups_every_slot_once(tokens, top_k, experts, block_m):
    ids = _ids(tokens, top_k, experts)
    _check_layout(ids, experts, block_m, align_by_expert_ref(ids, experts, block_m))


def test_capacity_is_reached_by_the_worst_routing():
    """Every expert hit once more than a block's multiple: the bound is tight, not just safe."""
    experts, block_m = 4, 8
    ids = torch.tensor([e for e in range(experts) for _ in range(block_m + 1)], dtype=torch.int32)[:, None]
    slots, _, used = align_by_expert_ref(ids, experts, block_m)
    assert int(used) == slots.numel() == align_capacity(ids.numel(), experts, block_m) == 2 * block_m * experts


@pytest.mark.cuda
@pytest.mark.parametrize("tokens,top_k,experts,block_m", CASES)
def test_kernel_matches_reference(monkeypatch, tokens, top_k, experts, block_m):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    monkeypatch.delenv(dispatch.DISABLE_ENV, raising=False)
    assert dispatch.kernels_available(), "CUDA is available but ninfer_core._C is not built"
    ids = _ids(tokens, top_k, experts, "cuda")
    got = align_by_expert(ids, experts, block_m)
    want = align_by_expert_ref(ids, experts, block_m)
    _check_layout(ids, experts, block_m, got)
    assert torch.equal(got[2], want[2]) and torch.equal(got[1], want[1])
    blocks = got[1].cpu()
    for expert in blocks[: int(want[2]) // block_m].unique().tolist():  # the same slots per expert
        rows = (blocks == expert).repeat_interleave(block_m).to(ids.device)
        assert sorted(got[0][rows].tolist()) == sorted(want[0][rows].tolist())


@pytest.mark.cuda
def test_kernel_in_a_cuda_graph_follows_new_routings(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    monkeypatch.delenv(dispatch.DISABLE_ENV, raising=False)
    ids = _ids(37, 8, 256, "cuda")
    align_by_expert(ids, 256, 16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = align_by_expert(ids, 256, 16)
    for seed in (1, 2):
        ids.copy_(_ids(37, 8, 256, "cuda", seed))
        graph.replay()
        torch.cuda.synchronize()
        _check_layout(ids, 256, 16, got)

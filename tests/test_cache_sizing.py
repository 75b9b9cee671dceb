"""KV sizing beside what else takes GPU memory (cache/sizing.py, llm.py): a drafter's own KV shares the
pages' budget, and the engine sizes its cache after the drafter's weights are resident, with the
per-token bytes its drafter then really allocates (MTP layer, DFlash model; n-gram none); a vision
tower built on the first image has its weights' room kept.

The GPU's free memory is stubbed (torch.cuda.mem_get_info) for the arithmetic; the engine runs on the
CPU (tiny random Qwen3.5 models), where its drafters' caches and the tower are allocated as on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from ninfer_core import llm as llm_module
from ninfer_core.cache.kv_pool import kv_bytes_per_token
from ninfer_core.cache.sizing import WORKSPACE_MIN_BYTES, plan_cache
from ninfer_core.cache.state_pool import state_bytes_per_slot
from ninfer_core.config import load_config
from ninfer_core.errors import NinferError
from ninfer_core.llm import LLM, EngineOptions
from speculative_harness import load, write_drafter, write_target
from tiny_model_dir import write_tiny_multimodal_dir

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_target(tmp_path_factory)[0]


def test_a_drafters_kv_shares_the_pages_budget(monkeypatch, target):
    """Free memory for exactly 1,000 target tokens past the workspace and state slots: alone they get
    1,000; with a drafter of a quarter of their bytes a token, the most tokens whose pages and drafter
    entries together fit."""
    config = load_config(target)
    per_token, seqs = kv_bytes_per_token(config, "auto", BF16), 4
    reserved = WORKSPACE_MIN_BYTES + (seqs + 1) * state_bytes_per_slot(config, BF16)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (reserved + 1000 * per_token, 16 << 30))

    def plan(draft: int = 0, later: int = 0) -> int:
        return plan_cache(config, torch.device("cuda"), BF16, kv_dtype="auto", max_seqs=seqs, max_context=None,
                          default_context=4096, kv_capacity=None, draft_kv_bytes_per_token=draft,
                          later_bytes=later).kv_tokens

    assert plan() == 1000
    draft = per_token // 4
    tokens = plan(draft)
    assert tokens * (per_token + draft) <= 1000 * per_token < (tokens + 1) * (per_token + draft)
    assert plan(later=300 * per_token) == 700  # a vision tower's room, kept for its first image
    with pytest.raises(NinferError, match="weights loaded later"):
        plan(later=1000 * per_token)


@pytest.mark.parametrize("spec", ["mtp", "dflash", "ngram"])
def test_the_engine_sizes_its_cache_after_loading_the_drafter(monkeypatch, tmp_path_factory, target, spec):
    """The drafter's weights load first, then the sizing, told the bytes a token of the drafter's KV
    takes: what its cache then holds for each of the target's pages' tokens."""
    options = {"spec": spec}
    if spec == "dflash":
        options["draft_model"] = write_drafter(tmp_path_factory, target)[0]
    calls: list[tuple[str, int]] = []
    load_draft, plan = llm_module.load_draft_weights, llm_module.plan_cache

    def loading(*args, **kwargs):
        calls.append(("draft", 0))
        return load_draft(*args, **kwargs)

    def planning(*args, **kwargs):
        calls.append(("plan", kwargs["draft_kv_bytes_per_token"]))
        return plan(*args, **kwargs)

    monkeypatch.setattr(llm_module, "load_draft_weights", loading)
    monkeypatch.setattr(llm_module, "plan_cache", planning)
    llm = load(target, **options)
    assert [name for name, _ in calls] == ["draft", "plan"]
    per_token = calls[1][1]
    cache, drafter = llm.engine.cache, llm.engine.speculator.drafter
    assert drafter.cache_bytes == cache.num_pages * cache.page_size * per_token
    assert (per_token > 0) == (spec != "ngram")


def test_the_engine_keeps_room_for_the_vision_tower_it_builds_later(monkeypatch, tmp_path):
    """A multimodal model's sizing is told the bytes of the tower it has not built yet: those of its
    weights once built (then 0: nothing more to keep)."""
    directory = write_tiny_multimodal_dir(tmp_path / "mm", moe=False).directory
    later: list[int] = []
    plan = llm_module.plan_cache

    def planning(*args, **kwargs):
        later.append(kwargs["later_bytes"])
        return plan(*args, **kwargs)

    monkeypatch.setattr(llm_module, "plan_cache", planning)
    llm = LLM.load(str(directory), EngineOptions(device="cpu", dtype="float32", max_seqs=1, max_context=256))
    tower = llm.vision.tower()
    assert later == [sum(p.numel() * p.element_size() for p in tower.parameters())] and later[0] > 0
    assert llm.vision.tower_bytes() == 0

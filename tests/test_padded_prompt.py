"""A padded prompt chunk (`ForwardBatch.valid_tokens`, what the prefill CUDA graphs run) through a
whole MoE model on the CPU, fp32: the real tokens' logits are those of the unpadded forward, and the
padding tokens route as real tokens of their row (ops/moe.py `padding_route_rows`), so the experts
read are the real tokens' only."""

from __future__ import annotations

import pytest
import torch

from hf_reference import assert_close_rel, build_hf_model, load_from_hf, ninfer_config, tiny_qwen3_5_config
from ninfer_core.cache import CacheManager
from ninfer_core.layers import moe as moe_layer
from ninfer_core.models.base import ForwardBatch

torch.set_num_threads(1)
REAL, BUCKET = 3, 16


@pytest.fixture(scope="module")
def model():
    from ninfer_core.models.qwen3_5 import Qwen3_5ForCausalLM

    # 24 experts, top-2: 3 real tokens hit at most 6 a layer, 13 padding tokens routed as their own
    # would hit others
    hf_config = tiny_qwen3_5_config(True, num_experts=24, num_experts_per_tok=2)
    ours = Qwen3_5ForCausalLM(ninfer_config(hf_config)).float().eval()
    load_from_hf(ours, build_hf_model(hf_config, seed=4))
    return ours


def _forward(model, ids: torch.Tensor, valid: int | None) -> torch.Tensor:
    manager = CacheManager(model.config, 256, 2, 16, dtype=torch.float32, scratch=True)
    seq = manager.allocate()
    manager.reserve(seq, ids.shape[1] if valid is None else valid)
    batch = ForwardBatch(
        input_ids=ids, positions=torch.arange(ids.shape[1])[None], cache_lens=torch.zeros(1, dtype=torch.long),
        slots=torch.tensor([seq.slot]), block_table=manager.block_table([seq]), logits="all",
        valid_tokens=None if valid is None else torch.tensor([valid]),
        pad_kv_row=manager.scratch_page * manager.page_size,
    )
    with torch.no_grad():
        return model(batch, manager.cache).logits[0]


def test_padding_routes_as_real_tokens_and_leaves_their_logits(model, monkeypatch):
    calls = []

    def recording_route(logits, top_k, renormalize, rows=None):
        weights, ids = route(logits, top_k, renormalize, rows)
        calls.append((rows, ids, route(logits, top_k, renormalize)[1]))
        return weights, ids

    route = moe_layer.moe_route
    monkeypatch.setattr(moe_layer, "moe_route", recording_route)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 300, (1, BUCKET), generator=gen)
    ids[0, REAL:] = 0  # the graphs' padding ids
    want = _forward(model, ids[:, :REAL], None)
    assert calls and all(rows is None for rows, _, _ in calls)
    calls.clear()
    got = _forward(model, ids, REAL)
    assert_close_rel(got[:REAL], want, 1e-5)
    assert len(calls) == len(model.config.layer_types)  # every layer is MoE
    for rows, routed, own in calls:
        assert rows.tolist() == [t % REAL for t in range(BUCKET)]
        assert torch.equal(routed[:REAL], own[:REAL]) and torch.equal(routed[REAL:], routed[rows[REAL:]])
        assert set(routed.flatten().tolist()) == set(own[:REAL].flatten().tolist())
    # what the padding's own routing would have read: more experts (so the test can tell)
    assert any(len(set(own.flatten().tolist())) > len(set(own[:REAL].flatten().tolist())) for _, _, own in calls)

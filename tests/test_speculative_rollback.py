"""Exact rollback of rejected draft tokens: GDN state (record + commit) and attention KV.

Layer level: a verify forward leaves the state pools untouched and gives the plain forward's
outputs (its token loop vs the chunked form: fp32 rounding apart); committing n tokens gives the state of n plain decode steps (fp32 rounding apart:
a T-row projection rounds differently from T one-row ones) and does not depend, bit for bit, on
the rejected tokens. Model level (dense tiny Qwen3.5, fp32): after verifying [t, d1, d2, d3],
keeping [t, d1] leaves a cache (GDN slots, KV of the kept positions) and a continuation that are
bitwise identical whatever d2, d3 were. (With MoE the kept rows' expert GEMMs also batch the
rejected rows' tokens, so only near-equality holds there; the engine tests cover MoE.)
"""

from __future__ import annotations

import torch

from ninfer_core.cache import CacheManager
from ninfer_core.config import ModelConfig
from ninfer_core.engine.speculative.rollback import commit_gdn
from ninfer_core.layers.gdn import GatedDeltaNet
from ninfer_core.models.base import ForwardBatch
from hf_reference import Runner, build_pair

torch.set_num_threads(1)

GDN_CONFIG = ModelConfig(
    arch="qwen3_5", vocab_size=16, hidden_size=24, num_layers=1, layer_types=["linear_attention"], num_heads=2,
    num_kv_heads=1, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
    linear_value_head_dim=6, linear_conv_kernel_dim=4,
)


def gdn_layer_and_pools(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    layer = GatedDeltaNet(GDN_CONFIG)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    conv = torch.randn(3, layer.conv_dim, 3, generator=gen)
    state = torch.randn(3, 4, 8, 6, generator=gen)
    return layer, conv, state, gen


def test_gdn_verify_leaves_pools_and_commit_equals_plain_decode():
    layer, conv, state, gen = gdn_layer_and_pools()
    slots = torch.tensor([2, 0])
    x = torch.randn(2, 5, 24, generator=gen)
    conv0, state0 = conv.clone(), state.clone()
    with torch.no_grad():
        out, record = layer.verify(x, conv, state, slots)
        assert torch.equal(conv, conv0) and torch.equal(state, state0)  # nothing written
        # the plain forward's outputs (its T > 1 path is the chunked form: equal up to fp32 rounding)
        torch.testing.assert_close(out, layer(x, conv.clone(), state.clone(), slots), atol=1e-5, rtol=1e-5)
        for n in (1, 3, 5):
            conv_c, state_c = conv0.clone(), state0.clone()
            layer.commit(record, conv_c, state_c, slots, torch.tensor([n, n]))
            conv_d, state_d = conv0.clone(), state0.clone()
            for t in range(n):  # plain decode, one token per step
                layer(x[:, t : t + 1], conv_d, state_d, slots)
            torch.testing.assert_close(conv_c, conv_d, atol=1e-6, rtol=1e-6)  # projections: T rows vs 1
            torch.testing.assert_close(state_c, state_d, atol=1e-5, rtol=1e-5)
            assert torch.equal(conv_c[1], conv0[1]) and torch.equal(state_c[1], state0[1])  # other slots untouched


def test_gdn_commit_ignores_rejected_tokens_bitwise():
    layer, conv, state, gen = gdn_layer_and_pools(1)
    slots = [1, 2]
    x = torch.randn(2, 6, 24, generator=gen)
    y = x.clone()
    y[:, 3:] = torch.randn(2, 3, 24, generator=gen)  # a different rejected tail
    results = []
    with torch.no_grad():
        for inputs in (x, y):
            _, record = layer.verify(inputs, conv, state, torch.tensor(slots))
            conv_c, state_c = conv.clone(), state.clone()
            layer.commit(record, conv_c, state_c, torch.tensor(slots), torch.tensor([3, 2]))  # different counts
            results.append((conv_c, state_c))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_model_rollback_is_bitwise_independent_of_the_rejected_tail():
    _, model = build_pair(moe=False)
    runner = Runner(model, max_tokens=256, max_seqs=3)
    prompt = torch.arange(3, 40)
    seqs = [runner.new_seq(), runner.new_seq()]
    plain = runner.new_seq()
    for seq in (*seqs, plain):
        runner.prefill(seq, prompt, chunk=16)
    manager: CacheManager = runner.manager
    n = len(prompt)
    rows = [[7, 8, 9, 10], [7, 8, 200, 201]]  # last token, kept draft, then two different rejected drafts
    for seq, ids in zip(seqs, rows):
        manager.reserve(seq.cache, n + 4)
        batch = ForwardBatch(
            input_ids=torch.tensor([ids]), positions=torch.arange(n, n + 4)[None], cache_lens=torch.tensor([n]),
            slots=torch.tensor([seq.cache.slot]), block_table=manager.block_table([seq.cache]), logits="all",
            verify=True,
        )
        with torch.no_grad():
            out = model(batch, manager.cache)
        commit_gdn(model, manager.cache.state, out.gdn_records, batch.slots, torch.tensor([2]))
        manager.truncate(seq.cache, n + 2)
        seq.length = n + 2
    a, b = (s.cache.slot for s in seqs)
    state = manager.cache.state
    for layer in state.layers:
        assert torch.equal(state.conv[layer][a], state.conv[layer][b])
        assert torch.equal(state.recurrent[layer][a], state.recurrent[layer][b])
    kv = manager.cache.kv
    for layer in kv.layers:
        for cache in (kv.k[layer], kv.v[layer]):
            kept = [cache[s.cache.pages].flatten(0, 1)[: n + 2] for s in seqs]
            assert torch.equal(kept[0], kept[1])
    logits = [runner.step([s], torch.tensor([[11, 12]])).logits for s in seqs]  # the continuation
    assert torch.equal(logits[0], logits[1])
    for token in (7, 8):  # plain decode of the kept tokens gives the same continuation, up to rounding
        runner.step([plain], torch.tensor([[token]]))
    torch.testing.assert_close(runner.step([plain], torch.tensor([[11, 12]])).logits, logits[0], atol=1e-4, rtol=1e-4)

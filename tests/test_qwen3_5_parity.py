"""Qwen3_5ForCausalLM against transformers on tiny random models (MoE and dense), fp32 on CPU.

The reference is transformers' Qwen3_5MoeForCausalLM / Qwen3_5ForCausalLM run without a cache
(full recompute) or through its own generate(); ours runs over the paged cache with every step
shape the engine uses: one-shot and chunked prefill, T=1 decode, batched decode, T=3 verify.
"""

from __future__ import annotations

import copy

import pytest
import torch

from hf_reference import Runner, assert_close_rel, build_pair, hf_logits, hf_text_state_dict
from ninfer_core.errors import ModelLoadError
from ninfer_core.models.base import ForwardBatch
from ninfer_core.models.qwen3_5 import Qwen3_5ForCausalLM

torch.set_num_threads(1)  # tiny tensors: thread start-up dominates and cores are shared

VOCAB = 300


def random_ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=["moe", "dense"])
def pair(request):
    return build_pair(moe=request.param == "moe")


def test_prefill_matches_hf(pair):
    hf, ours = pair
    ids = random_ids(100, seed=1)
    ref = hf_logits(hf, ids[None])[0]
    runner = Runner(ours)
    got = runner.prefill(runner.new_seq(), ids, chunk=100)
    assert_close_rel(got, ref)


def test_hidden_states_are_last_layer_output(pair):
    """ForwardOutput.hidden_states is the last decoder layer's output, before the final norm."""
    hf, ours = pair
    ids = random_ids(20, seed=2)
    captured = []
    hook = hf.model.layers[-1].register_forward_hook(lambda mod, args, out: captured.append(out))
    try:
        hf_logits(hf, ids[None])
    finally:
        hook.remove()
    runner = Runner(ours)
    out = runner.step([runner.new_seq()], ids[None], logits="none")
    assert out.logits is None
    assert_close_rel(out.hidden_states, captured[0])


def test_decode_steps_match_hf_recompute(pair):
    hf, ours = pair
    prompt, steps = 40, 32
    ids = random_ids(prompt + steps, seed=3)
    ref = hf_logits(hf, ids[None])[0]
    runner = Runner(ours)
    seq = runner.new_seq()
    runner.prefill(seq, ids[:prompt], chunk=16)
    for i in range(prompt, prompt + steps):
        out = runner.step([seq], ids[None, i : i + 1], logits="last")
        assert out.logits.shape == (1, 1, VOCAB) and out.logits.dtype == torch.float32
        assert_close_rel(out.logits[0, 0], ref[i])


def test_greedy_matches_hf_generate(pair):
    hf, ours = pair
    prompt, new_tokens = random_ids(12, seed=4), 64
    with torch.no_grad():
        expected = hf.generate(prompt[None], max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    expected = expected[0, len(prompt) :].tolist()

    runner = Runner(ours)
    seq = runner.new_seq()
    token = int(runner.prefill(seq, prompt, chunk=5)[-1].argmax())
    generated = [token]
    while len(generated) < new_tokens:
        token = int(runner.step([seq], torch.tensor([[token]]), logits="last").logits[0, -1].argmax())
        generated.append(token)
    assert generated == expected


@pytest.mark.parametrize("chunk", [64, 37, 16, 5])
def test_chunked_prefill_equals_one_shot(pair, chunk):
    """Chunks that are and are not multiples of the GDN chunk (64) and of the page size (16)."""
    _, ours = pair
    ids = random_ids(150, seed=5)
    one_shot = Runner(ours)
    seq_a = one_shot.new_seq()
    ref = one_shot.prefill(seq_a, ids, chunk=150)
    ref_next = one_shot.step([seq_a], ids[None, :1]).logits

    chunked = Runner(ours)
    seq_b = chunked.new_seq()
    assert_close_rel(chunked.prefill(seq_b, ids, chunk=chunk), ref)
    assert_close_rel(chunked.step([seq_b], ids[None, :1]).logits, ref_next)


def test_batched_decode_equals_separate(pair):
    """One decode step over 3 sequences of different lengths equals each sequence on its own."""
    hf, ours = pair
    runner = Runner(ours)
    prompts = [random_ids(n, seed=10 + n) for n in (5, 23, 40)]
    next_tokens = torch.tensor([[7], [123], [299]])
    seqs = [runner.new_seq() for _ in prompts]
    for seq, prompt in zip(seqs, prompts):
        runner.prefill(seq, prompt, chunk=16)
    snaps = [runner.manager.snapshot(s.cache.slot) for s in seqs]

    batched = runner.step(seqs, next_tokens, logits="last").logits
    assert batched.shape == (3, 1, VOCAB)
    for b, (seq, prompt) in enumerate(zip(seqs, prompts)):
        runner.rollback(seq, len(prompt), snaps[b])
        alone = runner.step([seq], next_tokens[b : b + 1], logits="last").logits
        assert_close_rel(batched[b], alone[0])
        ref = hf_logits(hf, torch.cat([prompt, next_tokens[b]])[None])[0, -1]
        assert_close_rel(batched[b, 0], ref)


def test_multi_token_step_equals_single_steps(pair):
    """A T=3 step (speculative verify shape) over 2 sequences equals 3 T=1 steps."""
    _, ours = pair
    runner = Runner(ours)
    prompts = [random_ids(n, seed=20 + n) for n in (20, 33)]
    seqs = [runner.new_seq() for _ in prompts]
    for seq, prompt in zip(seqs, prompts):
        runner.prefill(seq, prompt, chunk=16)
    snaps = [runner.manager.snapshot(s.cache.slot) for s in seqs]
    draft = torch.tensor([[1, 2, 3], [250, 17, 99]])

    multi = runner.step(seqs, draft, logits="all").logits
    assert multi.shape == (2, 3, VOCAB)
    for seq, prompt, snap in zip(seqs, prompts, snaps):
        runner.rollback(seq, len(prompt), snap)
    singles = torch.cat([runner.step(seqs, draft[:, t : t + 1]).logits for t in range(3)], dim=1)
    assert_close_rel(multi, singles)


def test_snapshot_restore_reproduces_outputs(pair):
    _, ours = pair
    runner = Runner(ours)
    seq = runner.new_seq()
    runner.prefill(seq, random_ids(30, seed=6), chunk=30)
    snap = runner.manager.snapshot(seq.cache.slot)
    tokens_a, tokens_b = random_ids(5, seed=7)[None], random_ids(5, seed=8)[None]

    first = runner.step([seq], tokens_a).logits
    runner.rollback(seq, 30, snap)
    other = runner.step([seq], tokens_b).logits
    runner.rollback(seq, 30, snap)
    again = runner.step([seq], tokens_a).logits
    assert not torch.allclose(first, other)
    torch.testing.assert_close(again, first, rtol=0, atol=0)


def test_mrope_positions(pair):
    """Equal (t, h, w) axes equal plain positions; distinct axes match transformers' mRoPE."""
    hf, ours = pair
    ids = random_ids(24, seed=9)
    plain = Runner(ours)
    ref = plain.step([plain.new_seq()], ids[None]).logits

    same_axes = torch.arange(24).expand(3, 1, 24)
    runner = Runner(ours)
    got = runner.step([runner.new_seq()], ids[None], mrope_positions=same_axes).logits
    assert_close_rel(got, ref)

    t = torch.arange(24)
    # Positions far apart on W so even the slowest frequency slot (T vs W in [5, 4, 3]) matters.
    distinct = torch.stack([t, (t * 5) % 11, (t * 397) % 4096])[:, None, :]
    runner = Runner(ours)
    got = runner.step([runner.new_seq()], ids[None], mrope_positions=distinct).logits
    assert_close_rel(got, hf_logits(hf, ids[None], position_ids=distinct))
    assert not torch.allclose(got, ref, atol=1e-3)


def test_rotary_tables_match_hf_real_layout():
    """cos/sin for the 35B-A3B layout (head_dim 256, 64 rotary dims, theta 1e7, mRoPE [11, 11, 10])."""
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextRotaryEmbedding

    from ninfer_core.layers.rope import RotaryEmbedding

    rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10]}
    hf_rotary = Qwen3_5MoeTextRotaryEmbedding(Qwen3_5MoeTextConfig(head_dim=256, rope_parameters=rope))
    positions = torch.randint(0, 200_000, (3, 2, 7), generator=torch.Generator().manual_seed(0))
    ref_cos, ref_sin = hf_rotary(torch.zeros(1, dtype=torch.float32), positions)
    cos, sin = RotaryEmbedding(64, 1e7, [11, 11, 10])(positions, torch.float32)
    torch.testing.assert_close(cos, ref_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, ref_sin, rtol=0, atol=1e-6)


def test_inputs_embeds_replace_embedding(pair):
    _, ours = pair
    ids = random_ids(10, seed=12)
    runner = Runner(ours)
    ref = runner.step([runner.new_seq()], ids[None]).logits
    runner = Runner(ours)
    seq = runner.new_seq()
    batch_embeds = ours.embed_tokens(ids[None]).detach()
    runner.manager.reserve(seq.cache, 10)
    batch = ForwardBatch(
        input_ids=torch.zeros(1, 10, dtype=torch.int64),
        positions=torch.arange(10)[None],
        cache_lens=torch.zeros(1, dtype=torch.int64),
        slots=torch.tensor([seq.cache.slot]),
        block_table=runner.manager.block_table([seq.cache]),
        inputs_embeds=batch_embeds,
        logits="last",
    )
    with torch.no_grad():
        got = ours(batch, runner.manager.cache).logits
    assert_close_rel(got, ref[:, -1:])


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def run_prefill_then_decode(model, ids: torch.Tensor, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, Runner]:
    """Logits [60, V] of a 50-token prefill in chunks of 20, then 10 single-token decode steps."""
    runner = Runner(model, dtype=dtype, device=device)
    seq = runner.new_seq()
    logits = [runner.prefill(seq, ids[:50], chunk=20)]
    logits += [runner.step([seq], ids[None, i : i + 1], logits="last").logits[0] for i in range(50, 60)]
    return torch.cat(logits).cpu(), runner


@pytest.mark.parametrize("device", DEVICES)
def test_fp32_on_device_matches_hf(pair, device):
    hf, ours = pair
    ids = random_ids(60, seed=13)
    got, _ = run_prefill_then_decode(copy.deepcopy(ours).to(device), ids, torch.float32, device)
    assert_close_rel(got, hf_logits(hf, ids[None])[0])


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_runs_close_to_fp32(pair, device):
    """The GPU dtype: bf16 weights, activations and KV, fp32 GDN state, fp32 logits."""
    hf, ours = pair
    ids = random_ids(60, seed=14)
    ref = hf_logits(hf, ids[None])[0]
    model = copy.deepcopy(ours).to(device=device, dtype=torch.bfloat16)
    got, runner = run_prefill_then_decode(model, ids, torch.bfloat16, device)
    assert runner.manager.cache.state.recurrent[0].dtype == torch.float32
    assert runner.manager.cache.kv.k[ours.config.full_attention_layers[0]].dtype == torch.bfloat16
    assert got.dtype == torch.float32
    # Per-position error relative to the logit scale. transformers in bf16 shows ~0.006 typical;
    # a few positions are worse where bf16 rounding flips an MoE top-k choice, hence the median.
    error = (got - ref).abs().amax(dim=-1) / ref.abs().max()
    assert error.median() < 0.02
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_tied_embeddings_and_mtp_weights():
    hf, ours = build_pair(moe=False, tie_word_embeddings=True, seed=3)
    assert ours.lm_head.weight is ours.embed_tokens.weight
    ids = random_ids(30, seed=13)
    runner = Runner(ours)
    assert_close_rel(runner.prefill(runner.new_seq(), ids, chunk=30), hf_logits(hf, ids[None])[0])

    weights = hf_text_state_dict(hf)
    assert "lm_head.weight" not in weights
    weights["mtp.fc.weight"] = torch.ones(72, 144)
    fresh = Qwen3_5ForCausalLM(ours.config)
    fresh.load_weights(weights.__getitem__, set(weights))
    assert set(fresh.mtp_weights) == {"mtp.fc.weight"}


def test_load_errors_name_the_tensor(pair):
    hf, ours = pair
    weights = hf_text_state_dict(hf)
    name = "layers.0.linear_attn.in_proj_qkv.weight"

    missing = dict(weights)
    del missing[name]
    with pytest.raises(ModelLoadError, match=name):
        Qwen3_5ForCausalLM(ours.config).load_weights(missing.__getitem__, set(missing))

    wrong = dict(weights)
    wrong[name] = wrong[name][:-1]
    rows, cols = weights[name].shape
    with pytest.raises(ModelLoadError, match=rf"{name}.*\({rows - 1}, {cols}\).*\({rows}, {cols}\)"):
        Qwen3_5ForCausalLM(ours.config).load_weights(wrong.__getitem__, set(wrong))

    untied_without_head = dict(weights)
    del untied_without_head["lm_head.weight"]
    with pytest.raises(ModelLoadError, match="lm_head.weight"):
        Qwen3_5ForCausalLM(ours.config).load_weights(untied_without_head.__getitem__, set(untied_without_head))

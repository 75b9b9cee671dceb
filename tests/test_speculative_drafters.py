"""The drafters against independent references.

- n-gram lookup: hand-made sequences.
- MTP: a float64 reference built from transformers' own Qwen3.5 MoE decoder layer / RMSNorm /
  rotary classes with the checkpoint's `mtp.*` weights, recomputed from scratch over the whole
  sequence each round (h = transformers' final hidden state, after the final norm; concat order
  [embedding | hidden]). The engine's MTP drafter, running incrementally (prompt chunks, verify
  catch-ups of every length, padded rows, feedback steps), must propose the same tokens, and the
  same probabilities for a sampled request.
- DFlash: a float64 reference written from z-lab's description (context = hidden_norm(fc(concat
  of transformers' hidden_states[i + 1]))), bidirectional block attention over [context, block]),
  recomputed from scratch each round, against the engine's drafter with its paged context cache.
The `Spy` drafter lets the target verify scripted drafts, so the real drafters see acceptance
patterns of every length although their random weights would rarely be right.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ninfer_core.engine.request import GenerationRequest
from ninfer_core.engine.sampling import SamplingParams
from ninfer_core.engine.speculative.ngram import lookup
from ninfer_core.ops.quant import QuantizedWeight, QuantLinear
from safetensors.torch import load_file
from speculative_harness import (DFLASH_LAYERS, PROMPTS, ScriptedDrafter, Spy, greedy, load, probes_only, run,
                                 write_drafter, write_target)
from tiny_model_dir import WIDE

torch.set_num_threads(1)


def test_ngram_lookup():
    def draft(tokens, k=4, max_n=3, min_n=1):
        return lookup(np.array(tokens), k, max_n, min_n)

    assert draft([1, 2, 3, 9, 1, 2, 3]) == [9, 1, 2, 3]  # longest suffix [1 2 3], copy wraps into the draft
    assert draft([7, 1, 2, 5, 5, 1, 2, 6, 6, 1, 2]) == [6, 6, 1, 2]  # the most recent occurrence wins
    assert draft([4, 4, 4], k=5) == [4, 4, 4, 4, 4]  # a loop of period 1
    assert draft([1, 2, 3, 4]) == []  # nothing repeats
    assert draft([1, 2, 3, 1, 5, 2, 3], max_n=2) == [1, 5, 2, 3]  # [2 3] beats the 1-gram [3]
    assert draft([1, 2, 3, 1], min_n=2) == []  # only a 1-gram matches
    assert draft([5]) == []


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_target(tmp_path_factory)


@pytest.fixture(scope="module")
def wide_target(tmp_path_factory):
    """The target at sizes the int8 CUDA kernels cover, so its decode steps are captured in graphs."""
    return write_target(tmp_path_factory, overrides=WIDE)


@pytest.fixture(scope="module")
def reference_model(target):
    """The target in float64 (transformers' grouped-GEMM experts take no float64: eager loop)."""
    model = copy.deepcopy(target[1]).double().eval()
    model.config._experts_implementation = "eager"
    return model


def final_hidden(model, ids: list[int]) -> torch.Tensor:
    """transformers' last hidden state (after the final norm) [T, H], float64."""
    with torch.no_grad():
        return model.model(input_ids=torch.tensor([ids]), use_cache=False).last_hidden_state[0]


def spy_run(llm, inner_outer: tuple, requests: list[GenerationRequest]) -> Spy:
    spy = Spy(*inner_outer)
    llm.engine.speculator.drafter = spy
    run(llm, requests)
    return spy


def plain_script(target_dir, requests: list[GenerationRequest], n: int) -> dict[str, list[int]]:
    base = load(target_dir)
    return {r.request_id: next(iter(run(base, [GenerationRequest(r.prompt_token_ids, greedy(n))]).values()))
            for r in requests}


# -- MTP -------------------------------------------------------------------------------------------

class MTPReference:
    """Qwen3.5 MTP from transformers' classes, float64, no cache: the layer runs over all entries."""

    def __init__(self, hf_model, weights: dict[str, torch.Tensor]):
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
            Qwen3_5MoeDecoderLayer, Qwen3_5MoeRMSNorm, Qwen3_5MoeTextRotaryEmbedding)

        config = copy.deepcopy(hf_model.config)
        config.layer_types, config.num_hidden_layers = ["full_attention"], 1
        config._attn_implementation = config._experts_implementation = "eager"
        self.model = hf_model
        self.layer = Qwen3_5MoeDecoderLayer(config, 0).double().eval()
        self.layer.load_state_dict({k.removeprefix("mtp.layers.0."): v for k, v in weights.items()
                                    if k.startswith("mtp.layers.0.")})
        self.norms = {}
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            self.norms[name] = Qwen3_5MoeRMSNorm(config.hidden_size, config.rms_norm_eps).double()
            self.norms[name].weight.data.copy_(weights[f"mtp.{name}.weight"])
        self.fc = weights["mtp.fc.weight"].double()
        self.rotary = Qwen3_5MoeTextRotaryEmbedding(config)

    @torch.no_grad()
    def draft_logits(self, tokens: list[int], drafted: list[int]) -> list[torch.Tensor]:
        """Logits of each draft step after `tokens`: entries i < c are (token i+1, target h_i), then
        step s adds entry (draft s, the MTP's own normed output of the previous entry)."""
        next_tokens, hidden = list(tokens[1:]), final_hidden(self.model, tokens)[:-1]
        logits = []
        for step in range(len(drafted)):
            embeds = self.model.model.embed_tokens(torch.tensor([next_tokens]))
            x = torch.cat([self.norms["pre_fc_norm_embedding"](embeds),
                           self.norms["pre_fc_norm_hidden"](hidden[None])], dim=-1)  # [embedding | hidden]
            x = F.linear(x, self.fc)
            n = x.shape[1]
            mask = torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)[None, None]
            cos_sin = self.rotary(x, torch.arange(n)[None, None].expand(3, 1, n))
            out = self.norms["norm"](self.layer(x, position_embeddings=cos_sin, attention_mask=mask))[0]
            logits.append(self.model.lm_head(out[-1]))
            next_tokens.append(drafted[step])
            hidden = torch.cat([hidden, out[-1:]])
        return logits


def test_mtp_drafts_match_the_transformers_reference(target, reference_model):
    directory, hf_model = target
    ref = MTPReference(reference_model, hf_model.mtp_reference)
    llm = load(directory, spec="mtp", draft_tokens=3, prefill_chunk=16)
    requests = [GenerationRequest(PROMPTS[2], greedy(40)), GenerationRequest(PROMPTS[0], greedy(40))]
    script = ScriptedDrafter(plain_script(directory, requests, 40), llm.loaded.config.vocab_size)
    spy = spy_run(llm, (llm.engine.speculator.drafter, script), requests)
    assert len(spy.log) > 20
    for tokens, draft in spy.log:
        expected = [int(lg.argmax()) for lg in ref.draft_logits(tokens, draft.tokens)]
        assert draft.tokens == expected, (len(tokens), draft.tokens, expected)


def test_mtp_drafts_after_plain_steps_match_the_reference(target, reference_model):
    """Rounds without drafts (the adaptive policy's K = 0 between its probes) run as plain decode
    steps, overlapped as on a GPU, the drafter catching up from their tokens still on the device: the
    drafts it makes when the policy drafts again equal the reference's, and the answers plain decode's."""
    directory, hf_model = target
    ref = MTPReference(reference_model, hf_model.mtp_reference)
    llm = load(directory, spec="mtp", draft_tokens=3, prefill_chunk=16)
    eng = llm.engine
    eng.overlap = True
    eng.speculator.adaptive = probes_only()
    requests = [GenerationRequest(PROMPTS[2], greedy(60)), GenerationRequest(PROMPTS[0], greedy(60))]
    plain = plain_script(directory, requests, 60)
    spy = Spy(eng.speculator.drafter, ScriptedDrafter(plain, llm.loaded.config.vocab_size))
    eng.speculator.drafter = spy
    overlapped, launch = [], eng._launch_sampling
    eng._launch_sampling = lambda *args: overlapped.append(eng._launched is not None) or launch(*args)
    assert run(llm, requests) == plain
    assert sum(overlapped) > 20  # plain steps launched with the last one in flight
    assert len(spy.log) >= 8 and llm.stats().spec.accepted > 0
    for tokens, draft in spy.log:
        expected = [int(lg.argmax()) for lg in ref.draft_logits(tokens, draft.tokens)]
        assert draft.tokens == expected, (len(tokens), draft.tokens, expected)


def test_mtp_sampled_draft_probabilities_match_the_reference(target, reference_model):
    directory, hf_model = target
    ref = MTPReference(reference_model, hf_model.mtp_reference)
    llm = load(directory, spec="mtp", draft_tokens=3)
    request = GenerationRequest(PROMPTS[0], SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True))
    spy = spy_run(llm, (llm.engine.speculator.drafter,), [request])
    assert len(spy.log) >= 3
    for tokens, draft in spy.log:
        expected = torch.stack([torch.softmax(lg, -1) for lg in ref.draft_logits(tokens, draft.tokens)])
        torch.testing.assert_close(draft.probs.double(), expected, atol=1e-5, rtol=0)


def _assert_int8_of(quantized: QuantizedWeight, weight: torch.Tensor) -> None:
    """quantized is weight [..., N, K] through int8 per row, exactly: scale = amax / 127 in fp32 (a
    true division on every device), code = round-half-even(w / scale)."""
    w = weight.float()
    scale = w.abs().amax(-1) / 127
    got = quantized.scales.float().cpu()
    assert torch.equal(got, scale), f"{float((got != scale).double().mean()):.4f} of the scales differ"
    codes = (w / scale[..., None]).round().clamp(-127, 127).to(torch.int8)
    differ = quantized.qweight.cpu() != codes
    assert not bool(differ.any()), f"{float(differ.double().mean()):.4f} of the codes differ"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_mtp_block_is_quantized_as_the_model(wide_target, device):
    """Under `--weights int8` the MTP block's projections and routed experts are int8 like the
    target's, filled from its own checkpoint tensors (the merged q | k | v from its three parts); the
    drafts it makes leave speculative greedy output equal to the plain greedy output."""
    directory, _ = wide_target
    llm = load(directory, weights="int8", spec="mtp", draft_tokens=3, device=device)
    layer = llm.engine.speculator.drafter.head.layers[0]
    tensors = {}
    for shard in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(shard))
    attn = "mtp.layers.0.self_attn."
    qkv = torch.cat([tensors[attn + f"{p}_proj.weight"] for p in "qkv"])
    assert isinstance(layer.self_attn.qkv_proj.linear, QuantLinear) and layer.self_attn.qkv_proj.linear.kind == "int8"
    _assert_int8_of(layer.self_attn.qkv_proj.linear.quantized, qkv)
    experts = layer.mlp.experts
    for part in ("gate_up", "down"):
        assert experts.formats[part].kind == "int8"
        _assert_int8_of(getattr(experts, part), tensors[f"mtp.layers.0.mlp.experts.{part}_proj"])
    plain = run(load(directory, weights="int8", device=device), [GenerationRequest(p, greedy(40)) for p in PROMPTS])
    drafted = run(llm, [GenerationRequest(p, greedy(40)) for p in PROMPTS])
    assert list(drafted.values()) == list(plain.values())


# -- DFlash ----------------------------------------------------------------------------------------

def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotate-half RoPE over the whole head: x [T, heads, D]."""
    d = x.shape[-1]
    angles = positions[:, None].double() * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def dflash_reference(w: dict[str, torch.Tensor], features: torch.Tensor, embed: torch.Tensor, lm_head: torch.Tensor,
                     last: int, k: int, mask_id: int, windows: tuple = (None, None), heads: int = 2,
                     head_dim: int = 16) -> torch.Tensor:
    """z-lab's DFlash, from scratch over the whole context: features [c, n*H] -> logits [k, V].
    A layer with a sliding window w is causal and sees keys at most w - 1 positions back."""
    w = {name: t.double() for name, t in w.items()}
    c = features.shape[0]
    ctx = rms(features @ w["fc.weight"].T, w["hidden_norm.weight"])
    x = embed[[last] + [mask_id] * k]
    pos_ctx, pos_blk = torch.arange(c), torch.arange(c, c + k + 1)
    key_pos = torch.cat([pos_ctx, pos_blk])
    for i, window in enumerate(windows):
        p = f"layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = rms((h @ w[p + "self_attn.q_proj.weight"].T).view(k + 1, heads, head_dim), w[p + "self_attn.q_norm.weight"])
        both = torch.cat([ctx, h])
        keys = rms((both @ w[p + "self_attn.k_proj.weight"].T).view(c + k + 1, 1, head_dim), w[p + "self_attn.k_norm.weight"])
        values = (both @ w[p + "self_attn.v_proj.weight"].T).view(c + k + 1, 1, head_dim)
        q, keys = rope(q, pos_blk), rope(keys, torch.cat([pos_ctx, pos_blk]))
        scores = torch.einsum("thd,shd->hts", q, keys.expand(-1, heads, -1)) * head_dim**-0.5
        if window is not None:
            gap = pos_blk[:, None] - key_pos[None, :]
            scores = scores.masked_fill(~((gap >= 0) & (gap < window)), float("-inf"))
        out = torch.einsum("hts,shd->thd", scores.softmax(-1), values.expand(-1, heads, -1)).reshape(k + 1, -1)
        x = x + out @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        x = x + (F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    return rms(x, w["norm.weight"])[1:] @ lm_head.T


def test_target_captures_the_layer_outputs_transformers_reports(target):
    """ForwardOutput.captured for layer i == transformers' hidden_states[i + 1] (DFlash's convention)."""
    directory, hf_model = target
    llm = load(directory)
    seq = llm.engine.cache.allocate()
    llm.engine.cache.reserve(seq, len(PROMPTS[2]))
    from ninfer_core.models.base import ForwardBatch

    ids = torch.tensor([PROMPTS[2]])
    batch = ForwardBatch(input_ids=ids, positions=torch.arange(ids.shape[1])[None], cache_lens=torch.tensor([0]),
                         slots=torch.tensor([seq.slot]), block_table=llm.engine.cache.block_table([seq]),
                         capture_layers=tuple(DFLASH_LAYERS))
    with torch.no_grad():
        captured = llm.loaded.model(batch, llm.engine.cache.cache).captured[0]
        hf = hf_model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
    expected = torch.cat([hf[i + 1][0] for i in DFLASH_LAYERS], -1)
    torch.testing.assert_close(captured, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("windows", [(None, None), (6, None)], ids=["bidirectional", "sliding-causal"])
def test_dflash_drafts_match_the_reference(windows, target, reference_model, tmp_path_factory):
    directory, _ = target
    layout = {} if windows[0] is None else {
        "layer_types": ["sliding_attention" if w else "full_attention" for w in windows], "sliding_window": windows[0]}
    drafter_dir, weights = write_drafter(tmp_path_factory, directory, **layout)
    llm = load(directory, spec="dflash", draft_model=drafter_dir, draft_tokens=5, prefill_chunk=16)
    requests = [GenerationRequest(PROMPTS[2], greedy(40)), GenerationRequest(PROMPTS[0], greedy(40))]
    requests[1].draft_tokens = 3  # rows of different block widths in one drafter pass
    script = ScriptedDrafter(plain_script(directory, requests, 40), llm.loaded.config.vocab_size)
    spy = spy_run(llm, (llm.engine.speculator.drafter, script), requests)
    assert len(spy.log) > 20 and {len(d.tokens) for _, d in spy.log} >= {3, 5}
    mask_id = llm.loaded.config.vocab_size - 1
    embed, head = reference_model.model.embed_tokens.weight, reference_model.lm_head.weight
    for tokens, draft in spy.log:
        with torch.no_grad():
            hidden = reference_model(input_ids=torch.tensor([tokens[:-1]]), output_hidden_states=True,
                                     use_cache=False).hidden_states
        features = torch.cat([hidden[i + 1][0] for i in DFLASH_LAYERS], -1)
        logits = dflash_reference(weights, features, embed, head, tokens[-1], len(draft.tokens), mask_id, windows)
        assert draft.tokens == logits.argmax(-1).tolist(), len(tokens)

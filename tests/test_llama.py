"""LlamaForCausalLM against transformers: the embedded SmolLM2 GGUF, tiny GGUF files (llama /
qwen2 / qwen3, quantized), and tiny safetensors checkpoints written by `save_pretrained`.

Each case runs our model through the paged KV cache (chunked prefill, decode, batched steps of
sequences at different lengths) and compares logits and greedy tokens with the transformers
model holding the same weights.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from hf_reference import Runner, assert_close_rel, hf_logits, hf_text_state_dict, ninfer_config
from tiny_gguf import GGUFModelSpec, write_gguf

from ninfer_core.config import load_config
from ninfer_core.errors import ModelLoadError, NinferError
from ninfer_core.layers.linear import merged_sources, source_names
from ninfer_core.models.default_model import default_model_path
from ninfer_core.models.llama import LlamaForCausalLM
from ninfer_core.models.loader import load_model
from ninfer_core.weights.gguf_reader import open_gguf

STORY_PROMPT = (
    "<|im_start|>user\nWrite a short story about a robot who learns to paint.<|im_end|>\n<|im_start|>assistant\n"
)


def ours_greedy(runner: Runner, prompt: list[int], num_tokens: int, chunk: int) -> list[int]:
    seq = runner.new_seq()
    next_id = int(runner.prefill(seq, prompt, chunk)[-1].argmax())
    out = [next_id]
    while len(out) < num_tokens:
        logits = runner.step([seq], torch.tensor([[next_id]]), logits="last").logits
        next_id = int(logits[0, -1].argmax())
        out.append(next_id)
    return out


@torch.no_grad()
def hf_greedy(hf_model, prompt: list[int], num_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf_model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_tokens, do_sample=False
    )
    return out[0, len(prompt) :].tolist()


# ---- the embedded SmolLM2-135M-Instruct (Q4_1 GGUF) -----------------------------------------


@pytest.fixture(scope="module")
def smollm_pair():
    """(ours, transformers, tokenizer). transformers' `from_pretrained(gguf_file=...)` insists on
    `accelerate`; for llama it runs `load_gguf_checkpoint`, which we call directly."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        path = default_model_path()
    except NinferError as e:
        pytest.skip(str(e))
    ckpt = open_gguf(path)
    ours = LlamaForCausalLM(ckpt.config).float().eval()
    ours.load_weights(ckpt.get, ckpt.names())

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=hf)["tensors"]
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied to the embeddings
    hf.tie_weights()
    hf.generation_config.eos_token_id = None  # run the full length, as our loop does
    return ours, hf.eval(), ckpt.load_tokenizer()


def test_smollm_weights_equal_transformers_gguf_loader(smollm_pair):
    """Every dequantized tensor, q and k un-permuted, equals transformers' (exactly)."""
    ours, hf, _ = smollm_pair
    expected = hf_text_state_dict(hf)
    got = dict(ours.named_parameters())
    sources = merged_sources(ours)  # q/k/v and gate/up are merged: compare with their parts concatenated
    assert {src for name in got for src in source_names(sources, name)} == set(expected) and len(expected) == 272
    for name, tensor in got.items():
        assert torch.equal(tensor, torch.cat([expected[src] for src in source_names(sources, name)])), name


def test_smollm_logits_match_transformers(smollm_pair):
    ours, hf, tok = smollm_pair
    prompt = tok.encode(STORY_PROMPT + "Once upon a time, in a small town")
    expected = hf_logits(hf, torch.tensor([prompt]))[0]
    runner = Runner(ours, max_tokens=256, max_seqs=1, page_size=16)
    got = runner.prefill(runner.new_seq(), prompt, chunk=11)
    assert_close_rel(got, expected, tol=1e-4)


def test_smollm_greedy_64_tokens_match_transformers(smollm_pair):
    ours, hf, tok = smollm_pair
    prompt = tok.encode(STORY_PROMPT)
    expected = hf_greedy(hf, prompt, 64)
    runner = Runner(ours, max_tokens=256, max_seqs=1, page_size=16)
    got = ours_greedy(runner, prompt, 64, chunk=32)
    assert got == expected, (tok.decode(got), tok.decode(expected))
    assert tok.decode(got).startswith("In the")


# ---- tiny random checkpoints ---------------------------------------------------------------

TINY_COMMON = dict(
    vocab_size=160,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)
# llama: untied; qwen3: head_dim 24 != hidden / heads, q/k norm, tied; qwen2: qkv bias.
TINY_ARCHS = {
    "llama": dict(tie_word_embeddings=False),
    "qwen3": dict(tie_word_embeddings=True, head_dim=24),
    "qwen2": dict(tie_word_embeddings=False),
}


def build_tiny_hf(arch: str, seed: int = 0):
    import transformers as tf

    config_cls, model_cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
    }[arch]
    model = model_cls(config_cls(**TINY_COMMON, **TINY_ARCHS[arch])).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # weights at a scale where every tensor (norms, biases) matters
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if "norm" in name else 0.0))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model


def check_against_hf(ours: LlamaForCausalLM, hf, seed: int = 1) -> None:
    """Chunked prefill, a batched step of two sequences at different lengths (T = 1 and T = 3),
    small pages shared by both sequences, and 32 greedy tokens."""
    g = torch.Generator().manual_seed(seed)
    vocab = hf.config.vocab_size
    a = torch.randint(1, vocab, (25,), generator=g).tolist()
    b = torch.randint(1, vocab, (16,), generator=g).tolist()
    runner = Runner(ours, max_tokens=256, max_seqs=2, page_size=4)
    seq_a, seq_b = runner.new_seq(), runner.new_seq()
    assert_close_rel(runner.prefill(seq_a, a[:20], chunk=7), hf_logits(hf, torch.tensor([a[:20]]))[0])
    assert_close_rel(runner.prefill(seq_b, b[:11], chunk=4), hf_logits(hf, torch.tensor([b[:11]]))[0])
    for width in (1, 3, 1):
        step_ids = torch.tensor([a[seq_a.length : seq_a.length + width], b[seq_b.length : seq_b.length + width]])
        got = runner.step([seq_a, seq_b], step_ids).logits
        for row, (seq, full) in enumerate(((seq_a, a), (seq_b, b))):
            expected = hf_logits(hf, torch.tensor([full[: seq.length]]))[0, -width:]
            assert_close_rel(got[row], expected)
    prompt = a[:9]
    assert ours_greedy(Runner(ours, max_tokens=64, max_seqs=1, page_size=4), prompt, 32, chunk=5) == hf_greedy(
        hf, prompt, 32
    )


def save_with_tokenizer(hf, directory) -> None:
    """save_pretrained plus a tokenizer.json (the loader needs one; the logits do not read it)."""
    from tiny_model_dir import build_tokenizer

    hf.save_pretrained(directory)
    build_tokenizer().save(str(directory / "tokenizer.json"))


@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_tiny_safetensors_checkpoint_matches_transformers(tmp_path, arch):
    """Through the loader `ninfer run DIR` uses (its `model.` prefix dropped: once, only Qwen3.5's were)."""
    hf = build_tiny_hf(arch)
    save_with_tokenizer(hf, tmp_path)
    config = load_config(tmp_path)
    assert config.arch == arch
    ours = load_model(str(tmp_path), "cpu", "float32", weights="bf16").model
    assert isinstance(ours, LlamaForCausalLM)
    check_against_hf(ours, hf)


def test_a_bare_decoder_checkpoint_loads(tmp_path):
    """A `*Model` checkpoint (no `model.` prefix, no lm_head: Qwen3-Embedding's layout) loads with
    its embeddings as the head, and its final norm gives transformers' last_hidden_state."""
    import transformers as tf

    hf = build_tiny_hf("qwen3")
    save_with_tokenizer(hf.model, tmp_path)
    assert load_config(tmp_path).tie_word_embeddings
    ours = load_model(str(tmp_path), "cpu", "float32", weights="bf16").model
    check_against_hf(ours, hf)
    assert isinstance(hf.model, tf.Qwen3Model)


# Every type gguf.quants can write, on a different tensor each.
GGUF_QTYPES = {
    "q_proj.weight": Q.Q8_0,
    "k_proj.weight": Q.Q4_0,
    "v_proj.weight": Q.Q4_1,
    "o_proj.weight": Q.F16,
    "gate_proj.weight": Q.Q4_0,
    "up_proj.weight": Q.BF16,
    "down_proj.weight": Q.Q8_0,
    "embed_tokens.weight": Q.Q8_0,
    "lm_head.weight": Q.Q4_1,
}


@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_tiny_quantized_gguf_matches_transformers(tmp_path, arch):
    """Quantized GGUF (llama: q/k permuted like llama.cpp) vs transformers holding the values
    the file encodes (float64 reference dequantization)."""
    hf = build_tiny_hf(arch)
    c = hf.config
    spec = GGUFModelSpec(
        arch=arch,
        num_layers=c.num_hidden_layers,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        vocab_size=c.vocab_size,
        rope_theta=5000.0,
        rms_eps=1e-6,
    )
    refs = write_gguf(tmp_path / "tiny.gguf", spec, hf_text_state_dict(hf), GGUF_QTYPES)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.from_numpy(refs[name if name == "lm_head.weight" else name.removeprefix("model.")]))
    ckpt = open_gguf(tmp_path / "tiny.gguf")
    ours = LlamaForCausalLM(ckpt.config).float().eval()
    ours.load_weights(ckpt.get, ckpt.names())
    check_against_hf(ours, hf)


# ---- contract and errors -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama():
    """(ModelConfig, canonical weights) of the tiny untied llama."""
    hf = build_tiny_hf("llama")
    return ninfer_config(hf.config), hf_text_state_dict(hf)


def test_logits_modes_and_hidden_states(tiny_llama):
    config, weights = tiny_llama
    model = LlamaForCausalLM(config).float().eval()
    model.load_weights(weights.__getitem__, set(weights))
    ids = torch.arange(1, 8)[None]
    runner = Runner(model, max_tokens=32, max_seqs=3, page_size=4)
    full = runner.step([runner.new_seq()], ids, logits="all")
    last = runner.step([runner.new_seq()], ids, logits="last")
    none = runner.step([runner.new_seq()], ids, logits="none")
    assert full.logits.shape == (1, 7, config.vocab_size) and full.logits.dtype == torch.float32
    torch.testing.assert_close(last.logits, full.logits[:, -1:], rtol=1e-5, atol=1e-5)  # BLAS row blocking
    assert none.logits is None
    assert none.hidden_states.shape == (1, 7, config.hidden_size)
    assert torch.equal(none.hidden_states, full.hidden_states)


def test_load_weights_errors_name_the_tensor(tiny_llama):
    config, weights = tiny_llama
    model = LlamaForCausalLM(config)
    missing = {k: v for k, v in weights.items() if k != "layers.1.mlp.up_proj.weight"}
    with pytest.raises(ModelLoadError, match="missing tensor 'layers.1.mlp.up_proj.weight'"):
        model.load_weights(missing.__getitem__, set(missing))
    bad_shape = dict(weights, **{"norm.weight": torch.ones(3)})
    with pytest.raises(ModelLoadError, match=r"'norm.weight' has shape \(3,\), expected \(64,\)"):
        model.load_weights(bad_shape.__getitem__, set(bad_shape))
    extra = dict(weights, **{"layers.0.self_attn.q_norm.weight": torch.ones(16)})
    with pytest.raises(ModelLoadError, match="no place for: layers.0.self_attn.q_norm.weight"):
        model.load_weights(extra.__getitem__, set(extra))


def test_tied_model_ignores_a_stored_lm_head(tiny_llama):
    config, weights = tiny_llama
    tied = LlamaForCausalLM(type(config)(**{**config.__dict__, "tie_word_embeddings": True}))
    tied.load_weights(weights.__getitem__, set(weights))  # lm_head.weight present, unused
    assert tied.lm_head.weight is tied.embed_tokens.weight
    assert torch.equal(tied.lm_head.weight, weights["embed_tokens.weight"])


def test_rejects_non_llama_configs(tiny_llama):
    config, _ = tiny_llama
    with pytest.raises(ModelLoadError, match="cannot run arch 'qwen3_5'"):
        LlamaForCausalLM(type(config)(**{**config.__dict__, "arch": "qwen3_5"}))

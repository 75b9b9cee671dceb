"""The fused CPU decode layer (csrc/cpu/decode_layer.h via ops/cpu_layer.py) against its reference,
the layer's forward that calls the same kernels one at a time: compact GGUF models of the three
Llama-family shapes (llama; qwen2 with a qkv bias; qwen3 with q/k norms and head_dim != hidden /
heads), decode and verify-sized steps of two sequences at different lengths on small pages, the
int8-activation math, and the real SmolLM2. Equal to the bit: the same ops on the same values."""

from __future__ import annotations

import pytest
import torch
from hf_reference import Runner, hf_text_state_dict
from test_gguf import QTYPES
from test_llama import TINY_ARCHS, build_tiny_hf
from tiny_gguf import GGUFModelSpec, write_gguf

from ninfer_core.models.loader import _fill, build_model, load_model
from ninfer_core.models.quantize import resolve_recipe
from ninfer_core.ops import cpu_layer, dispatch
from ninfer_core.weights.gguf_reader import open_gguf

pytestmark = pytest.mark.skipif(dispatch.cpu_extension() is None, reason="ninfer_core._cpu not built")


def compact_tiny(tmp_path, arch: str) -> torch.nn.Module:
    """The tiny `arch` model of test_llama.py as a mixed-type GGUF, loaded with compact weights."""
    hf = build_tiny_hf(arch)
    c = hf.config
    spec = GGUFModelSpec(arch=arch, num_layers=c.num_hidden_layers, hidden_size=c.hidden_size,
                         intermediate_size=c.intermediate_size, num_heads=c.num_attention_heads,
                         num_kv_heads=c.num_key_value_heads,
                         head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                         vocab_size=c.vocab_size, rope_theta=5000.0, rms_eps=1e-6)
    path = tmp_path / f"{arch}.gguf"
    write_gguf(path, spec, hf_text_state_dict(hf), QTYPES)
    ckpt = open_gguf(path)
    recipe = resolve_recipe("auto", torch.device("cpu"), torch.float32, 0,
                            gguf_formats={n: ckpt.quant_format(n) for n in ckpt.names()})
    model = build_model(ckpt.config, torch.device("cpu"), torch.float32, recipe)
    _fill(model, ckpt, torch.float32, torch.device("cpu"), fp8_source=False, recipe=recipe)
    return model.eval()


def run_steps(model: torch.nn.Module, seed: int = 3, kv_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Prompts in chunks of up to 7 tokens, then steps of 1 and 3 tokens of both sequences."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    a, b = (torch.randint(1, vocab, (n,), generator=g).tolist() for n in (24, 15))
    runner = Runner(model, max_tokens=128, max_seqs=2, page_size=4, kv_dtype=kv_dtype)
    seq_a, seq_b = runner.new_seq(), runner.new_seq()
    outs = [runner.prefill(seq_a, a[:18], chunk=7), runner.prefill(seq_b, b[:9], chunk=4)]
    for width in (1, 3, 1):
        ids = torch.tensor([a[seq_a.length : seq_a.length + width], b[seq_b.length : seq_b.length + width]])
        outs.append(runner.step([seq_a, seq_b], ids).logits)
    return outs


def fused_and_reference(model, monkeypatch, kv_dtype: torch.dtype | None = None
                        ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
    """Logits with the fused calls and with every layer's forward; the number of layers of each fused call."""
    calls = []
    fused = cpu_layer.decode_layers

    def counted(layers, *args):
        out = fused(layers, *args)
        if out is not None:
            calls.append(len(layers))
        return out

    monkeypatch.setattr(cpu_layer, "decode_layers", counted)
    ours = run_steps(model, kv_dtype=kv_dtype)
    monkeypatch.setattr(cpu_layer, "decode_layers", lambda *args: None)
    return ours, run_steps(model, kv_dtype=kv_dtype), calls


@pytest.mark.parametrize("math", ["exact", "int8"])
@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_fused_layer_equals_the_layer_forward(tmp_path, monkeypatch, arch, math):
    monkeypatch.setenv(dispatch.CPU_MATH_ENV, math)
    model = compact_tiny(tmp_path, arch)
    ours, reference, fused_calls = fused_and_reference(model, monkeypatch)
    assert fused_calls == [2] * (3 + 3 + 3)  # both layers in one call, every forward: 3 + 3 prompt chunks, 3 steps
    for got, want in zip(ours, reference):
        assert torch.equal(got, want)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fused_layer_with_a_16_bit_cache_equals_the_layer_forward(tmp_path, monkeypatch, arch, kv_dtype):
    """`--kv-dtype bf16 / fp16` on the CPU: the fused stack rounds k / v into the cache and widens them
    out as the layers' own kernel calls do (those are checked against torch and float64 in
    test_cpu_kernels)."""
    model = compact_tiny(tmp_path, arch)
    ours, reference, fused_calls = fused_and_reference(model, monkeypatch, kv_dtype=kv_dtype)
    assert fused_calls == [2] * (3 + 3 + 3)
    for got, want in zip(ours, reference):
        assert torch.equal(got, want)
    fp32_cache = run_steps(model)
    for got, want in zip(ours[2:], fp32_cache[2:]):  # the decode steps: the cache's rounding only
        torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)
        assert not torch.equal(got, want)


def test_layers_the_kernel_does_not_cover_run_their_forward(tmp_path, monkeypatch):
    model = compact_tiny(tmp_path, "llama")
    reference = run_steps(model)
    model.layers[1].self_attn.output_gate = True  # Qwen3.5's gated attention: not this kernel's
    assert cpu_layer._make_plan(model.layers[1]) == ()
    assert cpu_layer._make_plan(model.layers[0]) != ()
    model.layers[1].self_attn.output_gate = False  # (its forward without a gate projection is the plain one)
    model.layers[1].__dict__["_cpu_decode_plan"] = (model.layers[1].input_layernorm.weight.data_ptr(), ())
    ours, _, fused_calls = fused_and_reference(model, monkeypatch)
    assert fused_calls == [1] * 9  # the stack is refused; layer 0 alone is fused in each forward
    for got, want in zip(ours, reference):
        assert torch.equal(got, want)
    float_model = build_model(model.config, torch.device("cpu"), torch.float32)  # dense fp32 weights
    assert cpu_layer._make_plan(float_model.layers[0]) == ()


@pytest.mark.parametrize("math", ["bf16", "int8"])
def test_smollm_decodes_the_same_fused(monkeypatch, smollm_path, math):
    """The README's model (its down_proj Q4_1 blocks, the rest mapped to int4 / int8: exact math leaves
    its layers to their forward) under the default math and int8."""
    monkeypatch.setenv(dispatch.CPU_MATH_ENV, math)
    model = load_model(str(smollm_path), "cpu").model
    ours, reference, fused_calls = fused_and_reference(model, monkeypatch)
    assert fused_calls and set(fused_calls) == {model.config.num_layers}  # the whole stack in one call
    for got, want in zip(ours, reference):
        assert torch.equal(got, want)


def test_the_cpu_engine_keeps_an_fp16_cache_by_default(monkeypatch, smollm_path):
    """`--kv-dtype auto` on the CPU: an fp16 cache (llama.cpp's default) that the fused stack reads;
    the README's model answers a greedy prompt as with the exact fp32 cache; `fp32` keeps that one."""
    from ninfer_core.engine.sampling import SamplingParams
    from ninfer_core.llm import LLM, EngineOptions

    calls = []
    fused = cpu_layer.decode_layers
    monkeypatch.setattr(cpu_layer, "decode_layers", lambda *a: calls.append(1) or fused(*a))
    prompt = list(range(1000, 1040))
    tokens = {}
    for kv in ("auto", "fp32"):
        llm = LLM.load(str(smollm_path), EngineOptions(device="cpu", kv_dtype=kv))
        sampling = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        tokens[llm.stats().kv_dtype] = [t for out in llm.complete(prompt, sampling) for t in out.new_token_ids]
    assert set(tokens) == {"fp16", "fp32"} and calls
    assert tokens["fp16"] == tokens["fp32"] and len(tokens["fp16"]) == 24


@pytest.mark.parametrize("math", ["bf16", "int8"])
@pytest.mark.parametrize("kv_dtype", [None, torch.float32], ids=["fp16-cache", "fp32-cache"])
def test_qwen35_mixers_in_one_call_equal_the_layers_calls(tmp_path, monkeypatch, math, kv_dtype):
    """A tiny Qwen3.5 MoE model with int8 weights under the CPU's bf16 / int8 maths: its decode steps'
    GDN mixers (ops/gdn.py cpu_gdn_mixer), gated-attention mixers (cpu_layer.attention_mixer) and MoE
    layers (ops/moe.py cpu_moe_layer, where its shared expert is compact) each in one call give the
    logits of the layers' calls one by one (the attention's output gate a sigmoid an ulp apart), over
    prompts in chunks, then 1-, 3- and 1-token steps of two sequences; each ran in its layers."""
    from tiny_model_dir import write_tiny_model_dir

    from ninfer_core.ops import gdn as gdn_ops

    monkeypatch.setenv(dispatch.CPU_MATH_ENV, math)
    monkeypatch.setenv("NINFER_HOME", str(tmp_path / "home"))
    write_tiny_model_dir(tmp_path / "qwen35", moe=True, overrides=dict(hidden_size=64, moe_intermediate_size=32,
                                                                      shared_expert_intermediate_size=64))
    model = load_model(str(tmp_path / "qwen35"), "cpu", "float32", weights="int8").model
    calls = {"gdn": 0, "attention": 0}
    real_gdn, real_attention = gdn_ops.cpu_gdn_mixer, cpu_layer.attention_mixer

    def counted(name, real):
        def call(*args):
            out = real(*args)
            calls[name] += out is not None
            return out
        return call

    monkeypatch.setattr(gdn_ops, "cpu_gdn_mixer", counted("gdn", real_gdn))
    monkeypatch.setattr(cpu_layer, "attention_mixer", counted("attention", real_attention))
    ours = run_steps(model, kv_dtype=kv_dtype)
    monkeypatch.setattr(gdn_ops, "cpu_gdn_mixer", lambda *a: None)
    monkeypatch.setattr(cpu_layer, "attention_mixer", lambda *a: None)
    reference = run_steps(model, kv_dtype=kv_dtype)
    attention_layers = sum(not layer.is_linear for layer in model.layers)
    assert model.layers[0].is_linear and not model.layers[-1].is_linear
    # the GDN mixers of the one-token forwards (two steps and a prompt's last chunk) past the first layer
    # (its input is normed already); the attention mixers of all 9 forwards (chunks of up to 7 tokens)
    assert calls["gdn"] == 3 * (len(model.layers) - attention_layers - 1)
    assert calls["attention"] == 9 * attention_layers
    for got, want in zip(ours, reference):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_attention_mixer_binding_checks_its_shapes():
    """The binding refuses, before reading any pointer, heads that are not a multiple of the kv heads,
    an odd rotary_dim, more than 16 new tokens and projections of the wrong shapes."""
    from ninfer_core.ops.quant import quantize

    qkv = cpu_layer.linear_plan(quantize(torch.randn(2 * 64 + 2 * 32, 64), "int8"))  # 2 heads of 32 (+ gates), 1 kv
    o = cpu_layer.linear_plan(quantize(torch.randn(64, 64), "int8"))
    ext = dispatch.cpu_extension()

    def call(shape, qkv_plan=qkv):
        ext.attention_mixer(tuple(range(1, 15)), shape, True, 1e-6, True, 1e-6, True, 0.2, 1, qkv_plan, o, 1, False)

    for shape in [(3, 2, 32, 16, 1, 1, 4, 8), (2, 1, 32, 15, 1, 1, 4, 8), (2, 1, 32, 16, 1, 17, 4, 8)]:
        with pytest.raises(ValueError, match="attention_mixer: heads a multiple of kv_heads"):
            call(shape)
    with pytest.raises(ValueError, match="qkv \\[q \\(\\| gate\\) \\| k \\| v\\] of H inputs"):
        call((2, 1, 32, 16, 1, 1, 4, 8), cpu_layer.linear_plan(quantize(torch.randn(100, 64), "int8")))


@pytest.mark.parametrize("math", ["exact", "bf16", "int8"])
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_dense_qwen35_mlp_block_in_one_call_is_the_layers_calls(tmp_path, monkeypatch, math, weights):
    """A tiny dense Qwen3.5 model (zero-centred norms): each layer's post-attention add + norm and its
    SwiGLU MLP in one call (cpu_layer.mlp_block) give the logits of the calls one by one to the bit,
    over prompts in chunks of up to 7 tokens, then 1-, 3- and 1-token steps of two sequences (every
    forward: at most CPU_GEMV_ROWS rows); 24 rows (a prefill's) decline."""
    from tiny_model_dir import write_tiny_model_dir

    monkeypatch.setenv(dispatch.CPU_MATH_ENV, math)
    monkeypatch.setenv("NINFER_HOME", str(tmp_path / "home"))
    write_tiny_model_dir(tmp_path / "dense", moe=False, overrides=dict(hidden_size=64, intermediate_size=96))
    model = load_model(str(tmp_path / "dense"), "cpu", "float32", weights=weights).model
    ran, declined = [], []
    real = cpu_layer.mlp_block

    def counted(x, *args):
        out = real(x, *args)
        (ran if out is not None else declined).append(x.numel() // x.shape[-1])
        return out

    monkeypatch.setattr(cpu_layer, "mlp_block", counted)
    ours = run_steps(model)
    monkeypatch.setattr(cpu_layer, "mlp_block", lambda *args: None)
    reference = run_steps(model)
    assert model.layers[0].post_attention_layernorm.zero_centered
    layers = len(model.layers)
    # rows a forward: chunks of 7 / 7 / 4 of a, 4 / 4 / 1 of b, then 2 x 1, 2 x 3, 2 x 1
    assert sorted(ran) == sorted([7, 7, 4, 4, 4, 1, 2, 6, 2] * layers) and not declined
    for got, want in zip(ours, reference):
        assert torch.equal(got, want)
    x = torch.randn(24, 64)
    mlp = model.layers[0]
    assert real(x, x, mlp.post_attention_layernorm, mlp.mlp.gate_up_proj.linear, mlp.mlp.down_proj) is None


def test_mlp_block_binding_checks_its_shapes():
    """The binding refuses, before reading any pointer, projections that do not chain: gate_up [2 I, H]
    and down [H, I]."""
    from ninfer_core.ops.quant import quantize

    ext = dispatch.cpu_extension()
    gate_up = cpu_layer.linear_plan(quantize(torch.randn(2 * 32, 64), "int8"))
    for down in (torch.randn(64, 48), torch.randn(48, 32)):
        with pytest.raises(ValueError, match=r"mlp_block: 1 or more tokens, gate_up \[2 I, H\] and down \[H, I\]"):
            ext.mlp_block(tuple(range(1, 7)), 1, 1e-6, True, gate_up, cpu_layer.linear_plan(quantize(down, "int8")),
                          1, False)
    with pytest.raises(ValueError, match="mlp_block: 1 or more tokens"):
        ext.mlp_block(tuple(range(1, 7)), 0, 1e-6, True, gate_up,
                      cpu_layer.linear_plan(quantize(torch.randn(64, 32), "int8")), 1, False)

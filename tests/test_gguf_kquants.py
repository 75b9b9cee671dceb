"""GGUF K-quants (Q4_K, Q5_K, Q6_K) read through `open_gguf(...).get`.

gguf's numpy code cannot quantize to K-quants, so the blocks are built by hand: every byte random
except the fp16 super-block scales (d, dmin), drawn as finite fp16 values in [2^-12, 2^-2) with a
random sign. References: tiny_gguf's float64 dequantizer written from ggml's block layouts, a few
blocks whose values are worked out by hand from ggml-quants.c, and the file's q / k rows mapped back
to HF order by index bookkeeping. Every value the reader returns must be the float32 rounding of
the exact float64 value (ggml computes each one with a single float32 rounding too).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from tiny_gguf import (
    QK_K,
    GGUFModelSpec,
    gguf_name,
    reference_dequantize,
    write_encoded_gguf,
)

from ninfer_core.weights.gguf_reader import open_gguf

K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
# Byte offsets of the fp16 super-block scales inside one block.
FP16_FIELDS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}

# One llama layer with every 2-D row length a multiple of QK_K: q / k / v / o, gate / up / down and
# the embedding give 40 x 256 up to 512 x 256 and 256 x 512 (two super-blocks per row).
SPEC = GGUFModelSpec(
    arch="llama",
    num_layers=1,
    hidden_size=256,
    intermediate_size=512,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    vocab_size=40,
)


def tensor_shapes(spec: GGUFModelSpec) -> dict[str, tuple[int, ...]]:
    h, q_out, kv_out = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    return {
        "embed_tokens.weight": (spec.vocab_size, h),
        "norm.weight": (h,),
        "lm_head.weight": (spec.vocab_size, h),
        "layers.0.input_layernorm.weight": (h,),
        "layers.0.post_attention_layernorm.weight": (h,),
        "layers.0.self_attn.q_proj.weight": (q_out, h),
        "layers.0.self_attn.k_proj.weight": (kv_out, h),
        "layers.0.self_attn.v_proj.weight": (kv_out, h),
        "layers.0.self_attn.o_proj.weight": (h, q_out),
        "layers.0.mlp.gate_proj.weight": (spec.intermediate_size, h),
        "layers.0.mlp.up_proj.weight": (spec.intermediate_size, h),
        "layers.0.mlp.down_proj.weight": (h, spec.intermediate_size),
    }


def random_fp16_bits(rng: np.random.Generator, n: int) -> np.ndarray:
    """Bit patterns of normal fp16 values with |x| in [2^-12, 2^-2), random sign and mantissa."""
    sign = rng.integers(0, 2, n) << 15
    exponent = rng.integers(15 - 12, 15 - 2, n) << 10  # biased exponent: 2^(e - 15)
    mantissa = rng.integers(0, 1 << 10, n)
    return (sign | exponent | mantissa).astype(np.uint16)


def random_kquant_rows(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes per row] of random `qtype` super-blocks with finite, moderate fp16 scales."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    assert block_size == QK_K and cols % QK_K == 0
    blocks = rng.integers(0, 256, (rows * cols // QK_K, type_size), dtype=np.uint8)
    for offset in FP16_FIELDS[qtype]:
        blocks[:, offset : offset + 2] = random_fp16_bits(rng, len(blocks)).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, cols // QK_K * type_size)


def write_random_kquant_gguf(path: Path, qtype: Q, seed: int) -> dict[str, np.ndarray]:
    """Every 2-D tensor of SPEC as random `qtype` blocks (1-D norms F32); returns the references."""
    rng = np.random.default_rng(seed)
    encoded = {}
    for name, shape in tensor_shapes(SPEC).items():
        if len(shape) == 1:
            encoded[name] = (Q.F32, rng.standard_normal(shape).astype(np.float32))
        else:
            encoded[name] = (qtype, random_kquant_rows(qtype, *shape, rng))
    return write_encoded_gguf(path, SPEC, encoded)


def assert_float32_rounding_of(got: np.ndarray, exact: np.ndarray, what: str) -> None:
    assert got.dtype == np.float32 and got.shape == exact.shape, what
    assert np.isfinite(exact).all(), what
    mismatched = np.flatnonzero(got != exact.astype(np.float32))
    assert mismatched.size == 0, f"{what}: {mismatched.size} values differ, first at flat index {mismatched[:5]}"


@pytest.fixture(scope="module", params=K_QUANTS, ids=lambda q: q.name)
def kquant_file(request, tmp_path_factory):
    qtype = request.param
    path = tmp_path_factory.mktemp("kquant") / f"tiny-{qtype.name}.gguf"
    refs = write_random_kquant_gguf(path, qtype, seed=1234 + int(qtype))
    return qtype, path, refs


def test_every_tensor_is_the_float32_rounding_of_the_float64_reference(kquant_file):
    """All shapes (1 or 2 super-blocks per row, 40..512 rows); q / k un-permuted on K-quants too."""
    qtype, path, refs = kquant_file
    ckpt = open_gguf(path)
    assert ckpt.names() == set(refs)
    for name, ref in refs.items():
        assert_float32_rounding_of(ckpt.get(name).numpy(), ref, f"{qtype.name} {name}")


def test_file_holds_the_k_quant_type_and_block_bytes(kquant_file):
    """The tensors really are stored as `qtype` (not re-encoded by the writer)."""
    qtype, path, _ = kquant_file
    reader = gguf.GGUFReader(path)
    types = {t.name: t.tensor_type for t in reader.tensors if len(t.shape) == 2}
    assert set(types.values()) == {qtype} and len(types) == 9
    q = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    assert tuple(q.data.shape) == (256, gguf.GGML_QUANT_SIZES[qtype][1])  # [rows, one super-block]


def test_q_and_k_rows_are_un_permuted(kquant_file):
    """Per head, HF row (half h, index i) is the file's row 2i + h (llama.cpp interleaves the
    rotate-half pairs); v is stored as is."""
    qtype, path, refs = kquant_file
    ckpt = open_gguf(path)
    half = SPEC.head_dim // 2
    for name, heads in (("layers.0.self_attn.q_proj.weight", 4), ("layers.0.self_attn.k_proj.weight", 2)):
        file_rows = reference_dequantize(qtype, raw_tensor(path, name), refs[name].shape)
        expected = np.empty_like(file_rows)
        for head in range(heads):
            for h in range(2):
                for i in range(half):
                    expected[head * SPEC.head_dim + h * half + i] = file_rows[head * SPEC.head_dim + 2 * i + h]
        got = ckpt.get(name).numpy()
        assert_float32_rounding_of(got, expected, name)
        assert (got != file_rows.astype(np.float32)).mean() > 0.9, name  # the permutation is not a no-op
    v = "layers.0.self_attn.v_proj.weight"
    assert_float32_rounding_of(ckpt.get(v).numpy(), reference_dequantize(qtype, raw_tensor(path, v), refs[v].shape), v)


def raw_tensor(path: Path, canonical: str) -> np.ndarray:
    """The stored bytes of one tensor, rows in file order."""
    reader = gguf.GGUFReader(path)
    return np.array(next(t for t in reader.tensors if t.name == gguf_name(canonical)).data)


# ---- blocks worked out by hand from ggml-quants.c --------------------------------------------


def _fp16_bytes(x: float) -> list[int]:
    return list(np.array([x], dtype=np.float16).view(np.uint8))


def hand_q4_k_block() -> tuple[np.ndarray, np.ndarray]:
    """d = 0.5, dmin = 0.25. Scale bytes: [2] = 0xC5, [6] = 0x47, [10] = 0x9A, [11] = 0x21, so
    sub-block 2: scale 5, min 7; 6: scale 0xA | 3 << 4 = 58, min 9 | 1 << 4 = 25; 7: scale 1, min 2;
    the rest 0. qs[96 + 5] = 0x3C: value 192 + 5 has q = 12, value 224 + 5 has q = 3."""
    block = np.zeros(144, dtype=np.uint8)
    block[0:2], block[2:4] = _fp16_bytes(0.5), _fp16_bytes(0.25)
    block[4 + 2], block[4 + 6], block[4 + 10], block[4 + 11] = 0xC5, 0x47, 0x9A, 0x21
    block[16 + 96 + 5] = 0x3C
    want = np.zeros(QK_K)
    want[64:96] = -0.25 * 7  # q = 0
    want[192:224] = -0.25 * 25
    want[197] = 0.5 * 58 * 12 - 0.25 * 25  # 341.75
    want[224:256] = -0.25 * 2
    want[229] = 0.5 * 1 * 3 - 0.25 * 2  # 1.0
    return block, want


def hand_q5_k_block() -> tuple[np.ndarray, np.ndarray]:
    """d = 0.5, dmin = 0.25; sub-block 1: scale 3, min 2; sub-block 3: scale 4, min 0. qs[7] = 0x90
    (value 32 + 7: low bits 9) and qh[7] = 0b1010 (fifth bit of sub-blocks 1 and 3 at l = 7);
    qs[32 + 7] = 0x10 (value 96 + 7: low bits 1)."""
    block = np.zeros(176, dtype=np.uint8)
    block[0:2], block[2:4] = _fp16_bytes(0.5), _fp16_bytes(0.25)
    block[4 + 1], block[4 + 5], block[4 + 3] = 3, 2, 4
    block[16 + 7] = 0b1010
    block[48 + 7], block[48 + 32 + 7] = 0x90, 0x10
    want = np.zeros(QK_K)
    want[32:64] = -0.25 * 2
    want[39] = 0.5 * 3 * (9 + 16) - 0.25 * 2  # 37.0
    want[103] = 0.5 * 4 * (1 + 16)  # 34.0
    return block, want


def hand_q6_k_block() -> tuple[np.ndarray, np.ndarray]:
    """d = 0.25; int8 scales [0] = -3, [2] = 5, [13] = 127. ql[3] = 0x07, qh[3] = 0b10 -> value 3
    has q = 7 | 2 << 4 = 39; ql[64 + 20] = 0xB0, qh[32 + 20] = 0b110000 -> value 128 + 64 + 20 has
    q = 11 | 3 << 4 = 59 (both minus 32). Every other q is 0 - 32."""
    block = np.zeros(210, dtype=np.uint8)
    block[0 + 3], block[128 + 3] = 0x07, 0b10
    block[64 + 20], block[128 + 32 + 20] = 0xB0, 0b110000
    block[192 + 0], block[192 + 2], block[192 + 13] = np.array([-3, 5, 127], dtype=np.int8).view(np.uint8)
    block[208:210] = _fp16_bytes(0.25)
    want = np.zeros(QK_K)
    want[0:16] = 0.25 * -3 * -32  # 24.0
    want[3] = 0.25 * -3 * (39 - 32)  # -5.25
    want[32:48] = 0.25 * 5 * -32
    want[208:224] = 0.25 * 127 * -32
    want[212] = 0.25 * 127 * (59 - 32)  # 857.25
    return block, want


HAND_BLOCKS: dict[Q, Callable[[], tuple[np.ndarray, np.ndarray]]] = {
    Q.Q4_K: hand_q4_k_block,
    Q.Q5_K: hand_q5_k_block,
    Q.Q6_K: hand_q6_k_block,
}


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda q: q.name)
def test_hand_worked_block(tmp_path, qtype):
    """Reader and float64 reference both give the hand-computed values (a random block follows
    the hand one in the same row, so block order within a row counts too)."""
    block, want = HAND_BLOCKS[qtype]()
    rng = np.random.default_rng(7)
    rows = random_kquant_rows(qtype, 128, 2 * QK_K, rng)  # v_proj: kv heads x head_dim rows
    name = "layers.0.self_attn.v_proj.weight"
    rows[5, : len(block)] = block
    spec = GGUFModelSpec(**{**SPEC.__dict__, "hidden_size": 2 * QK_K})
    refs = write_encoded_gguf(tmp_path / "hand.gguf", spec, {name: (qtype, rows)})
    np.testing.assert_array_equal(refs[name][5, :QK_K], want)
    got = open_gguf(tmp_path / "hand.gguf").get(name).numpy()
    np.testing.assert_array_equal(got[5, :QK_K], want.astype(np.float32))
    assert_float32_rounding_of(got, refs[name], name)


# ---- the comparison has teeth: a reference that misreads the layout must fail --------------


def swap_scale_and_min(blocks: np.ndarray) -> np.ndarray:
    """q4_K / q5_K bytes whose true decoding equals a wrong decoder that swaps scale and min."""
    out = blocks.copy()
    out[:, 4:8], out[:, 8:12] = blocks[:, 8:12], blocks[:, 4:8]
    out[:, 12:16] = (blocks[:, 12:16] >> 4) | (blocks[:, 12:16] << 4)
    return out


def permute_bits(first: int, last: int, source_bits: tuple[int, ...]) -> Callable[[np.ndarray], np.ndarray]:
    """Bytes first..last of each block with bit i taken from bit source_bits[i]: decoding them
    correctly equals decoding the real bytes with a decoder that reads the bits in that order."""
    table = np.array([sum(((b >> src) & 1) << i for i, src in enumerate(source_bits)) for b in range(256)], np.uint8)

    def mutate(blocks: np.ndarray) -> np.ndarray:
        out = blocks.copy()
        out[:, first:last] = table[blocks[:, first:last]]
        return out

    return mutate


NIBBLES_SWAPPED = (4, 5, 6, 7, 0, 1, 2, 3)
BITS_REVERSED = (7, 6, 5, 4, 3, 2, 1, 0)
PAIRS_REVERSED = (6, 7, 4, 5, 2, 3, 0, 1)

WRONG_DECODERS = {
    "q4_K scale/min swapped": (Q.Q4_K, swap_scale_and_min),
    "q4_K nibble order swapped": (Q.Q4_K, permute_bits(16, 144, NIBBLES_SWAPPED)),
    "q5_K scale/min swapped": (Q.Q5_K, swap_scale_and_min),
    "q5_K fifth-bit order reversed": (Q.Q5_K, permute_bits(16, 48, BITS_REVERSED)),
    "q6_K ql nibble order swapped": (Q.Q6_K, permute_bits(0, 128, NIBBLES_SWAPPED)),
    "q6_K qh bit-pair order reversed": (Q.Q6_K, permute_bits(128, 192, PAIRS_REVERSED)),
}


@pytest.mark.parametrize("case", WRONG_DECODERS)
def test_a_wrong_reference_is_caught(tmp_path, case):
    """Decoding mutated bytes correctly == decoding the real bytes with a layout mistake."""
    qtype, mutate = WRONG_DECODERS[case]
    rows = random_kquant_rows(qtype, 64, 2 * QK_K, np.random.default_rng(11))
    name = "layers.0.mlp.up_proj.weight"
    spec = GGUFModelSpec(**{**SPEC.__dict__, "hidden_size": 2 * QK_K})
    refs = write_encoded_gguf(tmp_path / "t.gguf", spec, {name: (qtype, rows)})
    got = open_gguf(tmp_path / "t.gguf").get(name).numpy()
    assert_float32_rounding_of(got, refs[name], name)
    type_size = gguf.GGML_QUANT_SIZES[qtype][1]
    wrong = reference_dequantize(qtype, mutate(rows.reshape(-1, type_size)), got.shape)
    assert (got != wrong.astype(np.float32)).mean() > 0.3  # a reversed fifth bit is still right half the time
    with pytest.raises(AssertionError, match="values differ"):
        assert_float32_rounding_of(got, wrong, case)

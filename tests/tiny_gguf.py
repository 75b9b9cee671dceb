"""Tiny GGUF files written the way llama.cpp's converter writes them, with float64 references.

`write_gguf` takes an HF-layout state dict (canonical names), permutes q / k rows for the
`llama` architecture (rotate-half pairs -> interleaved pairs, as `convert_hf_to_gguf.py` does)
and quantizes each tensor with `gguf.quants.quantize`; `write_encoded_gguf` writes tensors that
are already in that GGUF form (e.g. hand-built K-quant blocks, which gguf's numpy code cannot
produce) under llama.cpp's tensor names, with the metadata. Both return what the file encodes,
dequantized here in float64 from the bytes written and mapped back to HF layout by index
bookkeeping — independent of the reader under test.
`train_byte_level_bpe` makes a small real vocabulary (tokens + merges) with `tokenizers`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

_BLOCK_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL_NAMES = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output"}


def gguf_name(canonical: str) -> str:
    module, kind = canonical.rsplit(".", 1)
    if module.startswith("layers."):
        _, layer, rest = module.split(".", 2)
        return f"blk.{layer}.{_BLOCK_NAMES[rest]}.{kind}"
    return f"{_GLOBAL_NAMES[module]}.{kind}"


def llamacpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute: per head, rows (h, i) -> (i, h), h the rotate half."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16).astype(np.float64)


# ---- K-quants (super-blocks of QK_K = 256 values), from ggml-common.h / ggml-quants.c ---------
# block_q4_K: fp16 d, fp16 dmin, 12 bytes of 6-bit (scale, min) pairs for 8 sub-blocks of 32,
#             128 bytes of 4-bit quants.            value = d * scale * q - dmin * min
# block_q5_K: as q4_K plus 32 bytes of fifth bits (qh) between the scales and the quants.
# block_q6_K: 128 bytes low 4 bits (ql), 64 bytes high 2 bits (qh), 16 int8 scales (one per 16
#             values), fp16 d.                      value = d * scale * (q - 32)
QK_K = 256


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 packed bytes -> (scale, min) of sub-blocks 0..7, each 6 bits (get_scale_min_k4).

    Sub-block j < 4: scale = low 6 bits of byte j, min = low 6 bits of byte j + 4.
    Sub-block j >= 4: the low 4 bits sit in byte j + 4 (scale: low nibble, min: high nibble),
    the top 2 bits in the spare top bits of byte j - 4 (scale) and byte j (min)."""
    b = packed.astype(np.int64)
    scales = np.empty((len(b), 8), dtype=np.int64)
    mins = np.empty_like(scales)
    for j in range(4):
        scales[:, j] = b[:, j] & 63
        mins[:, j] = b[:, j + 4] & 63
    for j in range(4, 8):
        scales[:, j] = (b[:, j + 4] & 0x0F) | ((b[:, j - 4] >> 6) << 4)
        mins[:, j] = (b[:, j + 4] >> 4) | ((b[:, j] >> 6) << 4)
    return scales, mins


def _low_high_nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 128] bytes -> [n, 256] 4-bit values: each 32-byte group gives 32 low nibbles, then its
    32 high nibbles (value 64c + l is the low nibble of byte 32c + l, 64c + 32 + l its high one)."""
    groups = qs.astype(np.int64).reshape(len(qs), 4, 1, 32)
    return np.concatenate([groups & 0x0F, groups >> 4], axis=2).reshape(len(qs), QK_K)


def _scaled_with_min(blocks: np.ndarray, q: np.ndarray) -> np.ndarray:
    """d * scale[s] * q - dmin * min[s], sub-block s = value index // 32 (q4_K / q5_K)."""
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    scales, mins = _k_scales_mins(blocks[:, 4:16])
    per_value = np.repeat(np.arange(8), 32)
    return d * scales[:, per_value] * q - dmin * mins[:, per_value]


def _dequantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    return _scaled_with_min(blocks, _low_high_nibbles(blocks[:, 16:144]))


def _dequantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    """Value v of sub-block s takes its fifth bit from bit s of qh[v % 32]."""
    qh = blocks[:, 16:48].astype(np.int64)
    fifth = (qh[:, None, :] >> np.arange(8)[None, :, None]) & 1  # [n, sub-block, 32]
    return _scaled_with_min(blocks, _low_high_nibbles(blocks[:, 48:176]) + 16 * fifth.reshape(len(blocks), QK_K))


def _dequantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """Each half h of 128 values uses ql[64h : 64h + 64] and qh[32h : 32h + 32]: value
    128h + 32k + l has low bits from ql[64h + 32(k % 2) + l] (low nibble for k < 2, high for k >= 2)
    and high bits (qh[32h + l] >> 2k) & 3; its scale is scales[value // 16]."""
    n = len(blocks)
    ql = blocks[:, 0:128].astype(np.int64).reshape(n, 2, 2, 32)  # [half, k % 2, l]
    qh = blocks[:, 128:192].astype(np.int64).reshape(n, 2, 1, 32)  # [half, -, l]
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2)  # [half, k, l]
    high = (qh >> (2 * np.arange(4))[None, None, :, None]) & 3
    q = (low | (high << 4)).reshape(n, QK_K) - 32
    scales = blocks[:, 192:208].copy().view(np.int8).astype(np.float64)
    d = _f16(blocks[:, 208:210])
    return d * np.repeat(scales, 16, axis=1) * q


_K_QUANT_DEQUANTIZERS = {Q.Q4_K: _dequantize_q4_k, Q.Q5_K: _dequantize_q5_k, Q.Q6_K: _dequantize_q6_k}


def reference_dequantize(qtype: Q, raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Float64 dequantization of llama.cpp blocks (`raw` as the file stores it), written from the
    ggml block layouts."""
    if qtype == Q.F32:
        return raw.astype(np.float64).reshape(shape)
    if qtype == Q.F16:
        return raw.astype(np.float64).reshape(shape)
    if qtype == Q.BF16:
        bits = raw.reshape(-1).view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).astype(np.float64).reshape(shape)
    blocks = raw.reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])
    if qtype in _K_QUANT_DEQUANTIZERS:
        return _K_QUANT_DEQUANTIZERS[qtype](blocks).reshape(shape)
    if qtype == Q.Q8_0:  # fp16 d, 32 x int8
        d = _f16(blocks[:, :2])
        values = d * blocks[:, 2:].view(np.int8).astype(np.float64)
    elif qtype in (Q.Q4_0, Q.Q4_1):  # fp16 d (, fp16 m), 16 bytes: low nibbles = values 0..15, high = 16..31
        header = 2 if qtype == Q.Q4_0 else 4
        d = _f16(blocks[:, :2])
        qs = blocks[:, header:]
        nibbles = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float64)
        values = d * (nibbles - 8) if qtype == Q.Q4_0 else d * nibbles + _f16(blocks[:, 2:4])
    elif qtype == Q.Q5_0:  # fp16 d, 4 bytes qh (bit i: the fifth bit of value i), then Q4_0's nibbles
        d = _f16(blocks[:, :2])
        qh = blocks[:, 2:6].copy().view("<u4").astype(np.int64)
        qs = blocks[:, 6:]
        low = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int64)
        values = d * ((low | ((qh >> np.arange(32)) & 1) << 4) - 16).astype(np.float64)
    else:
        raise ValueError(f"no reference dequantizer for {qtype.name}")
    return values.reshape(shape)


@dataclass
class GGUFTokenizerSpec:
    tokens: list[str]
    merges: list[str]
    token_types: list[int]
    pre: str = "default"
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    add_bos_token: bool = False
    chat_template: str | None = None


@dataclass
class GGUFModelSpec:
    arch: str  # GGUF architecture: llama | qwen2 | qwen3
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    context_length: int = 2048
    extra_tensors: dict[str, np.ndarray] = field(default_factory=dict)  # raw GGUF name -> F32 data


def write_gguf(
    path: Path,
    spec: GGUFModelSpec,
    state: dict[str, torch.Tensor],
    qtypes: dict[str, Q],
    tokenizer: GGUFTokenizerSpec | None = None,
    split_max_tensors: int = 0,
) -> dict[str, np.ndarray]:
    """Write `state` (canonical HF names) as a GGUF; `qtypes` maps a name suffix such as
    'q_proj.weight' to its type (1-D tensors are always F32). Returns {canonical name: float64
    values the file encodes, in HF layout}. `split_max_tensors`: a split model as gguf-split
    writes it (PATH's stem-0000i-of-0000N.gguf) with at most that many tensors a shard."""
    encoded = {}
    for name, tensor in state.items():
        w = tensor.detach().double().numpy().astype(np.float32)
        heads = permuted_heads(spec, name)
        if heads is not None:
            w = llamacpp_permute(w, heads)
        qtype = Q.F32 if w.ndim == 1 else next(t for suffix, t in qtypes.items() if name.endswith(suffix))
        encoded[name] = (qtype, gguf.quants.quantize(w, qtype))
    return write_encoded_gguf(path, spec, encoded, tokenizer, split_max_tensors)


def permuted_heads(spec: GGUFModelSpec, name: str) -> int | None:
    """Heads over which llama.cpp's converter permutes the rows of `name`; None if it does not."""
    if spec.arch != "llama":
        return None
    if ".q_proj." in name:
        return spec.num_heads
    return spec.num_kv_heads if ".k_proj." in name else None


def write_encoded_gguf(
    path: Path,
    spec: GGUFModelSpec,
    encoded: dict[str, tuple[Q, np.ndarray]],
    tokenizer: GGUFTokenizerSpec | None = None,
    split_max_tensors: int = 0,
) -> dict[str, np.ndarray]:
    """Write tensors already in GGUF form: {canonical name: (type, data)}, rows in GGUF order
    (q / k permuted for llama) and quantized types as uint8 bytes of shape [rows, bytes per row].
    Returns {canonical name: float64 values the file encodes, in HF layout}."""
    writer = gguf.GGUFWriter(str(path), spec.arch, split_max_tensors=split_max_tensors)
    add_model_metadata(writer, spec)
    if tokenizer is not None:
        add_tokenizer(writer, tokenizer)
    references = {}
    for name, (qtype, data) in encoded.items():
        quantized = data.dtype == np.uint8
        writer.add_tensor(gguf_name(name), data, raw_dtype=qtype if quantized else None)
        shape = data.shape
        if quantized:
            block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
            shape = (*shape[:-1], shape[-1] // type_size * block_size)
        values = reference_dequantize(qtype, data, shape)
        heads = permuted_heads(spec, name)
        if heads is not None:
            row_index = llamacpp_permute(np.arange(shape[0]), heads)  # GGUF row r holds HF row row_index[r]
            values[row_index] = values.copy()
        references[name] = values
    for raw_name, extra in spec.extra_tensors.items():
        writer.add_tensor(raw_name, extra.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return references


def add_model_metadata(writer: gguf.GGUFWriter, spec: GGUFModelSpec) -> None:
    writer.add_block_count(spec.num_layers)
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(spec.hidden_size)
    writer.add_feed_forward_length(spec.intermediate_size)
    writer.add_head_count(spec.num_heads)
    writer.add_head_count_kv(spec.num_kv_heads)
    writer.add_key_length(spec.head_dim)
    writer.add_value_length(spec.head_dim)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_layer_norm_rms_eps(spec.rms_eps)
    writer.add_vocab_size(spec.vocab_size)
    writer.add_file_type(1)


def add_tokenizer(writer: gguf.GGUFWriter, spec: GGUFTokenizerSpec) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(spec.pre)
    writer.add_token_list(spec.tokens)
    writer.add_token_types(spec.token_types)
    writer.add_token_merges(spec.merges)
    if spec.bos_token_id is not None:
        writer.add_bos_token_id(spec.bos_token_id)
    if spec.eos_token_id is not None:
        writer.add_eos_token_id(spec.eos_token_id)
    writer.add_add_bos_token(spec.add_bos_token)
    if spec.chat_template is not None:
        writer.add_chat_template(spec.chat_template)


def write_tokenizer_only_gguf(path: Path, spec: GGUFTokenizerSpec, arch: str = "llama") -> None:
    """A GGUF holding tokenizer metadata and no tensors (enough for tokenizer loaders)."""
    writer = gguf.GGUFWriter(str(path), arch)
    add_tokenizer(writer, spec)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def train_byte_level_bpe(corpus: list[str], vocab_size: int) -> tuple[list[str], list[str]]:
    """(tokens in id order, merges as 'a b') of a byte-level BPE trained on `corpus`."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(corpus, trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges

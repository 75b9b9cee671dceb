"""Tiny GGUF files written the way llama.cpp's converter writes them, with float64 references.

`write_gguf` takes an HF-layout state dict (canonical names), renames it to llama.cpp's tensor
names, permutes q / k rows for the `llama` architecture (rotate-half pairs -> interleaved pairs,
as `convert_hf_to_gguf.py` does), quantizes each tensor with `gguf.quants.quantize` and writes
the metadata. It returns what the file encodes, dequantized here in float64 from the bytes it
wrote and mapped back to HF layout by index bookkeeping — independent of the reader under test.
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


def reference_dequantize(qtype: Q, raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Float64 dequantization of llama.cpp blocks, written from the ggml block layouts."""
    if qtype == Q.F32:
        return raw.astype(np.float64).reshape(shape)
    if qtype == Q.F16:
        return raw.astype(np.float64).reshape(shape)
    if qtype == Q.BF16:
        bits = raw.reshape(-1).view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).astype(np.float64).reshape(shape)
    blocks = raw.reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])
    if qtype == Q.Q8_0:  # fp16 d, 32 x int8
        d = _f16(blocks[:, :2])
        values = d * blocks[:, 2:].view(np.int8).astype(np.float64)
    elif qtype in (Q.Q4_0, Q.Q4_1):  # fp16 d (, fp16 m), 16 bytes: low nibbles = values 0..15, high = 16..31
        header = 2 if qtype == Q.Q4_0 else 4
        d = _f16(blocks[:, :2])
        qs = blocks[:, header:]
        nibbles = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float64)
        values = d * (nibbles - 8) if qtype == Q.Q4_0 else d * nibbles + _f16(blocks[:, 2:4])
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
) -> dict[str, np.ndarray]:
    """Write `state` (canonical HF names) as a GGUF; `qtypes` maps a name suffix such as
    'q_proj.weight' to its type (1-D tensors are always F32). Returns {canonical name: float64
    values the file encodes, in HF layout}."""
    writer = gguf.GGUFWriter(str(path), spec.arch)
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
    if tokenizer is not None:
        add_tokenizer(writer, tokenizer)

    references = {}
    for name, tensor in state.items():
        w = tensor.detach().double().numpy().astype(np.float32)
        row_index = np.arange(w.shape[0])
        if spec.arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = spec.num_heads if ".q_proj." in name else spec.num_kv_heads
            w = llamacpp_permute(w, heads)
            row_index = llamacpp_permute(row_index, heads)  # GGUF row r holds HF row row_index[r]
        qtype = Q.F32 if w.ndim == 1 else next(t for suffix, t in qtypes.items() if name.endswith(suffix))
        raw = gguf.quants.quantize(w, qtype)
        writer.add_tensor(gguf_name(name), raw, raw_dtype=qtype if raw.dtype == np.uint8 else None)
        encoded = reference_dequantize(qtype, raw, w.shape)
        references[name] = np.empty_like(encoded)
        references[name][row_index] = encoded
    for raw_name, data in spec.extra_tensors.items():
        writer.add_tensor(raw_name, data.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return references


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

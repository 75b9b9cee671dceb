"""GGUF files (llama.cpp's format) -> ModelConfig, canonical HF tensors, tokenizer, chat template.

A GGUF carries everything a model needs in one file: architecture metadata under `{arch}.*`
keys, the tokenizer as token / merge arrays under `tokenizer.ggml.*`, the chat template, and
tensors under llama.cpp's names, possibly quantized. Tensors come by the same canonical names a
safetensors checkpoint gives (`layers.N.self_attn.q_proj.weight`), so a model's `load_weights`
cannot tell the two formats apart: `get` dequantizes them (`gguf.quants.dequantize`: Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0, K-quants, F16, BF16, F32), and `get_quantized` hands the quantized ones over
in our own formats without a second quantization (weights/gguf_quant.py: the CPU's compact path).

llama.cpp's conventions are undone here:
- tensor shapes are stored in ggml order (fastest dimension first); the numpy views the reader
  returns are already [rows, cols], which is the torch `nn.Linear` layout.
- for the `llama` architecture the converter permutes the rows of q and k within each head from
  rotate-half pairs (i, i + d/2) to interleaved pairs (2i, 2i + 1); we permute them back.
- Qwen3.5 / 3.6 files (`qwen35`, `qwen35moe`) have their own names, stored norm offsets, tiled
  value heads and split experts: weights/gguf_qwen35.py.
A permutation of rows is applied to quantized tensors as well (rows are independent); a change
of values only to float ones, so such a tensor has no `quant_format`. Where the converter moved a
weight's columns, the weight stays as stored and the model permutes its inputs (`input_orders`).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, ReaderTensor
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from ..config import MAX_POSITIONS, MAX_VOCAB, MAX_WIDTH, ConfigFields, ModelConfig
from ..errors import ModelLoadError
from ..tokenizer import Tokenizer as NinferTokenizer
from .gguf_qwen35 import (QWEN35_ARCHS, TensorFix, canonical_part, input_orders, layer_counts, qwen35_config,
                          tensor_fix)
from .gguf_split import SPLIT_COUNT, SPLIT_NO, SPLIT_TENSORS, first_shard, shard_name

if TYPE_CHECKING:  # torch (through ops / gguf_quant) is imported by the tensor readers only:
    import torch  # `ninfer ls` / `show` read a GGUF's config without it

    from ..ops.kquant import KQuantFormat
    from ..ops.quant import QuantFormat, QuantizedWeight

# GGUF `general.architecture` -> ModelConfig.arch: llama's decoder layout, then Qwen3.5 / 3.6.
LLAMA_LAYOUT_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
GGUF_ARCHS = {**LLAMA_LAYOUT_ARCHS, **QWEN35_ARCHS}

# Architectures whose llama.cpp converter interleaves the q / k rotary pairs.
_PERMUTED_QK_ARCHS = ("llama",)

_GLOBAL_TENSORS = {
    "token_embd": "embed_tokens",
    "output_norm": "norm",
    "output": "lm_head",
}
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_RE = re.compile(r"(\w+)\.(weight|bias)")

# general.file_type (llama_ftype) of unquantized files -> their float type. Quantized files have
# none of their own; they run in bfloat16 (fp16's range is the risk, not bf16's precision, which
# is far finer than a 4-8 bit quantization step).
_FILE_TYPE_DTYPE = {0: "float32", 1: "float16", 32: "bfloat16"}

# Tokens llama.cpp treats as an end of generation whatever the file's ids say (llama-vocab.cpp's
# list, the texts of families we run and their relatives).
_EOG_TEXTS = frozenset({"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
                        "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<｜end▁of▁sentence｜>"})

# llama.cpp token types (llama_token_type).
_TOKEN_NORMAL = 1
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4


def gguf_to_canonical_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `layers.3.self_attn.q_proj.weight`; None for names we do not know."""
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m:
        part = _BLOCK_TENSORS.get(m.group(2))
        return f"layers.{m.group(1)}.{part}.{m.group(3)}" if part else None
    m = _GLOBAL_RE.fullmatch(gguf_name)
    if m and m.group(1) in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[m.group(1)]}.{m.group(2)}"
    return None


def rotary_rows(rows: int, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k row permutation undone: HF row h*d/2 + i of a head is the file's row 2i + h."""
    if rows % (2 * n_heads):
        raise ModelLoadError(f"cannot un-permute {rows} rows over {n_heads} heads (not a multiple of 2 x heads)")
    half = rows // n_heads // 2
    return np.arange(rows).reshape(n_heads, half, 2).transpose(0, 2, 1).reshape(-1)


# Pre-tokenizer split regexes, keyed by `tokenizer.ggml.pre` (llama.cpp's names for them).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_REGEX_SPLITS = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "qwen35": _QWEN35_SPLIT,
}
# Pre-types that keep GPT-2's own split (ByteLevel's built-in regex); smollm first isolates digits.
_GPT2_SPLIT_TYPES = ("default", "gpt2", "gpt-2", "smollm")
# llama.cpp looks a whole pre-token up in the vocabulary before merging for the llama-3 family.
_IGNORE_MERGES_TYPES = ("llama-bpe", "llama3")


def _pre_tokenizer(pre: str, path: Path) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre in _GPT2_SPLIT_TYPES)
    if pre in _REGEX_SPLITS:
        split = pre_tokenizers.Split(Regex(_REGEX_SPLITS[pre]), behavior="isolated")
        return pre_tokenizers.Sequence([split, byte_level])
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _GPT2_SPLIT_TYPES:
        return byte_level
    known = sorted(_GPT2_SPLIT_TYPES + tuple(_REGEX_SPLITS))
    raise ModelLoadError(f"{path}: tokenizer pre-type '{pre}' is not supported (supported: {', '.join(known)})")


class FastGGUFReader(GGUFReader):
    """GGUFReader, faster where a start spends its time (SmolLM2's 49k-token vocabulary: 3.4 s of
    each start through gguf's reader, 1.0 s over a plain view, ~0.2 s with arrays read whole):
    - over a plain ndarray view of the memory map: slicing an np.memmap runs Python's
      memmap.__array_finalize__ for every slice (the view shares the map, nothing is read early);
    - a metadata array of numbers is one view (gguf's reader makes one per element), an array of
      strings a list of memoryviews made in one pass; `ReaderField.contents()` gives the same values
      (tests/test_gguf.py compares every field with gguf's reader)."""

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._data = value.view(np.ndarray)

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[Any], list[int], list[GGUFValueType]]:
        if raw_type != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        count_part = self._get(orig_offs + 4, np.uint64)
        item_type, count, offs = GGUFValueType(raw_itype[0]), int(count_part[0]), orig_offs + 12
        types = [GGUFValueType.ARRAY, item_type]
        if item_type == GGUFValueType.STRING:
            if count * 8 > len(self._data) - offs:
                raise ValueError(f"an array of {count} strings at offset {orig_offs} runs past the file")
            length = struct.Struct(">Q" if self.byte_order == "S" else "<Q")
            buffer, strings = memoryview(self._data), []
            for _ in range(count):
                (size,) = length.unpack_from(buffer, offs)
                end = offs + 8 + size
                if end > len(buffer):
                    raise ValueError(f"a string at offset {offs} runs past the file")
                strings.append(buffer[offs + 8 : end])  # a view of the map, like gguf's parts
                offs = end
            return offs - orig_offs, [raw_itype, count_part, *strings], list(range(2, 2 + count)), types
        item = self.gguf_scalar_to_np.get(item_type)
        if item is None:  # arrays of arrays: gguf's own reading
            return super()._get_field_parts(orig_offs, raw_type)
        values = self._get(offs, item, count)
        if len(values) != count:
            raise ValueError(f"an array of {count} values at offset {orig_offs} runs past the file")
        return 12 + int(values.nbytes), [raw_itype, count_part, values], [2], types


# GGUF's fixed header: magic, version (uint32), tensor count, metadata count (uint64 each). Each
# tensor description takes at least 8 + 1 + 4 + 8 + 4 + 8 bytes (name length, name, dims, one
# dim, type, offset), each metadata entry at least 8 + 1 + 4 + 1 (key length, key, type, value).
_HEADER = struct.Struct("<4sIQQ")
_MIN_TENSOR_INFO, _MIN_KV = 33, 14


def check_header_counts(path: Path) -> None:
    """Refuse a header whose counts its file cannot hold (the reader would loop over them first)."""
    with open(path, "rb") as f:
        head = f.read(_HEADER.size)
    if len(head) < _HEADER.size or head[:4] != b"GGUF":
        raise ModelLoadError(f"{path}: not a readable GGUF file (no GGUF header)")
    _, version, tensors, kvs = _HEADER.unpack(head)
    if version & 0xFFFF == 0:  # written on a big-endian machine
        _, version, tensors, kvs = struct.unpack(">4sIQQ", head)
    room = path.stat().st_size - _HEADER.size
    for name, count, size in (("tensor_count", tensors, _MIN_TENSOR_INFO), ("kv_count", kvs, _MIN_KV)):
        if count * size > room:
            raise ModelLoadError(f"{path}: GGUF header field '{name}' says {count}, more than the file's "
                                 f"{room + _HEADER.size} bytes can describe")


def _read(path: Path) -> FastGGUFReader:
    if not path.is_file():
        raise ModelLoadError(f"{path}: GGUF file not found")
    check_header_counts(path)
    try:
        return FastGGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from None


def _metadata(reader: GGUFReader, path: Path, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    try:
        return field.contents()
    except (ValueError, IndexError) as e:  # UnicodeDecodeError is a ValueError
        raise ModelLoadError(f"{path}: metadata key '{key}' cannot be read ({e})") from None


class GGUFFile:
    """An opened GGUF file: metadata parsed now, tensors memory-mapped and dequantized on request.
    A split model (weights/gguf_split.py) is opened by any of its shards: metadata from the first,
    tensors from all."""

    def __init__(self, path: str | Path):
        self.path = first_shard(Path(path))
        self._reader = _read(self.path)
        self._shards = self._open_shards()

    def _open_shards(self) -> list[FastGGUFReader]:
        """This file's reader, then the other shards' where the file is the first of a split model."""
        count = int(self.metadata(SPLIT_COUNT, 0) or 0)
        if count <= 1:
            return [self._reader]
        if self.metadata(SPLIT_NO, 0) != 0:
            raise ModelLoadError(f"{self.path}: shard {self.metadata(SPLIT_NO) + 1} of a split model whose name does "
                                 f"not say so: open its first shard (NAME-00001-of-{count:05d}.gguf)")
        shard = shard_name(self.path.name)
        if shard is None or shard.count != count:
            raise ModelLoadError(f"{self.path}: the first of {count} shards, but its name does not end in "
                                 f"-00001-of-{count:05d}.gguf, by which the others are found")
        readers = [self._reader]
        for number in range(2, count + 1):
            path = self.path.with_name(shard.sibling(number))
            if not path.is_file():
                raise ModelLoadError(f"{self.path}: shard {number} of {count} is missing ({path.name})")
            reader = _read(path)
            said = _metadata(reader, path, SPLIT_NO), _metadata(reader, path, SPLIT_COUNT)
            if said != (number - 1, count):
                raise ModelLoadError(f"{path}: not shard {number} of {count} of {self.path.name} (its split.no / "
                                     f"split.count: {said[0]} / {said[1]})")
            readers.append(reader)
        expected = self.metadata(SPLIT_TENSORS)
        found = sum(len(r.tensors) for r in readers)
        if expected is not None and found != expected:
            raise ModelLoadError(f"{self.path}: its {count} shards hold {found} tensors, {SPLIT_TENSORS} says {expected}")
        return readers

    @property
    def tensors(self) -> list[ReaderTensor]:
        """Every tensor of the model, over all its shards."""
        return [t for reader in self._shards for t in reader.tensors]

    def metadata(self, key: str, default: Any = None) -> Any:
        """A metadata value as Python data (str, int, float, bool or list)."""
        return _metadata(self._reader, self.path, key, default)

    def _require(self, key: str) -> Any:
        value = self.metadata(key)
        if value is None:
            raise ModelLoadError(f"{self.path}: missing metadata key '{key}'")
        return value

    def _values(self, t: ReaderTensor) -> np.ndarray:
        """One file tensor dequantized to float32, in HF dimension order."""
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        try:
            values = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ModelLoadError(
                f"{self.path}: tensor '{t.name}' has type {t.tensor_type.name}, which cannot be dequantized"
            ) from None
        values = np.require(values, dtype=np.float32, requirements=["C", "W"])
        if values.size != int(np.prod(shape)):
            raise ModelLoadError(f"{self.path}: tensor '{t.name}' holds {values.size} values, shape says {shape}")
        return values.reshape(shape)


class GGUFCheckpoint(GGUFFile):
    """A model's GGUF file: config, tokenizer and tensors under canonical HF names."""

    def __init__(self, path: str | Path):
        super().__init__(path)
        self.gguf_arch = str(self._require("general.architecture"))
        if self.gguf_arch not in GGUF_ARCHS:
            raise ModelLoadError(
                f"{self.path}: GGUF architecture '{self.gguf_arch}' is not supported "
                f"(supported: {', '.join(GGUF_ARCHS)})"
            )
        # canonical name -> its file tensors (two for experts stored as gate and up halves)
        self._tensors: dict[str, list[ReaderTensor | None]] = {}
        canonical = self._name_map()
        unknown = []
        for t in self.tensors:
            found = canonical(t.name)
            if found is None:
                unknown.append(t.name)
                continue
            name, part, count = found
            parts = self._tensors.setdefault(name, [None] * count)
            if len(parts) != count or parts[part] is not None:
                raise ModelLoadError(f"{self.path}: tensor '{t.name}' appears twice")
            parts[part] = t
        if "rope_freqs.weight" in unknown:
            raise ModelLoadError(
                f"{self.path}: RoPE frequency scaling (tensor 'rope_freqs.weight', Llama 3.x) is not supported yet"
            )
        if unknown:
            raise ModelLoadError(f"{self.path}: unknown tensors for '{self.gguf_arch}': {', '.join(unknown[:8])}")
        halves = [name for name, parts in self._tensors.items() if None in parts]
        if halves:
            raise ModelLoadError(f"{self.path}: '{halves[0]}' has a gate or an up half but not both")

    def _name_map(self) -> Callable[[str], tuple[str, int, int] | None]:
        """File tensor name -> (canonical name, part, parts): the arch's naming."""
        if self.gguf_arch in QWEN35_ARCHS:
            num_layers, _ = layer_counts(ConfigFields(self._arch_key, str(self.path), f"{self.gguf_arch}."))
            return lambda gguf_name: canonical_part(gguf_name, num_layers)

        def llama(gguf_name: str) -> tuple[str, int, int] | None:
            name = gguf_to_canonical_name(gguf_name)
            return None if name is None else (name, 0, 1)

        return llama

    # ---- metadata -------------------------------------------------------------------------------

    def _arch_key(self, key: str, default: Any = None) -> Any:
        return self.metadata(f"{self.gguf_arch}.{key}", default)

    @cached_property
    def config(self) -> ModelConfig:
        f = ConfigFields(self._arch_key, str(self.path), f"{self.gguf_arch}.")
        hidden = f.integer("embedding_length", high=MAX_WIDTH)
        vocab = f.integer("vocab_size", None, high=MAX_VOCAB)
        if vocab is None:  # older files: the vocabulary size is the token list's length
            tokens = self._reader.fields.get("tokenizer.ggml.tokens")
            if tokens is None:
                raise ModelLoadError(f"{self.path}: no '{self.gguf_arch}.vocab_size' and no tokenizer.ggml.tokens")
            vocab = len(tokens.data)  # tokens the file really holds: no bound needed
        common = dict(
            arch=GGUF_ARCHS[self.gguf_arch],
            vocab_size=vocab,
            hidden_size=hidden,
            tie_word_embeddings="lm_head.weight" not in self._tensors,
            bos_token_id=self._token_id("bos"),
            eos_token_ids=self._stop_token_ids(),
            torch_dtype=_FILE_TYPE_DTYPE.get(self.metadata("general.file_type"), "bfloat16"),
            rms_eps=f.number("attention.layer_norm_rms_epsilon", 1e-6),
            rope_theta=f.number("rope.freq_base", 10000.0),
        )
        scaling = self._arch_key("rope.scaling.type", "none")
        if scaling not in ("none", None):
            raise ModelLoadError(f"{self.path}: RoPE scaling '{scaling}' is not supported yet")
        if self.gguf_arch in QWEN35_ARCHS:
            return qwen35_config(f, self._arch_key, common)
        num_layers = f.integer("block_count", low=0)
        num_heads = f.integer("attention.head_count")
        if isinstance(self._arch_key("attention.head_count_kv"), list):
            raise ModelLoadError(f"{self.path}: per-layer KV head counts are not supported")
        num_kv_heads = f.integer("attention.head_count_kv", num_heads)
        head_dim = f.integer("attention.key_length", max(hidden // num_heads, 1))
        rotary_dims = f.integer("rope.dimension_count", head_dim, high=head_dim)
        return ModelConfig(
            **common,
            num_layers=num_layers,
            layer_types=["full_attention"] * num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            partial_rotary_factor=rotary_dims / head_dim,
            qk_norm="layers.0.self_attn.q_norm.weight" in self._tensors,
            attention_bias="layers.0.self_attn.q_proj.bias" in self._tensors,
            intermediate_size=f.integer("feed_forward_length", high=MAX_WIDTH),
            max_position_embeddings=f.integer("context_length", 32768, high=MAX_POSITIONS),
        )

    # ---- tensors --------------------------------------------------------------------------------

    def names(self) -> set[str]:
        """Canonical HF names of every tensor in the file (no `lm_head.weight` when tied)."""
        return set(self._tensors)

    def _parts(self, name: str) -> list[ReaderTensor]:
        parts = self._tensors.get(name)
        if parts is None:
            raise ModelLoadError(f"{self.path}: no tensor '{name}'")
        return parts  # type: ignore[return-value]  # no None left after __init__'s check

    def _single(self, name: str) -> ReaderTensor:
        """The one file tensor behind `name`, for the quantized paths."""
        parts = self._parts(name)
        if len(parts) != 1:
            raise ModelLoadError(f"{self.path}: '{name}' is made of {len(parts)} file tensors")
        return parts[0]

    def _fix(self, name: str) -> TensorFix | None:
        """What the converter did to this tensor, to undo (weights/gguf_qwen35.py; llama's q / k rows)."""
        if self.gguf_arch in QWEN35_ARCHS:
            return tensor_fix(name, self.config)
        if self.gguf_arch in _PERMUTED_QK_ARCHS and name.startswith("layers.") and (
                ".self_attn.q_proj." in name or ".self_attn.k_proj." in name):
            heads = self.config.num_heads if ".self_attn.q_proj." in name else self.config.num_kv_heads
            return TensorFix(rows=rotary_rows(int(self._single(name).shape[-1]), heads))
        return None

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Dequantized tensor in HF layout ([out, in] for linears), float32 unless `dtype` is given."""
        import torch

        parts = [self._values(t) for t in self._parts(name)]
        if len(parts) > 1 and len({p.shape for p in parts}) > 1:
            raise ModelLoadError(f"{self.path}: the halves of '{name}' differ in shape")
        w = torch.from_numpy(parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-2))
        fix = self._fix(name)
        if fix is not None:
            w = self._reorder(name, w, fix)
            if fix.value is not None:
                w = fix.value(w)
        return w if dtype is None else w.to(dtype)

    def _reorder(self, name: str, w, fix: TensorFix):
        """Rows (of values, codes or scales) back in HF order."""
        if fix.rows is None:
            return w
        if w.dim() == 0 or w.shape[0] != len(fix.rows):
            raise ModelLoadError(f"{self.path}: '{name}' has shape {tuple(w.shape)}, expected {len(fix.rows)} rows")
        return w.index_select(0, _index(fix.rows))

    def input_orders(self) -> dict[str, np.ndarray]:
        """Linears (canonical module names) whose weight keeps the file's column order, and the order
        the model gives their inputs instead (x_file = x[order])."""
        return input_orders(self.config) if self.gguf_arch in QWEN35_ARCHS else {}

    def quant_format(self, name: str) -> QuantFormat | KQuantFormat | None:
        """The format a tensor keeps on the CPU: a Q4_K / Q5_K / Q6_K / Q8_0 / Q4_0 / Q4_1 matrix its blocks as they are
        (`get_blocks`), other types (and K-quant routed experts, [E, N, K]) the format
        `get_quantized` gives; None when it has none (a float tensor, a block type without an
        exact mapping, a tensor whose values the converter changed, or one made of file tensors of
        different types)."""
        from ..ops.kquant import KQuantFormat
        from .gguf_quant import gguf_format
        from .kquant_layout import SUPER_BLOCK, block_type

        parts, fix = self._parts(name), self._fix(name)
        if len(parts[0].shape) not in (2, 3) or fix is not None and fix.value is not None:
            return None
        blocks = [block_type(t.tensor_type) for t in parts]
        # rows per expert for [E, N, K] experts; whole super-blocks of inputs (Q8_0 / Q4_x rows may end inside one)
        if None not in blocks and int(parts[0].shape[0]) % SUPER_BLOCK == 0:
            return KQuantFormat(tuple((block, int(t.shape[1])) for block, t in zip(blocks, parts)))
        return gguf_format(parts[0].tensor_type) if len({t.tensor_type for t in parts}) == 1 else None

    def get_blocks(self, name: str) -> np.ndarray:
        """A quantized matrix's blocks as the file holds them, [rows, bytes per row] (uint8), rows in
        HF order."""
        t = self._single(name)
        blocks = np.asarray(t.data).reshape(int(t.shape[1]), -1)  # a view of the read-only map
        fix = self._fix(name)
        if fix is None:
            return blocks
        import torch

        return self._reorder(name, torch.from_numpy(blocks.copy()), fix).numpy()

    def get_expert_blocks(self, name: str) -> list[np.ndarray]:
        """Routed experts' K-quant blocks as the file holds them: per part (gate, up), [E, rows, bytes]."""
        parts = self._parts(name)
        if len(parts[0].shape) != 3 or self._fix(name) is not None:
            raise ModelLoadError(f"{self.path}: '{name}' is not a stack of experts")
        return [np.asarray(t.data).reshape(int(t.shape[2]), int(t.shape[1]), -1) for t in parts]

    def get_quantized(self, name: str) -> QuantizedWeight:
        """A quantized 2-D or 3-D tensor in our format (`quant_format` must not be None), HF layout;
        expert halves stacked on their rows."""
        from ..ops.quant import QuantizedWeight
        from ..ops.quant_convert import concat_rows

        qw = concat_rows([self._quantized_part(t) for t in self._parts(name)])
        fix = self._fix(name)
        if fix is None:
            return qw
        offsets = None if qw.offsets is None else self._reorder(name, qw.offsets, fix)
        return QuantizedWeight(qw.kind, self._reorder(name, qw.qweight, fix), self._reorder(name, qw.scales, fix),
                               qw.group_size, offsets)

    def _quantized_part(self, t: ReaderTensor) -> QuantizedWeight:
        """One file tensor in our format, [..., rows, cols] as the file's (leading dims: experts)."""
        from ..ops.quant import QuantizedWeight
        from .gguf_quant import gguf_quantized

        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        cols, rows = shape[-1], int(np.prod(shape[:-1]))
        qw = gguf_quantized(t.data, t.tensor_type, rows, cols)
        lead = shape[:-1]

        def unflat(x):
            return None if x is None else x.reshape(*lead, *x.shape[1:])

        return QuantizedWeight(qw.kind, unflat(qw.qweight), unflat(qw.scales), qw.group_size, unflat(qw.offsets))

    # ---- tokenizer ------------------------------------------------------------------------------

    def _token_id(self, kind: str) -> int | None:
        value = self.metadata(f"tokenizer.ggml.{kind}_token_id")
        return None if value is None else int(value)

    @cached_property
    def _tokens(self) -> list[str] | None:
        """The vocabulary's token strings (decoded once: ~0.1 s for a 248K-token vocabulary)."""
        return self.metadata("tokenizer.ggml.tokens")

    def _stop_token_ids(self) -> list[int]:
        """What ends a generation, as llama.cpp decides it: eos, the end-of-turn / end-of-message
        ids, then every token spelled like an end of generation (a Qwen3.6 file names only
        <|im_end|>; its <|endoftext|> stops too, as its HF generation_config says)."""
        ids = [self._token_id(kind) for kind in ("eos", "eot", "eom")]
        ids += [i for i, text in enumerate(self._tokens or []) if text in _EOG_TEXTS]
        return list(dict.fromkeys(i for i in ids if i is not None))

    def build_tokenizer(self) -> Tokenizer:
        """A `tokenizers.Tokenizer` that splits text as llama.cpp does for this file (byte-level BPE).

        Control tokens become special added tokens (matched whole, dropped by skip_special_tokens),
        user-defined ones plain added tokens. With `tokenizer.ggml.add_bos_token`, encoding with
        special tokens prepends BOS, like a Llama `tokenizer.json` post-processor.
        """
        kind = self.metadata("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ModelLoadError(f"{self.path}: tokenizer model '{kind}' is not supported (only 'gpt2' byte-level BPE)")
        tokens: list[str] = self._tokens or self._require("tokenizer.ggml.tokens")  # raises when absent
        types: list[int] = self.metadata("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens)
        pre = self.metadata("tokenizer.ggml.pre", "default")
        merges = []
        for merge in self._require("tokenizer.ggml.merges"):
            pair = merge.split(" ")
            if len(pair) != 2:
                raise ModelLoadError(f"{self.path}: malformed merge {merge!r} in tokenizer.ggml.merges")
            merges.append((pair[0], pair[1]))
        vocab = {tok: i for i, tok in enumerate(tokens)}
        backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _IGNORE_MERGES_TYPES))
        backend.pre_tokenizer = _pre_tokenizer(pre, self.path)
        backend.decoder = decoders.ByteLevel()
        by_type = {ty: [t for t, tt in zip(tokens, types) if tt == ty] for ty in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)}
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in by_type[_TOKEN_CONTROL]])
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in by_type[_TOKEN_USER_DEFINED]])
        bos = self._token_id("bos")
        if self.metadata("tokenizer.ggml.add_bos_token", False) and bos is not None:
            backend.post_processor = processors.TemplateProcessing(
                single=f"{tokens[bos]}:0 $A:0", pair=f"{tokens[bos]}:0 $A:0 $B:1", special_tokens=[(tokens[bos], bos)]
            )
        return backend

    def load_tokenizer(self) -> NinferTokenizer:
        """The engine's tokenizer: vocabulary, stop ids, BOS and the chat template from metadata."""
        return NinferTokenizer(
            self.build_tokenizer(),
            eos_token_ids=self._stop_token_ids(),
            bos_token_id=self._token_id("bos"),
            chat_template=self.metadata("tokenizer.chat_template"),
            source=str(self.path),
        )


def _index(order: np.ndarray):
    import torch

    return torch.from_numpy(np.ascontiguousarray(order, dtype=np.int64))


def open_gguf(path: str | Path) -> GGUFCheckpoint:
    """Open a GGUF file (metadata parsed now, tensor data read on `get`)."""
    return GGUFCheckpoint(path)

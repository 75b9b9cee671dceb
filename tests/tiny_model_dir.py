"""A complete tiny Qwen3.5 model directory for engine and CLI tests: random weights + a small
byte-level BPE tokenizer (trained with `tokenizers`) that knows Qwen's special and markup tokens.

The real Qwen3.6 vocabulary (248k) would make even a tiny model's embedding 100+ MB; a trained
~400-token BPE keeps the model a few hundred KB while the chat markup still encodes to single ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import tokenizers
import torch
from tokenizers import decoders, models, pre_tokenizers, trainers

from tiny_checkpoints import write_tiny_qwen

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MARKUP = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France.",
    "def add(a, b):\n    return a + b\n",
    "system user assistant function parameter tools You are a helpful assistant.",
    "Émoji 😀 and 中文 and ünïcödé text, numbers 0123456789.",
]
VOCAB_SIZE = 400
# sizes the quantized kernels cover: int4 groups (32) divide every FFN input, the q / k / v, GDN and
# shared-expert projections reach 64 outputs, the CUDA kernels' vector widths divide every row (the
# tiny defaults, hidden 32 and expert inter 20, send int8 experts to the host-synced grouped path,
# which a CUDA graph cannot capture)
WIDE = dict(hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=64)


def build_tokenizer() -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in MARKUP])
    return tok


def write_tiny_model_dir(
    directory: Path, *, moe: bool = True, seed: int = 0, max_positions: int = 512, overrides: dict | None = None
):
    """Write weights + tokenizer files; return (transformers reference model, tokenizers.Tokenizer).
    `overrides`: more text-config fields (e.g. wider layers that int4 groups divide)."""
    directory.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    vocab = tok.get_vocab_size(with_added_tokens=True)
    im_end = tok.token_to_id("<|im_end|>")
    model = write_tiny_qwen(
        directory, moe=moe, multimodal=False, seed=seed,
        text_overrides={"vocab_size": vocab, "eos_token_id": im_end, "max_position_embeddings": max_positions,
                        **(overrides or {})},
    )
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None})
    )
    return model, tok


VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Patch 4 (the tiny tower's), small budgets: images 8x8 .. 48x48 pixels, videos up to 8 x 32 x 32.
IMAGE_PREPROCESSING = {"patch_size": 4, "size": {"shortest_edge": 64, "longest_edge": 48 * 48}}
VIDEO_PREPROCESSING = {"patch_size": 4, "size": {"shortest_edge": 64, "longest_edge": 8 * 32 * 32}}


@dataclass
class TinyMultimodal:
    directory: Path
    hf: torch.nn.Module
    ids: dict[str, int]


def write_tiny_multimodal_dir(directory: Path, moe: bool) -> TinyMultimodal:
    """A tiny Qwen3.5 multimodal checkpoint with a small tokenizer that knows the vision tokens."""
    tok = build_tokenizer()
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    ids = {t: tok.token_to_id(t) for t in VISION_TOKENS + ["<|im_end|>"]}
    hf = write_tiny_qwen(
        directory, moe=moe, multimodal=True, mtp=False,
        text_overrides={
            "vocab_size": tok.get_vocab_size(), "eos_token_id": ids["<|im_end|>"], "max_position_embeddings": 512
        },
    )
    token_ids = {
        "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
    }
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **token_ids}))
    for key, value in token_ids.items():
        setattr(hf.config, key, value)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": None}))
    (directory / "preprocessor_config.json").write_text(json.dumps(IMAGE_PREPROCESSING))
    (directory / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PREPROCESSING))
    return TinyMultimodal(directory, hf.eval(), ids)

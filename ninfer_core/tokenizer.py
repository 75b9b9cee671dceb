"""Tokenizer: an HF `tokenizers.Tokenizer` plus the metadata generation needs (eos, bos, template).

Real checkpoints ship `tokenizer.json`, which `tokenizers` loads directly; the GGUF loader builds
a `tokenizers.Tokenizer` from GGUF vocab + merges and passes it to the constructor. Special tokens
such as `<|im_start|>` are added tokens, so they encode to single ids wherever they appear.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import tokenizers

from .config import read_json_object
from .errors import ModelLoadError
from .prompt_ids import PromptIdCache

# One template, or named templates ("default", "tool_use", ...) as tokenizer_config.json may hold.
ChatTemplateSource = str | dict[str, str]


class Tokenizer:
    """Text <-> ids for one model, with the ids and strings that end or frame a generation."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        eos_token_ids: Iterable[int] = (),
        bos_token_id: int | None = None,
        chat_template: ChatTemplateSource | None = None,
        source: str = "<memory>",
    ):
        self.backend = backend
        self.source = source
        self.chat_template = chat_template
        self._added = backend.get_added_tokens_decoder()  # id -> AddedToken
        self.vocab_size = max(backend.get_vocab_size(with_added_tokens=True), max(self._added, default=-1) + 1)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.bos_token_id = bos_token_id
        for name, ids in (("eos", self.eos_token_ids), ("bos", () if bos_token_id is None else (bos_token_id,))):
            for token_id in ids:
                if backend.id_to_token(token_id) is None:
                    raise ModelLoadError(f"{source}: {name} token id {token_id} is not in the vocabulary")
        # Added tokens marked special (<|im_end|>, <|endoftext|>) are dropped from generated text;
        # markup tokens such as <think> / <tool_call> are non-special in Qwen checkpoints and kept.
        self.special_ids: frozenset[int] = frozenset(i for i, tok in self._added.items() if tok.special)
        self._bytes_of: dict[int, bytes] = {}  # token_bytes, filled as tokens are first seen
        self.prompt_ids = PromptIdCache(backend)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load `tokenizer.json` with eos / bos / chat template from the files beside it."""
        directory = Path(model_dir)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{directory}: no tokenizer.json (ninfer needs the HF fast-tokenizer file)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises plain Exception subclasses with terse messages
            raise ModelLoadError(f"{path}: cannot load tokenizer: {exc}") from exc
        config = read_json_object(directory / "tokenizer_config.json")
        generation = read_json_object(directory / "generation_config.json")

        def token_id(field: str) -> int | None:
            token = _token_content(config.get(field))
            if token is None:
                return None
            token_id = backend.token_to_id(token)
            if token_id is None:
                where = directory / "tokenizer_config.json"
                raise ModelLoadError(f"{where}: {field} {token!r} is not in the vocabulary")
            return token_id

        eos = [i for i in [token_id("eos_token")] if i is not None]
        gen_eos = generation.get("eos_token_id")
        eos += gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos]
        return cls(
            backend,
            eos_token_ids=eos,
            bos_token_id=token_id("bos_token"),
            chat_template=_find_chat_template(directory, config),
            source=str(directory),
        )

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Ids of `text`; special-token strings in it become their single ids.

        `add_special_tokens` runs the tokenizer's post-processor (e.g. a Llama BOS); rendered chat
        prompts already contain their framing tokens, so the default is off.
        """
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_prompt(self, text: str) -> list[int]:
        """`encode(text)` of a rendered prompt, reusing the ids of earlier prompts that start the
        same way (the turns of a chat; prompt_ids.py): a long conversation is not encoded again."""
        return self.prompt_ids.encode(text)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes a token contributes to decoded text (b"" for ids outside the vocabulary).

        A byte-level token may hold part of a multi-byte character; the incremental detokenizer
        joins these bytes, so it never has to re-decode a window of ids.
        """
        cached = self._bytes_of.get(token_id)
        if cached is None:
            added = self._added.get(token_id)
            if added is not None:
                cached = added.content.encode()
            else:
                piece = self.backend.id_to_token(token_id) if token_id >= 0 else None
                cached = b"" if piece is None else self._piece_bytes(piece)
            self._bytes_of[token_id] = cached
        return cached

    @cached_property
    def strips_leading_space(self) -> bool:
        """True when decode() drops the space a SentencePiece-style first token starts with."""
        for node in _decoder_nodes(self.backend):
            if node.get("type") == "Strip" and node.get("content") == " " and node.get("start", 0) > 0:
                return True
            if node.get("type") == "Metaspace" and node.get("prepend_scheme", "always") != "never":
                return True
        return False

    @cached_property
    def _piece_bytes(self) -> Callable[[str], bytes]:
        """A vocabulary piece's bytes, per id on first use: a table of the whole vocabulary cost the
        first request ~0.2 s (SmolLM2's 49K pieces on a 2-core CPU; Qwen's are 248K)."""
        types = {node.get("type") for node in _decoder_nodes(self.backend)}
        if "ByteLevel" in types:
            # str.translate + latin-1 turns each stand-in character back into its byte in C.
            to_latin1 = {ord(ch): b for ch, b in _byte_level_alphabet().items()}

            def piece_bytes(piece: str) -> bytes:
                try:
                    return piece.translate(to_latin1).encode("latin-1")
                except UnicodeEncodeError:  # not a byte-level piece
                    return piece.encode()
        else:  # SentencePiece style: "▁" stands for a space, "<0xAB>" for a raw byte (byte fallback)
            byte_fallback = "ByteFallback" in types

            def piece_bytes(piece: str) -> bytes:
                if byte_fallback and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                    return bytes([int(piece[3:5], 16)])
                return piece.replace("\u2581", " ").encode()
        return piece_bytes


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2 byte-level BPE's stand-in characters: printable Latin-1 bytes stand for themselves,
    the other 68 bytes (controls, space, soft hyphen...) map in order onto U+0100 and up."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    alphabet = {chr(b): b for b in printable}
    others = [b for b in range(256) if chr(b) not in alphabet]
    alphabet.update({chr(0x100 + n): b for n, b in enumerate(others)})
    return alphabet


def _decoder_nodes(backend: tokenizers.Tokenizer) -> list[dict[str, Any]]:
    """The decoder's JSON config flattened (a Sequence decoder lists its children)."""
    if backend.decoder is None:
        return []
    nodes, stack = [], [json.loads(backend.decoder.__getstate__())]
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node.get("decoders") or [])
    return nodes


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _find_chat_template(directory: Path, config: dict[str, Any]) -> ChatTemplateSource | None:
    """chat_template.jinja wins over chat_template.json, which wins over tokenizer_config.json."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    raw = read_json_object(directory / "chat_template.json").get("chat_template") or config.get("chat_template")
    if raw is None or isinstance(raw, str):
        return raw
    if isinstance(raw, list) and all(isinstance(t, dict) and "name" in t and "template" in t for t in raw):
        return {t["name"]: t["template"] for t in raw}
    raise ModelLoadError(f"{directory}: chat_template must be a string or a list of {{name, template}} objects")

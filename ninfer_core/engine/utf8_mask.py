"""Valid UTF-8 for constrained answers: which tokens may come next given the bytes so far.

xgrammar matches text byte by byte and admits byte sequences that are not UTF-8 where a grammar
allows "any character" (surrogates, overlong 4-byte forms), and byte-level vocabularies hold
tokens of single bytes: a model could then write a string that decodes to U+FFFD characters and
breaks its schema's maxLength or pattern. This filter is a UTF-8 decoder's state machine (the
Unicode standard's table of well-formed sequences): per state, the mask of tokens whose bytes
keep the text well-formed, ANDed with the grammar's mask; each accepted token moves the state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..ops.token_mask import words

BOUNDARY = 0  # the text so far ends at a character boundary
_STATES = 8
_REJECT = _STATES
# (state, first byte, last byte, next state): 0 boundary; 1 / 2 / 3 continuation bytes to go;
# 4 after E0 (A0..BF next), 5 after ED (80..9F: no surrogates), 6 after F0 (90..BF: no overlong),
# 7 after F4 (80..8F: nothing past U+10FFFF).
_RULES = [
    (0, 0x00, 0x7F, 0), (0, 0xC2, 0xDF, 1), (0, 0xE0, 0xE0, 4), (0, 0xE1, 0xEC, 2), (0, 0xED, 0xED, 5),
    (0, 0xEE, 0xEF, 2), (0, 0xF0, 0xF0, 6), (0, 0xF1, 0xF3, 3), (0, 0xF4, 0xF4, 7),
    (1, 0x80, 0xBF, 0), (2, 0x80, 0xBF, 1), (3, 0x80, 0xBF, 2),
    (4, 0xA0, 0xBF, 1), (5, 0x80, 0x9F, 1), (6, 0x90, 0xBF, 2), (7, 0x80, 0x8F, 2),
]


def _byte_table() -> np.ndarray:
    table = np.full((_STATES + 1, 256), _REJECT, dtype=np.uint8)
    for state, low, high, nxt in _RULES:
        table[state, low : high + 1] = nxt
    return table


@dataclass(frozen=True)
class Utf8Filter:
    """`next_state[s, t]`: the state after token t from state s (_REJECT: not well-formed);
    `masks[s]`: the packed bitmask (ops/token_mask.py layout) of the tokens allowed from s."""

    next_state: np.ndarray  # [states, V] uint8
    masks: np.ndarray  # [states, words(V)] int32 (ANDed on the host: numpy, no torch op overhead)

    @classmethod
    def build(cls, vocab: Sequence[bytes]) -> Utf8Filter:
        """From each token's bytes (b"" for special tokens: they never change the state)."""
        lengths = np.array([len(b) for b in vocab], dtype=np.int64)
        width = int(lengths.max(initial=0))
        flat = np.frombuffer(b"".join(vocab), dtype=np.uint8)
        data = np.zeros((len(vocab), max(width, 1)), dtype=np.uint8)
        data[np.arange(width) < lengths[:, None]] = flat  # row-major fill = the tokens' bytes in order
        table = _byte_table()
        next_state = np.empty((_STATES, len(vocab)), dtype=np.uint8)
        for start in range(_STATES):
            state = np.full(len(vocab), start, dtype=np.uint8)
            for pos in range(width):
                live = pos < lengths
                state[live] = table[state[live], data[live, pos]]
            next_state[start] = state
        allowed = next_state != _REJECT
        padded = np.zeros((_STATES, words(len(vocab)) * 32), dtype=bool)
        padded[:, : len(vocab)] = allowed
        packed = np.packbits(padded, axis=1, bitorder="little").view("<i4")
        return cls(next_state, packed.astype(np.int32))

    def advance(self, state: int, token: int) -> int:
        """The state after `token` (tokens past the vocabulary leave it as it is)."""
        return int(self.next_state[state, token]) if 0 <= token < self.next_state.shape[1] else state

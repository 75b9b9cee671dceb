"""Grammar-constrained decoding with xgrammar: compiled grammars, per-request matchers, masks.

A constrained request carries a `Grammar`, compiled from an xgrammar structural tag (what
chat/constraints.py builds: a reasoning block, then JSON or tool calls) by the model's
`GrammarCompiler`, which keeps the most recent grammars by their tag (a schema sent again is not
compiled again). The engine gives its Sequence a `GrammarMatcher`; every token appended to the
answer is accepted by it on the host. Before a constrained row is sampled, `constrain` fills the
row's next-token bitmask from its matcher (xgrammar, on the CPU, all rows in one call), keeps only
tokens that leave the answer well-formed UTF-8 (utf8_mask.py: xgrammar's byte matching admits
surrogates and overlong forms) and masks the row's logits on the device (ops/token_mask.py);
unconstrained rows are not touched.

The mask of a step needs the previous step's token accepted. The engine keeps its overlapped
steps for constrained rows by ordering the host work (engine/llm_engine.py): step N+1's forward is
queued, step N's tokens are read and accepted, then `constrain` fills the bitmask while that
forward runs, so only the mask's copy and kernel lengthen a step (as long as the host work fits
in the forward: scripts/bench_grammar.py measures both).

xgrammar (and the transformers it imports) is loaded on the first constrained request.
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import NinferError
from ..ops.token_mask import apply_token_mask, words
from ..tokenizer import Tokenizer
from .utf8_mask import BOUNDARY, Utf8Filter

CACHED_GRAMMARS = 64
_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # "[18:11:01] /project/cpp/x.cc:17: "


class GrammarError(NinferError):
    """A constraint xgrammar cannot compile (e.g. an unsupported or malformed JSON schema)."""


class GrammarMatcher:
    """One request's position in its grammar and in UTF-8 (advanced by each token of the answer)."""

    def __init__(self, matcher: Any, utf8: Utf8Filter):
        self.raw = matcher  # xgrammar.GrammarMatcher
        self.utf8 = utf8
        self.utf8_state = BOUNDARY

    def accept(self, token: int) -> bool:
        state = self.utf8.advance(self.utf8_state, token)
        if state >= len(self.utf8.masks) or not self.raw.accept_token(token):
            return False
        self.utf8_state = state
        return True

    @property
    def terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: the answer is over."""
        return bool(self.raw.is_terminated())


@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled grammar, shared by every request with the same constraint."""

    compiled: Any  # xgrammar.CompiledGrammar
    key: str  # the structural tag it was compiled from (canonical JSON)
    utf8: Utf8Filter

    def matcher(self) -> GrammarMatcher:
        import xgrammar

        return GrammarMatcher(xgrammar.GrammarMatcher(self.compiled), self.utf8)


class GrammarCompiler:
    """Compiles structural tags for one tokenizer and vocabulary; thread-safe (requests are
    prepared on the callers' threads). xgrammar's tokenizer info is built on first use."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Iterable[int],
                 cache_size: int = CACHED_GRAMMARS):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(set(stop_token_ids))
        self.cache_size = cache_size
        self._compiler: Any = None
        self._utf8: Utf8Filter | None = None
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, structural_tag: Mapping[str, Any]) -> Grammar:
        # not sorted: xgrammar writes an object's properties in the order the schema lists them
        key = json.dumps(structural_tag, ensure_ascii=False)
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is None:
                compiled = self._compile(key)
                assert self._utf8 is not None
                grammar = Grammar(compiled, key, self._utf8)
                self._cache[key] = grammar
                if len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(key)
            return grammar

    def _compile(self, key: str) -> Any:
        if self._compiler is None:
            self._compiler, self._utf8 = self._new_compiler()
        try:
            return self._compiler.compile_structural_tag(key)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError, ValueError and its own types
            message = _XGRAMMAR_PREFIX.sub("", str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
            raise GrammarError(f"cannot build a grammar for this constraint: {message}") from None

    def _new_compiler(self) -> tuple[Any, Utf8Filter]:
        """xgrammar's view of the vocabulary: each id as the bytes it decodes to (RAW), special
        tokens as empty strings (xgrammar never allows them), stop tokens only at the end; and
        the UTF-8 filter over the same bytes."""
        import xgrammar

        if not self.stop_token_ids:
            raise GrammarError("this model declares no end-of-answer token: a grammar could never finish")
        tokenizer, special = self.tokenizer, self.tokenizer.special_ids
        vocab = [b"" if i in special else tokenizer.token_bytes(i) for i in range(self.vocab_size)]
        info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, vocab_size=self.vocab_size,
                                      stop_token_ids=self.stop_token_ids)
        return xgrammar.GrammarCompiler(info, cache_enabled=False), Utf8Filter.build(vocab)


@functools.cache
def _batch_filler(threads: int) -> Any:
    import xgrammar

    return xgrammar.BatchGrammarMatcher(threads)


def _fill_threads(rows: int) -> int:
    """Rows are filled in parallel, one thread per row up to half the cores (xgrammar's "auto"):
    one row's fill can take milliseconds (bounded strings: xgrammar issue #852, open in 0.2.9), and
    several such rows in one thread would outlast the forward they hide behind."""
    return max(1, min(rows, (os.cpu_count() or 2) // 2))


def fill_bitmask(matchers: Sequence[GrammarMatcher | None], vocab: int,
                 pin: bool = False) -> tuple[torch.Tensor, list[int]]:
    """The host half of `constrain`: a packed mask [R, words(vocab)] whose rows that have a matcher
    hold the tokens their grammar and UTF-8 allow next (xgrammar fills them, in parallel), and
    those rows. `pin`: page-locked, for an asynchronous copy to the GPU."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    bitmask = torch.empty((len(matchers), words(vocab)), dtype=torch.int32, pin_memory=pin)
    live = [m for m in matchers if m is not None]
    if len(live) == 1:  # waking a thread pool costs ~60 us: more than most single fills
        live[0].raw.fill_next_token_bitmask(bitmask, rows[0])
    else:
        _batch_filler(_fill_threads(len(live))).batch_fill_next_token_bitmask([m.raw for m in live], bitmask, rows)
    # numpy on the shared memory: torch's small ops cost ~10x more, and wake its thread pool
    bitmask.numpy()[rows] &= live[0].utf8.masks[[m.utf8_state for m in live]]
    return bitmask, rows


def constrain(logits: torch.Tensor, matchers: Sequence[GrammarMatcher | None]) -> torch.Tensor:
    """Mask, in place, each row of logits [R, V] that has a matcher to the tokens its grammar
    allows next (the others are untouched); returns logits."""
    if all(m is None for m in matchers):
        return logits
    bitmask, rows = fill_bitmask(matchers, logits.shape[-1], pin=logits.device.type == "cuda")
    apply_token_mask(logits, bitmask.to(logits.device, non_blocking=True), rows)
    return logits

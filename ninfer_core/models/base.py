"""The contract between the engine and every model: one batched forward over a paged cache.

A step runs B sequences with T >= 1 new tokens each (T = 1 for decode, T = K+1 for speculative
verification, T = chunk for prefill with B = 1). Every sequence owns one state slot (GDN conv +
recurrent state) and a list of KV pages (its row in `block_table`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

import torch

from ..config import ModelConfig

if TYPE_CHECKING:
    from ..layers.gdn import GDNRecord


@dataclass
class StepWindows:
    """A tail fork's fused steps (`StateFork.tail`, layers/gdn.py `_forked`) as windows of at most
    MAX_STEP_TOKENS tokens run in turn after the chunked rule: window i advances row b from token
    offsets[i, b] for counts[i, b] tokens (0: none), its state first copied to fork_slots[i, b] (a
    checkpoint slot, or the row's own slot where no checkpoint falls). So a chat prompt's two
    checkpoints, its last message's start and its answer start (24 + 3 tokens apart in
    `bench_engine.chat_checkpoints`), take three windows instead of the chunked rule twice. Device
    tensors [W, B]; a prompt-chunk CUDA graph replays any values (W is its kind)."""

    offsets: torch.Tensor
    counts: torch.Tensor
    fork_slots: torch.Tensor


@dataclass
class StateFork:
    """A prefix-cache checkpoint inside a prompt chunk: row b's GDN state after its first tokens[b]
    new tokens is also written to state slot slots[b], and the chunk runs on (layers/gdn.py). So a
    chat's history end or answer start, or a prompt's last-but-one token, is kept without a
    second forward.
    Device tensors: a prompt-chunk CUDA graph replays with any values."""

    tokens: torch.Tensor  # [B] int64, 0 < tokens[b] <= valid_tokens[b]
    slots: torch.Tensor  # [B] int64 state slots (tokens[b] == valid_tokens[b]: a scratch slot, no fork)
    # every fork within MAX_STEP_TOKENS of its row's end (or within `steps`' windows of it): the rest
    # runs through the fused steps; else the chunked rule runs twice (layers/gdn.py `_forked`,
    # `_forked_chunked`)
    tail: bool = True
    # chunked forks only: a second fork within MAX_STEP_TOKENS of the row's end, the fused steps
    # after it (then.tokens == valid_tokens: none)
    then: StateFork | None = None
    # tokens[0] on the host, for an eager forward of one unpadded row: the chunked fork then runs the
    # rule over each side's own tokens (graphs replay with any values: None, masks)
    host_tokens: int | None = None
    # tail forks: the fused steps' windows (None: one, from tokens to the row's end, copying to slots)
    steps: StepWindows | None = None


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [B, T] int64
    positions: torch.Tensor  # [B, T] int64 absolute positions of the new tokens
    cache_lens: torch.Tensor  # [B] int64 tokens already in the KV cache before this step
    slots: torch.Tensor  # [B] int64 state-pool slot of each sequence
    block_table: torch.Tensor  # [B, max_pages] int32 KV page ids (unused entries: any value)
    mrope_positions: torch.Tensor | None = None  # [3, B, T] (t, h, w) for multimodal input
    inputs_embeds: torch.Tensor | None = None  # [B, T, hidden] replaces the embedding lookup
    logits: Literal["last", "all", "none"] = "last"
    # [1] int32: a decode / verify graph's real tokens (engine/cuda_graph.py); an MoE's router kernel
    # routes the tokens past them (the graph's spare rows) dead, so they read no expert
    live_tokens: torch.Tensor | None = None
    # Speculative verification: GDN layers leave their state slots untouched and return their
    # per-token inputs (ForwardOutput.gdn_records), so only the accepted prefix gets committed.
    verify: bool = False
    capture_layers: tuple[int, ...] = ()  # layers whose outputs a drafter reads (DFlash)
    host_cache_lens: tuple[int, ...] | None = None  # cache_lens known on the host (prefill attention: no sync)
    # A padded prompt chunk (prefill CUDA graphs): row b's first valid_tokens[b] tokens are real;
    # padding writes its KV to the flat row `pad_kv_row` and leaves the GDN state untouched, and
    # "last" logits are those of the last real token.
    valid_tokens: torch.Tensor | None = None  # [B] int64 on the device
    pad_kv_row: int = 0
    fork: StateFork | None = None  # a GDN state checkpoint inside the chunk

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_new_tokens(self) -> int:
        return self.input_ids.shape[1]


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None  # [B, 1 or T, vocab] float32
    hidden_states: torch.Tensor  # [B, T, hidden] last layer output before the final norm
    captured: torch.Tensor | None = None  # [B, T, len(capture_layers) * hidden], in capture_layers order
    gdn_records: dict[int, GDNRecord] | None = None  # layer -> record, verify forwards only


class CausalLM(Protocol):
    config: ModelConfig

    def forward(self, batch: ForwardBatch, cache: "ModelCacheLike") -> ForwardOutput: ...


class ModelCacheLike(Protocol):
    """Implemented by `ninfer_core.cache.ModelCache`."""

    page_size: int

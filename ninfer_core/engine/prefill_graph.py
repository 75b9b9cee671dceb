"""CUDA graphs of short prompt chunks: the host-free path of a short prompt.

Eagerly, a prompt chunk of the 35B launches ~4,400 kernels and its host time (Python, launches,
Triton's argument binding) is several times the GPU's: ~150 ms for a 37-token prompt whose GPU
work is ~18 ms. A chunk of one sequence with up to 2,048 tokens instead replays the graph of the
smallest bucket that holds it (16, 32, 48, ... 512, 768, ... 2,048 tokens), captured at load. Past
512 tokens the eager path is still host-bound (2,048 tokens: 86 ms of GPU work, 100-150 ms of wall
time on the H200), and the buckets are at most 1.5x apart, so padding costs less than the host did. The chunk is
padded to the bucket (`ForwardBatch.valid_tokens`): padding writes its KV to the scratch page,
advances no GDN state (g = beta = 0) and is never attended to by real tokens; attention runs on
`chunk_attention` (lengths on the device, a tensor-core Triton kernel on the GPU), so a
chunk may continue a cached prefix. The logits are the last real token's. With the prefix cache
each bucket also has graphs of chunks with a GDN state fork (`ForwardBatch.fork`: a checkpoint
taken inside the chunk), one per kind (the last tokens through the fused steps, in one window or
in TAIL_WINDOWS of them, engine/fork_windows.py; or the chunked rule twice, then the fused steps
from a second fork, or from the end when there is none); the forks' positions and slots are device
buffers.

Chunks that carry media, drafter layers or several sequences (mixed steps) run eagerly, and so
do chunks past the model's graph row limit (MoE experts that sync with the host past it: bf16
experts beyond 16 rows; quantized ones have no limit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..cache import CacheManager
from ..errors import NinferError
from ..models.base import CausalLM, ForwardBatch, ForwardOutput, StateFork, StepWindows
from .fork_windows import TAIL_WINDOWS
from .graph_capture import capture, graph_row_limit

BUCKETS = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
FORK_KINDS = ("tail", "windows", "chunked")


def fork_kind(fork: StateFork | None) -> str | None:
    """Which graph a chunk with this fork replays: none, the fused steps in one window or in
    TAIL_WINDOWS (`StateFork.steps`), or the chunked rule twice."""
    if fork is None:
        return None
    return ("tail" if fork.steps is None else "windows") if fork.tail else "chunked"


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor  # [1, bucket]
    positions: torch.Tensor  # [1, bucket]
    out: ForwardOutput


class PrefillGraphs:
    def __init__(self, model: CausalLM, manager: CacheManager, max_context: int, pool: tuple[int, int] | None):
        if manager.scratch_slot is None or manager.scratch_page is None:
            raise ValueError("prefill graphs need a cache built with scratch=True (padding writes its scratch page)")
        self.model, self.cache, self.pool = model, manager.cache, pool
        limit = graph_row_limit(model)
        self.buckets = tuple(b for b in BUCKETS if (limit is None or b <= limit) and b <= max_context)
        self.pad_kv_row = manager.scratch_page * manager.page_size
        self.max_pages = math.ceil(max_context / manager.page_size)
        device = manager.device
        self.cache_lens = torch.zeros(1, dtype=torch.long, device=device)
        self.scratch_slot = manager.scratch_slot
        self.slots = torch.full((1,), manager.scratch_slot, dtype=torch.long, device=device)
        self.valid = torch.ones(1, dtype=torch.long, device=device)
        self.block_table = torch.full((1, self.max_pages), manager.scratch_page, dtype=torch.int32, device=device)
        self.fork = StateFork(torch.ones(1, dtype=torch.long, device=device), self.slots.clone(),
                              then=StateFork(torch.ones(1, dtype=torch.long, device=device), self.slots.clone()))
        self.steps = StepWindows(*torch.zeros(3, TAIL_WINDOWS, 1, dtype=torch.long, device=device))
        # graph variants per bucket: no fork, or a fork of each kind (`fork_kind`)
        self.kinds: tuple[str | None, ...] = (None, *FORK_KINDS) if manager.prefix is not None else (None,)
        self.graphs: dict[tuple[int, str | None], _Graph] = {}

    def capture_all(self) -> int:
        for bucket in self.buckets:
            for kind in self.kinds:
                self._capture(bucket, kind)
        return len(self.graphs)

    def supports(self, batch: ForwardBatch) -> bool:
        return (
            batch.batch_size == 1
            and bool(self.buckets)
            and 1 < batch.num_new_tokens <= self.buckets[-1]
            and batch.logits in ("last", "none")
            and not batch.verify
            and not batch.capture_layers
            and batch.inputs_embeds is None
            and batch.mrope_positions is None
            and batch.block_table.shape[1] <= self.max_pages
            and fork_kind(batch.fork) in self.kinds
        )

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        """The chunk's forward by replay: logits of its last token ([1, 1, V], when asked) and the
        hidden states of its tokens (views of static buffers, valid until the next replay)."""
        tokens = batch.num_new_tokens
        kind = fork_kind(batch.fork)
        graph = self.graphs.get((next(b for b in self.buckets if b >= tokens), kind))
        if graph is None:
            raise NinferError(f"no prefill graph for {tokens} tokens (capture_all was not run)")
        graph.ids[:, :tokens].copy_(batch.input_ids)
        graph.ids[:, tokens:].zero_()
        graph.positions.copy_(batch.cache_lens[:, None] + torch.arange(graph.ids.shape[1], device=graph.ids.device))
        self.cache_lens.copy_(batch.cache_lens)
        self.slots.copy_(batch.slots)
        self.valid.fill_(tokens)
        self.block_table[:, : batch.block_table.shape[1]].copy_(batch.block_table)
        if batch.fork is not None:  # the fork's buffers, and the windows kind's steps, in one launch
            mine, theirs = [self.fork.tokens, self.fork.slots], [batch.fork.tokens, batch.fork.slots]
            if batch.fork.steps is not None:
                steps = batch.fork.steps
                mine += [self.steps.offsets, self.steps.counts, self.steps.fork_slots]
                theirs += [steps.offsets, steps.counts, steps.fork_slots]
            torch._foreach_copy_(mine, theirs)
        if batch.fork is not None and not batch.fork.tail:  # the chunked kind's graph reads a second fork
            then, spare = batch.fork.then, self.fork.then
            assert spare is not None
            if then is not None:
                spare.tokens.copy_(then.tokens)
                spare.slots.copy_(then.slots)
            else:  # none: the fused steps from the end run no token
                spare.tokens.fill_(tokens)
                spare.slots.fill_(self.scratch_slot)
        graph.graph.replay()
        out = graph.out
        return ForwardOutput(logits=out.logits if batch.logits == "last" else None,
                             hidden_states=out.hidden_states[:, :tokens])

    def _capture(self, bucket: int, kind: str | None) -> None:
        """Warm up and capture with every row on the scratch slot / page (the warm-up really runs)."""
        device = self.slots.device
        ids = torch.zeros(1, bucket, dtype=torch.long, device=device)
        positions = torch.arange(bucket, device=device)[None]
        self.cache_lens.zero_()
        self.valid.fill_(bucket)
        for fork in (self.fork, self.fork.then):
            assert fork is not None
            fork.tokens.fill_(bucket)
            fork.slots.copy_(self.slots)
        self.steps.offsets.fill_(bucket)  # empty windows on the scratch slot
        self.steps.counts.zero_()
        self.steps.fork_slots.fill_(self.scratch_slot)
        forks = {None: None, "tail": replace(self.fork, tail=True, then=None),
                 "windows": replace(self.fork, tail=True, then=None, steps=self.steps),
                 "chunked": replace(self.fork, tail=False)}
        batch = ForwardBatch(input_ids=ids, positions=positions, cache_lens=self.cache_lens, slots=self.slots,
                             block_table=self.block_table, logits="last", valid_tokens=self.valid,
                             pad_kv_row=self.pad_kv_row, fork=forks[kind])
        try:
            with torch.inference_mode():
                graph, out = capture(lambda: self.model.forward(batch, self.cache), self.pool)
        except Exception as exc:  # noqa: BLE001 - whatever broke the capture, say it loudly
            raise NinferError(f"CUDA graph capture failed for prompt chunks of {bucket} tokens: {exc} "
                              f"(run with --no-cuda-graphs to run without graphs)") from exc
        self.graphs[bucket, kind] = _Graph(graph, ids, positions, out)

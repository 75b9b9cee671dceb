"""CUDA graphs of the decode forward, one per batch-size bucket.

A decode step of the 35B launches ~1,000 kernels; replaying them as one graph removes the
CPU launch cost that otherwise dominates batch-1 decode. Each bucket (1, 2, 4, 8, ... up to
max_seqs) is captured on first use over static input buffers; a batch of B rows replays the
smallest bucket >= B, the spare rows pointed at a scratch state slot and a scratch KV page that
no sequence owns (their results are discarded). The block table has a fixed width (the pages of
`max_context`), so one graph serves every context length.

Everything inside the forward must be capture-safe (no host sync, no allocation outside the
graph pool): the CUDA kernels are. If capture still fails (say a torch fallback synchronises),
graphs are switched off with a warning and the engine runs eagerly.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from ..cache import CacheManager
from ..models.base import CausalLM, ForwardBatch

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [bucket, vocab] fp32, written by each replay


class DecodeGraphs:
    def __init__(self, model: CausalLM, manager: CacheManager, max_batch: int, max_context: int):
        if manager.scratch_slot is None or manager.scratch_page is None:
            raise ValueError("decode graphs need a cache built with scratch=True (a slot and a page for spare rows)")
        scratch_slot, scratch_page = manager.scratch_slot, manager.scratch_page
        self.model = model
        self.cache = manager.cache  # the tensors the forward reads and writes
        self.buckets = tuple(b for b in BUCKETS if b < max_batch) + (max_batch,)
        self.max_pages = max_pages = math.ceil(max_context / manager.page_size)
        device = next(model.parameters()).device
        n = self.buckets[-1]
        self.ids = torch.zeros(n, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, 1, dtype=torch.long, device=device)
        self.cache_lens = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.full((n,), scratch_slot, dtype=torch.long, device=device)
        self.block_table = torch.full((n, max_pages), scratch_page, dtype=torch.int32, device=device)
        self.scratch_slot, self.scratch_page = scratch_slot, scratch_page
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, _Graph] = {}
        self.enabled = True

    def supports(self, batch: ForwardBatch) -> bool:
        return (
            self.enabled
            and batch.num_new_tokens == 1
            and batch.batch_size <= self.buckets[-1]
            and batch.block_table.shape[1] <= self.max_pages
            and batch.inputs_embeds is None
            and batch.mrope_positions is None
            and batch.logits == "last"
            and not batch.verify
            and not batch.capture_layers
        )

    def logits(self, batch: ForwardBatch) -> torch.Tensor | None:
        """[B, vocab] fp32 logits of one decode step by graph replay; None when graphs are off."""
        b = batch.batch_size
        bucket = next(x for x in self.buckets if x >= b)
        graph = self.graphs.get(bucket) or self._capture(bucket)
        if graph is None:
            return None
        self._load_inputs(batch, bucket)
        graph.graph.replay()
        return graph.logits[:b]

    def _load_inputs(self, batch: ForwardBatch, bucket: int) -> None:
        b = batch.batch_size
        self.ids[:b].copy_(batch.input_ids)
        self.positions[:b].copy_(batch.positions)
        self.cache_lens[:b].copy_(batch.cache_lens)
        self.slots[:b].copy_(batch.slots)
        width = batch.block_table.shape[1]
        self.block_table[:b, :width].copy_(batch.block_table)
        self._park_rows(b, bucket)

    def _park_rows(self, start: int, end: int) -> None:
        """Rows start..end-1 compute position 0 on the scratch slot / page: identical inputs (so
        concurrent writes agree), outputs discarded."""
        self.ids[start:end].zero_()
        self.positions[start:end].zero_()
        self.cache_lens[start:end].zero_()
        self.slots[start:end].fill_(self.scratch_slot)
        self.block_table[start:end].fill_(self.scratch_page)

    def _static_batch(self, bucket: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.ids[:bucket],
            positions=self.positions[:bucket],
            cache_lens=self.cache_lens[:bucket],
            slots=self.slots[:bucket],
            block_table=self.block_table[:bucket],
            logits="last",
        )

    def _capture(self, bucket: int) -> _Graph | None:
        """Warm up and capture with every row on the scratch slot / page (the warm-up really runs,
        and must not advance a live sequence)."""
        self._park_rows(0, bucket)
        batch = self._static_batch(bucket)
        try:
            with torch.inference_mode():
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):  # warm-up outside the graph (lazy inits, autotuning)
                    self.model.forward(batch, self.cache)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    out = self.model.forward(batch, self.cache)
        except Exception as exc:  # noqa: BLE001 - any capture failure means: run eagerly
            log.warning("CUDA graph capture failed (%s); decoding without graphs", exc)
            self.enabled = False
            return None
        captured = _Graph(graph=graph, logits=out.logits[:, -1])
        self.graphs[bucket] = captured
        return captured

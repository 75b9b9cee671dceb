"""CUDA graphs of the decode forward (per batch bucket) and the verify forward (per bucket and width).

A decode step of the 35B launches ~800 kernels; replaying them as one graph removes the CPU
launch cost that otherwise dominates batch-1 decode. Each bucket (1, 2, 4, 8, ... up to
max_seqs) is captured at load (`capture_all`, so no request pays for a capture) over static
input buffers; a batch of B rows replays the smallest bucket >= B, the spare rows pointed at a
scratch state slot and a scratch KV page that no sequence owns (their results are discarded). An
MoE's router kernel (graphs of up to 8 tokens) routes the spare rows dead (`live_tokens`), and the
decode kernels read no expert for a dead row: batch 5 in the 8-row graph read 64 (token, expert)
pairs' weights for 40 real ones. The block table has a fixed width (the pages of `max_context`),
so one graph serves every context length.

Speculative verification (T = K+1 tokens per row, logits for every row, GDN pools untouched)
gets graphs keyed by (bucket, T, captured layers), each with a second graph that commits the
accepted prefix (`gdn_commit` per GDN layer over the verify's recorded projections, the kept
counts in a static buffer): a round is two replays. Widths are exact, not padded: a padded
column would write KV past the pages its sequence reserved.

Everything inside a forward must be capture-safe (no host sync, no allocation outside the graph
pool): the CUDA kernels are; the MoE experts are only up to `graph_max_tokens` rows (beyond,
their grouped GEMM reads group sizes on the host), so larger shapes run eagerly. If capture
still fails (say a torch fallback synchronises), graphs are switched off with a warning and the
engine runs eagerly.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch

from ..cache import CacheManager
from ..errors import NinferError
from ..models.base import CausalLM, ForwardBatch, ForwardOutput
from ..ops.gdn import MAX_STEP_TOKENS
from .graph_capture import capture, graph_row_limit
from .speculative.rollback import commit_gdn

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor  # [bucket, T] static inputs of this graph's width
    positions: torch.Tensor
    out: ForwardOutput  # static outputs, rewritten by each replay
    live: torch.Tensor  # [1] int32 the real tokens (ForwardBatch.live_tokens: the spare rows' MoE routed dead)
    commit: torch.cuda.CUDAGraph | None = None  # verify graphs: gdn_commit of every GDN layer
    live_count: int = 0  # the value `live` holds (set again only when the batch size changes)


class DecodeGraphs:
    def __init__(self, model: CausalLM, manager: CacheManager, max_batch: int, max_context: int):
        if manager.scratch_slot is None or manager.scratch_page is None:
            raise ValueError("decode graphs need a cache built with scratch=True (a slot and a page for spare rows)")
        self.model = model
        self.cache = manager.cache  # the tensors the forward reads and writes
        self.buckets = tuple(b for b in BUCKETS if b < max_batch) + (max_batch,)
        self.max_rows = graph_row_limit(model)
        self.max_pages = max_pages = math.ceil(max_context / manager.page_size)
        device = next(model.parameters()).device  # type: ignore[attr-defined]
        n = self.buckets[-1]
        self.cache_lens = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.full((n,), manager.scratch_slot, dtype=torch.long, device=device)
        self.counts = torch.zeros(n, dtype=torch.long, device=device)  # commit: tokens kept per row
        self.block_table = torch.full((n, max_pages), manager.scratch_page, dtype=torch.int32, device=device)
        self.scratch_slot, self.scratch_page = manager.scratch_slot, manager.scratch_page
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int, tuple[int, ...]], _Graph] = {}

    def capture_all(self, verify_widths: Iterable[int] = (), capture_layers: tuple[int, ...] = ()) -> int:
        """Capture the decode graph of every bucket, and the verify graphs of these widths (with the
        drafter's captured layers); returns how many graphs were captured."""
        count = 0
        for bucket in self.buckets:
            for width in (0, *verify_widths):
                key = (bucket, width, capture_layers if width else ())
                if key not in self.graphs and self.bucket(bucket, max(width, 1)) == bucket:
                    self._capture(*key)
                    count += 1
        return count

    def supports(self, batch: ForwardBatch) -> bool:
        width = batch.num_new_tokens
        decode = width == 1 and batch.logits == "last" and not batch.verify and not batch.capture_layers
        verify = batch.verify and batch.logits == "all" and width <= MAX_STEP_TOKENS
        return (
            (decode or verify)
            and self.bucket(batch.batch_size, width) is not None
            and batch.block_table.shape[1] <= self.max_pages
            and batch.inputs_embeds is None
            and batch.mrope_positions is None
        )

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        """The forward of a supported batch by graph replay (outputs: views of the static buffers,
        valid until the next replay of the same graph)."""
        b = batch.batch_size
        graph = self._graph(batch)
        self._load_inputs(batch, graph)
        graph.graph.replay()
        out = graph.out
        return replace(
            out,
            logits=None if out.logits is None else out.logits[:b],
            hidden_states=out.hidden_states[:b],
            captured=None if out.captured is None else out.captured[:b],
            gdn_records=None,  # the commit goes through `commit`
        )

    def commit(self, batch: ForwardBatch, counts: torch.Tensor) -> None:
        """After `forward(batch)` of a verify batch: advance each row's GDN slot through its first
        counts[b] tokens (int64 [B] on the device) by replaying the width's commit graph."""
        graph = self.graphs[self._key(batch)]
        assert graph.commit is not None
        b = batch.batch_size
        self.slots[:b].copy_(batch.slots)
        self.counts[:b].copy_(counts)
        self.counts[b:].zero_()
        graph.commit.replay()

    def bucket(self, rows: int, width: int = 1) -> int | None:
        """The graph batch size for `rows` rows of `width` tokens; None when none fits."""
        bucket = next((x for x in self.buckets if x >= rows), None)
        if bucket is None or (self.max_rows is not None and bucket * width > self.max_rows):
            return None
        return bucket

    def _key(self, batch: ForwardBatch) -> tuple[int, int, tuple[int, ...]]:
        bucket = self.bucket(batch.batch_size, batch.num_new_tokens)
        assert bucket is not None
        return bucket, batch.num_new_tokens if batch.verify else 0, tuple(batch.capture_layers)

    def _graph(self, batch: ForwardBatch) -> _Graph:
        key = self._key(batch)
        graph = self.graphs.get(key)
        if graph is None:
            log.info("capturing the CUDA graph of batch bucket %d, verify width %d during a request", key[0], key[1])
            graph = self._capture(*key)
        return graph

    def _load_inputs(self, batch: ForwardBatch, graph: _Graph) -> None:
        b = batch.batch_size
        # the four int64 inputs in one launch (torch's multi-tensor copy), not four copy kernels
        torch._foreach_copy_([graph.ids[:b], graph.positions[:b], self.cache_lens[:b], self.slots[:b]],
                             [batch.input_ids, batch.positions, batch.cache_lens, batch.slots])
        width = batch.block_table.shape[1]
        self.block_table[:b, :width].copy_(batch.block_table)
        if b < graph.ids.shape[0]:
            self._park_rows(graph.ids, graph.positions, b)
        real = b * graph.ids.shape[1]
        if graph.live_count != real:
            graph.live.fill_(real)
            graph.live_count = real

    def _park_rows(self, ids: torch.Tensor, positions: torch.Tensor, start: int) -> None:
        """Rows start.. compute positions 0..T-1 on the scratch slot / page: identical inputs (so
        concurrent writes agree), outputs discarded, nothing committed."""
        end, width = ids.shape
        ids[start:].zero_()
        positions[start:].copy_(torch.arange(width, device=ids.device).expand(end - start, -1))
        self.cache_lens[start:end].zero_()
        self.slots[start:end].fill_(self.scratch_slot)
        self.counts[start:end].zero_()
        self.block_table[start:end].fill_(self.scratch_page)

    def _capture(self, bucket: int, verify_width: int, capture_layers: tuple[int, ...]) -> _Graph:
        """Warm up and capture with every row on the scratch slot / page (the warm-up really runs,
        and must not advance a live sequence)."""
        ids, positions = (torch.zeros(bucket, max(verify_width, 1), dtype=torch.long, device=self.slots.device)
                          for _ in range(2))
        self._park_rows(ids, positions, 0)
        live = torch.full((1,), ids.numel(), dtype=torch.int32, device=ids.device)
        batch = ForwardBatch(
            input_ids=ids, positions=positions, cache_lens=self.cache_lens[:bucket],
            slots=self.slots[:bucket], block_table=self.block_table[:bucket],
            logits="all" if verify_width else "last", verify=bool(verify_width), capture_layers=capture_layers,
            live_tokens=live,
        )
        try:
            with torch.inference_mode():
                forward, out = capture(lambda: self.model.forward(batch, self.cache), self.pool)
                commit = None
                if verify_width:
                    records = out.gdn_records or {}
                    commit, _ = capture(lambda: commit_gdn(self.model, self.cache.state, records, batch.slots,
                                                           self.counts[:bucket]), self.pool)
        except Exception as exc:  # noqa: BLE001 - whatever broke the capture, say it loudly
            raise NinferError(f"CUDA graph capture failed for batch {bucket}, verify width {verify_width}: {exc} "
                              f"(run with --no-cuda-graphs to decode without graphs)") from exc
        graph = self.graphs[(bucket, verify_width, capture_layers)] = _Graph(forward, ids, positions, out, live, commit,
                                                                             live_count=ids.numel())
        return graph

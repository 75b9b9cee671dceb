"""MTP drafts: the checkpoint's own multi-token-prediction layer (`models/mtp.py`), K = 1..5.

Entry i of the MTP cache combines the target's normed hidden state h_i with the embedding of
token i+1 and predicts token i+2. Observing target rows (a prompt chunk, or the accepted rows of
a verify) runs the layer over them: that writes their MTP KV entries and leaves, per sequence,
the logits and normed output of its last entry c, which predict the first draft (the token after
the sequence's last one). Drafts 2..K feed the layer its own output: step s writes entry c + s
from (draft s, output of entry c + s - 1). The next observation rewrites those entries with the
target's hidden states, so speculative entries never outlive their round.

On the GPU, a batch of greedy requests drafts by replaying a CUDA graph of the whole chain
(`MTPChainGraphs`: argmax, then K-1 layer steps each followed by lm_head and argmax, all on the
device): one launch and one host sync per round instead of K Python-level steps. Greedy drafts
are the raw argmax of the MTP logits on both paths (the target's acceptance applies penalties);
sampled requests draft eagerly from their sampling distribution.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ...cache import CacheManager, ModelCache
from ...config import ModelConfig
from ...layers.attention import AttentionMetadata
from ...models.decoder import DecoderModel, StepContext
from ...models.mtp import MTPHead, mtp_layer_config
from ..sampling import Sampler, TokenHistory
from ..sequence import Sequence
from ..graph_capture import capture
from .base import Draft, Drafter, Observation, choose_drafts

if TYPE_CHECKING:
    from ..cuda_graph import DecodeGraphs

log = logging.getLogger(__name__)


@dataclass
class _Last:
    """A sequence's newest MTP entry: its cache index, normed output and logits."""

    index: int
    hidden: torch.Tensor  # [H]
    logits: torch.Tensor  # [V]


class MTPDrafter(Drafter):
    method = "mtp"
    max_draft_tokens = 5

    def __init__(self, target: DecoderModel, head: MTPHead, cache: CacheManager, sampler: Sampler,
                 graphs: DecodeGraphs | None = None):
        config: ModelConfig = target.config
        self.target, self.head, self.cache, self.sampler = target, head, cache, sampler
        dtype = target.embed_tokens.weight.dtype
        # the target's pages + its scratch page (graph rows with no sequence write there)
        pages = cache.num_pages + (cache.scratch_page is not None)
        self.kv = ModelCache.allocate(mtp_layer_config(config), pages, cache.page_size, 1, dtype, cache.device)
        self.cache_bytes = self.kv.kv.nbytes
        self._last: dict[str, _Last] = {}
        self.chains = MTPChainGraphs(self.run_layer, target.lm_head, graphs) if graphs is not None else None

    @torch.inference_mode()
    def observe(self, obs: Observation) -> None:
        rows = torch.tensor(obs.rows, device=obs.batch.input_ids.device)
        hidden = self.target.norm(obs.out.hidden_states[rows])
        batch = obs.batch
        positions = batch.mrope_positions[:, rows] if batch.mrope_positions is not None else batch.positions[rows]
        cache_lens = batch.cache_lens[rows]
        out = self.run_layer(obs.next_tokens(), hidden, positions, cache_lens, batch.block_table[rows])
        last = torch.tensor(obs.counts, device=out.device) - 1
        tail = out[torch.arange(len(obs.rows), device=out.device), last]
        logits = self.target.lm_head(tail).float()
        for i, seq in enumerate(obs.seqs):
            index = int(cache_lens[i]) + obs.counts[i] - 1
            self._last[seq.request_id] = _Last(index=index, hidden=tail[i], logits=logits[i])

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], counts: list[int]) -> list[Draft]:
        lasts = [self._last[s.request_id] for s in seqs]
        if self.chains is not None and all(s.request.sampling.is_greedy for s in seqs):
            table = self.cache.block_table([s.cache for s in seqs])
            chained = self.chains.run(lasts, [s.rope_delta for s in seqs], table, max(counts))
            if chained is not None:
                return [Draft(tokens[:k]) for tokens, k in zip(chained, counts)]
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        logits = torch.stack([last.logits for last in lasts])
        hidden = torch.stack([last.hidden for last in lasts])
        for step in range(max(counts)):
            histories = [TokenHistory(seqs[i].prompt_ids, seqs[i].output_ids + tokens[i]) for i in active]
            chosen, q = choose_drafts(self.sampler, logits, [seqs[i] for i in active], histories)
            for j, i in enumerate(active):
                tokens[i].append(chosen[j])
                if q[j] is not None:
                    probs[i].append(q[j])
            keep = [j for j, i in enumerate(active) if len(tokens[i]) < counts[i]]
            if not keep:
                break
            active = [active[j] for j in keep]
            device = hidden.device
            index = torch.tensor([lasts[i].index + step + 1 for i in active], device=device)
            deltas = torch.tensor([seqs[i].rope_delta for i in active], device=device)
            ids = torch.tensor([[chosen[j]] for j in keep], device=device)
            table = self.cache.block_table([seqs[i].cache for i in active])
            hidden = self.run_layer(ids, hidden[keep, None], (index + deltas)[:, None], index, table)[:, 0]
            logits = self.target.lm_head(hidden).float()
        return [Draft(t, torch.stack(p) if p else None) for t, p in zip(tokens, probs)]

    def release(self, seq: Sequence) -> None:
        self._last.pop(seq.request_id, None)

    def run_layer(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache_lens: torch.Tensor,
             block_table: torch.Tensor) -> torch.Tensor:
        """The MTP layer over rows [B, T] at MTP cache indices cache_lens[b] + t -> normed outputs."""
        embeds = self.target.embed_tokens(ids)
        cos, sin = self.target.rotary_emb(positions, embeds.dtype)
        attn = AttentionMetadata.build(block_table, cache_lens, ids.shape[1], self.kv.page_size, self.kv.kv.num_pages)
        step = StepContext(cos=cos, sin=sin, attn=attn, slots=cache_lens, cache=self.kv)
        return self.head(embeds, hidden, step)


@dataclass
class _Chain:
    logits: torch.Tensor  # [bucket, V] fp32: each row's newest MTP logits
    hidden: torch.Tensor  # [bucket, H]: its normed output
    index: torch.Tensor  # [bucket] int64: its MTP cache index
    deltas: torch.Tensor  # [bucket] int64: rope position deltas
    table: torch.Tensor  # [bucket, max_pages] int32
    graph: torch.cuda.CUDAGraph | None = None  # set once captured
    tokens: torch.Tensor | None = None  # [bucket, K] the drafts (static output)


class MTPChainGraphs:
    """Greedy K-token MTP draft chains as CUDA graphs per (batch bucket, K), on the target's
    decode-graph buckets, pool and scratch page. Rows are run to K even when they asked fewer
    drafts (the extra entries lie inside the pages the engine reserved for this round)."""

    def __init__(self, run_layer: Callable[..., torch.Tensor], lm_head: torch.nn.Module, graphs: DecodeGraphs):
        self.run_layer, self.lm_head, self.graphs = run_layer, lm_head, graphs
        self.chains: dict[tuple[int, int], _Chain] = {}
        self.enabled = True

    def run(self, lasts: list[_Last], deltas: list[int], table: torch.Tensor, k: int) -> list[list[int]] | None:
        """K drafts per row (a sequence's newest entry, rope delta, block table row), or None when
        no graph serves the batch."""
        b = len(lasts)
        bucket = self.graphs.bucket(b)
        if not self.enabled or bucket is None or table.shape[1] > self.graphs.max_pages:
            return None
        chain = self.chains.get((bucket, k)) or self._capture(bucket, k, lasts[0])
        if chain is None:
            return None
        chain.logits[:b].copy_(torch.stack([last.logits for last in lasts]))
        chain.hidden[:b].copy_(torch.stack([last.hidden for last in lasts]))
        chain.index[:b].copy_(torch.tensor([last.index for last in lasts]))
        chain.deltas[:b].copy_(torch.tensor(deltas))
        chain.table[:b, : table.shape[1]].copy_(table)
        self._park(chain, b)
        assert chain.graph is not None and chain.tokens is not None
        chain.graph.replay()
        return chain.tokens[:b].tolist()

    def _park(self, chain: _Chain, start: int) -> None:
        """Rows start.. draft from zeros at index 0 of the scratch page (outputs discarded)."""
        for t in (chain.logits, chain.hidden, chain.index, chain.deltas):
            t[start:].zero_()
        chain.table[start:].fill_(self.graphs.scratch_page)

    def _capture(self, bucket: int, k: int, like: _Last) -> _Chain | None:
        device = like.logits.device

        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        chain = _Chain(zeros(bucket, like.logits.shape[0], dtype=like.logits.dtype),
                       zeros(bucket, like.hidden.shape[0], dtype=like.hidden.dtype), zeros(bucket, dtype=torch.long),
                       zeros(bucket, dtype=torch.long), zeros(bucket, self.graphs.max_pages, dtype=torch.int32))
        self._park(chain, 0)

        def draft() -> torch.Tensor:
            token = chain.logits.argmax(-1)
            tokens, hidden = [token], chain.hidden
            for step in range(1, k):
                index = chain.index + step
                hidden = self.run_layer(token[:, None], hidden[:, None], (index + chain.deltas)[:, None], index,
                                        chain.table)[:, 0]
                token = self.lm_head(hidden).float().argmax(-1)
                tokens.append(token)
            return torch.stack(tokens, dim=1)

        try:
            chain.graph, chain.tokens = capture(draft, self.graphs.pool)
        except Exception as exc:  # noqa: BLE001 - any capture failure means: draft eagerly
            log.warning("CUDA graph capture of the MTP draft chain failed (%s); drafting eagerly", exc)
            self.enabled = False
            return None
        self.chains[(bucket, k)] = chain
        return chain

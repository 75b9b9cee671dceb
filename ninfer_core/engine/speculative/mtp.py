"""MTP drafts: the checkpoint's own multi-token-prediction layer (`models/mtp.py`), K = 1..5.

Entry i of the MTP cache combines the target's normed hidden state h_i with the embedding of
token i+1 and predicts token i+2. Observing target rows (a prompt chunk, or the accepted rows of
a verify) runs the layer over them: that writes their MTP KV entries and leaves, per sequence,
the logits and normed output of its last entry c, which predict the first draft (the token after
the sequence's last one). Drafts 2..K feed the layer its own output: step s writes entry c + s
from (draft s, output of entry c + s - 1). The next observation rewrites those entries with the
target's hidden states, so speculative entries never outlive their round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...cache import CacheManager, ModelCache
from ...config import ModelConfig
from ...layers.attention import AttentionMetadata
from ...models.decoder import DecoderModel, StepContext
from ...models.mtp import MTPHead, mtp_layer_config
from ..sampling import Sampler, TokenHistory
from ..sequence import Sequence
from .base import Draft, Drafter, Observation, choose_drafts


@dataclass
class _Last:
    """A sequence's newest MTP entry: its cache index, normed output and logits."""

    index: int
    hidden: torch.Tensor  # [H]
    logits: torch.Tensor  # [V]


class MTPDrafter(Drafter):
    method = "mtp"
    max_draft_tokens = 5

    def __init__(self, target: DecoderModel, head: MTPHead, cache: CacheManager, sampler: Sampler):
        config: ModelConfig = target.config
        self.target, self.head, self.cache, self.sampler = target, head, cache, sampler
        dtype = target.embed_tokens.weight.dtype
        self.kv = ModelCache.allocate(mtp_layer_config(config), cache.num_pages, cache.page_size, 1, dtype,
                                      cache.device)
        self.cache_bytes = self.kv.kv.nbytes
        self._last: dict[str, _Last] = {}

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

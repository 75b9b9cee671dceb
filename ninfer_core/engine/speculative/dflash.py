"""DFlash drafts: a z-lab block-diffusion companion checkpoint (`models/dflash.py`), K = 1..block-1.

Observing target rows turns their captured layer features into context K/V for every drafter
layer (cache index = the target's); a proposal is one drafter pass over the block
[last token, mask x K] at indices num_cached .. num_cached + K, whose rows 1..K give the drafts.
Blocks of different K in one batch are padded; padded block tokens are masked out of every
row's attention (inside the block attention is bidirectional, so they would change the drafts).
A greedy batch's drafts are the block's argmax in one kernel, left on the device for the judge to
read with its verdict (one sync a round, where a position at a time read each).
"""

from __future__ import annotations

import torch

from ...cache import CacheManager, KVPool
from ...cache.sizes import kv_token_bytes
from ...layers.attention import AttentionMetadata
from ...models.decoder import DecoderModel
from ...models.dflash import BlockInputs, DFlashConfig, DFlashModel
from ...ops.dispatch import upload
from ..penalties import PenaltyTables
from ..sampling import Sampler, TokenHistory
from ..sequence import Sequence
from .base import Draft, Drafter, Observation, choose_drafts


class DFlashDrafter(Drafter):
    method = "dflash"

    @staticmethod
    def kv_bytes_per_token(config: DFlashConfig, dtype: torch.dtype) -> int:
        """What the cache `__init__` allocates takes a target token: every drafter layer's KV in the
        model dtype."""
        return config.num_layers * kv_token_bytes(config.num_kv_heads, config.head_dim, dtype.itemsize, scaled=False)

    def __init__(self, target: DecoderModel, model: DFlashModel, cache: CacheManager, sampler: Sampler,
                 lm_head: torch.nn.Module | None = None):
        """`lm_head`: the drafts' (draft_head.py's int4 copy), None: the target's."""
        config = model.config
        config.check_target(target.config)
        self.target, self.model, self.cache, self.sampler = target, model, cache, sampler
        self.lm_head = target.lm_head if lm_head is None else lm_head
        self.max_draft_tokens = config.block_size - 1
        self.capture_layers = tuple(config.target_layer_ids)
        dtype = target.dtype
        self.kv = KVPool(list(range(config.num_layers)), cache.num_pages, cache.page_size, config.num_kv_heads,
                         config.head_dim, dtype, cache.device)
        self.cache_bytes = self.kv.nbytes
        self._caches = ([self.kv.k[i] for i in self.kv.layers], [self.kv.v[i] for i in self.kv.layers])
        self._ctx_len: dict[str, int] = {}

    @torch.inference_mode()
    def observe(self, obs: Observation) -> None:
        batch = obs.batch
        rows = upload(obs.rows, torch.long, batch.input_ids.device)
        assert obs.out.captured is not None, "the target forward did not capture the drafter's layers"
        cache_lens = batch.cache_lens[rows]
        width = batch.num_new_tokens
        meta = AttentionMetadata.build(batch.block_table[rows], cache_lens, width, self.kv.page_size, self.kv.num_pages)
        positions = cache_lens[:, None] + torch.arange(width, device=rows.device)
        self.model.write_context(obs.out.captured[rows], positions, meta.slot_mapping, *self._caches)
        if obs.counts is not None:
            self.settle(obs, obs.counts)

    def settle(self, obs: Observation, counts: list[int]) -> None:
        for i, seq in enumerate(obs.seqs):
            self._ctx_len[seq.request_id] = obs.start(i) + counts[i]

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], counts: list[int], penalties: PenaltyTables | None = None) -> list[Draft]:
        device = self.cache.device
        width = 1 + max(counts)
        ctx_lens = upload([self._ctx_len[s.request_id] for s in seqs], torch.long, device)
        ids = upload([[s.output_ids[-1]] + [self.model.config.mask_token_id] * (width - 1) for s in seqs], torch.long,
                     device)
        where = BlockInputs(
            positions=ctx_lens[:, None] + torch.arange(width, device=device),
            block_lens=upload([c + 1 for c in counts], torch.long, device),
            ctx_lens=ctx_lens,
            block_table=self.cache.block_table([s.cache for s in seqs]),
        )
        embeds = self.target.embed_tokens(ids) * self.model.config.embedding_scale
        hidden = self.model(embeds, where, *self._caches)
        logits = self.model.logits(hidden[:, 1:], self.lm_head)  # [B, width - 1, V]
        if all(s.request.sampling.is_greedy for s in seqs):  # the block's argmax at once, read by the judge
            chosen = logits.argmax(-1)
            return [Draft(pending=chosen[b, :c]) for b, c in enumerate(counts)]
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        for t in range(width - 1):
            rows = [i for i, k in enumerate(counts) if t < k]
            histories = [TokenHistory(seqs[i].prompt_ids, seqs[i].output_ids + tokens[i]) for i in rows]
            chosen, q = choose_drafts(self.sampler, logits[rows, t], [seqs[i] for i in rows], histories)
            for j, i in enumerate(rows):
                tokens[i].append(chosen[j])
                if q[j] is not None:
                    probs[i].append(q[j])
        return [Draft(t, torch.stack(p) if p else None) for t, p in zip(tokens, probs)]

    def release(self, seq: Sequence) -> None:
        self._ctx_len.pop(seq.request_id, None)

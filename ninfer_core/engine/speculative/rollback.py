"""Keeping only the accepted prefix of a verify forward in the cache.

Attention KV needs nothing but bookkeeping: entries past the accepted tokens are hidden by the
causal mask (cache_lens) and overwritten later; their pages go back with `CacheManager.truncate`.

Gated DeltaNet state cannot be truncated. The verify forward leaves every GDN state slot as it
was and returns, per layer, the per-token inputs (`GDNRecord`: pre-conv qkv, normalised k, v,
decay g, beta). `commit_gdn` then advances each slot through its accepted tokens only: conv
state = the last K-1 pre-conv inputs, recurrent state = the delta-rule recurrence
(`gated_delta_rule_recurrent`, the decode form) over the accepted (k, v, g, beta), all GDN layers
in one batched call. This is the original C++ NInfer's scheme ("record and replay"), chosen over
the alternatives:

(a) per-position state slots (vLLM): the verify writes T = K+1 full states per layer (35B-A3B:
    2 MB x 30 layers each) and the sequence moves to the accepted slot; K+1 slots per sequence.
(b) snapshot + replay forward: copy the slot, verify (state advanced by all T tokens), restore,
    and re-run the target over the accepted tokens: a second full forward on every round with a
    rejection (measured: `scripts/bench_spec.py rollback`).
(c) record per-step states during the verify: like (a) into scratch, then copy one of them.
Record-and-replay writes no per-position states and needs no snapshot: the slot is read by the
verify, then read and written once by the commit; the replay is j+1 delta-rule steps (no
projections, no other layers). On a full acceptance it costs the same as on a rejection.

Exactness: a rejected token's inputs are never read, so the committed state and everything that
follows are bit-for-bit the same whatever the rejected drafts were (tested on the dense model;
with MoE, the kept tokens' expert GEMMs share a batch with the rejected ones, which can change
their rounding). Against plain token-by-token decoding the state is equal up to fp32 rounding
only: a T-row projection rounds differently from T one-row ones (GEMM blocking depends on the
row count), which no rollback scheme avoids; greedy outputs are token-identical in the tests.

Measured per round (`scripts/bench_spec.py rollback`, tiny-qwen3.6-moe preset, 1 CPU thread,
context 512), kept 1 token / all K+1:
    K = 3:  record + commit 10.4 / 10.8 ms, per-position states (a/c, emulated) 10.2 / 10.2 ms,
            snapshot + replay (b) 15.1 / 10.2 ms
    K = 7:  12.1 / 12.7 ms, 11.7 / 11.9 ms, 16.6 / 11.9 ms
(b) pays a second forward on every rejection (+45%). (a)/(c) and ours are within 4% on the CPU,
where a state is 16 KB; on Qwen3.6-35B-A3B a state is 2 MB per layer and (a)/(c) write K+1 of
them per layer per round (and (a) keeps K+1 slots per sequence), which is what ours avoids; the
same bench on the GPU gives the numbers for that case.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from ...cache import StatePool
from ...layers.gdn import GDNRecord, gated_delta_rule_recurrent


@torch.inference_mode()
def commit_gdn(pool: StatePool, records: dict[int, GDNRecord], slots: list[int], counts: list[int]) -> None:
    """Advance slot slots[b] through the first counts[b] >= 1 tokens of batch row b, in every GDN
    layer. Rows keeping the same count and all layers go through one recurrence (few launches)."""
    if not records:
        return
    layers = list(records)
    by_count: dict[int, list[int]] = defaultdict(list)
    for row, n in enumerate(counts):
        by_count[n].append(row)
    device = pool.conv[layers[0]].device
    for n, rows in by_count.items():
        index = torch.tensor(rows, device=device)
        slot = torch.tensor([slots[r] for r in rows], device=device)
        # [L, rows, n, ...]: every layer's kept inputs, stacked
        qkv, k, v, g, beta = (torch.stack([getattr(records[i], f)[index, :n] for i in layers])
                              for f in ("qkv", "k", "v", "g", "beta"))
        conv = torch.stack([pool.conv[i][slot] for i in layers])  # [L, rows, C, K-1]
        window = torch.cat((conv, qkv.transpose(-1, -2).to(conv.dtype)), dim=-1)[..., n:]  # the last K-1 inputs
        state = torch.stack([pool.recurrent[i][slot] for i in layers]).flatten(0, 1)
        k = k.flatten(0, 1)
        _, state = gated_delta_rule_recurrent(k, k, v.flatten(0, 1), g.flatten(0, 1), beta.flatten(0, 1), state)
        state = state.unflatten(0, (len(layers), len(rows)))
        for j, i in enumerate(layers):
            pool.conv[i][slot] = window[j]
            pool.recurrent[i][slot] = state[j]

"""Keeping only the accepted prefix of a verify forward in the cache.

Attention KV needs nothing but bookkeeping: entries past the accepted tokens are hidden by the
causal mask (cache_lens) and overwritten later; their pages go back with `CacheManager.truncate`.

Gated DeltaNet state cannot be truncated. The verify forward leaves every GDN state slot as it
was and returns, per layer, the token's input projections (`GDNRecord`: pre-conv qkv, a, b).
`commit_gdn` then advances each slot through its accepted tokens only: the fused GDN steps
(`ops.gdn.gdn_commit`) re-run gates and the delta rule over the first counts[b] tokens (a device
tensor: no host sync, so the commit of a verify replays from a CUDA graph), on the CUDA kernel from
the verify's own conv outputs (`GDNRecord.act`): one launch per GDN layer, which also moves the
conv states on; elsewhere the conv runs again. This is the original C++ NInfer's scheme ("record
and replay"), chosen over the alternatives:

(a) per-position state slots (vLLM): the verify writes T = K+1 full states per layer (35B-A3B:
    2 MB x 30 layers each) and the sequence moves to the accepted slot; K+1 slots per sequence.
(b) snapshot + replay forward: copy the slot, verify (state advanced by all T tokens), restore,
    and re-run the target over the accepted tokens: a second full forward on every round with a
    rejection (measured: `scripts/bench_spec.py rollback`).
(c) record per-step states during the verify: like (a) into scratch, then copy one of them.
Record-and-replay writes no per-position states and needs no snapshot: the slot is read by the
verify, then read and written once by the commit; the replay is counts[b] delta-rule steps (no
projections, no other layers). On a full acceptance it costs the same as on a rejection.

Exactness: a rejected token's inputs are never read, so the committed state and everything that
follows are bit-for-bit the same whatever the rejected drafts were (tested on the dense model;
with MoE, the kept tokens' expert GEMMs share a batch with the rejected ones, which can change
their rounding). The commit runs the decode step's per-token math, so given the same projections
it is the state of counts[b] decode steps bit for bit; against plain token-by-token decoding the
projections themselves differ at fp32 rounding (a T-row GEMM blocks differently from T one-row
ones), which no rollback scheme avoids; greedy outputs are token-identical in the tests.

Measured per round (`scripts/bench_spec.py rollback`, tiny-qwen3.6-moe preset, CPU, context
512, 2026-11-29), kept 1 token / all K+1:
    K = 3:  record + commit 12.2 / 12.6 ms, per-position states (a/c, emulated) 10.3 / 10.7 ms,
            snapshot + replay (b) 16.6 / 11.4 ms
    K = 7:  16.0 / 16.0 ms, 13.5 / 13.1 ms, 19.3 / 13.2 ms
(b) pays a second forward on every rejection (+45%). On the CPU, where a state is 16 KB and every
op is launch overhead, (a)/(c) are ~18% cheaper than re-running the recurrence. On the GPU (35B-A3B,
K = 3, graphs, H100, thirty-ninth session) the commit is 0.30 ms of a 3.4 ms round; (c) inside the
verify kernel (the state after each token stored, 8 MB a layer, the accepted one copied back) took
the round only 0.9% faster for 240 MB of memory kept a round: measured and dropped
(docs/performance.md).
"""

from __future__ import annotations

import torch

from ...cache import StatePool
from ...layers.gdn import GDNRecord
from ...models.decoder import DecoderModel


@torch.inference_mode()
def commit_gdn(model: DecoderModel, pool: StatePool, records: dict[int, GDNRecord], slots: torch.Tensor,
               counts: torch.Tensor) -> None:
    """Advance slot slots[b] through the first counts[b] >= 0 tokens of verify row b, in every GDN
    layer (slots, counts: int64 tensors [B] on the model's device)."""
    for i, record in records.items():
        model.layers[i].linear_attn.commit(record, pool.conv[i], pool.recurrent[i], slots, counts)

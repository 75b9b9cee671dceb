"""The numbers the live panels draw, sampled from the engine's counters a few times a second.

Decode throughput is measured, not reported: generated tokens since the previous sample over the
time between samples (all requests together, the embedded server's included). Between requests
the last request's own rates are shown. Speculative decoding totals come from EngineStats.spec
(None: no drafter, shown as "off").
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from ninfer_core.engine.request import SpecStats
from ninfer_core.engine.service import ServiceStats

HISTORY = 60  # sparkline samples


@dataclass(frozen=True)
class GpuMemory:
    used: int
    total: int


@dataclass(frozen=True)
class LiveFrame:
    prefill_tok_s: float | None
    decode_tok_s: float | None
    spec: SpecStats | None
    kv_used: int | None
    kv_capacity: int | None
    chat_tokens: int  # this chat's tokens held in the KV cache now
    requests_running: int
    requests_waiting: int
    gpu: GpuMemory | None
    device: str
    prefix_cached_bytes: int = 0  # what the prefix cache holds (pages nobody uses + GDN checkpoints)
    prefix_hit_ratio: float | None = None  # prompt tokens served from the cache / looked up (None: off)


def gpu_memory(device: str) -> GpuMemory | None:
    if not device.startswith("cuda"):
        return None
    import torch

    free, total = torch.cuda.mem_get_info(torch.device(device))
    return GpuMemory(int(total - free), int(total))


class LiveSampler:
    """Turns successive engine snapshots into frames; keeps the decode-rate history for a sparkline."""

    def __init__(self) -> None:
        self._previous: tuple[float, int] | None = None  # (time, generated tokens)
        self.decode_history: deque[float] = deque(maxlen=HISTORY)

    def frame(self, stats: ServiceStats | None, device: str, chat_tokens: int = 0,
              client_rate: float | None = None, now: float | None = None) -> LiveFrame:
        """`client_rate`: tokens/s measured by the chat itself (remote mode has no engine counters)."""
        now = time.monotonic() if now is None else now
        if stats is None:
            if client_rate is not None:
                self.decode_history.append(client_rate)
            return LiveFrame(None, client_rate, None, None, None, chat_tokens, int(client_rate is not None), 0, None,
                             device)
        e = stats.engine
        rate = e.last_decode_tok_s or None
        if self._previous is not None and now > self._previous[0]:
            measured = (e.generated_tokens - self._previous[1]) / (now - self._previous[0])
            if e.running or measured > 0:
                rate = measured
                self.decode_history.append(measured)
        self._previous = (now, e.generated_tokens)
        return LiveFrame(
            prefill_tok_s=e.last_prefill_tok_s or None,
            decode_tok_s=rate,
            spec=e.spec,
            kv_used=e.kv_used_tokens,
            kv_capacity=e.kv_capacity_tokens,
            chat_tokens=chat_tokens,
            requests_running=e.running,
            requests_waiting=stats.waiting,
            gpu=gpu_memory(device),
            device=device,
            prefix_cached_bytes=e.prefix_cached_bytes,
            prefix_hit_ratio=(e.prefix_hit_tokens / e.prefix_queried_tokens if e.prefix_queried_tokens else 0.0)
            if e.prefix_cache else None,
        )

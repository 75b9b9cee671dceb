"""Repetition / presence / frequency penalties on logits, each row's history from count tables
(engine/penalties.py keeps them per slot): the CUDA kernel (csrc/penalties.cu: one pass, reading the
tables' rows in place) for fp32 CUDA logits, else the torch reference. Both give the same bits. And
the tables' update for generated tokens (`record_tokens`): one kernel launch on CUDA."""

from __future__ import annotations

import torch

from . import dispatch


def penalise_ref(logits: torch.Tensor, seen: torch.Tensor, counts: torch.Tensor, rep: torch.Tensor,
                 presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """logits [R, V] with rows' seen [R, V] bool, generated counts [R, V] and penalties [R]: a neutral
    row (1, 0, 0) comes back bit for bit (x - 0 is x)."""
    rep, presence, frequency = rep[:, None], presence[:, None], frequency[:, None]
    counts = counts.to(logits.dtype)
    out = torch.where(seen & (rep != 1), torch.where(logits < 0, logits * rep, logits / rep), logits)
    return out - (frequency * counts + presence * (counts > 0).to(logits.dtype))


def penalise(logits: torch.Tensor, seen: torch.Tensor, counts: torch.Tensor, rep: torch.Tensor,
             presence: torch.Tensor, frequency: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Penalised logits [R, V]: row r's history is row rows[r] of seen / counts [S, V] (None: row r,
    S = R); rep / presence / frequency [R] in the logits' dtype."""
    if not (logits.dtype == torch.float32 and logits.dim() == 2 and 0 < logits.shape[0] < 65536
            and dispatch.use_kernel(logits)):
        dispatch.fallback("penalise", logits)
        if rows is not None:
            seen, counts = seen.index_select(0, rows), counts.index_select(0, rows)
        return penalise_ref(logits, seen, counts, rep, presence, frequency)
    logits = logits.contiguous()
    out = torch.empty_like(logits)
    dispatch.extension().penalise(out, logits, seen, counts, rows, rep.contiguous(), presence.contiguous(),
                                  frequency.contiguous(), dispatch.stream_handle(logits))
    return out


def record_ref(seen: torch.Tensor, counts: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor) -> None:
    """seen [S, V] bool / counts [S, V] int32 in place: each ids[i] >= 0 counted and seen in row
    rows[i] (a pair may repeat); ids[i] < 0 means no token. Without a host sync (a mask would read the
    device: CUDA graphs capture this too), so a skipped entry adds 0 at id 0 of its row, and a row
    must not hold both a skipped entry and a token 0."""
    valid = ids >= 0
    ids = ids.clamp(min=0)
    counts.index_put_((rows, ids), valid.to(counts.dtype), accumulate=True)
    seen.index_put_((rows, ids), seen[rows, ids] | valid)


def record_tokens(seen: torch.Tensor, counts: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor) -> None:
    """`record_ref`; on CUDA one kernel (the kernel skips any entry out of range, the reference raises)."""
    if not ids.numel():
        return
    if seen.device.type != "cuda" or not dispatch.kernels_available():
        record_ref(seen, counts, rows, ids)
        return
    dispatch.extension().record_tokens(seen, counts, rows.contiguous(), ids.contiguous(),
                                       dispatch.stream_handle(seen))

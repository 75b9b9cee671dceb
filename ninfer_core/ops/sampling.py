"""Sampling filters and the draw: per-row temperature, top-k, top-p, min-p, one inverse-CDF draw.

Rows are already penalised logits [B, V]; each row has its own parameters, given as [B] tensors:
temperature (0 = greedy: argmax, the lowest id on ties), top_k (<= 0 or >= V = off), top_p
(>= 1 = off), min_p (<= 0 = off) and, for a draw, one uniform u in [0, 1) per row (ignored on
greedy rows). Tie rule (engine/sampling.py): every filter is a threshold on a value and keeps all
tokens tied at it:
- top-k keeps tokens whose logit >= the k-th largest logit;
- top-p keeps a token iff the mass of the top-k survivors strictly more likely than it is
  < top_p * their total mass;
- min-p keeps tokens whose probability >= min_p * the largest probability.
The draw is the first kept token, in id order, whose cumulative mass exceeds u * the kept mass.

The references filter and draw in float64. The CUDA kernel (csrc/sampling.cu, fp32 logits on a
CUDA device) never sorts the vocabulary; it keeps the same set except when top_p * mass or min_p
lies within fp32 rounding (~1e-7 relative) of a token's boundary, and its masses are fixed-point
sums of fp32 exps (see the kernel's header). It takes fp32 top_p / min_p / temperature, so a
parameter that only differs from its neutral value below fp32 resolution acts as neutral.

`greedy` is the engine's plain-greedy path (no penalties, no filters): the argmax of each row in
the logits' own dtype (fp32 / fp16 / bf16), the lowest id on ties, -1 for a row holding NaN / +inf
or no finite value; one launch of the split-row kernel in csrc/sampling.cu on CUDA, `greedy_ref`
(torch's argmax) elsewhere.
"""

from __future__ import annotations

import torch

from . import dispatch

# Shared-memory candidates per row in the kernel (its maximum); 0 sends every row through the
# full-vocabulary path, which the tests use to check that path on small inputs.
CANDIDATES = 4096
# Blocks the greedy kernel splits a row into at most: its partials per row (sampling.h:
# kGreedyMaxChunks; the binding checks the workspace against it).
GREEDY_MAX_CHUNKS = 256
# A row's segments at most in the sampler's first launch: its workspace per row (sampling.h:
# kSampleMaxSegments; the binding checks it).
SAMPLE_MAX_SEGMENTS = 1024


# ---- references (float64) -----------------------------------------------------------------------


def top_k_keep(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Mask of tokens whose logit >= the row's k-th largest; k <= 0 or k >= V keeps everything.
    One partial `topk` of the largest k in the batch, not a full sort."""
    vocab = logits.shape[-1]
    active = (k > 0) & (k < vocab)
    if not bool(active.any()):
        return torch.ones_like(logits, dtype=torch.bool)
    k_eff = torch.where(active, k, 1).long()
    top = torch.topk(logits, int(k_eff.max()), dim=-1).values
    threshold = top.gather(1, (k_eff - 1).unsqueeze(1))
    threshold = torch.where(active.unsqueeze(1), threshold, torch.full_like(threshold, -torch.inf))
    return logits >= threshold


def top_p_keep(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask of tokens whose probability >= that of the token where the descending cumulative mass
    first reaches top_p * row total (rows need not be normalised); top_p >= 1 keeps everything.
    Sorts only as many entries as the widest row has left (after top-k that is ~k, not V)."""
    active = top_p < 1
    keep = torch.ones_like(probs, dtype=torch.bool)
    if not bool(active.any()):
        return keep
    rows = probs[active]
    width = int((rows > 0).sum(-1).max())
    ranked = torch.topk(rows, width, dim=-1).values
    cdf = ranked.cumsum(-1)
    target = top_p[active].to(cdf.dtype).unsqueeze(1) * cdf[:, -1:]
    first = (cdf < target).sum(-1, keepdim=True).clamp(max=width - 1)
    keep[active] = rows >= ranked.gather(1, first)
    return keep


def min_p_keep(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask of tokens whose probability >= min_p * the row's largest probability."""
    return probs >= min_p.to(probs.dtype).unsqueeze(1) * probs.amax(-1, keepdim=True)


def draw_from_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: per row the first token whose cumulative mass exceeds u * row total (u in
    [0, 1), [B]). Never a zero-probability token (its cdf equals its predecessor's), also when
    rounding puts u * total at the very top. Also the resampling step of speculative decoding."""
    cdf = probs.cumsum(-1)
    idx = torch.searchsorted(cdf, (u.to(cdf.dtype) * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    last_positive = probs.shape[-1] - 1 - (probs.flip(-1) > 0).long().argmax(-1)
    return torch.minimum(idx, last_positive)


def filter_ref(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
               min_p: torch.Tensor) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on stochastic rows (temperature > 0) -> normalised
    float64 probabilities [B, V]."""
    x = logits.double()
    dev = x.device
    x = (x - x.amax(-1, keepdim=True)) / temperature.to(dev, x.dtype).unsqueeze(1)  # max first: no inf for tiny T
    probs = torch.softmax(x.masked_fill(~top_k_keep(x, top_k.to(dev, torch.long)), -torch.inf), dim=-1)
    top_p = top_p.to(dev, x.dtype)
    if bool((top_p < 1).any()):
        probs = probs * top_p_keep(probs, top_p)
    min_p = min_p.to(dev, x.dtype)
    if bool((min_p > 0).any()):
        probs = probs * min_p_keep(probs, min_p)
    return probs / probs.sum(-1, keepdim=True)


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """[B] bool: the rows a sampler can draw from (amax propagates NaN; +inf, or all -inf, is not
    finite); the others are rejected."""
    return torch.isfinite(logits.amax(-1))


def filtered_probs_ref(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                       top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Reference of `filtered_probs`: float32 [B, V], greedy rows one-hot at the argmax, rejected
    rows (not `finite_rows`) all 0."""
    rejected = ~finite_rows(logits)
    logits = logits.masked_fill(rejected[:, None], 0.0)
    probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    greedy = (temperature == 0).cpu()
    if bool(greedy.any()):
        rows = greedy.nonzero().squeeze(1).to(logits.device)
        probs[rows, logits[rows].argmax(-1)] = 1.0
    if not bool(greedy.all()):
        keep = (~greedy).nonzero().squeeze(1)
        rows = keep.to(logits.device)
        p = filter_ref(logits[rows], temperature.cpu()[keep], top_k.cpu()[keep], top_p.cpu()[keep],
                       min_p.cpu()[keep])
        probs[rows] = p.to(probs.dtype)
    return probs.masked_fill(rejected[:, None], 0.0)


def sample_ref(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
               min_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Reference of `sample`: [B] int64 token ids, -1 for a rejected row (not `finite_rows`)."""
    rejected = ~finite_rows(logits)
    logits = logits.masked_fill(rejected[:, None], 0.0)
    tokens = logits.argmax(-1)
    stochastic = (temperature > 0).cpu().nonzero().squeeze(1)
    if stochastic.numel():
        rows = stochastic.to(logits.device)
        probs = filter_ref(logits[rows], temperature.cpu()[stochastic], top_k.cpu()[stochastic],
                           top_p.cpu()[stochastic], min_p.cpu()[stochastic])
        tokens[rows] = draw_from_probs(probs, u.to(logits.device)[rows])
    return tokens.masked_fill(rejected, -1)


def greedy_ref(logits: torch.Tensor) -> torch.Tensor:
    """Reference of `greedy`: [B] int64, the argmax in the logits' own dtype (the lowest id on
    ties); the logit it picks tells the rows the sampler rejects (-1): argmax takes a NaN first,
    then +inf, and a row of -inf picks -inf."""
    tokens = logits.argmax(-1)
    picked = logits.gather(-1, tokens[:, None])[:, 0]
    return torch.where(torch.isfinite(picked), tokens, -1)


# ---- kernel wrappers ----------------------------------------------------------------------------


def use_kernel(logits: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
    """Whether `sample` / `filtered_probs` (fp32 logits; `greedy`: the `dtypes` it takes) on these
    logits run the CUDA kernel."""
    return (logits.dtype in dtypes and logits.dim() == 2 and 0 < logits.shape[1] < 2**31
            and dispatch.use_kernel(logits))


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, u: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """One token id per row, [B] int64 (into `out` when given), -1 for a row holding NaN / +inf or
    nothing finite. No host sync on the kernel path."""
    if not use_kernel(logits):
        dispatch.fallback("sample", logits)
        return _into(out, sample_ref(logits, temperature, top_k, top_p, min_p, u))
    out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device) if out is None else out
    _launch(logits, temperature, top_k, top_p, min_p, tokens=out, u=u)
    return out


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor, min_p: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """The distribution `sample` draws from, [B, V] float32: filtered tokens exactly 0, greedy rows
    one-hot at the argmax (the target `p` of speculative rejection sampling), rejected rows all 0."""
    if not use_kernel(logits):
        return _into(out, filtered_probs_ref(logits, temperature, top_k, top_p, min_p))
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device) if out is None else out
    _launch(logits, temperature, top_k, top_p, min_p, probs=out)
    return out


def sample_and_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     min_p: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample` and `filtered_probs` of the same rows, ([B] int64, [B, V] float32), in one kernel launch:
    a drafter's token and the q it was drawn from (where torch's inverse CDF took ~7 launches)."""
    if not use_kernel(logits):
        dispatch.fallback("sample", logits)
        return (sample_ref(logits, temperature, top_k, top_p, min_p, u),
                filtered_probs_ref(logits, temperature, top_k, top_p, min_p))
    tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    probs = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    _launch(logits, temperature, top_k, top_p, min_p, tokens=tokens, probs=probs, u=u)
    return tokens, probs


def kept_threshold(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Kernel only (debug / tests): the smallest kept logit per row, [B] float32; the kernel keeps
    exactly the tokens with logit >= it (greedy rows: the max)."""
    if not use_kernel(logits):
        raise RuntimeError("sampling: kept_threshold needs fp32 CUDA logits and the CUDA extension")
    out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device) if out is None else out
    _launch(logits, temperature, top_k, top_p, min_p, threshold=out)
    return out


def _launch(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
            min_p: torch.Tensor, *, tokens: torch.Tensor | None = None, probs: torch.Tensor | None = None,
            threshold: torch.Tensor | None = None, u: torch.Tensor | None = None) -> None:
    dev = logits.device
    dispatch.extension().sample_rows(  # shapes, dtypes and layouts checked there
        tokens=tokens, probs=probs, threshold=threshold, logits=logits.contiguous(),
        # float64 as they come: the kernel rounds and clamps them itself (no conversion launches)
        columns=columns_on_device([temperature, top_k, top_p, min_p], dev),
        uniform=None if u is None else u.to(dev, torch.float64).contiguous(),
        # the segment maxima between the kernel's two launches: any contents, so no memset (inside a
        # CUDA graph capture, an allocation from the graph's pool)
        segments=torch.empty(logits.shape[0] * SAMPLE_MAX_SEGMENTS, dtype=torch.long, device=dev),
        max_candidates=CANDIDATES, stream=dispatch.stream_handle(logits),
    )


def greedy(logits: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """`greedy_ref` of [B, V] logits, [B] int64 (into `out` when given): one kernel launch on CUDA
    logits, no host sync."""
    if not use_kernel(logits, (torch.float32, torch.bfloat16, torch.float16)):
        dispatch.fallback("greedy", logits)
        return _into(out, greedy_ref(logits))
    rows = logits.shape[0]
    out = torch.empty(rows, dtype=torch.long, device=logits.device) if out is None else out
    partials, counters = _greedy_workspace(logits.device, rows)
    dispatch.extension().greedy_rows(  # shapes, dtypes and layouts checked there
        tokens=out, logits=logits.contiguous(), partials=partials, counters=counters,
        stream=dispatch.stream_handle(logits),
    )
    return out


# device -> (partials, counters) of the greedy kernel, and every buffer ever handed out.
_greedy_workspaces: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_greedy_retired: list[tuple[torch.Tensor, torch.Tensor]] = []


def _greedy_workspace(device: torch.device, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy kernel's workspace for `rows` rows: partials (any contents) and counters that are
    0 between launches. One per device, zeroed once when allocated: the kernel's last block of a row
    resets its counter, so no launch (eager or graph replay) zeroes anything, where zeroing per
    call would cost a memset launch, and the buffer's address stays fixed for CUDA graphs. Launches
    are stream-ordered on it (the engine samples on one stream; two streams sampling at once on one
    device would race). Allocated outside capture: `capture` (engine/graph_capture.py) warms up
    first, so a capture finds it sized; a zeros() inside a capture would be a memset recorded into
    the graph, leaving eager calls before its first replay with garbage counters."""
    cached = _greedy_workspaces.get(device)
    if cached is not None and cached[1].numel() >= rows:
        return cached
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"sampling.greedy: first call with {rows} rows inside a CUDA graph capture; "
                           f"run it once before capturing (the kernel's workspace is allocated zeroed)")
    if cached is not None:
        _greedy_retired.append(cached)  # a captured graph may still point at it: kept alive
    capacity = max(rows, 64 if cached is None else 2 * cached[1].numel())
    cached = _greedy_workspaces[device] = (
        torch.empty(capacity * GREEDY_MAX_CHUNKS, dtype=torch.long, device=device),
        torch.zeros(capacity, dtype=torch.int32, device=device),
    )
    return cached


def columns_on_device(columns: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Per-row parameter columns as one [len(columns), B] float64 tensor on `device`; host columns in
    one pinned, non-blocking copy: a plain copy from pageable memory would wait for the GPU to finish
    the queued step."""
    if all(c.device == device for c in columns):
        return torch.stack([c.double() for c in columns])
    return dispatch.upload(torch.stack([c.double().cpu() for c in columns]), torch.float64, device)


def _into(dst: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    return value if dst is None else dst.copy_(value)

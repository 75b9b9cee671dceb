"""Token sampling: a batch of logits -> one next token id per row, each row with its own params.

Each row goes through the order used by HF `generate` and vLLM (steps 1-2 here in torch, 3-7 in
ops/sampling.py: the CUDA kernel for fp32 CUDA logits, else the float64 torch reference):

1. repetition penalty over every token seen in prompt + output (HF / vLLM semantics: divide a
   positive logit by the penalty, multiply a negative one; each distinct token once);
2. presence / frequency penalties with the OpenAI formula
   `logit -= frequency * count + presence * (count > 0)` over the *generated* tokens only, as
   vLLM and SGLang do: Qwen's recommended presence_penalty values are tuned on those servers, and
   counting the prompt would push the model away from quoting the user's own code and names;
   then OpenAI's `logit_bias` (a value in [-100, 100] added to a token's logit);
3. temperature (0 => greedy: argmax of the penalised logits, the lowest id on ties);
4. top-k, 5. top-p, 6. min-p, 7. one draw from the row's own generator.

Tie rule: every filter is a threshold on a value, and tokens tied at the threshold are all kept,
so the kept set never depends on token order:
- top-k keeps tokens whose logit >= the k-th largest logit (ties can keep more than k);
- top-p keeps a token iff the mass of the tokens strictly more likely than it is < top_p
  (= the descending prefix that first reaches top_p, plus everything tied with its last token);
- min-p keeps tokens whose probability >= min_p * the largest probability.

The reference filters and draws in float64 so that the kept set and the cumulative sums do not
depend on rounding over a 250k-token vocabulary; the kernel keeps the same set up to fp32
near-ties at a top-p / min-p boundary, with exact fixed-point sums (ops/sampling.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

import torch

from ..config import GenerationDefaults
from ..errors import NinferError
from ..ops import sampling as sampling_ops
from ..ops.dispatch import upload
from .logprobs import MAX_TOP_LOGPROBS
from ..ops.sampling import draw_from_probs, finite_rows, min_p_keep, top_k_keep, top_p_keep

__all__ = [  # the filters and the draw live in ops/sampling.py; re-exported for engine callers
    "Sampler",
    "SamplingParamError",
    "SamplingParams",
    "TokenHistory",
    "apply_logit_bias",
    "apply_penalties",
    "draw_from_probs",
    "finite_rows",
    "min_p_keep",
    "row_params",
    "top_k_keep",
    "top_p_keep",
]

# Every value the engine turns into a tensor must fit its dtype: a bad value is refused when the
# request is made, never found by the batched step it would break for everyone in the batch.
_INT64_MAX = 2**63 - 1
_SEED_RANGE = (-(2**63), 2**64)  # int64 or uint64 (torch wraps negatives modulo 2**64)
_TOKEN_ID_LIMIT = 2**31  # token ids are int32 in the kernels; the vocabulary check comes later
REPETITION_PENALTY_RANGE = (0.01, 100.0)  # a smaller divisor sends a float32 logit to inf
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_token_id(x: object) -> bool:
    return _is_int(x) and 0 <= x < _TOKEN_ID_LIMIT  # type: ignore[operator]


class SamplingParamError(NinferError):
    """A sampling parameter out of range; `field` names it (the server's error `param`)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"invalid sampling parameter: {message}")
        self.field = field


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise SamplingParamError(field, message)


@dataclass
class SamplingParams:
    """One request's sampling knobs. None = unset: the model's generation_config fills it
    (`with_defaults`), and a field still unset is neutral (temperature 1, no filter, no penalty)."""

    temperature: float | None = None  # >= 0; 0 = greedy
    top_k: int | None = None  # 0, -1 (vLLM's spelling) or None = no cap; any k >= vocab = no cap
    top_p: float | None = None  # (0, 1]
    min_p: float | None = None  # [0, 1]
    presence_penalty: float | None = None  # [-2, 2] (OpenAI range)
    frequency_penalty: float | None = None  # [-2, 2]
    repetition_penalty: float | None = None  # [0.01, 100]; 1 = off, > 1 discourages repeats
    seed: int | None = None  # fixes this request's draws, whatever else is in the batch
    max_tokens: int | None = None  # >= 1; None = until the context is full
    min_tokens: int = 0  # no end-of-answer token nor stop_token_ids before this many tokens (vLLM's)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit, [-100, 100]
    logprobs: int | None = None  # report each token's logprob and this many alternatives (0..20); None = off
    # the same for the prompt's tokens (all but the first, which nothing predicts): OpenAI's echo with
    # logprobs. The prompt is then read without the prefix cache (its tokens need their logits).
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        _require(t is None or (_is_number(t) and t >= 0), "temperature",
                 f"temperature must be a finite number >= 0, got {t!r}")
        k = self.top_k
        _require(k is None or (_is_int(k) and -1 <= k <= _INT64_MAX), "top_k",
                 f"top_k must be an integer >= 0 (0 or -1 = no cap) below 2**63, got {k!r}")
        p = self.top_p
        _require(p is None or (_is_number(p) and 0 < p <= 1), "top_p", f"top_p must be in (0, 1], got {p!r}")
        m = self.min_p
        _require(m is None or (_is_number(m) and 0 <= m <= 1), "min_p", f"min_p must be in [0, 1], got {m!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _require(v is None or (_is_number(v) and -2 <= v <= 2), name, f"{name} must be in [-2, 2], got {v!r}")
        r, (low, high) = self.repetition_penalty, REPETITION_PENALTY_RANGE
        _require(r is None or (_is_number(r) and low <= r <= high), "repetition_penalty",
                 f"repetition_penalty must be in [{low:g}, {high:g}], got {r!r}")
        s = self.seed
        _require(s is None or (_is_int(s) and _SEED_RANGE[0] <= s < _SEED_RANGE[1]), "seed",
                 f"seed must be a 64-bit integer, got {s!r}")
        n = self.max_tokens
        _require(n is None or (_is_int(n) and 1 <= n <= _INT64_MAX), "max_tokens",
                 f"max_tokens must be an integer >= 1 below 2**63, got {n!r}")
        m = self.min_tokens
        _require(_is_int(m) and 0 <= m <= _INT64_MAX and (n is None or m <= n), "min_tokens",
                 f"min_tokens must be an integer from 0 to max_tokens, got {m!r}")
        _require(isinstance(self.stop, list) and all(isinstance(x, str) and x for x in self.stop), "stop",
                 f"stop must be a list of non-empty strings, got {self.stop!r:.200}")
        _require(isinstance(self.stop_token_ids, list) and all(_is_token_id(x) for x in self.stop_token_ids),
                 "stop_token_ids", f"stop_token_ids must be a list of token ids in [0, 2**31), "
                 f"got {self.stop_token_ids!r:.200}")
        _require(isinstance(self.ignore_eos, bool), "ignore_eos",
                 f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        (low, high), bias = LOGIT_BIAS_RANGE, self.logit_bias
        _require(isinstance(bias, dict) and all(_is_token_id(k) for k in bias), "logit_bias",
                 f"logit_bias must map token ids in [0, 2**31) to numbers, got {bias!r:.200}")
        bad = next((v for v in bias.values() if not (_is_number(v) and low <= v <= high)), None)
        _require(bad is None, "logit_bias", f"logit_bias values must be in [{low:g}, {high:g}], got {bad!r}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            _require(n is None or (_is_int(n) and 0 <= n <= MAX_TOP_LOGPROBS), name,
                     f"{name} must be an integer in [0, {MAX_TOP_LOGPROBS}] (alternatives per token), got {n!r}")

    def check_vocabulary(self, vocab_size: int) -> None:
        """The token ids this request names exist in a model's vocabulary (logit_bias would index past it)."""
        outside = next((t for t in self.logit_bias if t >= vocab_size), None)
        _require(outside is None, "logit_bias",
                 f"logit_bias names token id {outside}, outside the vocabulary [0, {vocab_size})")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        """Whether sampling reads the token history (repetition / presence / frequency penalty)."""
        return (self.repetition_penalty not in (None, 1) or bool(self.presence_penalty)
                or bool(self.frequency_penalty))

    def with_defaults(self, defaults: GenerationDefaults) -> SamplingParams:
        """A copy whose unset fields come from the model's generation_config; user values win."""
        own = {f.name for f in fields(self)}
        fill = {
            f.name: getattr(defaults, f.name)
            for f in fields(defaults)
            if f.name in own and getattr(self, f.name) is None and getattr(defaults, f.name) is not None
        }
        try:
            return replace(self, **fill)
        except SamplingParamError as e:  # the user's own fields were checked when `self` was built
            raise SamplingParamError(e.field, f"{e} (from the model's generation_config.json)") from None

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """The request's private RNG: seeded => reproducible; else seeded from OS entropy."""
        g = torch.Generator(device=device)
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed % 2**64)
        return g


@dataclass
class TokenHistory:
    """The ids a row has seen: repetition penalty reads both, presence/frequency only `output_ids`."""

    prompt_ids: Sequence[int] | torch.Tensor
    output_ids: Sequence[int] | torch.Tensor = ()


# ---- penalties (the filters and the draw: ops/sampling.py) -----------------------------------------


def _as_ids(ids: Sequence[int] | torch.Tensor, vocab: int, row: int, device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(ids, dtype=torch.long, device=device).reshape(-1)
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab):
        raise NinferError(f"sampler: row {row} holds token ids {int(t.min())}..{int(t.max())} "
                          f"outside the vocabulary [0, {vocab})")
    return t


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams],
                    histories: Sequence[TokenHistory]) -> torch.Tensor:
    """Repetition, then presence / frequency penalties, in the logits' dtype (as HF does). Works on
    the distinct ids each row has seen, not on the vocabulary; rows without penalties untouched."""
    out = logits
    vocab = logits.shape[-1]
    for i, (p, h) in enumerate(zip(params, histories)):
        rep = 1.0 if p.repetition_penalty is None else p.repetition_penalty
        presence, frequency = p.presence_penalty or 0.0, p.frequency_penalty or 0.0
        if rep == 1 and presence == 0 and frequency == 0:
            continue
        if out is logits:
            out = logits.clone()
        output = _as_ids(h.output_ids, vocab, i, logits.device)
        if rep != 1:  # seen = prompt + output; positive logits / rep, negative * rep
            seen = torch.unique(torch.cat([_as_ids(h.prompt_ids, vocab, i, logits.device), output]))
            v = out[i, seen]
            out[i, seen] = torch.where(v < 0, v * rep, v / rep)
        if presence != 0 or frequency != 0:  # OpenAI: logit -= frequency * count + presence
            ids, counts = torch.unique(output, return_counts=True)
            out[i, ids] -= frequency * counts.to(out.dtype) + presence
    return out


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Each row's logit_bias added to its (penalised) logits; rows without one untouched. Separate
    from the penalties, which the engine may have applied from its device tables already."""
    out = logits
    for i, p in enumerate(params):
        if not p.logit_bias:
            continue
        ids = list(p.logit_bias)
        if max(ids) >= logits.shape[-1]:  # checked on the host: no device sync
            raise NinferError(f"sampler: row {i} biases token id {max(ids)}, outside the vocabulary "
                              f"[0, {logits.shape[-1]})")
        out = logits.clone() if out is logits else out
        index = upload(ids, torch.long, logits.device)
        bias = upload(list(p.logit_bias.values()), out.dtype, logits.device)
        out[i, index] += bias
    return out


# ---- the batched sampler ------------------------------------------------------------------------


def row_params(params: Sequence[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (temperature, top_k, top_p, min_p) as CPU tensors (float64 / int64 / float64 /
    float64), unset fields neutral: temperature 1, no top-k, top-p 1, min-p 0."""
    def column(name: str, neutral: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([neutral if getattr(p, name) is None else getattr(p, name) for p in params], dtype=dtype)

    return (column("temperature", 1.0, torch.float64), column("top_k", 0, torch.long),
            column("top_p", 1.0, torch.float64), column("min_p", 0.0, torch.float64))


def choice_sampling(sampling: SamplingParams, n: int) -> list[SamplingParams]:
    """The sampling of each of n answers to one prompt (OpenAI's `n`): choice i draws from seed + i
    (modulo 2**64, as the generator takes it), so a seeded request's choices differ from each other
    and each is reproducible; choice 0 is the request's own. Unseeded choices draw from OS entropy."""
    if n < 1:
        raise NinferError(f"n must be at least 1, got {n}")
    return [sampling] + [replace(sampling, seed=None if sampling.seed is None else (sampling.seed + i) % 2**64)
                         for i in range(1, n)]


def plain_greedy(params: Sequence[SamplingParams]) -> bool:
    """Every row takes the argmax of its logits as they come: greedy, no penalties, no logit bias."""
    return all(p.is_greedy and not p.has_penalties and not p.logit_bias for p in params)


class Sampler:
    """Batched sampling with per-row params, token histories and generators (stateless). Penalties
    run here in torch; filtering and the draw run in ops/sampling.py (the CUDA kernel for fp32
    CUDA logits, the float64 reference otherwise)."""

    def distribution(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                     histories: Sequence[TokenHistory], penalised: bool = False,
                     finite: torch.Tensor | None = None) -> torch.Tensor:
        """The exact distribution `sample` draws from, [B, V] float32 (masked tokens exactly 0;
        greedy rows one-hot at the argmax): the target `p` for speculative rejection sampling.
        `penalised`: as in `sample`. No host sync: a row whose logits are not finite comes out as
        its filter over zero logits; the caller tells those rows by `finite_rows` (`finite`: those
        rows, where the caller has them already)."""
        return sampling_ops.filtered_probs(self._filter_input(logits, params, histories, penalised, finite),
                                           *row_params(params))

    def draw(self, logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[TokenHistory],
             u: torch.Tensor, penalised: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [B], `distribution` [B, V]): each row's token drawn with uniform u[b] from exactly
        that distribution, in one kernel launch (a drafter's token and its q)."""
        return sampling_ops.sample_and_probs(self._filter_input(logits, params, histories, penalised, None),
                                             *row_params(params), u)

    def _filter_input(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                      histories: Sequence[TokenHistory], penalised: bool, finite: torch.Tensor | None) -> torch.Tensor:
        """`distribution`'s logits before the filters: non-finite rows zeroed, penalties, logit bias."""
        self._check_shapes(logits, params, histories)
        finite = finite_rows(logits) if finite is None else finite
        logits = logits.masked_fill(~finite[:, None], 0.0)
        if not penalised:
            logits = apply_penalties(logits, params, histories)
        return apply_logit_bias(logits, params)

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[TokenHistory],
               generators: Sequence[torch.Generator | None], penalised: bool = False) -> torch.Tensor:
        """One token id per row, [B] int64, -1 for a row whose logits hold NaN / +inf or no finite
        value (checked on the device: no host sync). A stochastic row draws exactly one float64
        uniform from its own generator (None = torch's global RNG); greedy rows draw nothing. So a
        seeded row's tokens depend only on its seed and its logits, never on the rest of the batch.
        `penalised`: the penalties are already in the logits (engine/penalties.py)."""
        self._check_shapes(logits, params, histories)
        if len(generators) != logits.shape[0]:
            raise NinferError(f"sampler: {len(generators)} generators for {logits.shape[0]} rows")
        if plain_greedy(params):
            # The argmax in the logits' own dtype (the lowest id on ties, as the sampler's), -1 for
            # the rows the sampler rejects: no fp32 copy, filtering, draws or row-parameter copies,
            # one kernel launch on CUDA (ops/sampling.py `greedy`).
            return sampling_ops.greedy(logits)
        if not penalised:  # a rejected row stays one (NaN / inf survive the penalties): the kernel's -1
            logits = apply_penalties(logits, params, histories)
        logits = apply_logit_bias(logits, params)
        zero = torch.zeros((), dtype=torch.float64, device=logits.device)
        u = torch.stack([zero if p.is_greedy else self._uniform(g, logits.device) for p, g in zip(params, generators)])
        return sampling_ops.sample(logits, *row_params(params), u)

    @staticmethod
    def _check_shapes(logits: torch.Tensor, params: Sequence[SamplingParams],
                      histories: Sequence[TokenHistory]) -> None:
        if logits.dim() != 2 or not logits.is_floating_point():
            raise NinferError(f"sampler: logits must be a float [batch, vocab] tensor, got {tuple(logits.shape)} "
                              f"{logits.dtype}")
        if not len(params) == len(histories) == logits.shape[0]:
            raise NinferError(f"sampler: {logits.shape[0]} logit rows, {len(params)} params, "
                              f"{len(histories)} histories")

    @staticmethod
    def _uniform(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
        where = generator.device if generator is not None else device
        return torch.rand((), dtype=torch.float64, generator=generator, device=where).to(device)

"""Adaptive draft length (`--adaptive-draft`): each round, per sequence, the K that should give the
most tokens per unit of time, from the sequence's recent acceptance.

Model: draft i is accepted with probability a only if every draft before it was (geometric), so a
round of K drafts yields E(K) = 1 + a + ... + a^K = (1 - a^(K+1)) / (1 - a) tokens and costs
C(K) = round(K) + K * draft in plain decode steps (round(0): a plain step and the drafter's
catch-up, a little over 1). The policy takes argmax E(K) / C(K)
over K = 0..limit (ties: the smaller K). Deterministic: the same rounds give the same choices.

round(K) depends on the batch and on whether the sequence samples (a sampled round also filters
and rejection-samples full-vocabulary rows): `RoundCosts` holds measured tables by (sampled,
batch) and interpolates between batches.

a per sequence: EMA(accepted) / EMA(tested) over its rounds, starting from a prior. Tested =
accepted, plus the first rejected draft if there was one: drafts after a rejection are never
judged, and counting them as failures (accepted / drafted) reads a = 0.8 at K = 8 as 0.42 and
pulls K down. At K = 0 nothing is learned, so after `probe_every` rounds without a tested draft
the policy asks for one draft, and recovers when acceptance comes back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ...errors import NinferError

# A round of K = 0..3 drafts in plain decode steps of the same batch and kind: the engine loop's
# MTP rounds with the judge's kept drafts at 72% (`scripts/bench_spec.py engine`, Qwen3.6-35B-A3B
# int4 with random weights, context 512; docs/performance.md), greedy and sampled (Qwen3.6's
# settings, presence penalty 1), batch 1 and 8, all on one H100 in one run (forty-eighth session;
# K = 0: a plain step, overlapped, plus the MTP drafter's catch-up). Past K = 3: the last slope.
# Random weights route every token to its own experts, so a batch-8 verify reads more expert bytes
# than a real model's: its costs are an upper bound. n-gram rounds draft on the host (cheaper than
# MTP's chain), so for n-gram these costs are conservative too.
LOOP_COST: dict[tuple[bool, int], tuple[float, ...]] = {
    (False, 1): (1.13, 1.59, 1.90, 2.24),
    (False, 8): (1.07, 1.81, 2.43, 2.79),
    (True, 1): (1.13, 1.62, 1.94, 2.27),
    (True, 8): (1.08, 1.91, 2.49, 2.89),
}


@dataclass(frozen=True)
class CostModel:
    """The time of a round of K drafts in plain decode steps (one batch size, one kind)."""

    verify: tuple[float, ...]  # verify[K]: the round's cost; past the table: its last slope
    draft: float = 0.0  # drafting one token, where the table leaves it out

    def __post_init__(self) -> None:
        if len(self.verify) < 2 or min(self.verify) <= 0 or self.draft < 0:
            raise NinferError("a draft cost model needs >= 2 positive verify costs and a draft cost >= 0")

    def __call__(self, k: int) -> float:
        table, last = self.verify, len(self.verify) - 1
        verify = table[k] if k <= last else table[last] + (k - last) * (table[last] - table[last - 1])
        return verify + k * self.draft


@dataclass(frozen=True)
class RoundCosts:
    """Cost models by (sampled, batch size): a measured batch's table, else the entrywise linear
    interpolation of the two measured batches around it (past the ends: the nearest)."""

    tables: Mapping[tuple[bool, int], tuple[float, ...]] = field(default_factory=lambda: dict(LOOP_COST))
    draft: float = 0.0
    _models: dict[tuple[int, bool], CostModel] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for sampled in (False, True):
            if not any(kind == sampled for kind, _ in self.tables):
                raise NinferError(f"round costs need a {'sampled' if sampled else 'greedy'} table")
        for table in self.tables.values():
            CostModel(table, self.draft)  # each checked

    def at(self, batch: int, sampled: bool) -> CostModel:
        model = self._models.get((batch, sampled))
        if model is None:  # made once a (batch, kind): the engine asks for every sequence every round
            model = self._models[batch, sampled] = self._interpolate(batch, sampled)
        return model

    def _interpolate(self, batch: int, sampled: bool) -> CostModel:
        sizes = sorted(b for kind, b in self.tables if kind == sampled)
        low = max([b for b in sizes if b <= batch], default=sizes[0])
        high = min([b for b in sizes if b >= batch], default=sizes[-1])
        a, b = self.tables[sampled, low], self.tables[sampled, high]
        t = 0.0 if high == low else (batch - low) / (high - low)
        width = max(len(a), len(b))
        a, b = (tuple(CostModel(x)(k) for k in range(width)) for x in (a, b))
        return CostModel(tuple(x + t * (y - x) for x, y in zip(a, b)), self.draft)


def expected_tokens(a: float, k: int) -> float:
    """Tokens a round of k drafts yields at per-draft acceptance a (the target's own token included)."""
    return sum(a**i for i in range(k + 1))


def best_k(a: float, limit: int, cost: CostModel) -> int:
    return max(range(limit + 1), key=lambda k: (expected_tokens(a, k) / cost(k), -k))


@dataclass
class _Rate:
    accepted: float  # EMA of accepted drafts per round
    tested: float  # EMA of judged drafts per round
    idle: int = 0  # rounds since a draft was last judged


@dataclass
class AdaptiveDraft:
    """Per-sequence K (keyed by request id) from the sequence's recent rounds."""

    cost: RoundCosts = field(default_factory=RoundCosts)
    # acceptance assumed before a sequence's first judged draft: the reference engine's MTP keeps 72%
    # of its K = 3 drafts, (a + a^2 + a^3) / 3 = 0.72 at a = 0.86
    prior: float = 0.86
    weight: float = 0.5  # of the newest round in the EMAs: drafts are good or bad in runs, follow them fast
    probe_every: int = 8  # rounds at K = 0 before one draft is tried
    _rates: dict[str, _Rate] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if not (0 <= self.prior <= 1 and 0 < self.weight <= 1 and self.probe_every >= 1):
            raise NinferError("adaptive drafts need 0 <= prior <= 1, 0 < weight <= 1 and probe_every >= 1")

    def acceptance(self, key: str) -> float:
        rate = self._rates.get(key)
        return self.prior if rate is None else rate.accepted / rate.tested

    def choose(self, key: str, limit: int, batch: int = 1, sampled: bool = False) -> int:
        """Drafts for the next round of `key`, at most `limit`, in a round of `batch` sequences."""
        k = best_k(self.acceptance(key), limit, self.cost.at(batch, sampled))
        rate = self._rates.get(key)
        if k == 0 and limit > 0 and rate is not None and rate.idle >= self.probe_every:
            return 1
        return k

    def update(self, key: str, drafted: int, accepted: int, asked: int = 0) -> None:
        """One verified round of `key`: `accepted` of its `drafted` drafts were kept, `asked` drafts
        were asked for. A round that asked and got none (an n-gram drafter without a match) spent its
        probe: the next comes `probe_every` rounds on, not in every round after, each of which would
        be a speculative step instead of a plain, overlapped one."""
        rate = self._rates.setdefault(key, _Rate(accepted=self.prior, tested=1.0))
        if drafted == 0:
            rate.idle = 0 if asked else rate.idle + 1
            return
        w, tested = self.weight, accepted + (accepted < drafted)
        rate.accepted = (1 - w) * rate.accepted + w * accepted
        rate.tested = (1 - w) * rate.tested + w * tested
        rate.idle = 0

    def release(self, key: str) -> None:
        self._rates.pop(key, None)

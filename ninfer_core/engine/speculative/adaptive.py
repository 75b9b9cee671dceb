"""Adaptive draft length (`--adaptive-draft`): each round, per sequence, the K that should give the
most tokens per unit of time, from the sequence's recent acceptance.

Model: draft i is accepted with probability a only if every draft before it was (geometric), so a
round of K drafts yields E(K) = 1 + a + ... + a^K = (1 - a^(K+1)) / (1 - a) tokens and costs
C(K) = verify(K) + K * draft decode steps. The policy takes argmax E(K) / C(K) over K = 0..limit
(ties: the smaller K). Deterministic: the same rounds give the same choices.

a per sequence: EMA(accepted) / EMA(tested) over its rounds, starting from a prior. Tested =
accepted, plus the first rejected draft if there was one: drafts after a rejection are never
judged, and counting them as failures (accepted / drafted) reads a = 0.8 at K = 8 as 0.42 and
pulls K down. At K = 0 nothing is learned, so after `probe_every` rounds without a tested draft
the policy asks for one draft, and recovers when acceptance comes back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...errors import NinferError

# A verify round of K drafts / a 1-token decode step, K = 0..7: Qwen3.6-35B-A3B int4, CUDA graphs,
# H200 (docs/performance.md, issue 4). K = 0 is the plain step.
H200_VERIFY_COST = (1.0, 1.32, 1.61, 1.62, 1.84, 1.91, 2.07, 2.27)


@dataclass(frozen=True)
class CostModel:
    """The time of a round of K drafts in decode steps."""

    verify: tuple[float, ...] = H200_VERIFY_COST  # verify[K]; past the table: its last slope
    draft: float = 0.0  # drafting one token; the engine's 0: n-gram is free, MTP / DFlash cost not per draft

    def __post_init__(self) -> None:
        if len(self.verify) < 2 or min(self.verify) <= 0 or self.draft < 0:
            raise NinferError("a draft cost model needs >= 2 positive verify costs and a draft cost >= 0")

    def __call__(self, k: int) -> float:
        table, last = self.verify, len(self.verify) - 1
        verify = table[k] if k <= last else table[last] + (k - last) * (table[last] - table[last - 1])
        return verify + k * self.draft


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

    cost: CostModel = field(default_factory=CostModel)
    prior: float = 0.6  # acceptance assumed before a sequence's first judged draft (K = 3 on the H200 table)
    weight: float = 0.5  # of the newest round in the EMAs: drafts are good or bad in runs, follow them fast
    probe_every: int = 8  # rounds at K = 0 before one draft is tried
    _rates: dict[str, _Rate] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if not (0 <= self.prior <= 1 and 0 < self.weight <= 1 and self.probe_every >= 1):
            raise NinferError("adaptive drafts need 0 <= prior <= 1, 0 < weight <= 1 and probe_every >= 1")

    def acceptance(self, key: str) -> float:
        rate = self._rates.get(key)
        return self.prior if rate is None else rate.accepted / rate.tested

    def choose(self, key: str, limit: int) -> int:
        """Drafts for the next round of `key`, at most `limit`."""
        k = best_k(self.acceptance(key), limit, self.cost)
        rate = self._rates.get(key)
        if k == 0 and limit > 0 and rate is not None and rate.idle >= self.probe_every:
            return 1
        return k

    def update(self, key: str, drafted: int, accepted: int) -> None:
        """One verified round of `key`: `accepted` of its `drafted` drafts were kept."""
        rate = self._rates.setdefault(key, _Rate(accepted=self.prior, tested=1.0))
        if drafted == 0:
            rate.idle += 1
            return
        w, tested = self.weight, accepted + (accepted < drafted)
        rate.accepted = (1 - w) * rate.accepted + w * accepted
        rate.tested = (1 - w) * rate.tested + w * tested
        rate.idle = 0

    def release(self, key: str) -> None:
        self._rates.pop(key, None)

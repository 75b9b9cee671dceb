"""Adaptive draft length (`--adaptive-draft`): the policy's choices against hand-computed
expectations, and greedy decoding with K chosen per round still equal to plain decoding.

Expected values come from the model of adaptive.py worked by hand: E(K) = 1 + a + ... + a^K
tokens per round, C(K) the round-cost table, K = argmax E(K) / C(K) (ties: the smaller K);
a = EMA(accepted) / EMA(tested) with weight w, starting from (prior, 1). The policy's dynamics are
worked on issue 4's H200 verify table (one table for every batch and kind); the default costs
(the engine loop's, by batch and kind) have their own test.
"""

from __future__ import annotations

import pytest
import torch

from ninfer_core.engine.penalties import PenaltyTables
from ninfer_core.engine.request import GenerationRequest
from ninfer_core.engine.sampling import Sampler
from ninfer_core.engine.sequence import Sequence
from ninfer_core.engine.speculative import AdaptiveDraft, CostModel, Draft, Drafter, RoundCosts, Speculator
from ninfer_core.engine.speculative.adaptive import LOOP_COST, best_k, expected_tokens
from ninfer_core.errors import NinferError
from speculative_harness import PROMPTS, greedy, load, probes_only, run, write_drafter, write_target

torch.set_num_threads(1)
N_TOKENS = 120
H200 = (1.0, 1.32, 1.61, 1.62, 1.84, 1.91, 2.07, 2.27)  # docs/performance.md, issue 4


# -- the policy -----------------------------------------------------------------------------


def policy(cls: type[AdaptiveDraft] = AdaptiveDraft, **kw) -> AdaptiveDraft:
    return cls(**{"cost": one_table(H200), "prior": 0.6, "weight": 0.5, "probe_every": 8, **kw})


def one_table(verify: tuple[float, ...]) -> RoundCosts:
    """The same costs for every batch, greedy or sampled."""
    return RoundCosts({(False, 1): verify, (True, 1): verify})


def test_model_pieces():
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(0.8, 3) == pytest.approx((1 - 0.8**4) / 0.2)
    assert expected_tokens(1.0, 4) == 5
    cost = CostModel(H200)
    assert [cost(k) for k in range(8)] == pytest.approx(H200)
    assert [cost(k) for k in (8, 10)] == pytest.approx([2.47, 2.87])  # the last slope, 0.20 a draft
    assert CostModel(H200, draft=0.5)(3) == pytest.approx(1.62 + 1.5)
    with pytest.raises(NinferError):
        CostModel(verify=(1.0,))
    with pytest.raises(NinferError):
        AdaptiveDraft(weight=0)
    with pytest.raises(NinferError, match="sampled table"):
        RoundCosts({(False, 1): H200})
    with pytest.raises(NinferError):
        RoundCosts({(False, 1): H200, (True, 1): (1.0, -2.0)})


def test_round_costs_between_and_past_the_measured_batches():
    """Entrywise linear in the batch between measured ones, the nearest past the ends; a shorter
    table is extended by its last slope before the two are mixed."""
    costs = RoundCosts({(False, 2): (1.0, 2.0, 3.0), (False, 8): (1.0, 3.0, 6.0), (True, 4): (1.0, 4.0)})
    assert costs.at(2, False).verify == pytest.approx((1.0, 2.0, 3.0))
    assert costs.at(1, False).verify == pytest.approx((1.0, 2.0, 3.0))  # below the smallest: it
    assert costs.at(6, False).verify == pytest.approx((1.0, 2 + 2 / 3, 3 + 2))  # 4 / 6 of the way
    assert costs.at(64, False).verify == pytest.approx((1.0, 3.0, 6.0))
    assert costs.at(8, True)(3) == pytest.approx(10.0)  # the one sampled table, its slope of 3
    mixed = RoundCosts({(False, 1): (1.0, 2.0), (False, 3): (1.0, 2.0, 2.5), (True, 1): (1.0, 2.0)})
    assert mixed.at(2, False).verify == pytest.approx((1.0, 2.0, (3.0 + 2.5) / 2))


def test_default_costs_draft_where_the_loop_gains():
    """The engine loop's MTP costs (LOOP_COST), worked by hand at the prior a = 0.86 (E(1..3) = 1.86,
    2.5996, 3.2357): batch 1 greedy K=3 (3.2357 / 2.24 = 1.44 > K=2 1.37); batch 1 sampled K=3
    (1.43 > K=2 1.34); batch 8 greedy K=3 (1.16 > K=2 1.07); batch 8 sampled K=3 (1.12 > K=2 1.04 >
    K=1 0.97); batch 4 sampled, 3/7 of the way to batch 8: K=3 costs 2.27 + 0.62 * 3/7 = 2.536 -> 1.28.
    Batch 1 greedy at a = 0.6: K=2 (1.96 / 1.90 = 1.03; K=1 1.6 / 1.59 = 1.01, K=3 2.176 / 2.24 = 0.97,
    K=0 1 / 1.13 = 0.885); at a = 0.5 K=1 (1.5 / 1.59 = 0.943 > K=2 1.75 / 1.90 = 0.921 > K=0's 0.885:
    a round without drafts pays the drafter's catch-up too); at a = 0.4: none (K=1 1.4 / 1.59 = 0.881)."""
    p = AdaptiveDraft()
    assert p.cost.tables == LOOP_COST and p.prior == 0.86
    kinds = ((1, False), (1, True), (8, False), (8, True))
    assert [p.choose("r", 3, b, sampled) for b, sampled in kinds] == [3, 3, 3, 3]
    assert p.cost.at(4, True)(3) == pytest.approx(2.27 + 0.62 * 3 / 7) and p.choose("r", 3, 4, True) == 3
    assert AdaptiveDraft(prior=0.6).choose("r", 3) == 2
    assert AdaptiveDraft(prior=0.5).choose("r", 3) == 1
    assert AdaptiveDraft(prior=0.4).choose("r", 3) == 0


def test_choices_follow_the_h200_table():
    """(1 + a + .. + a^K) / C(K) worked by hand: a = 0.6 -> K=3 2.176/1.62 = 1.34 beats K=4 1.25 and
    K=1 1.21; a = 0.3 -> K=1 1.3/1.32 < 1: none; a = 0.4 -> K=1 1.4/1.32 = 1.06 beats K=3 1.624/1.62;
    a = 0.875 -> K=6 4.86/2.07 = 2.35 beats K=7 5.25/2.27 = 2.31; a = 0.99 -> the limit."""
    cost = CostModel(H200)
    assert [best_k(a, 7, cost) for a in (0.0, 0.3, 0.4, 0.6, 0.875, 0.99)] == [0, 0, 1, 3, 6, 7]
    assert best_k(0.99, 15, cost) == 15  # 14.85/3.87 = 3.84 > K=14 13.99/3.67 = 3.81 (past the table: +0.2 a draft)
    assert best_k(0.6, 2, cost) == 2  # 1.96/1.61 = 1.217 > K=1 1.6/1.32 = 1.212
    assert best_k(0.6, 0, cost) == 0


def test_flat_table_drafts_the_limit_steep_table_fewer():
    """Flat: every round costs one step, more drafts never hurt: the limit for any a > 0 (a = 0: a
    tie, the smaller K). Steep (1, 1.1, 2.0, then +0.9): a = 0.8 -> K=1 (1.8/1.1 = 1.64 > 2.44/2),
    a = 0.05 -> none (1.05/1.1 < 1)."""
    flat, steep = one_table((1.0, 1.0)), one_table((1.0, 1.1, 2.0))
    for a in (0.05, 0.3, 0.9):
        assert policy(cost=flat, prior=a).choose("r", 6) == 6
    assert policy(cost=flat, prior=0.0).choose("r", 6) == 0
    assert [policy(cost=steep, prior=a).choose("r", 6) for a in (0.05, 0.3, 0.8, 0.99)] == [0, 1, 1, 1]


def test_high_acceptance_climbs_to_the_limit():
    """From the prior 0.6 (K=3), all drafts accepted: a = (0.3 + 1.5) / (0.5 + 1.5) = 0.9 -> K=6
    (5.22/2.07 = 2.52 vs K=7 5.70/2.27 = 2.51), then a = (0.9 + 3) / (1 + 3) = 0.975 -> 7."""
    p = policy()
    ks = []
    for _ in range(5):
        ks.append(p.choose("r", 7))
        p.update("r", ks[-1], ks[-1])
    assert ks == [3, 6, 7, 7, 7]


def test_zero_acceptance_stops_drafting_then_probes_and_recovers():
    p = policy()
    ks = []
    for _ in range(3):  # every first draft rejected: a = 0.3 after one round -> K=0
        ks.append(p.choose("r", 7))
        p.update("r", ks[-1], 0)
    assert ks == [3, 0, 0]
    ks = []
    for _ in range(16):  # a probe once 8 rounds went without a judged draft (2 of them above); rejected
        ks.append(p.choose("r", 7))
        p.update("r", ks[-1], 0)
    assert ks == [0] * 6 + [1] + [0] * 8 + [1]
    ks = []
    for _ in range(12):  # acceptance came back: probes pass
        ks.append(p.choose("r", 7))
        p.update("r", ks[-1], ks[-1])
    # a = (0.0375 + 0.5) / 1 = 0.54 after the accepted probe -> K=3 (1.98/1.62 = 1.22 > K=1 1.16);
    # then (0.27 + 1.5) / (0.5 + 1.5) = 0.884 -> K=6 (2.41 > K=7 2.38); then (0.88 + 3) / 4 = 0.97 -> 7
    assert ks == [0] * 8 + [1, 3, 6, 7]


def test_a_probe_that_gets_no_drafts_is_spent():
    """An n-gram drafter often has no match: a probe that asked and got none waits `probe_every`
    rounds for the next, as a rejected one does, instead of asking again every round."""
    p = policy(prior=0.0, probe_every=3)
    ks = []
    for _ in range(9):
        ks.append(p.choose("r", 7))
        p.update("r", 0, 0, asked=ks[-1])  # the drafter never has a draft
    assert ks == [0, 0, 0, 1, 0, 0, 0, 1, 0]
    p.update("r", 0, 0)  # a round that asked for none: one more without a judged draft
    p.update("r", 0, 0)
    assert p.choose("r", 7) == 1


def test_sequences_are_independent_and_released():
    p = policy()
    p.update("a", 7, 0)
    assert p.choose("a", 7) == 0 and p.choose("b", 7) == 3
    p.release("a")
    assert p.acceptance("a") == 0.6 and p.choose("a", 7) == 3


def test_tested_counts_the_first_rejection_only():
    """accepted 4 of 8 = 4 passed + 1 failed judgement: a = (0.3 + 2) / (0.5 + 2.5) = 0.767, not
    the 4/8 that would count never-judged drafts."""
    p = policy()
    p.update("r", 8, 4)
    assert p.acceptance("r") == pytest.approx(2.3 / 3.0)
    p.update("r", 8, 8)  # all accepted: 8 judged, 8 passed
    assert p.acceptance("r") == pytest.approx((1.15 + 4) / (1.5 + 4))
    p.update("r", 0, 0)  # nothing drafted: nothing learned
    assert p.acceptance("r") == pytest.approx((1.15 + 4) / (1.5 + 4))


# -- in the engine --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_target(tmp_path_factory)[0]


@pytest.fixture(scope="module")
def plain(target) -> list[list[int]]:
    llm = load(target)
    return [next(iter(run(llm, [GenerationRequest(p, greedy(N_TOKENS))]).values())) for p in PROMPTS]


BAD = range(30, 70)  # output positions where the phased drafter is always wrong


class PhasedDrafter(Drafter):
    """The true continuation, except for rounds starting at an output position in BAD: then every
    draft is off by one."""

    method = "phased"
    max_draft_tokens = 15

    def __init__(self, script: dict[str, list[int]], vocab: int):
        self.script, self.vocab = script, vocab

    def propose(self, seqs: list[Sequence], counts: list[int], penalties: PenaltyTables | None = None) -> list[Draft]:
        drafts = []
        for seq, k in zip(seqs, counts):
            done = len(seq.output_ids)
            tokens = self.script[seq.request_id][done : done + k]
            drafts.append(Draft([(t + 1) % self.vocab for t in tokens] if done in BAD else tokens))
        return drafts


def run_phased(target, plain, overlap: bool):
    """Two adaptive requests (limit 7) and one opted out, the drafts useless in the middle (BAD):
    the requests, the engine, every choice's (request, batch, sampled), the tokens and each
    request's rounds as (start position, drafted)."""
    llm = load(target)
    llm.engine.overlap = overlap
    requests = [GenerationRequest(p, greedy(N_TOKENS)) for p in PROMPTS]
    requests[1].draft_tokens = 0
    drafter = PhasedDrafter({r.request_id: toks for r, toks in zip(requests, plain)}, llm.loaded.config.vocab_size)
    asked: list[tuple[str, int, bool]] = []

    class Recorded(AdaptiveDraft):
        def choose(self, key: str, limit: int, batch: int = 1, sampled: bool = False) -> int:
            asked.append((key, batch, sampled))
            return super().choose(key, limit, batch, sampled)

    llm.engine.speculator = Speculator(drafter, 7, Sampler(), policy(Recorded))
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    rounds: dict[str, list[tuple[int, int]]] = {r.request_id: [] for r in requests}
    for out in llm.engine.generate(requests):
        if tokens[out.request_id]:  # the first output is the prefill's token
            rounds[out.request_id].append((len(tokens[out.request_id]), out.drafted))
        tokens[out.request_id] += out.new_token_ids
    return requests, llm, asked, list(tokens.values()), list(rounds.values())


def test_adaptive_greedy_identical_to_plain_and_k_follows_acceptance(target, plain):
    """Two adaptive requests (limit 7) and one opted out share every verify batch; the drafts turn
    useless in the middle: K goes to the limit, to 0 with probes, and back to the limit."""
    requests, llm, asked, tokens, logs = run_phased(target, plain, overlap=False)
    assert tokens == plain
    rounds = {r.request_id: log for r, log in zip(requests, logs)}
    for request in (requests[0], requests[2]):
        log = rounds[request.request_id]
        before = [k for at, k in log if at < BAD.start]
        during = [k for at, k in log if at in BAD]
        after = [k for at, k in log if at >= BAD.stop]
        assert before[:3] == [3, 6, 7] and set(before[2:]) == {7}, log  # as in the policy test above
        stop = during.index(0)  # rejections pull K down round by round, to none within a few rounds
        assert during[0] == 7 and stop <= 5 and during[:stop] == sorted(during[:stop], reverse=True), log
        assert set(during[stop:]) == {0, 1}, log  # then only probes of one draft
        start = next(i for i, k in enumerate(after) if k)
        assert start < 9 and after[start] == 1 and 7 in after[start:], log  # a probe finds good drafts again
    assert all(k == 0 for _, k in rounds[requests[1].request_id])
    # asked with the round's batch (the opted-out request rides along), greedy; never for the opted-out one
    assert {key for key, _, _ in asked} == {requests[0].request_id, requests[2].request_id}
    assert asked[0][1] == 3 and {batch for _, batch, _ in asked} <= {1, 2, 3} and not any(s for _, _, s in asked)
    stats = llm.stats().spec
    assert stats is not None and stats.draft_tokens == 7 and stats.accepted > N_TOKENS


def test_overlapped_rounds_without_drafts_probe_on_time(target, plain):
    """With steps overlapped (as on a GPU), the rounds without drafts are plain steps, each launched
    before the last is read: the policy counts them at launch, so its probes, and every round's
    K, come where the synchronous engine's do."""
    _, llm, _, tokens, overlapped = run_phased(target, plain, overlap=True)
    _, _, _, _, synchronous = run_phased(target, plain, overlap=False)
    assert tokens == plain and overlapped == synchronous
    assert llm.stats().spec.rounds > 0 and any(k == 1 for log in overlapped for _, k in log)  # probes made


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, target):
    return write_drafter(tmp_path_factory, target)[0]


@pytest.mark.parametrize("method,limit", [("ngram", 6), ("mtp", 3), ("dflash", 7)])
def test_engine_option_is_lossless_for_every_drafter(method, limit, target, drafter_dir, plain):
    """Random-weight MTP / DFlash drafts are nearly always wrong: their sequences fall to K = 0
    rounds (observed, not asked to draft) with probes, which must keep the drafter in step."""
    llm = load(target, spec=method, draft_tokens=limit, adaptive_draft=True,
               draft_model=drafter_dir if method == "dflash" else None)
    speculator = llm.engine.speculator
    assert speculator is not None and isinstance(speculator.adaptive, AdaptiveDraft)
    requests = [GenerationRequest(p, greedy(N_TOKENS)) for p in PROMPTS]
    drafted: set[int] = set()
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for out in llm.engine.generate(requests):
        if tokens[out.request_id]:  # a round (the first output is the prefill's token)
            drafted.add(out.drafted)
        tokens[out.request_id] += out.new_token_ids
    assert list(tokens.values()) == plain
    if method != "ngram":
        assert {0, 1} <= drafted, drafted  # rounds without drafts and probes both happened
    assert all(speculator.adaptive.acceptance(r.request_id) == speculator.adaptive.prior for r in requests)  # released
    assert llm.stats().spec.draft_tokens == limit
    assert load(target, spec="ngram").engine.speculator.adaptive is None


def test_ngram_probes_without_matches_leave_plain_steps(target):
    """Rounds without drafts are plain steps (overlapped on a GPU); an n-gram probe that found no
    match used to leave the next round probing again, so nearly every round was a speculative step
    (102 of ~120 here before the fix; 30 after: about one in probe_every + 1)."""
    llm = load(target, spec="ngram", draft_tokens=6)
    llm.engine.speculator.adaptive = probes_only(every=3)
    speculative, step = [], llm.engine._speculative_step
    llm.engine._speculative_step = lambda plan: speculative.append(plan) or step(plan)
    run(llm, [GenerationRequest(p, greedy(N_TOKENS)) for p in PROMPTS])
    assert llm.stats().spec.drafted > 0 and 0 < len(speculative) <= N_TOKENS // 3


def test_adaptive_needs_spec(target):
    with pytest.raises(NinferError, match="--adaptive-draft need --spec"):
        load(target, adaptive_draft=True)

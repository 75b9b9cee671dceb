"""Stochastic speculative sampling keeps the target distribution exactly (chi-square tests).

1. The acceptance rule alone (verify.py) on a 6-token vocabulary: the first emitted token is
   distributed as p_0, and the token after an accepted draft as p_1, for drafts sampled from q
   and for deterministic drafts (q one-hot). Deliberately broken rules (accept always; resample
   from p instead of the residual) must fail the same test.
2. The whole engine (MTP drafts sampled from the request's own distribution over the MTP
   logits, n-gram drafts): every generated token's randomized probability integral transform
   under the exact plain-sampling distribution (transformers logits + our sampler's
   temperature / top-k / repetition / presence penalties over the actual history) must be
   uniform; with the acceptance rule broken it is not.
3. Deterministically: every target row p_t the engine hands the rule equals the plain sampler's
   distribution (transformers logits) for the prefix prompt + output + drafts[:t].
Seeds are fixed, so the outcomes are deterministic; thresholds are p > 1e-3 (correct) and
p < 1e-6 (broken).
"""

from __future__ import annotations

import pytest
import torch

from ninfer_core.engine.request import GenerationRequest
from ninfer_core.engine.sampling import Sampler, SamplingParams, TokenHistory
from ninfer_core.engine.speculative import Draft, speculator
from ninfer_core.engine.speculative.base import read_with
from ninfer_core.engine.speculative.verify import judge_stochastic, stochastic_kept
from speculative_harness import PROMPTS, load, run, write_target

torch.set_num_threads(1)
V = 6
TRIALS = 20000


def chi2_pvalue(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells with expected count < 5 are pooled."""
    n = observed.sum()
    expected = expected_probs.double() * n
    small = expected < 5
    obs = torch.cat([observed[~small].double(), observed[small].double().sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def accept_stochastic(draft: Draft, p: torch.Tensor, generator: torch.Generator) -> list[int]:
    """The engine's rule for one sequence: p [k+1, V] target distributions -> the accepted drafts plus
    one more token."""
    return accept_stochastic_rows([draft], p, [generator])[0]


def accept_stochastic_rows(drafts: list[Draft], p: torch.Tensor, generators: list[torch.Generator],
                           finite: torch.Tensor | None = None) -> list[list[int]]:
    """`accept_stochastic` for B sequences at once, as the engine judges them: `judge_stochastic` (p,
    generators and `finite` as it takes them), then one read."""
    return stochastic_kept(drafts, read_with(drafts, judge_stochastic(drafts, p, generators, finite)))


def accept_always(draft: Draft, p: torch.Tensor, generator: torch.Generator) -> list[int]:
    """Broken: every draft kept, then a token from p_k."""
    k = len(draft.tokens)
    return draft.tokens + [int(torch.multinomial(p[k].double(), 1, generator=generator))]


def resample_from_p(draft: Draft, p: torch.Tensor, generator: torch.Generator) -> list[int]:
    """Broken: the right acceptance test, but a rejection resamples from p instead of max(0, p - q)."""
    out = accept_stochastic(draft, p, generator)
    n = len(out) - 1
    if n == len(draft.tokens):
        return out
    return out[:n] + [int(torch.multinomial(p[n].double(), 1, generator=generator))]


def random_dist(gen: torch.Generator, rows: int) -> torch.Tensor:
    return torch.softmax(torch.randn(rows, V, generator=gen, dtype=torch.float64) * 1.5, -1).float()


def emitted_counts(rule, one_hot: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Counts of the first emitted token, and of the second one after an accepted first draft."""
    gen = torch.Generator().manual_seed(seed)
    p, q = random_dist(gen, 3), random_dist(gen, 2)
    first, second = torch.zeros(V), torch.zeros(V)
    for _ in range(TRIALS):
        if one_hot:  # a deterministic proposal (n-gram style): a likely token, then an unlikely one
            draft = Draft([int(p[0].argmax()), int(p[1].argmin())])
        else:
            draft = Draft(torch.multinomial(q.double(), 1, generator=gen)[:, 0].tolist(), q)
        out = rule(draft, p, gen)
        first[out[0]] += 1
        if len(out) > 1:  # the first draft was accepted
            second[out[1]] += 1
    return first, second, p


@pytest.mark.parametrize("one_hot", [False, True], ids=["sampled-q", "one-hot-q"])
def test_rejection_sampling_keeps_the_target_distribution(one_hot):
    first, second, p = emitted_counts(accept_stochastic, one_hot)
    assert chi2_pvalue(first, p[0]) > 1e-3
    assert second.sum() > 1500 and chi2_pvalue(second, p[1]) > 1e-3


def test_a_batch_is_judged_as_its_sequences_one_by_one():
    """accept_stochastic_rows over sequences with 0..3 drafts, q drawn or one-hot, equals each
    sequence judged alone from the same generator state (the batch's rows back to back)."""
    gen = torch.Generator().manual_seed(4)
    for trial in range(200):
        drafts, ps = [], []
        for b, k in enumerate((3, 0, 2, 1, 3)):
            p = random_dist(gen, k + 1)
            if (b + trial) % 2 and k:
                q = random_dist(gen, k)
                drafts.append(Draft(torch.multinomial(q.double(), 1, generator=gen)[:, 0].tolist(), q))
            else:
                drafts.append(Draft(torch.randint(0, V, (k,), generator=gen).tolist()))
            ps.append(p)
        seeds = [trial * 10 + b for b in range(len(drafts))]
        alone = [accept_stochastic(d, p, torch.Generator().manual_seed(s)) for d, p, s in zip(drafts, ps, seeds)]
        together = accept_stochastic_rows(drafts, torch.cat(ps), [torch.Generator().manual_seed(s) for s in seeds])
        assert together == alone


def test_sequences_with_non_finite_rows_get_no_token():
    """`finite` False on one row of a sequence: if the sequence was judged on that row (it came
    before or at the first rejection) it keeps nothing and gets -1, else its tokens stand; the
    others are judged as without it (each generator gives its uniforms either way)."""
    gen = torch.Generator().manual_seed(9)
    ks = (3, 2, 1)
    drafts = [Draft(torch.randint(0, V, (k,), generator=gen).tolist()) for k in ks]
    p = random_dist(gen, sum(ks) + len(ks))
    def judge(finite: torch.Tensor | None) -> list[list[int]]:
        return accept_stochastic_rows(drafts, p, [torch.Generator().manual_seed(s) for s in (1, 2, 3)], finite)

    plain = judge(None)
    for row in range(p.shape[0]):
        b = next(b for b in range(len(ks)) if row < sum(ks[: b + 1]) + b + 1)
        t = row - (sum(ks[:b]) + b)
        finite = torch.ones(p.shape[0], dtype=torch.bool)
        finite[row] = False
        masked = judge(finite)
        judged = t <= len(plain[b]) - 1  # rows 0..n: the accepted drafts' and the last token's
        assert masked[b] == ([-1] if judged else plain[b])
        assert all(masked[c] == plain[c] for c in range(len(ks)) if c != b)


def per_sequence(rule):
    """The judge's batch rule (`judge_stochastic`: the verdict, each sequence's accepted count then
    its last token) from a per-sequence one, which returns accepted drafts + one token."""
    def rows(drafts: list[Draft], p: torch.Tensor, generators: list[torch.Generator],
             finite: torch.Tensor | None = None, tokens: torch.Tensor | None = None) -> torch.Tensor:
        assert finite is None or bool(finite.all())
        out, start = [], 0
        for draft, generator in zip(drafts, generators):
            out.append(rule(draft, p[start : start + len(draft.tokens) + 1], generator))
            assert out[-1][:-1] == draft.tokens[: len(out[-1]) - 1]
            start += len(draft.tokens) + 1
        return torch.tensor([len(o) - 1 for o in out] + [o[-1] for o in out], device=p.device)
    return rows


@pytest.mark.parametrize("rule", [accept_always, resample_from_p])
def test_broken_acceptance_rules_fail_the_test(rule):
    first, second, p = emitted_counts(rule, one_hot=False)
    assert min(chi2_pvalue(first, p[0]), chi2_pvalue(second, p[1])) < 1e-6


# -- the whole engine ------------------------------------------------------------------------------

# n-gram drafts need repeats, which strong penalties prevent
PARAMS = {
    "mtp": dict(temperature=1.3, top_k=6, repetition_penalty=1.3, presence_penalty=0.4, ignore_eos=True),
    "ngram": dict(temperature=0.6, top_k=3, repetition_penalty=1.02, frequency_penalty=0.05, ignore_eos=True),
}
N_TOKENS = 150


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_target(tmp_path_factory)


def pit_values(hf_model, requests: list[GenerationRequest], tokens: dict[str, list[int]]) -> torch.Tensor:
    """Randomized PIT of every generated token under the exact plain-sampling distribution."""
    sampler, gen = Sampler(), torch.Generator().manual_seed(123)
    values = []
    for request in requests:
        prompt, out = request.prompt_token_ids, tokens[request.request_id]
        with torch.no_grad():
            logits = hf_model(input_ids=torch.tensor([prompt + out]), use_cache=False).logits[0].float()
        rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(out)]
        histories = [TokenHistory(prompt, out[:j]) for j in range(len(out))]
        p = sampler.distribution(rows, [request.sampling] * len(out), histories).double()
        ids = torch.tensor(out)
        below = p.cumsum(-1).gather(1, ids[:, None])[:, 0] - p.gather(1, ids[:, None])[:, 0]
        values.append(below + torch.rand(len(out), generator=gen, dtype=torch.float64) * p.gather(1, ids[:, None])[:, 0])
    return torch.cat(values)


def engine_pvalue(directory, hf_model, spec: str) -> tuple[float, object]:
    llm = load(directory, spec=spec)
    requests = [GenerationRequest(PROMPTS[i % 3], SamplingParams(seed=i, max_tokens=N_TOKENS, **PARAMS[spec]))
                for i in range(4)]
    tokens = run(llm, requests)
    u = pit_values(hf_model, requests, tokens)
    bins = torch.histc(u.float(), bins=10, min=0, max=1)
    return chi2_pvalue(bins, torch.full((10,), 0.1)), llm.stats().spec


@pytest.mark.parametrize("spec", ["mtp", "ngram"])
def test_engine_samples_the_plain_distribution(spec, target):
    pvalue, stats = engine_pvalue(*target, spec=spec)
    assert stats.drafted > 300 and stats.accepted > 0 and stats.rejected > 0, stats
    assert pvalue > 1e-3, (pvalue, stats)


def test_engine_with_broken_acceptance_fails(target, monkeypatch):
    monkeypatch.setattr(speculator, "judge_stochastic", per_sequence(accept_always))
    pvalue, stats = engine_pvalue(*target, spec="mtp")
    assert pvalue < 1e-6, (pvalue, stats)


def test_verify_rows_are_the_exact_target_distributions(target, monkeypatch):
    """Each p_t handed to the acceptance rule equals the plain sampler's distribution for the prefix
    prompt + output + drafts[:t] (transformers logits; penalties count the drafts as generated)."""
    directory, hf_model = target
    seen = []

    def spy(draft, p, generator):
        seen.append((llm.engine.running[0].output_ids[:], draft.tokens, p.clone()))  # output before this round
        return accept_stochastic(draft, p, generator)

    monkeypatch.setattr(speculator, "judge_stochastic", per_sequence(spy))
    llm = load(directory, spec="mtp")
    params = SamplingParams(seed=1, max_tokens=12, **PARAMS["mtp"])
    request = GenerationRequest(PROMPTS[0], params)
    run(llm, [request])
    sampler = Sampler()
    assert len(seen) >= 3 and all(len(d) == 3 for _, d, _ in seen[:3])
    for output, drafts, p in seen:
        for t in range(len(drafts) + 1):
            ids = request.prompt_token_ids + output + drafts[:t]
            with torch.no_grad():
                logits = hf_model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1:].float()
            expected = sampler.distribution(logits, [params], [TokenHistory(request.prompt_token_ids, output + drafts[:t])])
            torch.testing.assert_close(p[t : t + 1], expected, atol=2e-5, rtol=0)

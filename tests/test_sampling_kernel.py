"""The CUDA sampler (csrc/sampling.cu) against the float64 reference (ninfer_core/ops/sampling.py).

CPU tests check the reference wrappers against an independent float64 loop formulation and the
dispatch fallback. `cuda` tests run the kernel on fresh random rows (Gaussian, tied, peaked, flat,
-inf entries, a huge range), each row with its own temperature / top-k / top-p / min-p, through
both of its paths (shared-memory candidates, and the full-vocabulary path forced with
CANDIDATES = 0): the kept set equals the reference's (tokens within 1e-5 of a top-p or min-p
boundary excepted: fp32 near-ties), the filtered distribution matches, greedy rows are the argmax,
a given u draws the reference's inverse-CDF token, a chi-square test over 20k draws matches the
reference distribution and rejects a wrong top-p, the engine's Sampler agrees with the
reference, and the kernel replays inside a CUDA graph. The plain greedy kernel (`greedy`) is checked
against a float64 reference (lowest id of the max; -1 for NaN / +inf / all -inf rows) on every
logits dtype, vocabularies off the vector width, unaligned rows, batches 1-9 and past 65535 rows,
and in CUDA graph replays. Outputs are poisoned first, so every element must be written.
"""

from __future__ import annotations

import math

import pytest
import torch

from ninfer_core.engine.graph_capture import capture
from ninfer_core.engine.sampling import (
    Sampler,
    SamplingParams,
    TokenHistory,
    row_params,
)
from ninfer_core.ops import dispatch
from ninfer_core.ops import sampling as ops
from ninfer_core.ops.sampling import top_k_keep
from test_sampling import GREEDY_DTYPES, GREEDY_KINDS, greedy_rows

DEVICE = torch.device("cuda")
EPS = 1e-5  # near-tie band (fractions of the row mass / of the max probability)
KINDS = ("gauss", "ties", "peaked", "flat", "neginf", "huge")


# ---- inputs and the float64 decision boundaries --------------------------------------------------


def make_logits(kinds: list[str], vocab: int, g: torch.Generator) -> torch.Tensor:
    """One row per kind, float32 on the CPU; every row has a finite max."""
    rows = []
    for kind in kinds:
        x = torch.randn(vocab, generator=g, dtype=torch.float64)
        if kind == "gauss":
            x = x * 2.5
        elif kind == "ties":  # quarter steps: many exact ties, also at the top
            x = (x * 4).round() / 4
        elif kind == "peaked":
            x = x * 2
            x[torch.randint(vocab, (3,), generator=g)] += 25
        elif kind == "flat":
            x = x * 0.05
        elif kind == "neginf":
            x = x * 2
            x[torch.rand(vocab, generator=g) < 0.3] = -math.inf
            x[int(torch.randint(vocab, (), generator=g))] = 1.0
        elif kind == "huge":
            x = x * 60
        rows.append(x.float())
    return torch.stack(rows)


def make_params(rows: int, vocab: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Per-row (temperature, top_k, top_p, min_p), mixing every filter with its neutral value."""
    def pick(choices: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([choices[int(i)] for i in torch.randint(len(choices), (rows,), generator=g)], dtype=dtype)

    return (pick([0.0, 1.0, 0.7, 1.3, 0.5, 2.0, 1e-30], torch.float64),
            pick([0, -1, 1, 2, 5, 20, 100, 1500, vocab - 1, vocab, vocab + 5], torch.long),
            pick([1.0, 0.95, 0.5, 0.8, 0.1, 0.999], torch.float64),
            pick([0.0, 0.0, 0.05, 0.2, 0.001], torch.float64))


def reference(logits: torch.Tensor, temperature, top_k, top_p, min_p) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 probabilities (greedy rows one-hot), `live` (finite mass in float64) and `near`
    (within EPS of a top-p or min-p boundary), all [B, V] on the CPU."""
    x = logits.double().cpu()
    probs = ops.filter_ref(x, temperature.clamp_min(1e-300), top_k, top_p, min_p)
    live = torch.zeros(x.shape, dtype=torch.bool)
    near = torch.zeros(x.shape, dtype=torch.bool)
    for i in range(x.shape[0]):
        if temperature[i] == 0:
            probs[i] = 0
            probs[i, x[i].argmax()] = 1
            live[i] = True
            continue
        z = (x[i] - x[i].max()) / temperature[i]
        live[i] = z > -600
        keep = top_k_keep(z[None], top_k[i : i + 1])[0]
        p = torch.softmax(z.masked_fill(~keep, -math.inf), -1)
        kept = keep
        if top_p[i] < 1:  # mass strictly above each top-k survivor
            ascending, order = torch.sort(z[keep])
            cum = p[keep][order].cumsum(0)
            above = cum[-1] - cum[torch.searchsorted(ascending, z[keep], right=True) - 1]
            near[i, keep] |= (above - top_p[i]).abs() < EPS
            kept = keep.clone()
            kept[keep] = above < top_p[i]
        if min_p[i] > 0:
            near[i] |= kept & ((p / p.max() - min_p[i]).abs() < EPS)
    return probs, live, near


# ---- CPU: the reference wrappers ------------------------------------------------------------------


def loop_distribution(row: list[float], t: float, k: int, top_p: float, min_p: float) -> list[float]:
    """Independent float64 formulation of one row (plain loops)."""
    vocab = len(row)
    if t == 0:
        best = max(range(vocab), key=lambda i: (row[i], -i))
        return [float(i == best) for i in range(vocab)]
    x = [v / t for v in row]
    if 0 < k < vocab:
        kth = sorted(x, reverse=True)[k - 1]
        x = [v if v >= kth else -math.inf for v in x]
    top = max(x)
    probs = [math.exp(v - top) for v in x]
    probs = [q / sum(probs) for q in probs]
    if top_p < 1:
        probs = [q if sum(r for r in probs if r > q) < top_p else 0.0 for q in probs]
    if min_p > 0:
        probs = [q if q >= min_p * max(probs) else 0.0 for q in probs]
    return [q / sum(probs) for q in probs]


def test_reference_matches_float64_loops():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 40, generator=g) * 2
    logits[3, [4, 9, 17]] = logits[3].max() + 1  # a three-way tie at the top
    t = torch.tensor([0.0, 1.0, 0.7, 1.3, 0.9, 0.0], dtype=torch.float64)
    k = torch.tensor([0, 5, 0, 2, 50, 3])
    p = torch.tensor([1.0, 1.0, 0.6, 0.9, 0.95, 0.5], dtype=torch.float64)
    m = torch.tensor([0.0, 0.0, 0.0, 0.1, 0.02, 0.3], dtype=torch.float64)
    u = torch.rand(6, generator=g, dtype=torch.float64)
    probs = ops.filtered_probs_ref(logits, t, k, p, m)
    tokens = ops.sample_ref(logits, t, k, p, m, u)
    for i in range(6):
        want = loop_distribution(logits[i].double().tolist(), float(t[i]), int(k[i]), float(p[i]), float(m[i]))
        torch.testing.assert_close(probs[i].double(), torch.tensor(want, dtype=torch.float64), atol=1e-6, rtol=1e-5)
        if t[i] == 0:
            assert tokens[i] == logits[i].argmax()
        else:
            cdf = torch.tensor(want, dtype=torch.float64).cumsum(0)
            assert tokens[i] == int((cdf <= u[i]).sum())


def test_row_params_fill_neutral_values():
    t, k, p, m = row_params([SamplingParams(), SamplingParams(temperature=0, top_k=20, top_p=0.9, min_p=0.1)])
    assert (t.tolist(), k.tolist(), p.tolist(), m.tolist()) == ([1.0, 0.0], [0, 20], [1.0, 0.9], [0.0, 0.1])
    assert (t.dtype, k.dtype, p.dtype, m.dtype) == (torch.float64, torch.long, torch.float64, torch.float64)


def test_cpu_logits_use_the_reference():
    logits = torch.randn(3, 30)
    params = row_params([SamplingParams(top_k=5), SamplingParams(top_p=0.7), SamplingParams(temperature=0)])
    u = torch.rand(3, dtype=torch.float64)
    assert not ops.use_kernel(logits)
    assert torch.equal(ops.sample(logits, *params, u), ops.sample_ref(logits, *params, u))
    assert torch.equal(ops.filtered_probs(logits, *params), ops.filtered_probs_ref(logits, *params))
    with pytest.raises(RuntimeError, match="kept_threshold"):
        ops.kept_threshold(logits, *params)


def rejected_batch(vocab: int, g: torch.Generator) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor]:
    """Rows 1-4 rejected (NaN, a NaN with its sign bit set, +inf, nothing but -inf), rows 0 and 5
    drawable; greedy and stochastic rows among both kinds."""
    logits = torch.randn(6, vocab, generator=g) * 2
    logits[1, vocab // 3] = math.nan
    logits[2, vocab - 1] = -math.nan
    logits[3, 0] = math.inf
    logits[4] = -math.inf
    assert logits[2, vocab - 1].view(torch.int32) < 0  # the sign bit is set: the smallest order key
    params = row_params([SamplingParams(top_k=5), SamplingParams(temperature=0), SamplingParams(top_k=20, top_p=0.7),
                         SamplingParams(), SamplingParams(temperature=0), SamplingParams(min_p=0.1)])
    return logits, params, torch.rand(6, generator=g, dtype=torch.float64)


def test_rejected_rows_draw_nothing():
    """`sample` gives -1 and `filtered_probs` a zero row for a row holding a NaN (of either sign) or
    +inf, or nothing finite, greedy or not; the batch's other rows come out as they would alone."""
    logits, params, u = rejected_batch(40, torch.Generator().manual_seed(3))
    tokens, probs = ops.sample(logits, *params, u), ops.filtered_probs(logits, *params)
    assert tokens[1:5].tolist() == [-1] * 4 and (probs[1:5] == 0).all()
    good = torch.tensor([0, 5])
    alone = [c[good] for c in params]
    assert torch.equal(tokens[good], ops.sample(logits[good], *alone, u[good])) and (tokens[good] >= 0).all()
    assert torch.equal(probs[good], ops.filtered_probs(logits[good], *alone))


def test_sample_and_probs_are_sample_and_filtered_probs():
    """The drafters' one call: on the CPU the two references (the kernel's: a GPU test below)."""
    g = torch.Generator().manual_seed(17)
    logits = make_logits(["gauss", "peaked", "ties", "neginf"], 300, g)
    params, u = make_params(4, 300, g), torch.rand(4, generator=g, dtype=torch.float64)
    tokens, probs = ops.sample_and_probs(logits, *params, u)
    assert torch.equal(tokens, ops.sample_ref(logits, *params, u))
    assert torch.equal(probs, ops.filtered_probs_ref(logits, *params))


# ---- CUDA: the kernel --------------------------------------------------------------------------------


@pytest.fixture
def kernel(monkeypatch):
    monkeypatch.delenv(dispatch.DISABLE_ENV, raising=False)
    assert dispatch.extension() is not None, "CUDA is available but ninfer_core._C is not built"


@pytest.fixture(params=["candidates", "full"])
def path(request, kernel, monkeypatch):
    """Both kernel paths: shared-memory candidates (default) and the full-vocabulary one."""
    if request.param == "full":
        monkeypatch.setattr(ops, "CANDIDATES", 0)
    return request.param


def run_kernel(logits: torch.Tensor, t, k, p, m, u) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, probs, threshold) from the kernel into poisoned outputs, on the CPU."""
    x = logits.to(DEVICE)
    assert ops.use_kernel(x)
    tokens = torch.full((x.shape[0],), -1, dtype=torch.long, device=DEVICE)
    probs = torch.full(x.shape, math.nan, device=DEVICE)
    threshold = torch.full((x.shape[0],), math.nan, device=DEVICE)
    params = [v.to(DEVICE) for v in (t, k, p, m)]
    assert ops.sample(x, *params, u.to(DEVICE), out=tokens) is tokens
    assert ops.filtered_probs(x, *params, out=probs) is probs
    assert ops.kept_threshold(x, *params, out=threshold) is threshold
    return tokens.cpu(), probs.cpu(), threshold.cpu()


def check_rows(logits: torch.Tensor, t, k, p, m, u) -> int:
    """Every check of one batch; returns how many rows had a near-tie difference (skipped)."""
    tokens, probs, threshold = run_kernel(logits, t, k, p, m, u)
    assert not probs.isnan().any() and not threshold.isnan().any() and (tokens >= 0).all()
    ref, live, near = reference(logits, t, k, p, m)
    skipped = 0
    for i in range(logits.shape[0]):
        row = logits[i]
        if t[i] == 0:
            assert tokens[i] == row.argmax() and threshold[i] == row.max()
            assert torch.equal(probs[i], torch.nn.functional.one_hot(row.argmax(), row.numel()).float())
            continue
        kept = (row >= threshold[i]) & torch.isfinite(row)
        wanted = ref[i] > 0
        same = live[i] & ~near[i]
        assert torch.equal(kept[same], wanted[same]), f"row {i}: kept set differs from the reference"
        if not torch.equal(kept[live[i]], wanted[live[i]]):
            skipped += 1  # a token sits within EPS of a boundary: the masses legitimately differ
            continue
        assert (probs[i][ref[i] == 0] == 0).all()
        torch.testing.assert_close(probs[i].double(), ref[i], atol=1e-7, rtol=1e-4)
        assert wanted[tokens[i]], f"row {i}: drew a token the reference filters out"
        cdf = ref[i].cumsum(0)
        low, high = float(cdf[tokens[i]] - ref[i][tokens[i]]), float(cdf[tokens[i]])
        assert low - EPS <= float(u[i]) <= high + EPS, f"row {i}: u={float(u[i])} outside [{low}, {high}]"
    return skipped


SHAPES = [(8, 1), (16, 7), (24, 50), (12, 1000), (12, 4099), (12, 20000), (6, 248320)]


@pytest.mark.cuda
@pytest.mark.parametrize("rows, vocab", SHAPES, ids=lambda v: str(v))
def test_kernel_matches_reference(path, rows, vocab):
    g = torch.Generator().manual_seed(rows * 100003 + vocab)
    skipped = 0
    for kinds in (KINDS, KINDS[::-1]):
        picked = [kinds[i % len(kinds)] for i in range(rows)]
        if vocab == 248320:  # a flat 248k row leaves no gap of 2 * EPS between boundaries
            picked = [kind if kind != "flat" else "gauss" for kind in picked]
        logits = make_logits(picked, vocab, g)
        skipped += check_rows(logits, *make_params(rows, vocab, g), torch.rand(rows, generator=g, dtype=torch.float64))
    assert skipped <= 1


@pytest.mark.cuda
def test_qwen_defaults_on_a_full_vocabulary(path):
    """Top-k 20 + top-p 0.95 and top-p alone at Qwen3.6's vocabulary, batch 16."""
    g = torch.Generator().manual_seed(7)
    logits = make_logits(["gauss", "peaked", "ties", "neginf"] * 4, 248320, g)
    t = torch.full((16,), 0.7, dtype=torch.float64)
    k = torch.tensor([20] * 8 + [0] * 8)
    p = torch.full((16,), 0.95, dtype=torch.float64)
    assert check_rows(logits, t, k, p, torch.zeros(16, dtype=torch.float64),
                      torch.rand(16, generator=g, dtype=torch.float64)) == 0


@pytest.mark.cuda
@pytest.mark.parametrize("vocab", [40, 4099, 248320])
def test_kernel_rejects_rows_as_the_reference(path, vocab):
    """The kernel's own check of the rows (its first launch's segment maxima): -1, zero probs and a
    NaN threshold where the reference rejects a row, the reference's tokens and probs elsewhere."""
    logits, params, u = rejected_batch(vocab, torch.Generator().manual_seed(vocab))
    tokens, probs, threshold = run_kernel(logits, *params, u)
    assert tokens.tolist() == ops.sample_ref(logits, *params, u).tolist()
    assert tokens[1:5].tolist() == [-1] * 4 and threshold[1:5].isnan().all() and not threshold[[0, 5]].isnan().any()
    torch.testing.assert_close(probs, ops.filtered_probs_ref(logits, *params), atol=1e-7, rtol=1e-4)
    assert (probs[1:5] == 0).all()


@pytest.mark.cuda
def test_sample_and_probs_in_one_launch_equal_the_two_calls(path):
    """One launch with both outputs gives `sample`'s tokens and `filtered_probs`' rows exactly, and
    each token is one its distribution keeps."""
    g = torch.Generator().manual_seed(21)
    vocab = 248320
    logits = make_logits(["gauss", "peaked", "ties", "neginf"] * 2, vocab, g).to(DEVICE)
    params = [v.to(DEVICE) for v in make_params(8, vocab, g)]
    u = torch.rand(8, generator=g, dtype=torch.float64).to(DEVICE)
    tokens, probs = ops.sample_and_probs(logits, *params, u)
    assert torch.equal(tokens, ops.sample(logits, *params, u))
    assert torch.equal(probs, ops.filtered_probs(logits, *params))
    assert (probs.gather(1, tokens[:, None]) > 0).all()


@pytest.mark.cuda
def test_greedy_ties_and_edge_uniforms(path):
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0, -math.inf], [-math.inf, -math.inf, 2.0, 2.0, 2.0],
                           [1.0, 1.0, 1.0, 1.0, 1.0], [0.5, -0.0, 0.0, -1.0, 0.25]] * 3)
    t = torch.tensor([0.0] * 4 + [1.0] * 8, dtype=torch.float64)
    k = torch.tensor([0] * 4 + [2, 2, 2, 3] + [0] * 4)
    u = torch.tensor([0.3] * 4 + [0.0, 0.5, 1 - 2**-53, 0.999] * 2, dtype=torch.float64)
    tokens, probs, _ = run_kernel(logits, t, k, torch.ones(12, dtype=torch.float64), torch.zeros(12, dtype=torch.float64), u)
    assert tokens[:4].tolist() == [1, 2, 0, 0]  # lowest id among the tied maxima
    assert tokens[4:].tolist() == ops.sample_ref(logits[4:], t[4:], k[4:], torch.ones(8), torch.zeros(8), u[4:]).tolist()
    # row 7, top-k 3: the 3rd largest is 0.0, and -0.0 ties with it
    assert (probs[7] > 0).tolist() == [True, True, True, False, True]


def chi2_pvalue(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson goodness of fit; cells expected < 5 pooled; a draw where p = 0 gives 0."""
    if counts[expected == 0].any():
        return 0.0
    e = expected.double() * counts.sum()
    small = e < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    exp = torch.cat([e[~small], e[small].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    return float(torch.special.gammaincc(torch.tensor((int(keep.sum()) - 1) / 2, dtype=torch.float64), stat / 2))


@pytest.mark.cuda
def test_draws_follow_the_reference_distribution(path):
    g = torch.Generator().manual_seed(11)
    vocab, n = 50, 20000
    logits = torch.randn(1, vocab, generator=g) * 1.5
    t, k, p, m = (torch.tensor([0.8], dtype=torch.float64), torch.tensor([30]), torch.tensor([0.9], dtype=torch.float64),
                  torch.tensor([0.01], dtype=torch.float64))
    expected = reference(logits, t, k, p, m)[0][0]
    assert 5 <= int((expected > 0).sum()) < 30  # the filters really cut
    rows = logits.expand(n, -1).to(DEVICE)
    u = torch.rand(n, dtype=torch.float64, generator=torch.Generator(DEVICE).manual_seed(3), device=DEVICE)
    tokens = ops.sample(rows, *(v.expand(n).to(DEVICE) for v in (t, k, p, m)), u)
    counts = torch.bincount(tokens.cpu(), minlength=vocab)
    assert chi2_pvalue(counts, expected) > 1e-3
    # top-p off by 0.02 either way (two tokens fewer / more) and no filter at all are rejected
    for wrong_p in (0.88, 0.92):
        wrong = reference(logits, t, k, torch.tensor([wrong_p], dtype=torch.float64), m)[0][0]
        assert not torch.equal(wrong > 0, expected > 0)
        assert chi2_pvalue(counts, wrong) < 1e-6
    unfiltered = reference(logits, t, torch.tensor([0]), torch.tensor([1.0]), torch.tensor([0.0]))[0][0]
    assert chi2_pvalue(counts, unfiltered) < 1e-6


@pytest.mark.cuda
def test_sampler_on_cuda_matches_the_reference_sampler(kernel, monkeypatch):
    """Sampler.sample / distribution through the kernel agree with the reference on the GPU, and a
    seeded row draws the same tokens whatever shares its batch."""
    params = [SamplingParams(seed=1), SamplingParams(temperature=0.7, seed=2),
              SamplingParams(temperature=1.3, top_k=5, seed=3), SamplingParams(temperature=0.9, top_p=0.8, seed=4),
              SamplingParams(temperature=0.8, min_p=0.1, seed=5),
              SamplingParams(temperature=0.6, top_k=20, top_p=0.95, min_p=0.05, repetition_penalty=1.2,
                             presence_penalty=1.5, seed=6),
              SamplingParams(temperature=0, repetition_penalty=1.5), SamplingParams(temperature=1e-4, top_k=-1, seed=8)]
    histories = [TokenHistory([i, i + 1, 40], [i + 2, i + 2, 41]) for i in range(len(params))]
    logits = (torch.randn(len(params), 151936, generator=torch.Generator().manual_seed(9)) * 3).to(DEVICE)

    def draw(rows: list[int]) -> list[int]:
        gens = [params[i].make_generator(DEVICE) if not params[i].is_greedy else None for i in rows]
        out = Sampler().sample(logits[rows], [params[i] for i in rows], [histories[i] for i in rows], gens)
        return out.tolist()

    everything = list(range(len(params)))
    kernel_tokens = draw(everything)
    kernel_probs = Sampler().distribution(logits, params, histories).cpu()
    assert draw([5]) == [kernel_tokens[5]] and draw([3, 5, 0]) == [kernel_tokens[i] for i in (3, 5, 0)]
    monkeypatch.setenv(dispatch.DISABLE_ENV, "1")
    assert draw(everything) == kernel_tokens
    torch.testing.assert_close(kernel_probs, Sampler().distribution(logits, params, histories).cpu(),
                               atol=1e-7, rtol=1e-4)


@pytest.mark.cuda
def test_unsupported_inputs_fall_back_to_the_reference(kernel):
    logits = torch.randn(3, 64, device=DEVICE).bfloat16()
    params = [v.to(DEVICE) for v in row_params([SamplingParams(top_k=4), SamplingParams(top_p=0.5),
                                                 SamplingParams(temperature=0)])]
    u = torch.rand(3, dtype=torch.float64, device=DEVICE)
    assert not ops.use_kernel(logits)
    assert torch.equal(ops.sample(logits, *params, u), ops.sample_ref(logits, *params, u))


@pytest.mark.cuda
def test_kernel_replays_in_cuda_graph(kernel):
    """Everything on the device beforehand: the wrapper then only launches on torch's stream."""
    g = torch.Generator().manual_seed(13)
    rows, vocab = 8, 248320
    logits = make_logits(["gauss", "peaked"] * 4, vocab, g).to(DEVICE)
    t = torch.tensor([0.7, 1.0, 0.0, 0.6] * 2, dtype=torch.float64, device=DEVICE)
    k = torch.tensor([20, 0, 0, 1500] * 2, device=DEVICE)
    p = torch.tensor([0.95, 0.9, 1.0, 0.8] * 2, dtype=torch.float64, device=DEVICE)
    m = torch.tensor([0.0, 0.05, 0.0, 0.0] * 2, dtype=torch.float64, device=DEVICE)
    u = torch.rand(rows, dtype=torch.float64, device=DEVICE)
    tokens = torch.empty(rows, dtype=torch.long, device=DEVICE)
    probs = torch.empty(rows, vocab, device=DEVICE)

    def both() -> None:
        ops.sample(logits, t, k, p, m, u, out=tokens)
        ops.filtered_probs(logits, t, k, p, m, out=probs)

    graph, _ = capture(both)
    for seed in (1, 2):
        logits.copy_(make_logits(["peaked", "gauss"] * 4, vocab, torch.Generator().manual_seed(seed)).to(DEVICE))
        u.copy_(torch.rand(rows, dtype=torch.float64, device=DEVICE))
        tokens.fill_(-1)
        probs.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(tokens, ops.sample(logits, t, k, p, m, u))
        assert torch.equal(probs, ops.filtered_probs(logits, t, k, p, m))
        torch.testing.assert_close(probs.cpu().double(), reference(logits.cpu(), t.cpu(), k.cpu(), p.cpu(), m.cpu())[0],
                                   atol=1e-7, rtol=1e-4)


# ---- CUDA: the plain greedy kernel -------------------------------------------------------------------

def greedy_logits(rows: int, vocab: int, dtype: torch.dtype, g: torch.Generator, kinds=GREEDY_KINDS) -> torch.Tensor:
    """[rows, vocab] in `dtype` on the CPU, the kinds in turn (test_sampling.py's rows)."""
    return greedy_rows([kinds[r % len(kinds)] for r in range(rows)], vocab, dtype, g)


def greedy_expected(logits: torch.Tensor) -> list[int]:
    """float64 per row, no argmax: -1 for NaN / +inf / no finite value, else the first id of the max."""
    x = logits.double().cpu()
    tokens = []
    for row in x:
        if bool(row.isnan().any()) or bool((row == math.inf).any()) or bool((row == -math.inf).all()):
            tokens.append(-1)
        else:
            tokens.append(int((row == row.max()).nonzero()[0, 0]))
    return tokens


def run_greedy(logits: torch.Tensor) -> torch.Tensor:
    """The kernel's tokens for CPU logits, into a poisoned output."""
    x = logits.to(DEVICE)
    out = torch.full((x.shape[0],), 12345, dtype=torch.long, device=DEVICE)
    assert ops.greedy(x, out=out) is out
    return out.cpu()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", GREEDY_DTYPES, ids=str)
@pytest.mark.parametrize("vocab", [1, 7, 1000, 4099, 151936, 248320])
def test_greedy_kernel_matches_reference(kernel, dtype, vocab):
    g = torch.Generator().manual_seed(vocab)
    for rows in range(1, 10) if vocab < 100000 else (1, 2, 8, 9):  # full vocabularies: fewer batches
        logits = greedy_logits(rows + len(GREEDY_KINDS) * (rows == 9), vocab, dtype, g)  # 9: every kind once more
        tokens = run_greedy(logits)
        assert tokens.tolist() == greedy_expected(logits), f"rows={rows}"
        assert torch.equal(tokens, ops.greedy_ref(logits.to(DEVICE)).cpu())  # torch's argmax on the GPU agrees
        kinds = GREEDY_KINDS[::-1]  # the same rows at a batch where the row holds another kind
        logits = greedy_logits(rows, vocab, dtype, g, kinds)
        assert run_greedy(logits).tolist() == greedy_expected(logits), f"rows={rows}, reversed kinds"


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", GREEDY_DTYPES, ids=str)
def test_greedy_kernel_on_unaligned_rows_and_extreme_batches(kernel, dtype):
    """Rows that start off a 16-byte boundary (the element-wise path), a max in every position of a
    short row, and more rows than a grid's second dimension holds (65535)."""
    g = torch.Generator().manual_seed(3)
    for vocab in (8, 1000, 248320):
        flat = greedy_logits(4, vocab, dtype, g).reshape(-1)
        shifted = torch.cat([flat[:1], flat]).to(DEVICE)[1:].view(4, vocab)  # 1 element off alignment
        assert shifted.data_ptr() % 16 != 0 and shifted.is_contiguous()
        out = torch.full((4,), 12345, dtype=torch.long, device=DEVICE)
        assert ops.greedy(shifted, out=out).tolist() == greedy_expected(shifted)
    vocab = 37
    eye = torch.eye(vocab, dtype=dtype) - 1  # row i: 0 at id i, -1 elsewhere
    assert run_greedy(eye).tolist() == list(range(vocab))
    many = torch.randn(70000, 5, generator=g).to(dtype)
    many[12345, :] = math.nan
    want = many.double().argmax(-1)
    want[12345] = -1
    assert torch.equal(run_greedy(many), want)


@pytest.mark.cuda
def test_greedy_kernel_after_other_shapes_and_on_the_sampler_path(kernel):
    """The per-row counters return to 0 after every launch: calls of varying batch and vocabulary
    back to back (and one with logits of several dtypes) stay exact; the engine's Sampler takes it."""
    g = torch.Generator().manual_seed(21)
    for rows, vocab, dtype in [(1, 248320, torch.bfloat16), (8, 248320, torch.float32), (3, 1000, torch.float16),
                               (1, 248320, torch.bfloat16), (9, 151936, torch.bfloat16), (2, 7, torch.float32),
                               (1, 248320, torch.float16)] * 2:
        logits = greedy_logits(rows, vocab, dtype, g, ("gauss", "ties", "nan", "neginf_mix", "last"))
        assert run_greedy(logits).tolist() == greedy_expected(logits)
    logits = greedy_logits(5, 248320, torch.bfloat16, g, ("gauss", "ties", "posinf", "all_neginf", "flat")).to(DEVICE)
    got = Sampler().sample(logits, [SamplingParams(temperature=0)] * 5, [TokenHistory([])] * 5, [None] * 5)
    assert got.tolist() == greedy_expected(logits)
    wide = greedy_logits(3, 1000, torch.float64, g).to(DEVICE)  # no kernel for fp64: torch's argmax, no error
    assert ops.greedy(wide).tolist() == greedy_expected(wide)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_greedy_kernel_replays_in_cuda_graph(kernel, dtype):
    """Replays re-use the counters the last launch reset; eager calls between replays too."""
    g = torch.Generator().manual_seed(17)
    rows, vocab = 3, 248320
    logits = greedy_logits(rows, vocab, dtype, g, ("gauss", "ties", "nan")).to(DEVICE)
    tokens = torch.empty(rows, dtype=torch.long, device=DEVICE)
    graph, _ = capture(lambda: ops.greedy(logits, out=tokens))
    for step, kinds in enumerate([("ties", "gauss", "last"), ("posinf", "flat", "neginf_mix"),
                                  ("gauss", "all_neginf", "ties"), ("last", "last", "gauss")]):
        logits.copy_(greedy_logits(rows, vocab, dtype, g, kinds).to(DEVICE))
        tokens.fill_(12345)
        graph.replay()
        torch.cuda.synchronize()
        assert tokens.tolist() == greedy_expected(logits), f"replay {step}"
        if step % 2:  # an eager call on the same workspace between replays
            assert ops.greedy(logits[:2]).tolist() == greedy_expected(logits[:2])

"""Sampler tests: every transform against a float64 loop reference (and HF's logits processors),
the tie rule at each filter's boundary, seeded reproducibility, and a chi-square check on draws
that is shown to reject a wrong distribution; the plain greedy reference against loops, and the
greedy kernel's binding checks on CPU tensors (where ninfer_core._C is built)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ninfer_core.config import GenerationDefaults
from ninfer_core.engine.sampling import (
    Sampler,
    SamplingParamError,
    SamplingParams,
    TokenHistory,
    apply_penalties,
    draw_from_probs,
    min_p_keep,
    plain_greedy,
    top_k_keep,
    top_p_keep,
)
from ninfer_core.engine import sampling
from ninfer_core.errors import NinferError
from ninfer_core.ops import sampling as sampling_ops

# ---- independent float64 reference: one row, plain loops -------------------------------------------


def ref_distribution(logits: np.ndarray, p: SamplingParams, prompt: list[int], output: list[int]) -> np.ndarray:
    x = [float(v) for v in logits]
    vocab = len(x)
    rep = p.repetition_penalty if p.repetition_penalty is not None else 1.0
    for t in set(prompt) | set(output):
        x[t] = x[t] * rep if x[t] < 0 else x[t] / rep
    for t in set(output):
        x[t] -= (p.frequency_penalty or 0.0) * output.count(t) + (p.presence_penalty or 0.0)
    if p.temperature == 0:
        best = max(range(vocab), key=lambda i: (x[i], -i))  # largest value, lowest id
        return np.eye(vocab)[best]
    temperature = 1.0 if p.temperature is None else p.temperature
    x = [v / temperature for v in x]
    if p.top_k and 0 < p.top_k < vocab:
        kth = sorted(x, reverse=True)[p.top_k - 1]
        x = [v if v >= kth else -math.inf for v in x]
    top = max(x)
    probs = [math.exp(v - top) for v in x]
    probs = [q / sum(probs) for q in probs]
    if p.top_p is not None and p.top_p < 1:
        probs = [q if sum(r for r in probs if r > q) < p.top_p else 0.0 for q in probs]
    if p.min_p:
        probs = [q if q >= p.min_p * max(probs) else 0.0 for q in probs]
    return np.array(probs) / sum(probs)


def run(params: list[SamplingParams], logits: torch.Tensor, histories: list[TokenHistory] | None = None):
    histories = histories or [TokenHistory([]) for _ in params]
    return Sampler().distribution(logits, params, histories)


# ---- SamplingParams ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"seed": 2**64}, "seed"),
        ({"seed": "7"}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": "###"}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
        # values the batched step turns into tensors: refused when the request is made
        ({"top_k": 2**63}, "top_k"),
        ({"max_tokens": 2**63}, "max_tokens"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),
        ({"stop_token_ids": [2**31]}, "stop_token_ids"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"logit_bias": {-1: 1}}, "logit_bias"),
        ({"logit_bias": {5: math.nan}}, "logit_bias"),
    ],
)
def test_params_reject_out_of_range(kwargs, fragment):
    with pytest.raises(NinferError, match=fragment):
        SamplingParams(**kwargs)


def test_params_accept_edges():
    SamplingParams(temperature=0, top_k=10**9, top_p=1.0, min_p=0.0, presence_penalty=-2, frequency_penalty=2,
                   repetition_penalty=0.5, seed=-(2**63), max_tokens=1, stop=["\n\n"], stop_token_ids=[0])
    SamplingParams(top_k=0)
    SamplingParams(top_k=-1)
    SamplingParams(top_k=2**63 - 1, max_tokens=2**63 - 1, seed=2**64 - 1, logit_bias={0: -100, 2**31 - 1: 100})


def test_param_errors_name_their_field_and_the_vocabulary_check():
    with pytest.raises(SamplingParamError) as err:
        SamplingParams(top_p=2.0)
    assert err.value.field == "top_p"
    SamplingParams(logit_bias={7: 1.0}).check_vocabulary(8)
    with pytest.raises(SamplingParamError, match=r"token id 8, outside the vocabulary \[0, 8\)") as err:
        SamplingParams(logit_bias={8: 1.0}).check_vocabulary(8)
    assert err.value.field == "logit_bias"


def test_logit_bias_is_added_before_temperature_and_greedy():
    logits = torch.zeros(2, 8)
    params = [SamplingParams(temperature=0.5, logit_bias={3: 2.0, 5: -100.0}),
              SamplingParams(temperature=0, logit_bias={6: 0.5})]
    dist = run(params, logits)
    want = torch.softmax(torch.tensor([0, 0, 0, 2.0, 0, -100.0, 0, 0]) / 0.5, -1)
    torch.testing.assert_close(dist[0], want)
    assert dist[1].argmax() == 6 and dist[1].max() == 1  # greedy: the argmax of the biased logits


def test_with_defaults_user_values_win(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "presence_penalty": 1.5,
         "eos_token_id": [1, 2]}))
    defaults = GenerationDefaults.from_model_dir(tmp_path)
    got = SamplingParams(temperature=0.2, top_p=1.0, seed=3).with_defaults(defaults)
    assert (got.temperature, got.top_k, got.top_p, got.presence_penalty) == (0.2, 20, 1.0, 1.5)
    assert got.min_p is None and got.frequency_penalty is None and got.seed == 3

    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.7}))
    assert SamplingParams().with_defaults(GenerationDefaults.from_model_dir(tmp_path)).is_greedy
    assert not SamplingParams(temperature=1.0).with_defaults(GenerationDefaults.from_model_dir(tmp_path)).is_greedy


def test_with_defaults_names_generation_config_on_bad_default():
    with pytest.raises(NinferError, match=r"top_p.*generation_config"):
        SamplingParams().with_defaults(GenerationDefaults(top_p=1.5))


def test_seeded_generators_match_and_negative_seeds_wrap():
    a, b = SamplingParams(seed=5).make_generator(), SamplingParams(seed=5).make_generator()
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
    c, d = SamplingParams(seed=-1).make_generator(), SamplingParams(seed=2**64 - 1).make_generator()
    assert torch.equal(torch.rand(4, generator=c), torch.rand(4, generator=d))


# ---- penalties --------------------------------------------------------------------------------------


def test_repetition_penalty_matches_hf():
    torch.manual_seed(0)
    logits = torch.randn(3, 40) * 3
    prompts = [[1, 5, 5, 9], [0, 39], []]
    outputs = [[9, 9, 12], [], [7, 7, 7, 3]]
    penalties = [1.3, 0.7, 2.0]
    params = [SamplingParams(repetition_penalty=r, temperature=0) for r in penalties]
    histories = [TokenHistory(p, o) for p, o in zip(prompts, outputs)]
    ours = apply_penalties(logits, params, histories)
    for row, (pr, out, r) in enumerate(zip(prompts, outputs, penalties)):
        ids = torch.tensor([pr + out]) if pr + out else torch.zeros(1, 0, dtype=torch.long)
        hf = RepetitionPenaltyLogitsProcessor(penalty=r)(ids, logits[row : row + 1].clone())
        torch.testing.assert_close(ours[row], hf[0], rtol=1e-6, atol=1e-6)
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[[1, 5, 9, 12]] = False
    assert torch.equal(ours[0, untouched], logits[0, untouched])


def test_penalties_match_float64_reference_and_use_output_only_for_presence():
    torch.manual_seed(1)
    logits = torch.randn(2, 30) * 2
    p = SamplingParams(repetition_penalty=1.2, presence_penalty=0.8, frequency_penalty=0.3, temperature=0)
    histories = [TokenHistory([4, 4, 6], [6, 8, 8, 8]), TokenHistory([2], [])]
    ours = apply_penalties(logits, [p, p], histories)
    for row, h in enumerate(histories):
        x = logits[row].double().tolist()
        for t in set(h.prompt_ids) | set(h.output_ids):
            x[t] = x[t] * 1.2 if x[t] < 0 else x[t] / 1.2
        for t in set(h.output_ids):
            x[t] -= 0.3 * list(h.output_ids).count(t) + 0.8
        np.testing.assert_allclose(ours[row].double().numpy(), x, rtol=1e-6, atol=1e-6)
    # token 4 is only in the prompt: repetition penalty yes, presence / frequency no
    rep_only = apply_penalties(logits, [SamplingParams(repetition_penalty=1.2)], histories[:1])
    assert ours[0, 4] == rep_only[0, 4]
    assert ours[0, 8] < rep_only[0, 8]


def test_history_ids_outside_vocab_are_rejected():
    with pytest.raises(NinferError, match="row 0.*vocabulary"):
        run([SamplingParams(repetition_penalty=1.1)], torch.zeros(1, 8), [TokenHistory([3, 8])])


# ---- filters: masks and the tie rule -----------------------------------------------------------------


def test_top_k_mask_matches_reference_and_hf():
    torch.manual_seed(2)
    logits = torch.randn(5, 64)
    ks = torch.tensor([1, 7, 0, 64, 500])
    keep = top_k_keep(logits, ks)
    for row, k in enumerate(ks.tolist()):
        if 0 < k < 64:
            kth = sorted(logits[row].tolist(), reverse=True)[k - 1]
            want = [v >= kth for v in logits[row].tolist()]
            hf = TopKLogitsWarper(top_k=k)(None, logits[row : row + 1]) > -math.inf
            assert torch.equal(hf[0], keep[row])
        else:
            want = [True] * 64
        assert keep[row].tolist() == want


def test_top_k_keeps_every_token_tied_at_the_kth_value():
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0], [2.0, 1.0, 1.0, 1.0, 0.0]])
    keep = top_k_keep(logits, torch.tensor([2, 1]))
    assert keep.tolist() == [[True, True, True, True, False], [True, False, False, False, False]]


def test_top_p_mask_matches_reference_and_hf():
    torch.manual_seed(3)
    probs = torch.softmax(torch.randn(4, 50, dtype=torch.float64) * 2, -1)
    ps = torch.tensor([0.3, 0.9, 0.999, 1.0], dtype=torch.float64)
    keep = top_p_keep(probs, ps)
    for row, p in enumerate(ps.tolist()):
        q = probs[row].tolist()
        want = [sum(r for r in q if r > v) < p for v in q]
        assert keep[row].tolist() == want
        hf = TopPLogitsWarper(top_p=p)(None, probs[row : row + 1].log()) > -math.inf
        assert torch.equal(hf[0], keep[row])


def test_top_p_tie_rule_is_inclusive_and_boundary_is_exact():
    probs = torch.tensor([[0.5, 0.25, 0.125, 0.125]] * 4, dtype=torch.float64)
    keep = top_p_keep(probs, torch.tensor([0.5, 0.75, 0.76, 0.25], dtype=torch.float64))
    # mass strictly above a token must be < top_p: 0.5 reaches 0.5 exactly, so token 1 is out
    assert keep.tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [True, True, True, True],  # the boundary falls inside the 0.125 tie: both kept
        [True, False, False, False],
    ]
    assert torch.equal(top_p_keep(probs * 2, torch.tensor([0.5, 0.75, 0.76, 0.25], dtype=torch.float64)), keep)
    # through the full pipeline: logits [2, 1, 1, 1, 0] -> p ~ [.447, .164 x3, .060]; top_p 0.5
    # lands on the first of three tied tokens, and all three are kept
    dist = run([SamplingParams(top_p=0.5)], torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0]]))
    assert (dist[0] > 0).tolist() == [True, True, True, True, False]


def test_top_p_sorts_only_the_surviving_candidates():
    probs = torch.zeros(2, 1000, dtype=torch.float64)
    probs[0, [10, 500, 999]] = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    probs[1, [3, 4]] = 0.5
    assert top_p_keep(probs, torch.tensor([0.6, 0.4], dtype=torch.float64)).nonzero().tolist() == [
        [0, 500], [0, 999], [1, 3], [1, 4]]


def test_min_p_mask_matches_reference_hf_and_tie_rule():
    torch.manual_seed(4)
    probs = torch.softmax(torch.randn(3, 40, dtype=torch.float64) * 2, -1)
    ms = torch.tensor([0.0, 0.05, 0.4], dtype=torch.float64)
    keep = min_p_keep(probs, ms)
    for row, m in enumerate(ms.tolist()):
        q = probs[row].tolist()
        assert keep[row].tolist() == [v >= m * max(q) for v in q]
        if m > 0:
            hf = MinPLogitsWarper(min_p=m)(None, probs[row : row + 1].log()) > -math.inf
            assert torch.equal(hf[0], keep[row])
    exact = torch.tensor([[0.5, 0.25, 0.125, 0.125]], dtype=torch.float64)
    assert min_p_keep(exact, torch.tensor([0.5], dtype=torch.float64)).tolist() == [[True, True, False, False]]


# ---- the composed distribution ------------------------------------------------------------------------

MIXED = [
    SamplingParams(),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=0.9, top_p=0.8),
    SamplingParams(temperature=0.8, min_p=0.1),
    SamplingParams(temperature=0.6, top_k=20, top_p=0.95, min_p=0.05, repetition_penalty=1.2,
                   presence_penalty=1.5, frequency_penalty=0.4),
    SamplingParams(temperature=0, repetition_penalty=1.5),
    SamplingParams(temperature=1e-4, top_k=-1),
]


def test_distribution_matches_float64_reference():
    torch.manual_seed(5)
    logits = torch.randn(len(MIXED), 64) * 3
    histories = [TokenHistory([i, i + 1, 40], [i + 2, i + 2, 41]) for i in range(len(MIXED))]
    dist = run(MIXED, logits, histories)
    assert dist.dtype == torch.float32
    for row, (p, h) in enumerate(zip(MIXED, histories)):
        want = ref_distribution(logits[row].numpy(), p, list(h.prompt_ids), list(h.output_ids))
        np.testing.assert_allclose(dist[row].double().numpy(), want, atol=1e-6, rtol=1e-5)
        assert torch.equal(dist[row] == 0, torch.from_numpy(want == 0))  # masked tokens exactly 0
        single = run([p], logits[row : row + 1], [h])  # a row does not depend on its neighbours
        assert torch.equal(single[0], dist[row])


def test_tiny_temperature_is_near_greedy_without_nan():
    logits = torch.tensor([[3.0, -2.0, 2.5, 0.0]])
    dist = run([SamplingParams(temperature=1e-310)], logits)  # logits / T alone would be inf - inf
    assert dist.tolist() == [[1.0, 0.0, 0.0, 0.0]]


def test_distribution_matches_hf_processor_chain():
    torch.manual_seed(6)
    logits = torch.randn(4, 100) * 2.5
    prompt = [3, 3, 17, 64]
    for row in range(4):
        chain = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.1), TemperatureLogitsWarper(0.7),
                                     TopKLogitsWarper(30), TopPLogitsWarper(0.9), MinPLogitsWarper(0.02)])
        hf = torch.softmax(chain(torch.tensor([prompt]), logits[row : row + 1].clone()), -1)[0]
        p = SamplingParams(repetition_penalty=1.1, temperature=0.7, top_k=30, top_p=0.9, min_p=0.02)
        ours = run([p], logits[row : row + 1], [TokenHistory(prompt)])[0]
        torch.testing.assert_close(ours, hf, atol=1e-6, rtol=1e-5)
        assert torch.equal(ours > 0, hf > 0)


# ---- drawing ------------------------------------------------------------------------------------------


def test_greedy_is_argmax_of_penalised_logits_and_uses_no_randomness():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [0.0, 3.0, 2.9, 1.0]])
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, repetition_penalty=1.5)]
    histories = [TokenHistory([]), TokenHistory([1])]
    g = torch.Generator().manual_seed(0)
    state = g.get_state()
    tokens = Sampler().sample(logits, params, histories, [g, g])
    assert tokens.tolist() == [1, 2]  # row 0: tie -> lowest id; row 1: 3/1.5 = 2 < 2.9
    assert torch.equal(g.get_state(), state)
    torch.manual_seed(7)
    big = torch.randn(6, 1000)
    assert torch.equal(Sampler().sample(big, [SamplingParams(temperature=0)] * 6, [TokenHistory([])] * 6,
                                        [None] * 6), big.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_plain_greedy_rows_take_the_argmax_in_their_dtype_as_the_sampler_would(monkeypatch, dtype):
    """Greedy rows without penalties or logit bias skip the sampler's fp32 path: the same tokens as
    that path (the lowest id on ties, -1 for NaN / +inf / all -inf rows) on logits of any float dtype,
    and none of its row-parameter tensors or draws."""
    torch.manual_seed(11)
    logits = torch.randn(7, 300).to(dtype)
    logits[1, [5, 9]] = logits[1].max() + 1  # a tie: id 5
    logits[2, 17] = float("nan")
    logits[3, 4] = float("inf")
    logits[4] = float("-inf")
    logits[5, :] = 0.0  # all tied: id 0
    logits[6, 3], logits[6, 8] = float("inf"), float("nan")  # +inf before a NaN
    greedy = [SamplingParams(temperature=0)] * 7
    want = Sampler().sample(logits.float(), greedy[:6] + [SamplingParams(temperature=0, logit_bias={0: 0.0})],
                            [TokenHistory([])] * 7, [None] * 7)  # a logit bias keeps the general path
    monkeypatch.setattr(sampling, "row_params", lambda params: pytest.fail("the general path ran"))
    got = Sampler().sample(logits, greedy, [TokenHistory([])] * 7, [None] * 7)
    assert got.dtype == torch.long and got.tolist() == want.tolist()
    assert got.tolist()[1:] == [5, -1, -1, -1, 0, -1]
    assert plain_greedy(greedy) and not plain_greedy([SamplingParams(temperature=0, presence_penalty=0.5)])
    assert not plain_greedy([SamplingParams(temperature=0.7)])


GREEDY_KINDS = ("gauss", "ties", "nan", "posinf", "all_neginf", "neginf_mix", "nan_and_posinf", "signed_zeros",
                "lowest", "largest", "last", "first_nan", "flat")


def greedy_rows(kinds: list[str], vocab: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """One row of logits [len(kinds), vocab] in `dtype` per kind (the special values at random ids)."""
    info = torch.finfo(dtype)
    rows = []
    for kind in kinds:
        x = torch.randn(vocab, generator=g, dtype=torch.float64) * 3

        def at() -> int:
            return int(torch.randint(vocab, (), generator=g))

        if kind == "ties":  # quarter steps: ties everywhere, and two ids share a new max
            x = (x * 4).round() / 4
            x[[at(), at()]] = float(x.max()) + 1
        elif kind == "nan":
            x[at()] = math.nan
        elif kind == "posinf":
            x[at()] = math.inf
        elif kind == "all_neginf":
            x[:] = -math.inf
        elif kind == "neginf_mix":  # about half -inf, the rest finite
            x[torch.rand(vocab, generator=g) < 0.5] = -math.inf
        elif kind == "nan_and_posinf":
            x[at()], x[at()] = math.inf, math.nan
        elif kind == "signed_zeros":  # -0.0 ties +0.0: the lowest id wins
            x = torch.where(torch.rand(vocab, generator=g) < 0.5, 0.0, -0.0).double() - (x.abs() > 2).double()
        elif kind == "lowest":  # the most negative finite value everywhere, -inf in front
            x[:] = info.min
            x[0] = -math.inf
        elif kind == "largest":  # the largest finite value is a token, not a rejection
            x[at()] = info.max
        elif kind == "last":  # the max in the very last id (past the last full vector)
            x[-1] = float(x.max()) + 1
        elif kind == "first_nan":
            x[0] = math.nan
        elif kind == "flat":  # every id tied
            x[:] = 0.5
        rows.append(x.to(dtype))
    return torch.stack(rows)


def loop_greedy(row: list[float]) -> int:
    """Plain loops: -1 for NaN / +inf anywhere or no finite value, else the first id of the max."""
    if any(math.isnan(v) or v == math.inf for v in row):
        return -1
    best = max(row)
    return -1 if best == -math.inf else row.index(best)  # index(): the first id that == best (-0.0 == 0.0)


GREEDY_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", GREEDY_DTYPES, ids=str)
@pytest.mark.parametrize("vocab", [1, 7, 1000, 4099])
def test_greedy_ref_matches_loops(dtype, vocab):
    g = torch.Generator().manual_seed(vocab)
    kinds = list(GREEDY_KINDS) + ["gauss"] * 3
    logits = greedy_rows(kinds, vocab, dtype, g)
    want = [loop_greedy(row) for row in logits.double().tolist()]
    got = sampling_ops.greedy_ref(logits)
    assert got.dtype == torch.long and got.tolist() == want
    assert torch.equal(sampling_ops.greedy(logits), got)  # CPU: the reference
    out = torch.full((len(kinds),), 12345, dtype=torch.long)
    assert sampling_ops.greedy(logits, out=out) is out and torch.equal(out, got)
    if vocab > 1:  # a non-contiguous view too
        wide = torch.cat([logits, logits], dim=1)[:, :vocab]
        assert torch.equal(sampling_ops.greedy(wide), got)


def test_greedy_ref_on_a_full_vocabulary():
    g = torch.Generator().manual_seed(5)
    logits = greedy_rows(["gauss", "ties", "last", "neginf_mix"], 248320, torch.bfloat16, g)
    want = [loop_greedy(row) for row in logits.double().tolist()]
    assert sampling_ops.greedy_ref(logits).tolist() == want and min(want) >= 0
    assert sampling_ops.greedy_ref(logits[:0]).shape == (0,)


@pytest.fixture
def greedy_binding():
    ext = sampling_ops.dispatch.extension()
    if ext is None:
        pytest.skip("ninfer_core._C is not built")
    return ext


def _greedy_kwargs(rows: int = 3, vocab: int = 100, dtype: torch.dtype = torch.bfloat16) -> dict:
    return dict(tokens=torch.empty(rows, dtype=torch.long), logits=torch.randn(rows, vocab).to(dtype),
                partials=torch.empty(rows * sampling_ops.GREEDY_MAX_CHUNKS, dtype=torch.long),
                counters=torch.zeros(rows, dtype=torch.int32), stream=0)


GREEDY_REJECTS = [
    ("logits is float64, expected float32 or float16 or bfloat16", lambda kw: {"logits": kw["logits"].double()}),
    ("logits is int64, expected float32", lambda kw: {"logits": kw["logits"].long()}),
    ("logits must be contiguous", lambda kw: {"logits": torch.randn(100, 3).t()}),
    (r"logits has shape \(300,\), expected \(\*, \*\)", lambda kw: {"logits": kw["logits"].reshape(-1)}),
    (r"logits has shape \(3, 0\), out of the kernel's range", lambda kw: {"logits": kw["logits"][:, :0]}),
    ("tokens is int32, expected int64", lambda kw: {"tokens": kw["tokens"].int()}),
    (r"tokens has shape \(2,\), expected \(3,\)", lambda kw: {"tokens": kw["tokens"][:2]}),
    ("tokens must be contiguous", lambda kw: {"tokens": torch.empty(6, dtype=torch.long)[::2]}),
    ("partials has 767 elements, needs at least 768", lambda kw: {"partials": kw["partials"][:-1]}),
    ("partials is int32, expected int64", lambda kw: {"partials": kw["partials"].int()}),
    (r"partials has shape \(3, 256\), expected \(\*,\)", lambda kw: {"partials": kw["partials"].view(3, -1)}),
    ("counters has 2 elements, needs at least 3", lambda kw: {"counters": kw["counters"][:2]}),
    ("counters is int64, expected int32", lambda kw: {"counters": kw["counters"].long()}),
    ("counters overlaps partials", lambda kw: {"counters": kw["partials"][:2].view(torch.int32)}),
    ("tokens overlaps logits", lambda kw: {"logits": kw["tokens"].view(torch.float32).view(3, 2),
                                           "partials": kw["partials"][:6 * 256]}),
]


@pytest.mark.parametrize("match, change", GREEDY_REJECTS, ids=[m for m, _ in GREEDY_REJECTS])
def test_greedy_binding_rejects_what_the_kernel_cannot_take(greedy_binding, match, change):
    """The binding's C++ checks, on CPU tensors: a good call gets through every check to the device
    check (DeviceError), a bad one is a ValueError naming the argument before it."""
    kw = _greedy_kwargs()
    for dtype in GREEDY_DTYPES:
        with pytest.raises(greedy_binding.DeviceError, match="greedy_rows: logits is not on a CUDA device"):
            greedy_binding.greedy_rows(**{**kw, "logits": kw["logits"].to(dtype)})
    with pytest.raises(ValueError, match="greedy_rows: " + match) as info:
        greedy_binding.greedy_rows(**{**kw, **change(kw)})
    assert not isinstance(info.value, greedy_binding.DeviceError)


def test_greedy_wrapper_passes_the_binding_checks(greedy_binding, monkeypatch):
    """`greedy` on its kernel path (CPU tensors routed there) builds arguments the binding takes."""
    monkeypatch.setattr(sampling_ops.dispatch, "use_kernel", lambda *tensors: True)
    monkeypatch.setattr(sampling_ops.dispatch, "stream_handle", lambda t: 0)
    for rows, vocab in ((1, 1), (9, 7), (2, 248320), (100, 50)):
        for dtype in GREEDY_DTYPES:
            logits = torch.randn(rows, vocab).to(dtype)
            with pytest.raises(greedy_binding.DeviceError, match="is not on a CUDA device"):
                sampling_ops.greedy(logits)
            with pytest.raises(greedy_binding.DeviceError, match="is not on a CUDA device"):
                sampling_ops.greedy(logits, out=torch.empty(rows, dtype=torch.long))


def _generate(params: list[SamplingParams], row_logits: list[torch.Tensor], watch: int) -> list[int]:
    """Run steps for a batch; every row appends its token to its own history; return row `watch`."""
    sampler, gens = Sampler(), [p.make_generator() for p in params]
    histories = [TokenHistory([0, 1, 2], []) for _ in params]
    for step_logits in row_logits:
        tokens = sampler.sample(step_logits, params, histories, gens)
        histories = [TokenHistory(h.prompt_ids, [*h.output_ids, t]) for h, t in zip(histories, tokens.tolist())]
    return list(histories[watch].output_ids)


def test_seeded_rows_are_reproducible_and_independent_of_the_batch():
    torch.manual_seed(8)
    steps = [torch.randn(4, 500) for _ in range(12)]
    mine = SamplingParams(seed=1234, temperature=1.2, top_k=400, presence_penalty=0.5)
    alone = _generate([mine], [s[2:3] for s in steps], 0)
    again = _generate([mine], [s[2:3] for s in steps], 0)
    others = [SamplingParams(seed=9, top_p=0.5), SamplingParams(temperature=0), SamplingParams(min_p=0.2)]
    batched = _generate([others[0], others[1], mine, others[2]], steps, 2)
    reordered = _generate([mine, *others], [s[[2, 0, 1, 3]] for s in steps], 0)
    assert alone == again == batched == reordered
    other_seed = _generate([SamplingParams(seed=1235, temperature=1.2, top_k=400, presence_penalty=0.5)],
                           [s[2:3] for s in steps], 0)
    assert other_seed != alone


def test_draw_never_picks_a_zero_probability_token():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]] * 3, dtype=torch.float64)
    u = torch.tensor([0.0, 0.25, 1.0], dtype=torch.float64)  # 1.0 stands for u * total rounding up
    assert draw_from_probs(probs, u).tolist() == [1, 3, 3]


CHI2_CRITICAL_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322, 8: 26.124,
                     9: 27.877}


def chi_square_passes(counts: np.ndarray, expected: np.ndarray) -> bool:
    """Pearson test at alpha = 0.001; any draw of a token with expected probability 0 fails."""
    support = expected > 0
    if counts[~support].any():
        return False
    e = counts.sum() * expected[support]
    stat = float(((counts[support] - e) ** 2 / e).sum())
    return stat < CHI2_CRITICAL_999[int(support.sum()) - 1]


def test_empirical_frequencies_match_and_the_check_can_fail():
    logits = torch.tensor([[2.0, 1.5, 1.4, 0.3, 0.2, -0.5, -1.0, -3.0, 1.0, 0.9]])
    p = SamplingParams(temperature=0.8, top_k=8, top_p=0.97, min_p=0.05, repetition_penalty=1.3, seed=42)
    history = TokenHistory([0, 8], [4])
    n = 20000
    tokens = Sampler().sample(logits.expand(n, -1), [p] * n, [history] * n, [p.make_generator()] * n)
    counts = np.bincount(tokens.numpy(), minlength=10)
    expected = ref_distribution(logits[0].numpy(), p, [0, 8], [4])
    assert 3 <= (expected > 0).sum() < 10  # the filters really cut something
    assert chi_square_passes(counts, expected)
    swapped = expected.copy()
    i, j = np.argsort(-expected)[1:3]
    swapped[[i, j]] = swapped[[j, i]]
    assert not chi_square_passes(counts, swapped)
    unfiltered = ref_distribution(logits[0].numpy(), SamplingParams(temperature=0.8, repetition_penalty=1.3),
                                  [0, 8], [4])
    assert not chi_square_passes(counts, unfiltered)
    no_penalty = ref_distribution(logits[0].numpy(), SamplingParams(temperature=0.8, top_k=8, top_p=0.97,
                                                                    min_p=0.05), [0, 8], [4])
    assert not chi_square_passes(counts, no_penalty)


# ---- bad batches ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "logits, n_params, fragment",
    [
        (torch.zeros(8), 1, "float \\[batch, vocab\\]"),
        (torch.zeros(2, 8), 1, "2 logit rows, 1 params"),
    ],
)
def test_bad_batches_are_rejected(logits, n_params, fragment):
    with pytest.raises(NinferError, match=fragment):
        run([SamplingParams()] * n_params, logits, [TokenHistory([])] * n_params)


def test_rows_without_finite_logits_are_flagged_not_raised():
    """The distribution reads nothing back from the device: a row of NaN, +inf or only -inf comes
    out as a proper distribution (its filter over zero logits) and `finite_rows` names it; the
    other rows are as they would be alone."""
    logits = torch.tensor([[0.0, math.nan, 1.0], [-math.inf] * 3, [0.0, math.inf, 1.0], [1.0, 2.0, 0.5]])
    params = [SamplingParams(temperature=0.7)] * 4
    probs = run(params, logits, [TokenHistory([])] * 4)
    assert sampling.finite_rows(logits).tolist() == [False, False, False, True]
    assert bool(torch.isfinite(probs).all()) and torch.allclose(probs.sum(-1), torch.ones(4))
    torch.testing.assert_close(probs[3:], run(params[:1], logits[3:], [TokenHistory([])]))


def test_generator_count_must_match_rows():
    with pytest.raises(NinferError, match="1 generators for 2 rows"):
        Sampler().sample(torch.zeros(2, 4), [SamplingParams()] * 2, [TokenHistory([])] * 2, [None])

"""scripts/bench_spec.py `engine`: the engine loop with MTP rounds at a set acceptance. Its numbers are
timings (the GPU's, in docs/performance.md); what is checked here is that the rounds are what the
table says they are: the keep probability gives the asked accepted / drafted, no draft survives at
acceptance 0 (a token a round, as many rounds as plain steps), K = 0 runs speculative rounds without
drafts, and the forced judge puts the engine's back when a run is done."""

from __future__ import annotations

import argparse
import gzip
import json

import pytest
import torch

from tiny_model_dir import WIDE, write_tiny_model_dir

@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("acceptance", [0.0, 0.3, 0.72, 0.95])
def test_keep_probability_gives_the_acceptance(bench_spec, k, acceptance):
    c = bench_spec.keep_probability(acceptance, k)
    assert sum(c ** j for j in range(1, k + 1)) / k == pytest.approx(acceptance, abs=1e-9)


def test_engine_rounds_at_the_asked_acceptance(bench_spec, tmp_path):
    write_tiny_model_dir(tmp_path / "model", moe=True, overrides=WIDE)
    args = argparse.Namespace(model=tmp_path / "model", batches="1,2", k="0,1,3", context=16, tokens=200,
                              acceptance=0.72, device="cpu", dtype="auto", weights="bf16", json=tmp_path / "r.json",
                              profile=24, trace=True)
    result = bench_spec.bench_engine(args)
    rows = result["rows"]
    assert set(result["profiles"]) == {"mtp_greedy", "plain_greedy", "mtp_sampled", "plain_sampled"}
    for name, profiled in result["profiles"].items():  # no GPU here: no kernel, so no idle time between them
        assert profiled["gpu_idle_ms_per_step"] == 0
        if name.startswith("plain"):
            assert not (tmp_path / f"r_{name}.trace.json.gz").exists()
            continue
        events = json.loads(gzip.decompress((tmp_path / f"r_{name}.trace.json.gz").read_bytes()))["traceEvents"]
        assert any(e.get("cat") == "python_function" and "engine_decode" in e.get("name", "") for e in events)
    assert result["profiles"]["mtp_greedy"]["steps"] < result["profiles"]["plain_greedy"]["steps"]
    assert [row["batch"] for row in rows] == [1, 2]
    for row in rows:
        for kind in ("greedy", "sampled"):
            for k in (1, 3):
                none, forced = row[f"mtp_{kind}_k{k}_at_0"], row[f"mtp_{kind}_k{k}_at_0.72"]
                assert none["acceptance"] == 0 and none["tokens_per_round"] == 1
                assert none["steps"] == pytest.approx(row[f"plain_{kind}"]["steps"])
                assert forced["acceptance"] == pytest.approx(0.72, abs=0.1)
                assert forced["tokens_per_round"] == pytest.approx(1 + 0.72 * k, abs=0.35)
                assert none["plain_steps"] == pytest.approx(none["ms_per_step"] / row[f"plain_{kind}"]["ms_per_step"])
            # K = 0: speculative rounds (their spec counters exist) without a draft, a token each
            bare = row[f"mtp_{kind}_k0"]
            assert bare["acceptance"] == 0 and bare["tokens_per_round"] == 1
            assert bare["steps"] == pytest.approx(row[f"plain_{kind}"]["steps"])
    assert "acceptance" not in rows[0]["plain_greedy"]  # plain runs have no spec counters


def test_forced_judge_keeps_drafts_then_the_judges_token(bench_spec):
    """Keep 1: every draft, then the judge's last token; keep 0: the judge's last token alone, on the
    device (kept counts, following tokens) as on the host; the returned judge is the engine's own."""
    def judge(seqs, drafts, logits, penalties=None):  # accepts nothing: its last token 7 (then pads)
        return bench_spec.Verdict(torch.tensor([1, 1]), torch.tensor([[7, 0, 0, 0], [7, 5, 5, 5]]),
                                  lambda: [[7], [7]])

    drafts = [bench_spec.Draft([1, 2, 3]), bench_spec.Draft([4])]
    speculator = argparse.Namespace(judge=judge)
    assert bench_spec.force_acceptance(speculator, 1.0) is judge
    verdict = speculator.judge([None, None], drafts, None)
    assert verdict.kept() == [[1, 2, 3, 7], [4, 7]]
    assert verdict.counts.tolist() == [4, 2] and verdict.following[:, :4].tolist()[0] == [1, 2, 3, 7]
    assert verdict.following[1, :2].tolist() == [4, 7]
    speculator.judge = judge
    bench_spec.force_acceptance(speculator, 0.0)
    verdict = speculator.judge([None, None], drafts, None)
    assert verdict.kept() == [[7], [7]]
    assert verdict.counts.tolist() == [1, 1] and verdict.following[:, 0].tolist() == [7, 7]

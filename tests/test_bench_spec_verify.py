"""scripts/bench_spec.py `verify` on the tiny preset: a row per K with the formula's speed-ups, and on
a GPU every drafting form by graph, K after K on one model (the penalised chain's graphs read one
penalty tables object for their life: a bench that made new tables per K failed the drafter's
assertion on the H200, forty-fifth session); `profile` on a GPU: the verify round beside the decode
step by kernel kind."""

from __future__ import annotations

import argparse

import pytest

from ninfer_core.bench_step import DENSE_GEMM


def run_verify(bench_spec, device: str, max_k: int) -> dict:
    args = argparse.Namespace(preset="tiny-qwen3.6-moe", device=device, dtype="auto", context=48, max_k=max_k,
                              weights="bf16", repeats=1, acceptance=0.5)
    return bench_spec.bench_verify(args)


def check_rows(result: dict, max_k: int, mode: str) -> None:
    assert [row["k"] for row in result["rows"]] == list(range(1, max_k + 1))
    for row in result["rows"]:
        k, ratio = row["k"], row[f"verify_{mode}_ratio"]
        assert ratio > 0 and row["mtp_draft_eager_ms"] > 0 and row["dflash_draft_ms"] > 0
        assert row["speedup_verify_only"] == pytest.approx((1 + k * 0.5) / ratio)


def test_verify_bench_rows_on_the_cpu(bench_spec):
    result = run_verify(bench_spec, "cpu", 2)
    assert result["decode_graph_ms"] is None and result["decode_eager_ms"] > 0
    check_rows(result, 2, "eager")
    assert not any("graph" in key for row in result["rows"] for key in row)


@pytest.mark.cuda
def test_verify_bench_drafts_every_form_by_graph_on_cuda(bench_spec):
    result = run_verify(bench_spec, "cuda", 3)
    check_rows(result, 3, "graph")
    for row in result["rows"]:
        for form in ("graph", "sampled_graph", "penalised_graph"):
            assert row[f"mtp_draft_{form}_ms"] > 0, (row["k"], form)


@pytest.mark.cuda
@pytest.mark.parametrize("weights", ["bf16", "int4"])
def test_profile_bench_sets_a_verify_round_beside_the_decode_step_by_kernel_kind(bench_spec, weights):
    args = argparse.Namespace(preset="tiny-qwen3.6-moe", device="cuda", dtype="auto", context=48, max_k=3,
                              weights=weights, repeats=1, acceptance=0.5)
    tables = bench_spec.bench_profile(args)["step_tables"]
    decode, verify = tables["decode step"], tables["K = 3 verify + commit"]

    def total(table: list[dict], row: str, key: str = "bytes") -> float:
        return sum(r[key] for r in table if r["row"] == row)

    gate_up, gdn = "MoE gate_up (routed + shared)", "GDN recurrent (state read + written)"
    assert total(verify, gate_up) > total(decode, gate_up) > 0  # 4 tokens hit more experts
    assert total(verify, gdn) == pytest.approx(1.5 * total(decode, gdn))  # verify reads, commit reads + writes
    for table in (decode, verify):
        assert sum(r["share_us"] for r in table) > 0
        assert total(table, gate_up, "calls") > 0 and total(table, gdn, "calls") > 0  # their kernels were named
        # int4: our GEMVs by projection; bf16: cuBLAS's kernels, one row
        projections = [r for r in table if r["row"].startswith("GEMV") and r["calls"] > 0]
        dense = [r for r in table if r["row"] == DENSE_GEMM and r["calls"] > 0]
        assert (projections and not dense) if weights == "int4" else (dense and not projections)

"""`ninfer bench serve` against a real server on the tiny model: the report's token accounting
and batching agree with what was asked and with the engine's own counters."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import typer
from typer.testing import CliRunner

from ninfer_app.bench_serve import BenchRequest, register, send
from ninfer_core.server.app import ServerHandle
from server_harness import load_tiny_llm, write_model


def test_bench_serve_corpus_and_saturation(tmp_path_factory, tmp_path):
    directory, _ = write_model(tmp_path_factory, "tiny_bench")
    handle = ServerHandle.start(load_tiny_llm(directory), port=0)
    bench = typer.Typer()
    bench.callback()(lambda: None)  # a group, as `ninfer bench` will be
    register(bench)
    runner = CliRunner()
    try:
        corpus_out, wave_out = tmp_path / "corpus.json", tmp_path / "wave.json"
        result = runner.invoke(bench, ["serve", "--url", handle.url, "--concurrency", "1,2", "--synthetic", "4",
                                       "--prompt-tokens", "8", "--max-tokens", "32", "--greedy", "--out",
                                       str(corpus_out)])
        assert result.exit_code == 0, result.output
        one, two = json.loads(corpus_out.read_text())["points"]
        for point in (one, two):
            assert point["errors"] == 0 and point["requests"] == 4
            assert point["prompt_tokens"] == 4 * 8 and point["completion_tokens"] == 4 * 32
            assert point["finish_reasons"] == {"length": 4} and point["acceptance"] is None
            assert point["ttft_ms"]["p50"] > 0 and point["tpot_ms"]["p50"] > 0 and point["itl_ms"]["p99"] > 0
        # 31 decode steps a request: the two clients' requests overlap for most of them, even on a busy
        # CI machine (with 6 tokens the first could finish before the second's HTTP request was parsed)
        assert one["avg_decode_batch"] == 1.0 and two["avg_decode_batch"] > 1.0
        # each point opened its request connections (GET /v1/models) before its clock started: 1 + 2
        models = re.search(r'ninfer_http_requests_total\{route="/v1/models",status="200"\} (\S+)',
                           httpx.get(handle.url + "/metrics").text)
        assert models is not None and float(models.group(1)) == 3
        # with an engine report (batch 2's row: the concurrency's), the figures as ratios to its
        engine = tmp_path / "engine.json"
        engine.write_text(json.dumps({"ttft": [], "decode": [
            {"batch": 1, "tpot_ms": 99.0, "tok_s": 1.0, "step_ms": 9.0},
            {"batch": 2, "tpot_ms": 4.0, "tok_s": 300.0, "step_ms": 2.5, "limit_ms": 0.5}]}))
        result = runner.invoke(bench, ["serve", "--url", handle.url, "--mode", "saturation", "--concurrency", "2",
                                       "--synthetic", "1", "--prompt-tokens", "8", "--max-tokens", "60",
                                       "--interval", "0.05", "--engine", str(engine),
                                       "--out", str(wave_out)])
        assert result.exit_code == 0, result.output
        (wave,) = json.loads(wave_out.read_text())["points"]
        assert wave["errors"] == 0 and wave["completion_tokens"] == 2 * 60
        assert wave["steady_seconds"] > 0 and wave["steady_decode_tok_s"] > 0
        assert wave["vs_engine"] == {"tpot_vs_loop": wave["tpot_ms"]["p50"] / 4.0,
                                     "tpot_vs_step": wave["tpot_ms"]["p50"] / 2.5,
                                     "tpot_vs_limit": wave["tpot_ms"]["p50"] / 0.5,
                                     "steady_vs_loop": wave["steady_decode_tok_s"] / 300.0}
        assert f"TPOT / the loop's {wave['tpot_ms']['p50'] / 4.0:.3f}x" in result.output
        assert f"TPOT / the limit {wave['tpot_ms']['p50'] / 0.5:.3f}x" in result.output
    finally:
        handle.stop()


def test_bench_serve_ttft_per_prompt_length(tmp_path_factory, tmp_path):
    """The ttft mode: per length, the first prompt, the repeats and the cached resend each reach the
    server with exactly that many prompt tokens; the resend is served from the prefix cache, and so
    is the second chat's system prompt (it resumes where its question starts)."""
    directory, _ = write_model(tmp_path_factory, "tiny_bench_ttft", max_positions=2048)
    handle = ServerHandle.start(load_tiny_llm(directory, max_context=2048), port=0)
    bench = typer.Typer()
    bench.callback()(lambda: None)
    register(bench)
    out, engine = tmp_path / "ttft.json", tmp_path / "engine.json"
    # an engine report with the 24-token length only (and no chat figure): ratios where it has them
    engine.write_text(json.dumps({"decode": [], "ttft": [{"tokens": 24, "first_ms": 2.0, "repeat_ms": 0.5,
                                                          "chat_ms": None, "limit_ms": 0.25}]}))
    try:
        hits, rows = [_metric(handle.url, "ninfer_prefix_cache_hits_total")], []
        for length in ("24", "400"):  # one run each: the hits of the 400-token one alone
            result = CliRunner().invoke(bench, ["serve", "--url", handle.url, "--mode", "ttft", "--lengths", length,
                                                "--repeats", "2", "--greedy", "--engine", str(engine),
                                                "--out", str(out)])
            assert result.exit_code == 0, result.output
            rows += json.loads(out.read_text())["lengths"]
            hits.append(_metric(handle.url, "ninfer_prefix_cache_hits_total"))
        assert [r["tokens"] for r in rows] == [24, 400]
        assert rows[0]["vs_engine"] == {"first": rows[0]["first_ms"] / 2.0, "repeat": rows[0]["repeat_ms"] / 0.5,
                                        "chat": None, "repeat_vs_limit": rows[0]["repeat_ms"] / 0.25}
        assert rows[1]["vs_engine"] == {"first": None, "repeat": None, "chat": None, "repeat_vs_limit": None}
        for row in rows:
            assert row["errors"] == 0, row
            assert row["prompt_tokens"] == [row["tokens"]] * 4, row
            assert min(row[k] for k in ("first_ms", "repeat_ms", "cached_ms", "chat_ms", "chat_shared_ms",
                                        "chat_turn2_ms")) > 0
        assert "400 tokens: TTFT first" in result.output and "same system prompt" in result.output
        assert "next turn" in result.output
        # the first chat is sized to the length (its system prompt fitted by /tokenize); the second,
        # another question under the same system prompt, within a few tokens of it
        assert rows[1]["chat_prompt_tokens"][0] in range(396, 401), rows[1]
        assert abs(rows[1]["chat_prompt_tokens"][1] - 400) <= 15, rows[1]
        # the 400-token resend hit its own prompt (all but the last token, checkpointed one before it),
        # the second chat all but its question (~20 words) and the assistant header (its system prompt
        # past SPLIT_MIN tokens), and the first chat's next turn the first chat up to its answer start
        # (the `<think>` opener after the assistant header); the 24-token length's nothing (its
        # history under SPLIT_MIN)
        first, second, turn2 = rows[1]["chat_prompt_tokens"]
        assert turn2 > first + 40, rows[1]  # the first chat's question, a 40-word reply, a new question
        assert hits[1] - hits[0] == 0 and hits[2] - hits[1] >= 399 + (second - 80) + (first - 5), (hits, rows[1])
    finally:
        handle.stop()


def test_bench_serve_refuses_an_engine_report_it_cannot_read_before_sending(tmp_path):
    bench = typer.Typer()
    bench.callback()(lambda: None)
    register(bench)
    bad, wrong = tmp_path / "bad.json", tmp_path / "wrong.json"
    bad.write_text("{not json")
    wrong.write_text(json.dumps({"points": []}))  # a bench serve report, not an engine one
    for path, message in ((bad, "cannot read it as JSON"), (tmp_path / "missing.json", "cannot read it as JSON"),
                          (wrong, "not a `ninfer bench engine --json` report")):
        # port 9 (discard): nothing listens there; the report is refused before any request
        result = CliRunner().invoke(bench, ["serve", "--url", "http://127.0.0.1:9", "--mode", "ttft",
                                            "--engine", str(path)])
        assert result.exit_code != 0 and message in result.output, result.output
        assert "is the server running" not in result.output


def _metric(url: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", httpx.get(url + "/metrics").text, re.M)
    assert match is not None, name
    return float(match.group(1))


def test_bench_send_reports_a_refusal_and_frees_its_connection(tmp_path_factory):
    """`send` builds its request before the clock and closes each response: after a refused request
    (a 400, reported with its status) the next one gets the client's only connection and is timed."""
    directory, _ = write_model(tmp_path_factory, "tiny_bench_send")
    handle = ServerHandle.start(load_tiny_llm(directory), port=0)

    async def run():
        async with httpx.AsyncClient(base_url=handle.url, timeout=httpx.Timeout(60, pool=10),
                                     limits=httpx.Limits(max_connections=1)) as client:
            refused = await send(client, BenchRequest(id="empty", max_tokens=2, prompt=[]), {"temperature": 0.0}, None)
            served = await send(client, BenchRequest(id="ok", max_tokens=6, ignore_eos=True, prompt=list(range(10, 18))),
                                {"temperature": 0.0}, None)
            return refused, served

    try:
        refused, served = asyncio.run(run())
    finally:
        handle.stop()
    assert not refused.ok and refused.error.startswith("HTTP 400") and "empty" in refused.error
    assert served.ok, served.error
    assert (served.prompt_tokens, served.completion_tokens, served.finish_reason) == (8, 6, "length")
    assert served.e2e_s >= served.ttft_s > 0

"""`ninfer bench serve`: load an HTTP server as ../shared/reference/ninfer-benchmark-methodology.md
describes and report makespan, rates, TTFT / TPOT / ITL percentiles and speculative acceptance.

Modes, run at each concurrency C:
- corpus: a fixed request set, shuffled once with seed 20260811 and sent in that order at every C
  by exactly C workers, each sending its next request after reading its current response;
  makespan runs from the workers' release to the last complete response.
- saturation: C copies of one request (distinct seeds) released together. The server's /metrics
  is sampled every second (--interval); an interval is steady when no prefill chunk ran, C requests were
  running, none waiting, and every decode step carried exactly C rows. Steady decode tok/s =
  rows / seconds over the steady intervals (ramp-up, prefill and drain excluded).
- ttft: one request at a time, per prompt length (--lengths): the first prompt of that length the
  server sees, then --repeats fresh prompts of it (median: "repeat"), then the last one sent again
  (its prefix cached). Random-token prompts, two-token answers. Then two chats under one new
  system prompt: the first reads it all ("chat"), the second, another question, resumes where its
  question starts ("chat_shared", the prefix cache's checkpoint there, taken where the system prompt
  has SPLIT_MIN = 256 tokens or more: shorter chats run as plain prompts), and the first chat's next
  turn (its question, a fixed reply, a new question: "chat_turn2", which resumes at the first chat's
  answer start where that prompt had SPLIT_MIN tokens). The system prompt is sized so
  that the first chat has that many tokens, or the most under it (the server's /tokenize counts the
  rendered chat; a server without it gets that many words): a chat of the plain prompts' length
  reads the same prompt graph, so the two differ by what a chat costs, not by a larger graph.

With --engine (the JSON of `ninfer bench engine --json` on the same model and machine) each figure
also comes as a ratio to the engine's own: TTFT per length to the engine loop's (first, repeat,
chat), and a point's TPOT to the loop's at that batch and to the GPU's step alone (`step_ms`), its
steady decode to the loop's tok/s: what the HTTP path costs on top of the engine, and the engine on
top of the GPU. Where the report has the card's limits (a CUDA run: its `limit_ms`), the repeated TTFT
and the TPOT also come over the limit: the prefill at the bandwidth or GEMM peak, the step's bytes at
the bandwidth.

Requests stream (with usage), so TTFT and the gaps between chunks are the client's view, HTTP
included. With --serve, every point starts a fresh `ninfer serve` (the methodology's rule); with
--url, all points share one running server (say so when publishing).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Annotated, Any, Optional, TypeVar

import typer

from .output import fail

if TYPE_CHECKING:
    import httpx  # imported where used: `ninfer --help` should not pay for it

Result = TypeVar("Result")
SHUFFLE_SEED = 20260811
WORDS = "the of and to in is for on with as by at from this that are be was it an or".split()  # ~1 token each
STOCHASTIC = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "presence_penalty": 1.0,
              "frequency_penalty": 0.0}


@dataclass
class BenchRequest:
    """One corpus entry: chat `messages` or a raw `prompt` (text or token ids)."""

    id: str
    max_tokens: int
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None
    thinking: bool = False
    seed: int | None = None
    ignore_eos: bool = False

    def body(self, sampling: dict[str, Any], seed: int | None) -> tuple[str, dict[str, Any]]:
        # no "model": the server's startup model (a name it does not serve would be a 404)
        common = {"max_tokens": self.max_tokens, "stream": True, "ignore_eos": self.ignore_eos,
                  "stream_options": {"include_usage": True}, "seed": seed, **sampling}
        if self.messages is not None:
            return "/v1/chat/completions", {**common, "messages": self.messages,
                                            "chat_template_kwargs": {"enable_thinking": self.thinking}}
        return "/v1/completions", {**common, "prompt": self.prompt}


@dataclass
class Sample:
    id: str
    ok: bool
    error: str = ""
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    accepted: int = 0
    rejected: int = 0
    finish_reason: str | None = None

    @property
    def tpot_s(self) -> float | None:
        n = self.completion_tokens - 1
        return (self.e2e_s - self.ttft_s) / n if n > 0 else None


def load_corpus(path: Path) -> list[BenchRequest]:
    """JSON lines of BenchRequest fields."""
    requests = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        if line.strip():
            entry = json.loads(line)
            requests.append(BenchRequest(**{"id": str(entry.pop("id", i)), **entry}))
    return requests


def synthetic_corpus(count: int, prompt_tokens: int, max_tokens: int) -> list[BenchRequest]:
    """Fixed-token requests: random token-id prompts (ids below 300: in every vocabulary), exactly
    `max_tokens` answers (eos ignored)."""
    rng = random.Random(SHUFFLE_SEED)
    return [BenchRequest(id=f"synthetic-{i}", max_tokens=max_tokens, ignore_eos=True,
                         prompt=[rng.randrange(10, 300) for _ in range(prompt_tokens)]) for i in range(count)]


async def send(client: httpx.AsyncClient, request: BenchRequest, sampling: dict[str, Any], seed: int | None) -> Sample:
    import httpx

    path, body = request.body(sampling, seed)
    # built (the body encoded) before the clock starts: the client's work, not the server's
    http_request = client.build_request("POST", path, json=body)
    sample = Sample(request.id, ok=False)
    start = last = time.perf_counter()
    try:
        response = await client.send(http_request, stream=True)
        try:
            if response.status_code != 200:
                sample.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return sample
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()  # the chunk's arrival, before the client parses it
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    sample.error = chunk["error"].get("message", "error event")
                    return sample
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if choice.get("text") or delta.get("content") or delta.get("reasoning_content") or \
                            delta.get("tool_calls"):
                        if sample.ttft_s == 0.0:
                            sample.ttft_s = now - start
                        else:
                            sample.gaps_s.append(now - last)
                        last = now
                    sample.finish_reason = choice.get("finish_reason") or sample.finish_reason
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    details = usage.get("completion_tokens_details") or {}
                    sample.prompt_tokens, sample.completion_tokens = usage["prompt_tokens"], usage["completion_tokens"]
                    sample.accepted = details.get("accepted_prediction_tokens") or 0
                    sample.rejected = details.get("rejected_prediction_tokens") or 0
        finally:
            await response.aclose()
    except httpx.HTTPError as e:
        sample.error = f"{type(e).__name__}: {e}"
        return sample
    sample.e2e_s, sample.ok = time.perf_counter() - start, True
    return sample


def scrape(client: httpx.Client) -> dict[str, float]:
    """The unlabelled series of /metrics, by name."""
    text = client.get("/metrics").text
    return {m[1]: float(m[2]) for m in re.finditer(r"^([a-z_]+) (\S+)$", text, re.M)}


class Sampler:
    """Samples /metrics every `interval` seconds while a point runs; keeps (time, values)."""

    def __init__(self, url: str, headers: dict[str, str], interval: float):
        import httpx

        self.client = httpx.Client(base_url=url, headers=headers, timeout=10)
        self.interval = interval
        self.points: list[tuple[float, dict[str, float]]] = []

    async def sample(self) -> None:
        self.points.append((time.perf_counter(), await asyncio.to_thread(scrape, self.client)))

    async def run(self, stop: asyncio.Event) -> None:
        """Samples after each interval until `stop`, then once more (the first sample is taken
        before the point starts: `sample`)."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.interval)
            except asyncio.TimeoutError:
                pass
            await self.sample()

    def steady(self, concurrency: int) -> tuple[float, float]:
        """(decode rows, seconds) over the steady intervals (see the module doc)."""
        rows = seconds = 0.0
        for (t0, a), (t1, b) in zip(self.points, self.points[1:], strict=False):
            steps = b["ninfer_engine_decode_steps_total"] - a["ninfer_engine_decode_steps_total"]
            d_rows = b["ninfer_engine_decode_rows_total"] - a["ninfer_engine_decode_rows_total"]
            if (b["ninfer_engine_prefill_chunks_total"] == a["ninfer_engine_prefill_chunks_total"] and steps >= 1
                    and d_rows == concurrency * steps
                    and a["ninfer_requests_running"] == b["ninfer_requests_running"] == concurrency
                    and a["ninfer_requests_waiting"] == b["ninfer_requests_waiting"] == 0):
                rows, seconds = rows + d_rows, seconds + (t1 - t0)
        return rows, seconds


def percentiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] * 1000

    return {"mean": statistics.fmean(ordered) * 1000, "p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}


async def run_point(url: str, headers: dict[str, str], mode: str, requests: list[BenchRequest], concurrency: int,
                    sampling: dict[str, Any], interval: float = 1.0) -> dict[str, Any]:
    import httpx

    sampler = Sampler(url, headers, interval)
    stop = asyncio.Event()
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=httpx.Timeout(3600, connect=30),
                                 limits=httpx.Limits(max_connections=concurrency + 2)) as client:
        # Before the clock starts: the first /metrics sample, and the request connections opened (one
        # GET /v1/models each). Their first-use costs in this process (the thread pool, httpx's
        # transport, the connections) made a fresh client's first request ~50 ms slower than the rest
        # against a warm server (tiny model, CPU): a client cost, not the server's TTFT.
        await sampler.sample()
        await asyncio.gather(*(client.get("/v1/models") for _ in range(concurrency)))
        sampling_task = asyncio.create_task(sampler.run(stop))
        start = time.perf_counter()
        if mode == "corpus":
            queue = list(requests)
            queue.reverse()

            async def worker() -> list[Sample]:
                done = []
                while queue:
                    request = queue.pop()
                    done.append(await send(client, request, sampling, request.seed))
                return done

            samples = [s for batch in await asyncio.gather(*(worker() for _ in range(concurrency))) for s in batch]
        else:
            base = requests[0]
            samples = list(await asyncio.gather(*(send(client, base, sampling, (base.seed or 0) + i)
                                                  for i in range(concurrency))))
        makespan = time.perf_counter() - start
        stop.set()
        await sampling_task
    return summarize(mode, concurrency, samples, makespan, sampler)


async def run_ttft(url: str, headers: dict[str, str], lengths: list[int], repeats: int,
                   sampling: dict[str, Any]) -> list[dict[str, Any]]:
    """TTFT per prompt length, first sight / repeat / cached (see the module doc)."""
    import httpx

    rng = random.Random(SHUFFLE_SEED)
    rows = []
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=httpx.Timeout(3600, connect=30)) as client:
        await client.get("/v1/models")  # the connection, before any clock (see run_point)

        async def ttft(prompt: list[int]) -> Sample:
            return await send(client, BenchRequest(id=f"ttft-{len(prompt)}", max_tokens=2, ignore_eos=True,
                                                   prompt=prompt), sampling, None)

        def chat_request(system: str, question: str, earlier: tuple[dict[str, str], ...] = ()) -> BenchRequest:
            return BenchRequest(id="ttft-chat", max_tokens=2, ignore_eos=True, messages=[
                {"role": "system", "content": system}, *earlier, {"role": "user", "content": question}])

        async def chat(system: str, question: str, earlier: tuple[dict[str, str], ...] = ()) -> Sample:
            return await send(client, chat_request(system, question, earlier), sampling, None)

        async def sized_system(length: int, question: str) -> str:
            """Words whose chat with `question` has `length` tokens, or the most under it (at least one
            word): the longest prefix of a random draw that fits, found by bisection on /tokenize's
            count; without /tokenize, `length` words."""
            words = [rng.choice(WORDS) for _ in range(length)]

            async def fits(n: int) -> bool:
                _, body = chat_request(" ".join(words[:n]), question).body(sampling, None)
                response = await client.post("/tokenize", json={key: body[key] for key in
                                                                ("messages", "chat_template_kwargs")})
                response.raise_for_status()
                return response.json()["count"] <= length

            try:
                low, high = 1, length
                while low < high:
                    middle = (low + high + 1) // 2
                    low, high = (middle, high) if await fits(middle) else (low, middle - 1)
            except (httpx.HTTPStatusError, KeyError, ValueError):
                low = length
            return " ".join(words[:low])

        for length in lengths:
            prompts = [[rng.randrange(10, 300) for _ in range(length)] for _ in range(repeats + 1)]
            samples = [await ttft(p) for p in prompts] + [await ttft(prompts[-1])]
            questions = ["Question: " + " ".join(rng.choice(WORDS) for _ in range(20)) for _ in range(3)]
            system = await sized_system(length, questions[0])
            chats = [await chat(system, question) for question in questions[:2]]
            # the first chat's next turn: its question, a reply (the thinking model's history keeps no
            # reasoning, so any reply resumes alike), a new question
            reply = " ".join(rng.choice(WORDS) for _ in range(40))
            chats.append(await chat(system, questions[2], ({"role": "user", "content": questions[0]},
                                                          {"role": "assistant", "content": reply})))
            ok = [s for s in samples + chats if s.ok]
            rows.append({
                "tokens": length, "errors": len(samples) + len(chats) - len(ok),
                "error_examples": sorted({s.error for s in samples + chats if not s.ok})[:3],
                "prompt_tokens": [s.prompt_tokens for s in samples if s.ok],
                "first_ms": samples[0].ttft_s * 1e3 if samples[0].ok else None,
                "repeat_ms": statistics.median(s.ttft_s * 1e3 for s in samples[1:-1] if s.ok)
                if any(s.ok for s in samples[1:-1]) else None,
                "cached_ms": samples[-1].ttft_s * 1e3 if samples[-1].ok else None,
                "chat_prompt_tokens": [s.prompt_tokens for s in chats if s.ok],
                "chat_ms": chats[0].ttft_s * 1e3 if chats[0].ok else None,
                "chat_shared_ms": chats[1].ttft_s * 1e3 if chats[1].ok else None,
                "chat_turn2_ms": chats[2].ttft_s * 1e3 if chats[2].ok else None,
            })
    return rows


def summarize(mode: str, concurrency: int, samples: list[Sample], makespan: float, sampler: Sampler) -> dict[str, Any]:
    ok = [s for s in samples if s.ok]
    first, last = sampler.points[0][1], sampler.points[-1][1]
    steps = last["ninfer_engine_decode_steps_total"] - first["ninfer_engine_decode_steps_total"]
    rows = last["ninfer_engine_decode_rows_total"] - first["ninfer_engine_decode_rows_total"]
    prompt = sum(s.prompt_tokens for s in ok)
    completion = sum(s.completion_tokens for s in ok)
    drafted = sum(s.accepted + s.rejected for s in ok)
    result: dict[str, Any] = {
        "mode": mode, "concurrency": concurrency, "requests": len(samples), "errors": len(samples) - len(ok),
        "error_examples": sorted({s.error for s in samples if not s.ok})[:3],
        "makespan_s": makespan, "requests_per_s": len(samples) / makespan,
        "prompt_tokens": prompt, "completion_tokens": completion,
        "corpus_prefill_tok_s": prompt / makespan, "corpus_decode_tok_s": (completion - len(ok)) / makespan,
        "avg_decode_batch": rows / steps if steps else None,
        "ttft_ms": percentiles([s.ttft_s for s in ok]),
        "tpot_ms": percentiles([t for s in ok if (t := s.tpot_s) is not None]),
        "itl_ms": percentiles([g for s in ok for g in s.gaps_s]),
        "acceptance": sum(s.accepted for s in ok) / drafted if drafted else None,
        "finish_reasons": {r: sum(s.finish_reason == r for s in ok) for r in {s.finish_reason for s in ok}},
    }
    if mode == "saturation":
        steady_rows, steady_s = sampler.steady(concurrency)
        result["steady_decode_tok_s"] = steady_rows / steady_s if steady_s else None
        result["steady_seconds"] = steady_s
    return result


def start_server(serve_args: str) -> tuple[subprocess.Popen, str]:
    import httpx

    proc = subprocess.Popen([sys.executable, "-m", "ninfer_app", "serve", *shlex.split(serve_args), "--port", "0"],
                            stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    match = re.search(r"listening on (http://\S+) ", proc.stderr.readline())
    if match is None:
        proc.kill()
        raise RuntimeError("ninfer serve did not start")
    url, deadline = match.group(1), time.monotonic() + 1800
    while httpx.get(url + "/health").status_code != 200:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"ninfer serve exited or never became ready: {proc.stderr.read()[-2000:]}")
        time.sleep(0.5)
    return proc, url


def bench_serve(
    mode: Annotated[str, typer.Option(help="corpus (makespan), saturation (decode wave) or ttft (per prompt length).")] = "corpus",
    concurrency: Annotated[str, typer.Option(help="Comma-separated concurrency points.")] = "1,2,4,8",
    url: Annotated[Optional[str], typer.Option(help="A running server (all points share it).")] = None,
    serve: Annotated[Optional[str], typer.Option(help="`ninfer serve` arguments: a fresh server per point.")] = None,
    corpus: Annotated[Optional[Path], typer.Option(help="JSON lines of requests (see BenchRequest).")] = None,
    synthetic: Annotated[int, typer.Option(help="Without --corpus: this many random-token requests.")] = 16,
    prompt_tokens: Annotated[int, typer.Option(help="Synthetic prompt length.")] = 512,
    max_tokens: Annotated[int, typer.Option(help="Synthetic answer length.")] = 256,
    greedy: Annotated[bool, typer.Option(help="Temperature 0 instead of the methodology's sampling.")] = False,
    interval: Annotated[float, typer.Option(help="Seconds between server samples (saturation).")] = 1.0,
    lengths: Annotated[str, typer.Option(help="Prompt lengths of the ttft mode, comma-separated.")] = "37,128,512,2048,8192",
    repeats: Annotated[int, typer.Option(help="ttft mode: fresh prompts per length after the first.", min=1)] = 3,
    api_key: Annotated[Optional[str], typer.Option(envvar="NINFER_API_KEY")] = None,
    engine: Annotated[Optional[Path], typer.Option(help="`ninfer bench engine --json` output of the same model: "
                                                   "each figure also as a ratio to the engine's.")] = None,
    out: Annotated[Optional[Path], typer.Option(help="Write the JSON report here.")] = None,
) -> None:
    """Measure a server: makespan, tok/s, TTFT / TPOT / ITL percentiles, acceptance, per concurrency."""
    if (url is None) == (serve is None):
        raise typer.BadParameter("give exactly one of --url or --serve")
    if mode not in ("corpus", "saturation", "ttft"):
        raise typer.BadParameter("--mode must be corpus, saturation or ttft")
    reference = load_engine_report(engine) if engine is not None else None
    sampling = {"temperature": 0.0} if greedy else STOCHASTIC
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    if mode == "ttft":
        return _bench_ttft(url, serve, [int(x) for x in lengths.split(",")], repeats, sampling, headers, out,
                           reference)
    requests = load_corpus(corpus) if corpus else synthetic_corpus(synthetic, prompt_tokens, max_tokens)
    random.Random(SHUFFLE_SEED).shuffle(requests)
    report = []
    for c in [int(x) for x in concurrency.split(",")]:
        result = _on_server(url, serve, lambda point_url: run_point(point_url, headers, mode, requests, c, sampling,
                                                                    interval))
        if reference is not None:
            result["vs_engine"] = decode_ratios(result, reference)
        report.append(result)
        ttft, tpot = result["ttft_ms"] or {}, result["tpot_ms"] or {}
        typer.echo(f"C={c}: {result['requests']} req ({result['errors']} failed) in {result['makespan_s']:.2f} s, "
                   f"decode {result['corpus_decode_tok_s']:.1f} tok/s, TTFT p50 {ttft.get('p50', 0):.1f} ms, "
                   f"TPOT p50 {tpot.get('p50', 0):.2f} ms, avg batch {result['avg_decode_batch'] or 0:.2f}"
                   + (f", steady {result['steady_decode_tok_s'] or 0:.1f} tok/s" if mode == "saturation" else "")
                   + _ratio_text(result.get("vs_engine"), {"tpot_vs_loop": "TPOT / the loop's",
                                                           "tpot_vs_step": "TPOT / the GPU step's",
                                                           "tpot_vs_limit": "TPOT / the limit",
                                                           "steady_vs_loop": "steady / the loop's tok/s"}))
    if out is not None:
        out.write_text(json.dumps({"mode": mode, "points": report}, indent=2))


def _on_server(url: str | None, serve: str | None, run: Callable[[str], Coroutine[Any, Any, Result]]) -> Result:
    """run(url) on `url`, or on a fresh `ninfer serve` started with the `serve` arguments and
    stopped after; an unreachable server is a clean error."""
    import httpx

    try:
        proc, point_url = start_server(serve) if serve is not None else (None, url)
    except RuntimeError as e:
        fail(str(e))
    try:
        return asyncio.run(run(point_url))  # type: ignore[arg-type]
    except httpx.HTTPError as e:
        fail(f"{point_url}: {e} (is the server running?)")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)


def _bench_ttft(url: str | None, serve: str | None, lengths: list[int], repeats: int, sampling: dict[str, Any],
                headers: dict[str, str], out: Path | None, reference: dict[str, Any] | None = None) -> None:
    """The ttft mode: one server (a fresh one with --serve, so that first sights are the server's)."""
    rows = _on_server(url, serve, lambda point_url: run_ttft(point_url, headers, lengths, repeats, sampling))

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    for row in rows:
        if reference is not None:
            row["vs_engine"] = ttft_ratios(row, reference)
        typer.echo(f"{row['tokens']} tokens: TTFT first {ms(row['first_ms'])} ms, repeat {ms(row['repeat_ms'])} ms, "
                   f"cached {ms(row['cached_ms'])} ms; chat {ms(row['chat_ms'])} ms, same system prompt "
                   f"{ms(row['chat_shared_ms'])} ms, next turn {ms(row['chat_turn2_ms'])} ms ({row['errors']} failed)"
                   + _ratio_text(row.get("vs_engine"), {"first": "first / the engine's",
                                                        "repeat": "repeat / the engine's",
                                                        "chat": "chat / the engine's",
                                                        "repeat_vs_limit": "repeat / the limit"}))
    if out is not None:
        out.write_text(json.dumps({"mode": "ttft", "lengths": rows}, indent=2))


def load_engine_report(path: Path) -> dict[str, Any]:
    """`ninfer bench engine --json` output: its `ttft` and `decode` rows; a file that is not one is a
    clean error before any request is sent."""
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        fail(f"--engine {path}: cannot read it as JSON ({e})")
    if not isinstance(report, dict) or not isinstance(report.get("ttft"), list) or \
            not isinstance(report.get("decode"), list):
        fail(f"--engine {path}: not a `ninfer bench engine --json` report (no ttft / decode rows)")
    return report


def _ratio(served: float | None, engine: Any) -> float | None:
    return served / engine if served is not None and isinstance(engine, (int, float)) and engine > 0 else None


def ttft_ratios(row: dict[str, Any], reference: dict[str, Any]) -> dict[str, float | None]:
    """A ttft row's first / repeat / chat TTFT over the engine's at the same prompt length, and its
    repeat over the prefill's limit (None where the engine report has no such length or figure)."""
    engine = next((r for r in reference["ttft"] if r.get("tokens") == row["tokens"]), {})
    ratios = {key: _ratio(row[f"{key}_ms"], engine.get(f"{key}_ms")) for key in ("first", "repeat", "chat")}
    return {**ratios, "repeat_vs_limit": _ratio(row["repeat_ms"], engine.get("limit_ms"))}


def decode_ratios(point: dict[str, Any], reference: dict[str, Any]) -> dict[str, float | None]:
    """A point's TPOT p50 over the engine loop's at the batch of its concurrency, over the GPU's step
    alone and over the step's limit; its steady decode (saturation) over the loop's aggregate tok/s."""
    engine = next((r for r in reference["decode"] if r.get("batch") == point["concurrency"]), {})
    tpot = (point.get("tpot_ms") or {}).get("p50")
    return {"tpot_vs_loop": _ratio(tpot, engine.get("tpot_ms")), "tpot_vs_step": _ratio(tpot, engine.get("step_ms")),
            "tpot_vs_limit": _ratio(tpot, engine.get("limit_ms")),
            "steady_vs_loop": _ratio(point.get("steady_decode_tok_s"), engine.get("tok_s"))}


def _ratio_text(ratios: dict[str, float | None] | None, labels: dict[str, str]) -> str:
    shown = [f"{labels[k]} {v:.3f}x" for k, v in (ratios or {}).items() if v is not None and k in labels]
    return f"; {', '.join(shown)}" if shown else ""


def register(bench_group: typer.Typer) -> None:
    """Add `serve` to a `bench` command group."""
    bench_group.command("serve")(bench_serve)


"""GET /metrics in the Prometheus text format, from a registry private to each app.

Request counts by route and status come from an ASGI middleware; token counts and latency
histograms (queue time, time to first token, inter-token latency, request duration) from the
engine service's observer hooks, i.e. engine-side timing; KV usage, running and waiting
requests are read from the services when scraped, and so are the speculative-decoding counters
(drafted / accepted tokens, verify rounds; zero without a drafter, so dashboards need not change).
With several models loaded, the engine series are their sums (the largest batch: the maximum).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..engine.service import EngineService, ServiceStats

router = APIRouter()

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/models", "/health",
          "/api/ps", "/api/stop")
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.5, 1, 2, 5, 10, 30, 60, 120)


class ServerMetrics:
    """The app's registry; also the engine service's observer (see ServiceObserver)."""

    def __init__(self, services: Callable[[], list[EngineService]]):
        """`services`: the engines in memory now (read at each scrape)."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ninfer_http_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=r)
        self.prompt_tokens = Counter("ninfer_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("ninfer_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter("ninfer_requests_finished", "Engine requests finished by reason", ["finish_reason"],
                                registry=r)
        self.queue_time = Histogram("ninfer_queue_time_seconds", "Time waiting for admission", registry=r,
                                    buckets=_LATENCY_BUCKETS)
        self.ttft = Histogram("ninfer_time_to_first_token_seconds", "Submit to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.itl = Histogram("ninfer_inter_token_latency_seconds", "Gap between a request's outputs", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.duration = Histogram("ninfer_request_duration_seconds", "Submit to last token", registry=r,
                                  buckets=_LATENCY_BUCKETS)
        r.register(_EngineGauges(services))

    # -- ServiceObserver --------------------------------------------------------------------

    def request_admitted(self, queued_s: float, prompt_tokens: int) -> None:
        self.queue_time.observe(queued_s)
        self.prompt_tokens.inc(prompt_tokens)

    def tokens_generated(self, count: int, first: bool, latency_s: float) -> None:
        self.generation_tokens.inc(count)
        (self.ttft if first else self.itl).observe(latency_s)

    def request_finished(self, finish_reason: str, duration_s: float) -> None:
        self.finished.labels(finish_reason).inc()
        self.duration.observe(duration_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineGauges(Collector):
    """Point-in-time engine state, read at scrape time (summed over the loaded models)."""

    def __init__(self, services: Callable[[], list[EngineService]]):
        self.services = services

    def collect(self) -> Iterator[Metric]:
        stats: list[ServiceStats] = [service.stats() for service in self.services()]
        if not stats:
            return
        engines = [s.engine for s in stats]
        specs = [e.spec for e in engines if e.spec is not None]
        used, capacity = sum(e.kv_used_tokens for e in engines), sum(e.kv_capacity_tokens for e in engines)
        for name, doc, value in (
            ("ninfer_kv_cache_usage_ratio", "Fraction of KV cache tokens in use", used / capacity if capacity else 0.0),
            ("ninfer_kv_cache_used_tokens", "KV cache tokens in use", used),
            ("ninfer_kv_cache_capacity_tokens", "KV cache capacity in tokens", capacity),
            ("ninfer_kv_cache_bytes", "KV cache size in bytes", sum(e.kv_bytes for e in engines)),
            ("ninfer_weight_bytes", "Resident model weight bytes (after quantization)",
             sum(e.weight_bytes for e in engines)),
            ("ninfer_kv_cache_reserved_tokens", "KV tokens held by running requests",
             sum(s.kv_reserved_tokens for s in stats)),
            ("ninfer_prefix_cache_bytes", "Memory the prefix cache holds (KV pages + GDN state checkpoints)",
             sum(e.prefix_cached_bytes for e in engines)),
            ("ninfer_prefix_cache_checkpoints", "GDN state checkpoints kept by the prefix cache",
             sum(e.prefix_checkpoints for e in engines)),
            ("ninfer_requests_running", "Requests in the engine", sum(e.running for e in engines)),
            ("ninfer_requests_waiting", "Requests in the admission queue", sum(s.waiting for s in stats)),
            ("ninfer_decode_batch_max", "Largest decode batch so far", max(e.max_decode_batch for e in engines)),
            ("ninfer_models_loaded", "Models in memory", len(stats)),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        # step counters: a client sampling them each second finds the steady decode intervals
        for name, doc, value in (
            ("ninfer_engine_decode_steps", "Batched decode steps", sum(e.decode_steps for e in engines)),
            ("ninfer_engine_decode_rows", "Sequences decoded, summed over decode steps",
             sum(e.decode_rows for e in engines)),
            ("ninfer_engine_prefill_chunks", "Prefill chunks computed", sum(e.prefill_chunks for e in engines)),
            ("ninfer_spec_decode_draft_tokens", "Speculative tokens proposed", sum(s.drafted for s in specs)),
            ("ninfer_spec_decode_accepted_tokens", "Speculative tokens accepted", sum(s.accepted for s in specs)),
            ("ninfer_spec_decode_rounds", "Speculative verify rounds, summed over sequences",
             sum(s.rounds for s in specs)),
            ("ninfer_prefix_cache_hits", "Prompt tokens served from the prefix cache",
             sum(e.prefix_hit_tokens for e in engines)),
            ("ninfer_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
             sum(e.prefix_queried_tokens for e in engines)),
        ):
            yield CounterMetricFamily(name, doc, value=value)


class RequestCounter:
    """ASGI middleware: count every HTTP response by route (known routes only) and status."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = next((r for r in ROUTES if path == r or path.startswith(r + "/")), "other")

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

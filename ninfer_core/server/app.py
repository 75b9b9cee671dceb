"""The FastAPI app and ServerHandle, which runs it on uvicorn in a background thread.

ServerHandle is the one way to serve, for `ninfer serve` and for the TUI's toggle alike:
`ServerHandle.start(model, host, port, ...)` returns once the socket listens; `stop()` ends the
requests in flight (their streams get an error event) and the server. `model` is the startup
model: an LLM (the handle runs an EngineService on it and stops it again), an EngineService the
caller owns, or a loader function run in the background while /health answers 503. While a
handle serves an LLM, that LLM's engine belongs to the service: chat through `handle.service`.

Requests pick a model by name through the ModelPool (model_pool.py): `names` says which names
exist (default: only the startup model's) and `loader` loads the others on demand.
"""

from __future__ import annotations

import logging
import re
import socket
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial

import uvicorn
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.concurrency import run_in_threadpool
from starlette.types import Message

from ..engine.service import DEFAULT_MAX_QUEUE, EngineService
from ..errors import NinferError
from ..llm import LLM
from . import (anthropic, completions, embeddings, metrics, models, ollama, ollama_models, openai_chat, responses,
               tokenize)
from .auth import ApiKeyMiddleware
from .body import DEFAULT_MAX_BODY_BYTES
from .boundary import ErrorBoundary
from .errors import install_error_handlers
from .hosts import LOCAL_ORIGINS, ClientCheck, HostPolicy, OriginPolicy
from .media_fetch import MediaFetchLimits, MediaResolver
from .metrics import RequestCounter, ServerMetrics
from .model_pool import FixedNames, ModelNames, ModelPool, PoolOptions
from .response_store import DEFAULT_MAX_RESPONSES, ResponseStore

log = logging.getLogger(__name__)

WARM_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")


def create_app(
    pool: ModelPool,
    server_metrics: ServerMetrics,
    *,
    api_key: str | None = None,
    cors_origins: Sequence[str] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_stored_responses: int = DEFAULT_MAX_RESPONSES,
    allow_local_media: bool = False,
    media_fetch: MediaFetchLimits | None = None,
    hosts: HostPolicy | None = None,
) -> FastAPI:
    """`allow_local_media`: clients may name files on this machine (else data: and http(s) URLs only);
    `hosts`: the Host names answered (hosts.py; default: a loopback server's); `cors_origins`: the web
    page origins served besides loopback ones (hosts.py); CORS admits the same."""
    app = FastAPI(title="ninfer", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=partial(_warm_up, api_key=api_key))
    app.state.pool = pool
    app.state.inflight = set()  # engine streams of this app's requests (generation.py), for stop()
    app.state.max_body_bytes = max_body_bytes
    app.state.responses = ResponseStore(max_stored_responses)
    app.state.media = MediaResolver(allow_local_media, media_fetch)
    app.state.metrics = server_metrics
    app.state.pull_options = None  # hub.PullOptions of /api/pull (None: the defaults, HF_ENDPOINT etc.)
    for module in (models, openai_chat, completions, responses, anthropic, tokenize, embeddings, ollama, ollama_models,
                   metrics):
        app.include_router(module.router)
    install_error_handlers(app)
    # the last added is the outermost: count everything (500s included: the boundary answers them
    # inside the counter; the 403s of foreign Host names and Origins too), refuse those first, answer
    # preflights before the key check
    app.add_middleware(ErrorBoundary)
    app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    origins = list(cors_origins or [])
    app.add_middleware(
        CORSMiddleware,
        allow_origins=origins,
        allow_origin_regex=LOCAL_ORIGINS,  # pages on this machine, as the Origin check (hosts.py) allows
        allow_methods=["*"],
        allow_headers=["*"],
        expose_headers=["Retry-After"],
        max_age=600,
    )
    app.add_middleware(ClientCheck, hosts=hosts or HostPolicy.for_server("127.0.0.1", None),
                       origins=OriginPolicy.for_server(cors_origins))
    app.add_middleware(RequestCounter, metrics=app.state.metrics)
    return app


@asynccontextmanager
async def _warm_up(app: FastAPI, api_key: str | None) -> AsyncIterator[None]:
    """As uvicorn starts, before it takes connections: one empty POST to each generation route (a 400
    before any model work) and one call in the thread pool. What Starlette, FastAPI and anyio make
    on first use (the middleware stack, the routes, each endpoint's source context, a worker thread)
    is then not made in the first client's request: ~4 ms of its TTFT (tiny model on this CPU). The
    requests are not counted in /metrics. A failure here is logged; the server starts anyway."""
    headers = [(b"content-length", b"0")]
    if api_key is not None:
        headers.append((b"authorization", b"Bearer " + api_key.encode()))
    try:
        for path in WARM_ROUTES:
            scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                     "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
                     "headers": headers, "client": None, "server": None}
            await app(scope, _empty_body, _discard)
        await run_in_threadpool(lambda: None)
    except Exception:  # noqa: BLE001 - the first request pays instead
        log.exception("warming up the server's routes failed")
    app.state.metrics.requests.clear()
    yield


async def _empty_body() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


async def _discard(message: Message) -> None:
    pass


ModelSource = LLM | EngineService | Callable[[], LLM]


class ServerHandle:
    def __init__(self, app: FastAPI, server: uvicorn.Server, sock: socket.socket, pool: ModelPool):
        self.app = app
        self.pool = pool
        self._server = server
        self._sock = sock
        self._borrowed: EngineService | None = None  # the caller's: only our observer is removed
        # set when uvicorn returns: waited on instead of Thread.join, which a KeyboardInterrupt can
        # leave reporting a live thread as finished (CPython gh-90882), so the process would exit
        # under a stream in flight
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ninfer-http", daemon=True)

    @classmethod
    def start(
        cls,
        model: ModelSource,
        host: str = "127.0.0.1",
        port: int = 8080,
        *,
        api_key: str | None = None,
        cors_origins: Sequence[str] | None = None,
        max_queue: int = DEFAULT_MAX_QUEUE,
        max_concurrency: int | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        model_id: str | None = None,
        allow_local_media: bool = False,
        media_fetch: MediaFetchLimits | None = None,
        names: ModelNames | None = None,
        loader: Callable[[str], LLM] | None = None,
        pool_options: PoolOptions | None = None,
        allowed_hosts: Sequence[str] | None = None,
    ) -> ServerHandle:
        """Listen on host:port (0 = any free port) and serve `model` (see the module doc) under
        `model_id` (default: the model's own name; "default" for a loader), plus what `names` lists.
        `allowed_hosts`: Host names answered besides loopback names, IP addresses and `host`
        (hosts.py: the DNS-rebinding guard).

        Logging is left to the host program (uvicorn's loggers propagate to the root logger), so
        an embedding UI keeps control of the terminal.
        """
        if model_id is None:
            own = model if isinstance(model, LLM) else model.llm if isinstance(model, EngineService) else None
            model_id = own.name if own is not None else "default"
        server_metrics = ServerMetrics(lambda: pool.services())

        def make_service(llm: LLM) -> EngineService:
            return EngineService(llm, max_queue=max_queue, max_concurrency=max_concurrency,
                                 observers=[server_metrics]).start()

        pool = ModelPool(names or FixedNames({model_id: model_id}), make_service, loader, pool_options,
                         default=model_id)
        app = create_app(pool, server_metrics, api_key=api_key, cors_origins=cors_origins, max_body_bytes=max_body_bytes,
                         allow_local_media=allow_local_media, media_fetch=media_fetch,
                         hosts=HostPolicy.for_server(host, allowed_hosts))
        sock = _listen(host, port)
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="on", timeout_graceful_shutdown=5)
        handle = cls(app, uvicorn.Server(config), sock, pool)
        if isinstance(model, EngineService):
            model.observers.append(app.state.metrics)
            handle._borrowed = model
            pool.add(model_id, model.start(), borrowed=True)
        elif isinstance(model, LLM):
            pool.add(model_id, make_service(model))
        else:
            pool.load_startup(model_id, model)
        handle._thread.start()
        while not handle._server.started and not handle._done.wait(0.01):
            pass
        if not handle._server.started:
            handle.stop()
            raise NinferError(f"the server on {host}:{port} failed to start (see the log above)")
        return handle

    @property
    def host(self) -> str:
        return self._sock.getsockname()[0]

    @property
    def port(self) -> int:
        return self._sock.getsockname()[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def model_id(self) -> str:
        """The startup model's name (what a request without `model` gets)."""
        return self.pool.default or ""

    @property
    def service(self) -> EngineService | None:
        """The startup model's service (None while it loads, or once another model took its place)."""
        return self.pool.service()

    @property
    def error(self) -> str | None:
        """Why the startup model failed to load, if it did."""
        return self.pool.default_error

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server stops (True) or `timeout` passes (False)."""
        return self._done.wait(timeout)

    def stop(self) -> None:
        """Every request in flight ends first (a stream with its error event), then the server
        (uvicorn waits for those answers to go out), then the socket."""
        self.pool.close()  # owned services stop: streams in flight end with an error event
        for stream in self.app.state.inflight.copy():  # a borrowed service runs on: cancel ours only
            stream.cancel()
        if self._borrowed is not None and self.app.state.metrics in self._borrowed.observers:
            self._borrowed.observers.remove(self.app.state.metrics)
        self._server.should_exit = True
        if self._thread.ident is not None:
            self._done.wait()
        self._sock.close()

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self._sock])
        finally:
            self._done.set()


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if re.fullmatch(r"[0-9a-fA-F:]+", host) and ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, as asyncio's own listeners have: asyncio turns Nagle's algorithm off
    # (TCP_NODELAY) only on connections whose socket says so. With proto 0 every small SSE write
    # waited for the client's delayed ACK: ~40 ms before the first token of each request after
    # the first on a keep-alive connection (this CPU, in-process: 40-46 ms -> 0.1-0.5 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise NinferError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(128)
    return sock

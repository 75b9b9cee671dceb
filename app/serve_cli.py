"""`ninfer serve`: the OpenAI / Anthropic-compatible server, every flag also an environment variable.

The socket listens at once and /health answers 503 while the startup model loads, so a supervisor
or an editor can start the server and poll it. Every other model of this machine (`ninfer ls`) is
served by name too, loaded on demand (`--max-loaded`, `--keep-alive`). Ctrl-C or SIGTERM stops it:
requests in flight get their error event, then the server and the engines stop
(server/stop_signals.py).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from ninfer_core.errors import NinferError

from .engine_flags import (
    KV_CAPACITY_HELP,
    KV_DTYPE_HELP,
    MAX_CONTEXT_FLAGS,
    MAX_CONTEXT_HELP,
    MMPROJ_HELP,
    PREFIX_CACHE_GB_HELP,
    PREFIX_CACHE_HELP,
    CPU_MATH_HELP,
    THREADS_HELP,
    WEIGHTS_HELP,
    apply_cpu_runtime,
    check_engine_options,
    describe_engine,
    parse_kv_capacity,
)
from .models_cli import pull_if_needed
from .output import fail
from .tui.settings import default_model

if TYPE_CHECKING:
    from ninfer_core.llm import EngineOptions


def _env(name: str) -> str:
    return f"NINFER_{name}"


def keep_alive_flag(value: str) -> float:
    """--keep-alive in seconds (keep_alive.FOREVER for -1)."""
    from ninfer_core.server.keep_alive import parse_keep_alive

    try:
        return parse_keep_alive(value)
    except ValueError as e:
        raise NinferError(f"--keep-alive: {e}") from None


def on_demand_options(options: EngineOptions, spec: str) -> EngineOptions:
    """The engine options of a model loaded on demand: the startup model's, without what belongs to
    that model alone (its chat template, its drafter, its vision projector) and with --max-context
    capped at the model's own limit (a 32k flag must not refuse an 8k model)."""
    from ninfer_core.hub.catalog import locate, model_config

    other = replace(options, chat_template=None, spec=None, draft_tokens=None, draft_model=None, adaptive_draft=False,
                    mmproj=None)
    if other.max_context is not None:
        other = replace(other, max_context=min(other.max_context, model_config(locate(spec)).max_position_embeddings))
    return other


def startup_model(spec: str | None) -> tuple[str, str]:
    """(name clients use, what the loader loads) of the model `ninfer serve [MODEL]` starts with."""
    from ninfer_core.hub.catalog import embedded_model, find_model

    if spec is None:
        embedded = embedded_model()
        if embedded is None:
            from ninfer_core.models.default_model import default_model_path

            default_model_path()  # raises the install hint
        return embedded.name, str(embedded.path)  # type: ignore[union-attr]
    path = Path(spec).expanduser()
    if path.exists():
        return (path.stem if path.is_file() else path.resolve().name), spec
    found = find_model(spec)
    return (found.name if found is not None else spec), spec


def serve(
    model: Annotated[Optional[str], typer.Argument(
        help="HF checkpoint directory or .gguf file (default: the embedded SmolLM2-135M-Instruct).",
        envvar=_env("MODEL"))] = None,
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0 for every interface).",
                                      envvar=_env("HOST"))] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.", envvar=_env("PORT"))] = 8080,
    api_key: Annotated[Optional[str], typer.Option(help="Require this key (Bearer or x-api-key); unset: accept any.",
                                                   envvar=_env("API_KEY"))] = None,
    cors_origin: Annotated[Optional[list[str]], typer.Option(
        help="Allowed browser origin besides localhost pages (repeatable; '*' for any). Requests from "
             "web pages of other origins get 403.",
        envvar=_env("CORS_ORIGIN"))] = None,
    allowed_hosts: Annotated[Optional[list[str]], typer.Option(
        "--allowed-hosts",
        help="Host name clients may reach this server by, besides localhost, IP addresses and --host (repeatable; "
             "'*' for any). Others get 403 (DNS-rebinding guard). Default with --host 0.0.0.0: any.",
        envvar=_env("ALLOWED_HOSTS"))] = None,
    max_concurrency: Annotated[int, typer.Option(help="Requests decoded together in one batch.",
                                                 envvar=_env("MAX_CONCURRENCY"))] = 8,
    max_queue: Annotated[int, typer.Option(help="Requests waiting for admission before 429.",
                                           envvar=_env("MAX_QUEUE"))] = 64,
    max_context: Annotated[Optional[int], typer.Option(*MAX_CONTEXT_FLAGS, help=MAX_CONTEXT_HELP,
                                                       envvar=_env("MAX_CONTEXT"))] = None,
    max_loaded: Annotated[int, typer.Option(help="Models in memory at once (others load on demand, the least "
                                                 "recently used idle one making room).",
                                            envvar=_env("MAX_LOADED"))] = 1,
    keep_alive: Annotated[str, typer.Option(help="How long a model loaded on demand stays after its last request "
                                                 "(5m, 30s, 1h30m; 0: unload at once; -1: forever). The startup model "
                                                 "stays until another needs its place (or a request's "
                                                 "keep_alive says otherwise).",
                                            envvar=_env("KEEP_ALIVE"))] = "5m",
    kv_capacity: Annotated[str, typer.Option(help=KV_CAPACITY_HELP, envvar=_env("KV_CAPACITY"))] = "auto",
    kv_dtype: Annotated[str, typer.Option(help=KV_DTYPE_HELP, envvar=_env("KV_DTYPE"))] = "auto",
    weights: Annotated[str, typer.Option(help=WEIGHTS_HELP, envvar=_env("WEIGHTS"))] = "auto",
    prefill_chunk: Annotated[Optional[int], typer.Option(help="Prefill chunk in tokens (default 8192 on GPUs of 48+ GiB, else 4096; 1024 CPU).",
                                                         envvar=_env("PREFILL_CHUNK"))] = None,
    chat_template: Annotated[Optional[Path], typer.Option(help="Jinja chat template file for the startup model "
                                                               "(it, --spec and the draft flags apply to it alone).",
                                                          envvar=_env("CHAT_TEMPLATE"))] = None,
    model_name: Annotated[Optional[str], typer.Option(help="Name of the startup model for clients (default: its "
                                                           "name in `ninfer ls`, or its directory / file name).",
                                                      envvar=_env("MODEL_NAME"))] = None,
    max_body_mb: Annotated[int, typer.Option(help="Largest request body in MiB.", envvar=_env("MAX_BODY_MB"))] = 32,
    allow_local_media: Annotated[bool, typer.Option(
        "--allow-local-media", help="Let clients name image / video files on this machine (paths, file:// URLs).",
        envvar=_env("ALLOW_LOCAL_MEDIA"))] = False,
    media_timeout: Annotated[float, typer.Option(help="Seconds to download one http(s) image or video.",
                                                 envvar=_env("MEDIA_TIMEOUT"))] = 30.0,
    allow_private_media_urls: Annotated[bool, typer.Option(
        "--allow-private-media-urls",
        help="Fetch image / video URLs on loopback, private and link-local addresses too (refused by default: "
             "clients could otherwise reach this machine's and the LAN's services through the server).",
        envvar=_env("ALLOW_PRIVATE_MEDIA_URLS"))] = False,
    device: Annotated[str, typer.Option(help="cpu, cuda or auto.", envvar=_env("DEVICE"))] = "auto",
    dtype: Annotated[str, typer.Option(help="auto (bf16 on GPU, fp32 on CPU), float32, bfloat16, float16.",
                                       envvar=_env("DTYPE"))] = "auto",
    vision: Annotated[bool, typer.Option("--vision", help="Load the vision tower at start (else on first media).",
                                         envvar=_env("VISION"))] = False,
    mmproj: Annotated[Optional[Path], typer.Option("--mmproj", help=MMPROJ_HELP, envvar=_env("MMPROJ"))] = None,
    spec: Annotated[Optional[str], typer.Option(help="Speculative decoding: mtp, dflash or ngram (default off).",
                                                envvar=_env("SPEC"))] = None,
    draft_tokens: Annotated[Optional[int], typer.Option(help="Drafts per round (default 3 mtp, 15 dflash, 4 ngram).",
                                                        envvar=_env("DRAFT_TOKENS"))] = None,
    adaptive_draft: Annotated[bool, typer.Option(
        "--adaptive-draft/--no-adaptive-draft",
        help="Per request, draft 0..--draft-tokens tokens a round from its recent acceptance (needs --spec).",
        envvar=_env("ADAPTIVE_DRAFT"))] = False,
    draft_model: Annotated[Optional[Path], typer.Option(help="DFlash drafter checkpoint directory.",
                                                        envvar=_env("DRAFT_MODEL"))] = None,
    random_weights: Annotated[bool, typer.Option(
        "--random-weights", help="Benchmark mode: config and tokenizer from MODEL, random weights.",
        envvar=_env("RANDOM_WEIGHTS"))] = False,
    threads: Annotated[Optional[int], typer.Option(help=THREADS_HELP)] = None,
    cpu_math: Annotated[Optional[str], typer.Option("--cpu-math", help=CPU_MATH_HELP)] = None,
    prefix_cache: Annotated[bool, typer.Option("--prefix-cache/--no-prefix-cache", help=PREFIX_CACHE_HELP,
                                               envvar=_env("PREFIX_CACHE"))] = True,
    prefix_cache_gb: Annotated[Optional[float], typer.Option(help=PREFIX_CACHE_GB_HELP,
                                                             envvar=_env("PREFIX_CACHE_GB"))] = None,
    log_level: Annotated[str, typer.Option(help="Server log level (debug, info, warning, error).",
                                           envvar=_env("LOG_LEVEL"))] = "warning",
) -> None:
    """Serve models over HTTP: OpenAI Chat Completions, Completions, Responses and Anthropic Messages.
    MODEL is loaded at start; every model in `ninfer ls` is served by its name too, loaded on demand."""
    from ninfer_core.llm import LLM, EngineOptions
    from ninfer_core.server.app import ServerHandle
    from ninfer_core.server.media_fetch import MediaFetchLimits
    from ninfer_core.server.model_pool import CatalogNames, PoolOptions
    from ninfer_core.server.stop_signals import StopSignals

    try:
        if log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise NinferError(f"--log-level must be debug, info, warning or error, got '{log_level}'")
        logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        options = EngineOptions(device=device, dtype=dtype, max_context=max_context,
                                kv_capacity=parse_kv_capacity(kv_capacity), kv_dtype=kv_dtype, weights=weights,
                                max_seqs=max_concurrency,
                                prefill_chunk=prefill_chunk, chat_template=chat_template, vision=vision,
                                mmproj=mmproj,
                                random_weights=random_weights, spec=spec, draft_tokens=draft_tokens,
                                draft_model=draft_model, adaptive_draft=adaptive_draft, prefix_cache=prefix_cache,
                                prefix_cache_gb=prefix_cache_gb)
        check_engine_options(options)
        pool = PoolOptions(max_loaded=max_loaded, keep_alive_s=keep_alive_flag(keep_alive))
        apply_cpu_runtime(threads, cpu_math)
        pull_if_needed(model or default_model())
        name, spec = startup_model(model or default_model())
        name = model_name or name
        handle = ServerHandle.start(lambda: LLM.load(spec, options), host, port, api_key=api_key,
                                    cors_origins=cors_origin, allowed_hosts=allowed_hosts, max_queue=max_queue,
                                    max_body_bytes=max_body_mb * 1024 * 1024, model_id=name,
                                    allow_local_media=allow_local_media,
                                    media_fetch=MediaFetchLimits(timeout_s=media_timeout,
                                                                 allow_private_urls=allow_private_media_urls),
                                    names=CatalogNames(startup=(name, spec)),
                                    loader=lambda other: LLM.load(other, on_demand_options(options, other)),
                                    pool_options=pool)
    except NinferError as e:
        fail(str(e))
    typer.secho(f"ninfer: listening on {handle.url} (OpenAI base URL {handle.url}/v1); loading the model...",
                err=True)
    announced = False
    with StopSignals() as signals:
        try:
            while not handle.wait(0.2) and handle.error is None and not signals.requested.is_set():
                service = handle.service
                if service is not None and not announced:
                    announced = True
                    typer.secho(f"ninfer: {handle.model_id} ready (context {service.context_limit} tokens, "
                                f"{service.max_concurrency} concurrent; {describe_engine(service.stats().engine)}); "
                                f"the other models of `ninfer ls` load on demand", err=True)
            if signals.received:
                stats = handle.service.stats() if handle.service else None
                busy = stats.engine.running + stats.waiting if stats else 0
                typer.secho(f"ninfer: {signals.received}: stopping ({busy} requests in flight end with an error)",
                            err=True)
        finally:
            handle.stop()
    if handle.error is not None:
        fail(handle.error)
    typer.secho("ninfer: stopped", err=True)


def register(cli: typer.Typer) -> None:
    cli.command()(serve)

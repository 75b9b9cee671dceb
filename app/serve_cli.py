"""`ninfer serve`: the OpenAI / Anthropic-compatible server, every flag also an environment variable.

The socket listens at once and /health answers 503 while the model loads, so a supervisor or
an editor can start the server and poll it. Ctrl-C or SIGTERM stops it: requests in flight get
their error event, then the server and the engine stop (server/stop_signals.py).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Optional

import typer

from ninfer_core.errors import NinferError

from .engine_flags import KV_CAPACITY_HELP, KV_DTYPE_HELP, WEIGHTS_HELP, describe_engine, parse_kv_capacity
from .output import fail
from .tui.settings import default_model


def _env(name: str) -> str:
    return f"NINFER_{name}"


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
        help="Allowed browser origin (repeatable; '*' for any). Default: localhost origins.",
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
    max_context: Annotated[Optional[int], typer.Option(help="Context limit per request in tokens.",
                                                       envvar=_env("MAX_CONTEXT"))] = None,
    kv_capacity: Annotated[str, typer.Option(help=KV_CAPACITY_HELP, envvar=_env("KV_CAPACITY"))] = "auto",
    kv_dtype: Annotated[str, typer.Option(help=KV_DTYPE_HELP, envvar=_env("KV_DTYPE"))] = "auto",
    weights: Annotated[str, typer.Option(help=WEIGHTS_HELP, envvar=_env("WEIGHTS"))] = "auto",
    prefill_chunk: Annotated[Optional[int], typer.Option(help="Prefill chunk in tokens (default 4096 GPU, 1024 CPU).",
                                                         envvar=_env("PREFILL_CHUNK"))] = None,
    chat_template: Annotated[Optional[Path], typer.Option(help="Jinja chat template file to use instead.",
                                                          envvar=_env("CHAT_TEMPLATE"))] = None,
    model_name: Annotated[Optional[str], typer.Option(help="Model id shown to clients (default: the model's name).",
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
    log_level: Annotated[str, typer.Option(help="Server log level (debug, info, warning, error).",
                                           envvar=_env("LOG_LEVEL"))] = "warning",
) -> None:
    """Serve a model over HTTP: OpenAI Chat Completions, Completions, Responses and Anthropic Messages."""
    from ninfer_core.llm import LLM, EngineOptions
    from ninfer_core.server.app import ServerHandle
    from ninfer_core.server.media_fetch import MediaFetchLimits
    from ninfer_core.server.stop_signals import StopSignals

    try:
        if log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise NinferError(f"--log-level must be debug, info, warning or error, got '{log_level}'")
        logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        options = EngineOptions(device=device, dtype=dtype, max_context=max_context,
                                kv_capacity=parse_kv_capacity(kv_capacity), kv_dtype=kv_dtype, weights=weights,
                                max_seqs=max_concurrency,
                                prefill_chunk=prefill_chunk, chat_template=chat_template, vision=vision,
                                random_weights=random_weights, spec=spec, draft_tokens=draft_tokens,
                                draft_model=draft_model, adaptive_draft=adaptive_draft)
        options.check_spec()
        handle = ServerHandle.start(lambda: LLM.load(model or default_model(), options), host, port, api_key=api_key,
                                    cors_origins=cors_origin, allowed_hosts=allowed_hosts, max_queue=max_queue,
                                    max_body_bytes=max_body_mb * 1024 * 1024, model_id=model_name,
                                    allow_local_media=allow_local_media,
                                    media_fetch=MediaFetchLimits(timeout_s=media_timeout,
                                                                 allow_private_urls=allow_private_media_urls))
    except NinferError as e:
        fail(str(e))
    typer.secho(f"ninfer: listening on {handle.url} (OpenAI base URL {handle.url}/v1); loading the model...",
                err=True)
    announced = False
    with StopSignals() as signals:
        try:
            while not handle.wait(0.2) and handle.slot.error is None and not signals.requested.is_set():
                if handle.service is not None and not announced:
                    announced = True
                    typer.secho(f"ninfer: {handle.slot.model_id} ready (context {handle.service.context_limit} "
                                f"tokens, {handle.service.max_concurrency} concurrent; "
                                f"{describe_engine(handle.service.stats().engine)})", err=True)
            if signals.received:
                stats = handle.service.stats() if handle.service else None
                busy = stats.engine.running + stats.waiting if stats else 0
                typer.secho(f"ninfer: {signals.received}: stopping ({busy} requests in flight end with an error)",
                            err=True)
        finally:
            handle.stop()
    if handle.slot.error is not None:
        fail(handle.slot.error)
    typer.secho("ninfer: stopped", err=True)


def register(cli: typer.Typer) -> None:
    cli.command()(serve)

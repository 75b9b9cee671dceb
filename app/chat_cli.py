"""`ninfer chat [MODEL]` (and bare `ninfer`, via `open_tui`): the terminal UI.

Local mode loads MODEL (a checkpoint directory, a .gguf file or a pulled model's name; default:
the model set in the wizard, else the embedded SmolLM2). Remote mode (`--endpoint URL`) chats
through any OpenAI-compatible server; MODEL then names one of its models (default: the first).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from ninfer_core.errors import NinferError

from .engine_flags import (
    KvDtypeOpt,
    MaxContextOpt,
    MmprojOpt,
    PrefixCacheGbOpt,
    PrefixCacheOpt,
    CpuMathOpt,
    ThreadsOpt,
    WeightsOpt,
    apply_cpu_runtime,
    check_engine_options,
)
from .models_cli import pull_if_needed

if TYPE_CHECKING:
    from ninfer_core.llm import EngineOptions

DEFAULT_SEQUENCES = 4  # the chat plus a few clients of the embedded server, decoded together


def chat(
    model: Annotated[Optional[str], typer.Argument(
        help="Checkpoint directory, .gguf file or pulled model (default: the wizard's default, else the "
             "embedded SmolLM2); with --endpoint, the server's model id.")] = None,
    image: Annotated[Optional[list[Path]], typer.Option(
        "--image", help="Image or video to attach to the first message (repeatable).")] = None,
    endpoint: Annotated[Optional[str], typer.Option(
        help="Chat through this OpenAI-compatible server (e.g. http://host:8000/v1) instead of a local model.",
        envvar="NINFER_ENDPOINT")] = None,
    api_key: Annotated[Optional[str], typer.Option(help="API key for --endpoint.", envvar="NINFER_ENDPOINT_API_KEY")] = None,
    max_context: MaxContextOpt = None,
    max_concurrency: Annotated[int, typer.Option(
        help="Sequences the engine runs at once (the embedded server shares them).")] = DEFAULT_SEQUENCES,
    spec: Annotated[Optional[str], typer.Option(help="Speculative decoding: mtp, dflash or ngram.")] = None,
    draft_tokens: Annotated[Optional[int], typer.Option(help="Drafts per round (default: per method).")] = None,
    adaptive_draft: Annotated[bool, typer.Option(
        "--adaptive-draft/--no-adaptive-draft",
        help="Per request, draft 0..--draft-tokens tokens a round from its recent acceptance (needs --spec).")] = False,
    draft_model: Annotated[Optional[Path], typer.Option(help="DFlash companion checkpoint directory.")] = None,
    weights: WeightsOpt = "auto",
    kv_dtype: KvDtypeOpt = "auto",
    mmproj: MmprojOpt = None,
    device: Annotated[str, typer.Option(help="cpu, cuda or auto.")] = "auto",
    dtype: Annotated[str, typer.Option(help="auto (bf16 on GPU, fp32 on CPU), float32, bfloat16, float16.")] = "auto",
    threads: ThreadsOpt = None,
    cpu_math: CpuMathOpt = None,
    prefix_cache: PrefixCacheOpt = True,
    prefix_cache_gb: PrefixCacheGbOpt = None,
) -> None:
    """Chat in the terminal UI (local model, or a remote server with --endpoint)."""
    from ninfer_core.llm import EngineOptions

    from .output import fail

    engine = EngineOptions(device=device, dtype=dtype, max_context=max_context, max_seqs=max_concurrency, spec=spec,
                           draft_tokens=draft_tokens, draft_model=draft_model, adaptive_draft=adaptive_draft,
                           weights=weights, kv_dtype=kv_dtype, mmproj=mmproj, prefix_cache=prefix_cache,
                           prefix_cache_gb=prefix_cache_gb)
    try:
        check_engine_options(engine)
        apply_cpu_runtime(threads, cpu_math)
    except NinferError as e:
        fail(str(e))
    if endpoint is None:
        pull_if_needed(model)
    open_tui(model, image=[str(p) for p in image or []], endpoint=endpoint, api_key=api_key, engine=engine)


def open_tui(model: str | None = None, *, image: list[str] | None = None, endpoint: str | None = None,
             api_key: str | None = None, engine: EngineOptions | None = None) -> None:
    """Run the TUI (bare `ninfer` calls this with no arguments: the default model, 4 sequences)."""
    from ninfer_core.llm import EngineOptions
    from ninfer_core.threads import apply_threads

    from .output import fail
    from .tui.app import LaunchOptions, NinferApp

    if api_key and not endpoint:
        fail("--api-key needs --endpoint")
    try:
        if engine is None:  # bare `ninfer`: NINFER_THREADS or the default (`ninfer chat` applied --threads)
            apply_threads(None)
        app = NinferApp(LaunchOptions(model=model, engine=engine or EngineOptions(max_seqs=DEFAULT_SEQUENCES),
                                      endpoint=endpoint, api_key=api_key, images=list(image or [])))
    except NinferError as e:
        fail(str(e))
    app.run()


def register(cli: typer.Typer) -> None:
    """Adds `ninfer chat`. Bare `ninfer` opens the TUI through the root callback calling `open_tui()`."""
    cli.command()(chat)

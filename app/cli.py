"""The `ninfer` command line: run a prompt or a conversation, benchmark a model.

Answers stream to stdout, reasoning and statistics to stderr, so `ninfer run ... > answer.txt`
keeps only the answer. Errors caused by the user's input print one line, no traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ninfer_core import __version__
from ninfer_core.errors import EngineError, NinferError

from . import bench_engine_cli, bench_serve, chat_cli, models_cli, ps_cli, serve_cli
from .engine_flags import (
    KvCapacityOpt,
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
    parse_int_list,
    parse_kv_capacity,
)
from .models_cli import pull_if_needed
from .output import fail
from .tui.settings import default_model

cli = typer.Typer(add_completion=False, help="Local inference for Qwen3.5 / Qwen3.6.")
bench_app = typer.Typer(help="Benchmarks: synthetic models (--synthetic) and the HTTP server (serve).")

ModelArg = Annotated[
    Optional[str],
    typer.Argument(metavar="MODEL", help="A model name (`ninfer ls`), checkpoint directory or .gguf file (default: the wizard's "
                        "default, else the embedded SmolLM2-135M-Instruct)."),
]
DeviceOpt = Annotated[str, typer.Option(help="cpu, cuda or auto.")]
DtypeOpt = Annotated[str, typer.Option(help="auto (bf16 on GPU, fp32 on CPU), float32, bfloat16, float16.")]
SpecOpt = Annotated[Optional[str], typer.Option(help="Speculative decoding: mtp, dflash or ngram (default off).")]
DraftTokensOpt = Annotated[Optional[int], typer.Option(
    help="Drafts per round (default 3 mtp, 15 dflash, 4 ngram; at most 5, block-1, 15).")]
DraftModelOpt = Annotated[Optional[Path], typer.Option(help="DFlash drafter checkpoint directory (--spec dflash).")]
AdaptiveDraftOpt = Annotated[bool, typer.Option(
    "--adaptive-draft/--no-adaptive-draft",
    help="Per request, draft 0..--draft-tokens tokens a round from its recent acceptance (needs --spec).")]


def _show_version(value: bool) -> None:
    if value:
        print(f"ninfer {__version__}")
        raise typer.Exit()


@cli.callback(invoke_without_command=True)
def _main(
    ctx: typer.Context,
    version: Annotated[bool, typer.Option("--version", callback=_show_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """Local inference for Qwen3.5 / Qwen3.6 and Llama-family models. Without a command: the chat TUI."""
    if ctx.invoked_subcommand is None:
        chat_cli.open_tui()


def _user_message(text: str, images: list[Path], videos: list[Path]) -> dict[str, Any]:
    """Media parts first, then the text (the order Qwen's examples use)."""
    if not images and not videos:
        return {"role": "user", "content": text}
    parts: list[dict[str, Any]] = [{"type": "image", "image": str(p)} for p in images]
    parts += [{"type": "video", "video": str(p)} for p in videos]
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


def _read_json(path: Path, what: str) -> Any:
    """A JSON file's value; errors name `what` (e.g. "messages file")."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise NinferError(f"{path}: cannot read {what} ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise NinferError(f"{path}: not valid JSON ({e})") from None


def _read_messages(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """A JSON list of OpenAI-style messages, or an object with `messages` (and `tools`)."""
    data = _read_json(path, "messages file")
    messages, tools = (data, None) if isinstance(data, list) else (data.get("messages"), data.get("tools"))
    if not isinstance(messages, list) or not messages:
        raise NinferError(f"{path}: expected a non-empty list of messages (or an object with 'messages')")
    for i, m in enumerate(messages):
        _check_message(m, f"{path}: messages[{i}]")
    if tools is not None and not isinstance(tools, list):
        raise NinferError(f"{path}: 'tools' must be a list")
    return messages, tools


def _check_message(message: Any, where: str) -> None:
    """OpenAI's message shape: a role, and content (a string or a list of parts; an assistant message
    with tool calls may leave it null)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise NinferError(f"{where}: expected an object with a string 'role'")
    content = message.get("content")
    if content is None and not (message["role"] == "assistant" and message.get("tool_calls")):
        raise NinferError(f"{where}: no 'content' (a string, or a list of parts such as "
                          f"{{\"type\": \"text\", \"text\": ...}}; null only beside an assistant's tool_calls)")
    if content is not None and not isinstance(content, (str, list)):
        raise NinferError(f"{where}: 'content' must be a string or a list of parts, got {type(content).__name__}")


def _prompt_text(prompt: str | None, positional: str | None) -> str | None:
    """--prompt, the PROMPT argument, or (neither given, stdin not a terminal) stdin: `echo hi | ninfer run`."""
    if prompt is not None and positional is not None:
        raise NinferError("give the prompt once: as PROMPT or with --prompt")
    text = prompt if prompt is not None else positional
    if text is None and not sys.stdin.isatty():
        text = sys.stdin.read().strip() or None
    return text


def _check_files(paths: list[Path], flag: str) -> None:
    for path in paths:
        if not path.is_file():
            raise NinferError(f"{flag} {path}: no such file")


def _output_format(value: str | None) -> Any:
    """--format: "json" (any JSON object) or a JSON Schema file -> the JsonOutput constraint."""
    from ninfer_core.chat.constraints import JsonOutput

    if value is None:
        return None
    if value == "json":
        return JsonOutput(source="--format")
    path = Path(value)
    schema = _read_json(path, "the --format schema file (or give 'json')")
    if not isinstance(schema, (dict, bool)):
        raise NinferError(f"--format {path}: a JSON Schema is an object")
    return JsonOutput(schema, source=f"--format {path}")


def _stats_line(llm, r) -> str:
    """The statistics line on stderr; on the CPU it names the threads in force (torch's own count)."""
    import torch

    t = r.timings
    spec_line = ""
    if r.spec is not None:
        s = r.spec
        spec_line = (f" | spec {s.method} K={s.draft_tokens}: {s.accepted}/{s.drafted} accepted "
                     f"({100 * s.acceptance_rate:.1f}%), {s.tokens_per_round:.2f} tok/round")
    device = llm.loaded.device
    threads = torch.get_num_threads()
    where = f"{threads} thread{'s' if threads != 1 else ''}" if device.type == "cpu" else str(device)
    return (f"[{llm.name}, {where}] prompt {len(r.prompt_token_ids)} tok, prefill {t.prefill_tok_s:.1f} tok/s | "
            f"{len(r.token_ids)} tok, decode {t.decode_tok_s:.1f} tok/s{spec_line} | finish: {r.finish_reason}")


@cli.command()
def run(
    model: ModelArg = None,
    prompt_arg: Annotated[Optional[str], typer.Argument(
        metavar="PROMPT", help="User message (or --prompt; without either, stdin when it is not a terminal).")] = None,
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", help="User message.")] = None,
    messages: Annotated[Optional[Path], typer.Option(help="JSON file of OpenAI-style messages (and tools).")] = None,
    system: Annotated[Optional[str], typer.Option(help="System message (with a prompt).")] = None,
    image: Annotated[Optional[list[Path]], typer.Option(help="Image file for the prompt (repeatable).")] = None,
    video: Annotated[Optional[list[Path]], typer.Option(help="Video file for the prompt (repeatable).")] = None,
    vision: Annotated[bool, typer.Option("--vision", help="Load the vision tower at start.")] = False,
    mmproj: MmprojOpt = None,
    max_tokens: Annotated[Optional[int], typer.Option(help="Most tokens to generate.")] = None,
    temperature: Annotated[Optional[float], typer.Option(help="0 = greedy.")] = None,
    top_k: Annotated[Optional[int], typer.Option(help="Keep the k most likely tokens (0 = no cap).")] = None,
    top_p: Annotated[Optional[float], typer.Option()] = None,
    min_p: Annotated[Optional[float], typer.Option()] = None,
    presence_penalty: Annotated[Optional[float], typer.Option()] = None,
    frequency_penalty: Annotated[Optional[float], typer.Option()] = None,
    repetition_penalty: Annotated[Optional[float], typer.Option()] = None,
    seed: Annotated[Optional[int], typer.Option()] = None,
    stop: Annotated[Optional[list[str]], typer.Option(help="Stop string (repeatable).")] = None,
    stop_token_id: Annotated[Optional[list[int]], typer.Option(help="Stop token id (repeatable).")] = None,
    no_thinking: Annotated[bool, typer.Option("--no-thinking", help="Answer without reasoning.")] = False,
    chat_template: Annotated[Optional[Path], typer.Option(help="Jinja chat template file to use instead.")] = None,
    max_context: MaxContextOpt = None,
    prefill_chunk: Annotated[Optional[int], typer.Option(help="Prefill chunk in tokens (default 8192 on GPUs of 48+ GiB, else 4096; 1024 CPU).")] = None,
    weights: WeightsOpt = "auto",
    kv_dtype: KvDtypeOpt = "auto",
    kv_capacity: KvCapacityOpt = "auto",
    spec: SpecOpt = None,
    draft_tokens: DraftTokensOpt = None,
    adaptive_draft: AdaptiveDraftOpt = False,
    draft_model: DraftModelOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    threads: ThreadsOpt = None,
    cpu_math: CpuMathOpt = None,
    prefix_cache: PrefixCacheOpt = True,
    prefix_cache_gb: PrefixCacheGbOpt = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of streaming.")] = False,
    output_format: Annotated[Optional[str], typer.Option(
        "--format", help="Force the answer (after any reasoning) to be JSON: 'json' (any object) or a JSON Schema "
                         "file.")] = None,
) -> None:
    """Answer one prompt (`ninfer run MODEL "PROMPT"`, --prompt, stdin, or --messages), streaming the answer."""
    import torch

    from ninfer_core.chat.output_parser import ContentDelta, ReasoningDelta, ToolCallEnd
    from ninfer_core.engine.sampling import SamplingParams
    from ninfer_core.llm import LLM, ChatFinished, ChatRequest, EngineOptions
    from ninfer_core.threads import busy_hint

    try:
        options = EngineOptions(device=device, dtype=dtype, max_context=max_context, prefill_chunk=prefill_chunk,
                                weights=weights, kv_dtype=kv_dtype, kv_capacity=parse_kv_capacity(kv_capacity),
                                chat_template=chat_template, vision=vision, mmproj=mmproj, spec=spec,
                                draft_tokens=draft_tokens,
                                draft_model=draft_model, adaptive_draft=adaptive_draft, prefix_cache=prefix_cache,
                                prefix_cache_gb=prefix_cache_gb)
        check_engine_options(options)
        apply_cpu_runtime(threads, cpu_math)
        if messages is not None and (prompt is not None or prompt_arg is not None):
            raise NinferError("give a prompt or --messages, not both")
        if prompt is None and prompt_arg is None and model is not None and " " in model and not Path(model).exists():
            raise NinferError(f"'{model}' is not a model: the model comes first (`ninfer run MODEL \"PROMPT\"`), "
                              f"or give the prompt alone with --prompt")
        text = None if messages is not None else _prompt_text(prompt, prompt_arg)
        if text is None and messages is None:
            raise NinferError("no prompt: `ninfer run [MODEL] \"PROMPT\"`, --prompt, --messages FILE, or pipe it in")
        tools = None
        if messages is not None:
            if image or video:
                raise NinferError("--image / --video go with a prompt; in --messages use image_url / video parts")
            chat_messages, tools = _read_messages(messages)
        else:
            _check_files(image or [], "--image")
            _check_files(video or [], "--video")
            chat_messages = ([{"role": "system", "content": system}] if system else []) + [
                _user_message(text, image or [], video or [])
            ]
        sampling = SamplingParams(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty, seed=seed,
            max_tokens=max_tokens, stop=list(stop or []), stop_token_ids=list(stop_token_id or []),
        )
        constraint = _output_format(output_format)
        spec = model or default_model()
        pull_if_needed(spec)
        llm = LLM.load(spec, options)
        request = ChatRequest(messages=chat_messages, sampling=sampling, tools=tools, enable_thinking=not no_thinking,
                              constraint=constraint)
        if json_out:
            print(json.dumps(llm.chat_result(request).to_json(), ensure_ascii=False))
            return
        for event in llm.chat(request):
            if isinstance(event, ReasoningDelta):
                typer.secho(event.text, nl=False, err=True, dim=True)
            elif isinstance(event, ContentDelta):
                sys.stdout.write(event.text)
                sys.stdout.flush()
            elif isinstance(event, ToolCallEnd):
                print(json.dumps({"tool_call": {"name": event.call.name, "arguments": json.loads(event.call.arguments)}},
                                 ensure_ascii=False))
            elif isinstance(event, ChatFinished):
                print()
                typer.secho(_stats_line(llm, event.result), err=True, dim=True)
                hint = busy_hint(torch.get_num_threads()) if llm.loaded.device.type == "cpu" else None
                if hint:
                    typer.secho(hint, err=True, dim=True)
    except (NinferError, EngineError) as e:
        fail(str(e))


@bench_app.callback(invoke_without_command=True)
def bench(
    ctx: typer.Context,
    model: Annotated[Optional[str], typer.Option(help="Checkpoint directory or .gguf file (or use --synthetic).")] = None,
    synthetic: Annotated[Optional[str], typer.Option(help="Preset with random weights: qwen3.6-35b-a3b, "
                                                          "qwen3.6-27b, tiny-qwen3.6-moe.")] = None,
    prefill: Annotated[str, typer.Option(help="Prompt lengths timed (comma list, 8k = 8192; none to skip).")] = "512,8k,64k",
    contexts: Annotated[str, typer.Option(help="Contexts of the batch-1 decode runs.")] = "4k,32k",
    batches: Annotated[str, typer.Option(help="Batch sizes of the aggregate decode runs (at --batch-context).")] = "1,2,4,8",
    batch_context: Annotated[int, typer.Option(help="Context of the batch > 1 decode runs.")] = 4096,
    decode_steps: Annotated[int, typer.Option(help="Decode steps timed per run.")] = 32,
    prefill_chunk: Annotated[int, typer.Option(help="Prefill chunk in tokens.")] = 8192,
    layers: Annotated[Optional[int], typer.Option(help="Only the preset's first N layers (its exact shapes where "
                                                       "the whole model does not fit, e.g. the 35B on a CPU).")] = None,
    weights: WeightsOpt = "auto",
    kv_dtype: KvDtypeOpt = "auto",
    cuda_graphs: Annotated[bool, typer.Option(help="Decode with CUDA graphs (GPU).")] = True,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    threads: ThreadsOpt = None,
    cpu_math: CpuMathOpt = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Prefill and decode speed against the bandwidth roofline (a preset with random weights or a checkpoint)."""
    if ctx.invoked_subcommand is not None:
        return
    if (synthetic is None) == (model is None):
        fail("give --model DIR or --synthetic PRESET (or a subcommand: `ninfer bench serve --help`)")
    from ninfer_core.bench import BenchSetup, run_bench

    try:
        apply_cpu_runtime(threads, cpu_math)
        setup = BenchSetup(
            model=synthetic or model, device=device, dtype=dtype, weights=weights, kv_dtype=kv_dtype,
            prefill_lengths=parse_int_list(prefill, "--prefill"), decode_contexts=parse_int_list(contexts, "--contexts"),
            decode_batches=parse_int_list(batches, "--batches"), batch_context=batch_context,
            decode_steps=decode_steps, prefill_chunk=prefill_chunk, cuda_graphs=cuda_graphs, layers=layers,
        )
        report = run_bench(setup, progress=lambda msg: typer.secho(msg, err=True, dim=True))
    except NinferError as e:
        fail(str(e))
    if json_out:
        print(json.dumps(report.to_json()))
        return
    r = report
    print(f"{r.model} on {r.device}: weights {r.weights} ({r.weight_bytes / 1e9:.2f} GB, "
          f"{r.weight_bytes_per_token / 1e9:.2f} GB/token), KV {r.kv_dtype}, graphs {'on' if r.cuda_graphs else 'off'}")
    if r.copy_bandwidth_gb_s == r.copy_bandwidth_gb_s:  # not NaN: a GPU
        print(f"copy bandwidth {r.copy_bandwidth_gb_s:.0f} GB/s -> batch-1 roofline {r.roofline_tok_s:.0f} tok/s")
    for p in r.prefill:
        print(f"prefill {p.tokens:>6} tokens: {p.tok_s:10.1f} tok/s ({p.seconds:.2f} s)")
    for d in r.decode:
        graph = "" if d.graph_ms_per_step is None else f"; the graph alone {d.graph_ms_per_step:.3f} ms"
        print(f"decode  batch {d.batch:>2} @ {d.context:>6}: {d.tok_s:10.1f} tok/s ({d.ms_per_step:.2f} ms/step, "
              f"{d.gb_s:.0f} GB/s, {100 * d.roofline_fraction:.1f}% of roofline{graph})")


models_cli.register(cli)
serve_cli.register(cli)
ps_cli.register(cli)
bench_serve.register(bench_app)
bench_engine_cli.register(bench_app)
chat_cli.register(cli)
cli.add_typer(bench_app, name="bench")


def main() -> None:
    cli()

"""`ninfer bench engine MODEL`: TTFT per prompt length and decode through the engine loop (GPU)."""

from __future__ import annotations

import json
import logging
import time
from typing import Annotated

import typer

from ninfer_core.errors import NinferError

from .engine_flags import KvDtypeOpt, WeightsOpt, parse_int_list
from .output import fail


def bench_engine(
    model: Annotated[str, typer.Argument(help="HF checkpoint directory (with --random-weights: config and "
                                              "tokenizer only) or .gguf file.")],
    lengths: Annotated[str, typer.Option(help="Prompt lengths of the TTFT runs (comma list, 8k = 8192).")]
    = "37,128,512,2k,8k",
    batches: Annotated[str, typer.Option(help="Batch sizes of the decode-through-the-loop runs.")] = "1,8",
    tokens: Annotated[int, typer.Option(help="Tokens each sequence decodes in the loop runs.")] = 128,
    repeats: Annotated[int, typer.Option(help="Repeated prompts per length (median).")] = 3,
    weights: WeightsOpt = "auto",
    kv_dtype: KvDtypeOpt = "auto",
    max_context: Annotated[int, typer.Option(help="Context limit per request in tokens.")] = 16384,
    cuda_graphs: Annotated[bool, typer.Option(help="Decode with CUDA graphs.")] = True,
    random_weights: Annotated[bool, typer.Option("--random-weights", help="Random weights (config + tokenizer "
                                                                          "from MODEL).")] = False,
    device: Annotated[str, typer.Option(help="cuda, cpu or auto.")] = "cuda",
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """What a user gets from the engine: TTFT (first and repeated) and decode through the engine loop,
    with the host overhead as a ratio to the GPU's own step time (on the GPU unless --device cpu)."""
    from ninfer_core.bench_engine import run_engine_bench
    from ninfer_core.llm import LLM, EngineOptions

    try:
        batch_sizes = parse_int_list(batches, "--batches")
        options = EngineOptions(device=device, weights=weights, kv_dtype=kv_dtype, max_context=max_context,
                                max_seqs=max(batch_sizes, default=1), cuda_graphs=cuda_graphs,
                                random_weights=random_weights)
        logging.basicConfig(level=logging.WARNING)
        started = time.perf_counter()
        llm = LLM.load(model, options)
        load_s = time.perf_counter() - started
        report = run_engine_bench(llm, parse_int_list(lengths, "--lengths"), batch_sizes, tokens, repeats,
                                  progress=lambda msg: typer.secho(msg, err=True, dim=True))
        report.load_s = load_s
    except NinferError as e:
        fail(str(e))
    if json_out:
        print(json.dumps(report.to_json()))
        return
    print(f"{report.model} on {report.device}: weights {report.weights}, KV {report.kv_dtype}, "
          f"graphs {'on' if report.cuda_graphs else 'off'}, overlap {'on' if report.overlap else 'off'}, "
          f"loaded in {report.load_s:.1f} s")
    if report.bandwidth_gb_s is not None:
        print(f"limits: copy bandwidth {report.bandwidth_gb_s:.0f} GB/s, bf16 GEMM {report.matmul_tflop_s:.0f} TFLOP/s")
    for t in report.ttft:
        chat = "" if t.chat_ms is None else f", chat-shaped {t.chat_ms:8.1f} ms (chunk ends: {t.chat_split_ms:8.1f} ms)"
        pieces = "" if t.pieces_ms is None else f", graph pieces {t.pieces_ms:8.1f} ms (one chunk: {t.one_chunk_ms:8.1f} ms)"
        limit = "" if t.limit_ms is None else f" = {t.repeat_ms / t.limit_ms:.1f}x the limit {t.limit_ms:.2f} ms"
        resent = "" if t.resent_ms is None else f", resent {t.resent_ms:8.1f} ms"
        if t.short_split_ms is not None:
            resent += f" (its first send split before the last token: {t.short_split_ms:8.1f} ms)"
        print(f"TTFT {t.tokens:>6} tokens: first {t.first_ms:8.1f} ms, repeat {t.repeat_ms:8.1f} ms"
              f"{limit}{resent}{chat}{pieces}")
    for d in report.decode:
        limit = "" if d.limit_ms is None else f", {d.tpot_ms / d.limit_ms:.2f}x the limit {d.limit_ms:.3f} ms"
        print(f"decode batch {d.batch:>2}: TPOT {d.tpot_ms:.2f} ms ({d.tok_s:.0f} tok/s) vs GPU step "
              f"{d.step_ms:.2f} ms = {d.overhead:.2f}x{limit}")


def register(bench_group: typer.Typer) -> None:
    bench_group.command("engine")(bench_engine)

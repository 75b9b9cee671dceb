"""Engine flags shared by `run`, `serve`, `chat` and `bench` (one spelling, one parser), and the
check of their values before any model is read (a typo should not cost a 15 s load)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from ninfer_core.errors import NinferError
from ninfer_core.threads import ENV as THREADS_ENV

from .units import human_bytes

if TYPE_CHECKING:
    from ninfer_core.llm import EngineOptions

WEIGHTS_HELP = ("Weights: auto (GPU: models of 2B+ parameters int4 experts/MLP + int8 rest, else the model dtype; "
                "CPU: a GGUF's own quantization, int8 for other checkpoints, the model dtype when --dtype is given), "
                "bf16, int8, int4. Quantized checkpoints are cached on disk after the first load.")
KV_DTYPE_HELP = "KV cache: auto (the model dtype; fp16 on the CPU), fp32, bf16, fp16, fp8 (e4m3) or int8."
KV_CAPACITY_HELP = ("KV cache tokens over all sequences: auto (GPU: the memory left after weights and workspace; "
                    "CPU: max-context x sequences) or a number.")
THREADS_HELP = (f"CPU threads for the model's math (default: ${THREADS_ENV}, else the physical cores this process "
                "may use; on a machine busy with other work, fewer is faster: try 1).")
CPU_MATH_HELP = ("CPU math of compact weights: bf16 (default: bf16 prefill GEMMs where the CPU has bf16 arithmetic, "
                 "decode with fp32 activations), int8 (also int8 activations in decode, llama.cpp's way: faster on "
                 "large models, less exact) or exact (fp32 throughout). Default: $NINFER_CPU_MATH, else bf16.")
MAX_CONTEXT_HELP = "Context limit in tokens per sequence (prompt + answer); --ctx-size is the same flag."
MAX_CONTEXT_FLAGS = ("--max-context", "--ctx-size")
WeightsOpt = Annotated[str, typer.Option(help=WEIGHTS_HELP)]
ThreadsOpt = Annotated[Optional[int], typer.Option("--threads", help=THREADS_HELP)]
CpuMathOpt = Annotated[Optional[str], typer.Option("--cpu-math", help=CPU_MATH_HELP)]
MaxContextOpt = Annotated[Optional[int], typer.Option(*MAX_CONTEXT_FLAGS, help=MAX_CONTEXT_HELP)]
KvDtypeOpt = Annotated[str, typer.Option(help=KV_DTYPE_HELP)]
KvCapacityOpt = Annotated[str, typer.Option(help=KV_CAPACITY_HELP)]
PREFIX_CACHE_HELP = ("Reuse the KV cache and GDN state of prompt prefixes seen before (chat turns, shared system "
                     "prompts, retried requests).")
PREFIX_CACHE_GB_HELP = "Memory for the prefix cache's GDN state checkpoints in GiB (default 2 on a GPU, 0.25 on the CPU)."
MMPROJ_HELP = ("A GGUF model's vision projector: llama.cpp's mmproj .gguf file (default: an mmproj*.gguf in the "
               "model's folder, if there is one).")
MmprojOpt = Annotated[Optional[Path], typer.Option("--mmproj", help=MMPROJ_HELP)]
PrefixCacheOpt = Annotated[bool, typer.Option("--prefix-cache/--no-prefix-cache", help=PREFIX_CACHE_HELP)]
PrefixCacheGbOpt = Annotated[Optional[float], typer.Option(help=PREFIX_CACHE_GB_HELP)]


def check_engine_options(options: EngineOptions) -> None:
    """Every engine flag's value, checked before loading: device, dtype, weights, KV dtype, the
    speculative method and its companions, and the positive numbers."""
    from ninfer_core.cache.kv_pool import resolve_kv_dtype
    from ninfer_core.engine.speculative import METHODS
    from ninfer_core.models.loader import DTYPES, resolve_device, resolve_dtype
    from ninfer_core.models.quantize import WEIGHT_MODES

    if options.dtype != "auto" and options.dtype not in DTYPES:
        raise NinferError(f"--dtype must be auto or one of {', '.join(DTYPES)}, got '{options.dtype}'")
    if options.weights not in WEIGHT_MODES:
        raise NinferError(f"--weights must be one of {', '.join(WEIGHT_MODES)}, got '{options.weights}'")
    if options.spec is not None and options.spec not in METHODS:
        raise NinferError(f"--spec must be one of {', '.join(METHODS)}, got '{options.spec}'")
    if options.spec == "dflash" and options.draft_model is None:
        raise NinferError("--spec dflash needs --draft-model DIR (a DFlash drafter checkpoint)")
    if options.draft_model is not None and options.spec not in (None, "dflash"):
        raise NinferError(f"--draft-model is for --spec dflash, not {options.spec}")
    options.check()
    for flag, value in (("--max-context", options.max_context), ("--prefill-chunk", options.prefill_chunk),
                        ("--draft-tokens", options.draft_tokens), ("--max-concurrency", options.max_seqs)):
        if value is not None and value < 1:
            raise NinferError(f"{flag} must be a positive number, got {value}")
    resolve_kv_dtype(options.kv_dtype, resolve_dtype(options.dtype, resolve_device(options.device)))


def parse_kv_capacity(value: str) -> int | None:
    """`auto` (None) or a positive number of tokens."""
    if value == "auto":
        return None
    if not value.isdigit() or int(value) < 1:
        raise NinferError(f"--kv-capacity must be 'auto' or a positive number of tokens, got '{value}'")
    return int(value)


def parse_int_list(value: str, flag: str) -> tuple[int, ...]:
    """`512,8k,64K` -> (512, 8192, 65536); empty or `none` -> ()."""
    if value.strip().lower() == "none":
        return ()
    out = []
    for part in filter(None, (p.strip() for p in value.split(","))):
        scale = 1024 if part[-1] in "kK" else 1
        digits = part[:-1] if scale > 1 else part
        if not digits.isdigit() or int(digits) < 1:
            raise NinferError(f"{flag}: expected positive numbers separated by commas (8k = 8192), got '{value}'")
        out.append(int(digits) * scale)
    return tuple(out)


def describe_engine(stats) -> str:
    """One line of what the engine holds: weights recipe and size, KV format and capacity, graphs."""
    prefix = (f"prefix cache on ({human_bytes(stats.prefix_checkpoint_budget_bytes)} of GDN state checkpoints)"
              if stats.prefix_cache else "prefix cache off")
    return (f"weights {stats.weights or 'model dtype'} ({human_bytes(stats.weight_bytes)}), "
            f"KV {stats.kv_dtype} {stats.kv_capacity_tokens:,} tokens ({human_bytes(stats.kv_bytes)}), "
            f"CUDA graphs {'on' if stats.cuda_graphs else 'off'}, {prefix}")


def apply_cpu_runtime(threads: int | None, cpu_math: str | None) -> int:
    """--threads and --cpu-math for this process (checked: a bad value is a NinferError); the
    threads in force."""
    from ninfer_core.ops import dispatch
    from ninfer_core.threads import apply_threads

    try:
        dispatch.set_cpu_math(cpu_math)
    except ValueError as e:
        raise NinferError(str(e)) from None
    return apply_threads(threads)

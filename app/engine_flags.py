"""Engine flags shared by `run`, `serve`, `chat` and `bench` (one spelling, one parser)."""

from __future__ import annotations

from typing import Annotated

import typer

from ninfer_core.errors import NinferError

from .units import human_bytes

WEIGHTS_HELP = ("Weights: auto (GPU: models of 2B+ parameters int4 experts/MLP + int8 rest, else the model dtype; "
                "CPU: a GGUF's own quantization, int8 for other checkpoints, the model dtype when --dtype is given), "
                "bf16, int8, int4. Quantized checkpoints are cached on disk after the first load.")
KV_DTYPE_HELP = "KV cache: auto (the model dtype), bf16, fp16, fp8 (e4m3) or int8."
KV_CAPACITY_HELP = ("KV cache tokens over all sequences: auto (GPU: the memory left after weights and workspace; "
                    "CPU: max-context x sequences) or a number.")
WeightsOpt = Annotated[str, typer.Option(help=WEIGHTS_HELP)]
KvDtypeOpt = Annotated[str, typer.Option(help=KV_DTYPE_HELP)]
KvCapacityOpt = Annotated[str, typer.Option(help=KV_CAPACITY_HELP)]


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
    return (f"weights {stats.weights or 'model dtype'} ({human_bytes(stats.weight_bytes)}), "
            f"KV {stats.kv_dtype} {stats.kv_capacity_tokens:,} tokens ({human_bytes(stats.kv_bytes)}), "
            f"CUDA graphs {'on' if stats.cuda_graphs else 'off'}")

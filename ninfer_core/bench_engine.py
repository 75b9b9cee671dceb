"""`ninfer bench engine MODEL`: what a user of the engine gets, beside what the GPU does.

Through the same loop the server runs (scheduler, sampling, detokenization, stop checks):
- time to first token per prompt length, the first prompt of that length after load ("first",
  where compilation or autotuning for a new shape would show) and later ones ("repeat"); with the
  prefix cache also of chat-shaped prompts, which ask for checkpoints where their last message and
  their answer start (GDN state forks inside the chunk, `ForwardBatch.fork`), beside the same
  prompts with the scheduler ending a chunk at each checkpoint instead (what the forks replace);
  prompts longer than the largest prompt graph also read in graph-sized pieces and as one eager
  chunk (the two sides of `Scheduler.pieces_up_to`); with the prefix cache, the same prompt sent
  again ("resent": a regenerated answer, resumed one token before its end), prompts shorter than
  `PrefixCache.split_min` with that split forced (what taking it would cost their first send);
- decode through the loop at each batch size: time per output token per sequence (TPOT) and
  aggregate tok/s, next to the device time of one decode step of that batch (the forward by CUDA
  graph replay and the sampling kernel, timed with CUDA events; the wall clock on the CPU). Their
  ratio is the host overhead a user pays on top of the GPU.

And each against the card's limit (CUDA; none on the CPU): a decode step's bytes (the weights it
touches, each row's KV and GDN state) at the copy bandwidth measured on the spot, a prompt's prefill at
that bandwidth or at the bf16 GEMM peak measured likewise, whichever takes longer (bench.py's counts:
`decode_step_bytes`, `prefill_limit_ms`).

Prompts are random token ids (a fresh draw per request), answers greedy with `ignore_eos`.
"""

from __future__ import annotations

import datetime
import math
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch

from .bench import copy_bandwidth, decode_step_bytes, matmul_peak, prefill_limit_ms
from .cache.prefix_cache import SPLIT_MIN
from .engine.llm_engine import LLMEngine
from .engine.request import GenerationRequest
from .engine.sampling import SamplingParams
from .errors import NinferError
from .llm import LLM

TTFT_LENGTHS = (37, 128, 512, 2048, 8192)
LOOP_BATCHES = (1, 8)
LOOP_PROMPT_TOKENS = 32  # the prompt of each sequence the decode runs start from


@dataclass
class TTFTRun:
    tokens: int
    first_ms: float  # the first prompt of this length since load
    repeat_ms: float  # median of the later ones
    chat_ms: float | None = None  # median, chat-shaped checkpoints (prefix cache only)
    chat_split_ms: float | None = None  # the same, a chunk ending at each checkpoint
    # prompts longer than a prompt graph holds: read in graph-sized pieces / as one eager chunk
    pieces_ms: float | None = None
    one_chunk_ms: float | None = None
    limit_ms: float | None = None  # the prefill at the card's bandwidth or GEMM peak (CUDA only)
    resent_ms: float | None = None  # median, the same prompt sent again (prefix cache only)
    short_split_ms: float | None = None  # median first send of a prompt under split_min, split forced


@dataclass
class LoopDecodeRun:
    batch: int
    tpot_ms: float  # wall time per output token of one sequence, through the engine loop
    tok_s: float  # aggregate over the batch
    step_ms: float  # device time of one decode step of this batch (forward + sampling)
    overhead: float  # tpot_ms / step_ms
    limit_ms: float | None = None  # the step's bytes at the card's copy bandwidth (CUDA only)


@dataclass
class EngineBenchReport:
    model: str
    device: str
    weights: str
    kv_dtype: str
    cuda_graphs: bool
    overlap: bool
    ttft: list[TTFTRun] = field(default_factory=list)
    decode: list[LoopDecodeRun] = field(default_factory=list)
    date: str = ""
    torch: str = ""
    load_s: float | None = None  # LLM.load's wall time (weights, KV sizing, graph captures, warm-up), if timed
    bandwidth_gb_s: float | None = None  # the limits' measured copy bandwidth and bf16 GEMM peak (CUDA)
    matmul_tflop_s: float | None = None

    def to_json(self) -> dict:
        return asdict(self)


def _greedy(tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)


class _Runner:
    def __init__(self, engine: LLMEngine, seed: int):
        self.engine = engine
        self.generator = torch.Generator().manual_seed(seed)

    def prompt(self, length: int) -> list[int]:
        return torch.randint(0, self.engine.config.vocab_size, (length,), generator=self.generator).tolist()

    def ttft_ms(self, length: int, checkpoints: tuple[int, ...] = (), prompt: list[int] | None = None) -> float:
        """Submit one prompt (a fresh one of `length` tokens unless given) on an idle engine;
        milliseconds until its first token is out."""
        prompt = self.prompt(length) if prompt is None else prompt
        request = GenerationRequest(prompt, _greedy(2), checkpoints=checkpoints)
        start = time.perf_counter()
        self.engine.add_request(request)
        first = None
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if first is None and out.new_token_ids:
                    first = time.perf_counter()
        assert first is not None
        return (first - start) * 1e3

    def loop_decode(self, batch: int, tokens: int) -> tuple[float, float]:
        """B requests decoding `tokens` tokens each: (ms per token per sequence, aggregate tok/s),
        timed from the step that gives every sequence its first token to the last one."""
        for _ in range(batch):
            self.engine.add_request(GenerationRequest(self.prompt(LOOP_PROMPT_TOKENS), _greedy(tokens + 1)))
        counts: dict[str, int] = {}
        start = None
        while self.engine.has_unfinished():
            for out in self.engine.step():
                counts[out.request_id] = counts.get(out.request_id, 0) + len(out.new_token_ids)
            if start is None and len(counts) == batch:
                start, base = time.perf_counter(), sum(counts.values())
        seconds = time.perf_counter() - start
        generated = sum(counts.values()) - base
        return seconds / (generated / batch) * 1e3, generated / seconds

    @torch.inference_mode()
    def step_ms(self, batch: int, steps: int = 20) -> float:
        """Device time of one decode step (forward + sampling) of `batch` sequences at a short context."""
        engine = self.engine
        requests = [GenerationRequest(self.prompt(LOOP_PROMPT_TOKENS), _greedy(steps + 8)) for _ in range(batch)]
        for request in requests:
            engine.add_request(request)
        while any(s.in_prefill or not s.output_ids for s in engine.running) or engine.scheduler.waiting:
            engine.step()
        engine.sync()  # nothing in flight while the step is timed alone
        seqs = list(engine.running)
        ids = [[s.output_ids[-1]] for s in seqs]

        def one() -> None:
            out = engine._forward([engine._rows_batch(seqs, ids, "last")])[0]
            engine._sample(seqs, out.logits[:, -1])

        for _ in range(3):
            one()
        times = [_device_ms(one, engine.device) for _ in range(steps)]
        for request in requests:
            engine.abort(request.request_id)
        while engine.has_unfinished():
            engine.step()
        return statistics.median(times)


def chat_checkpoints(length: int) -> tuple[int, ...]:
    """Where a chat prompt of `length` tokens asks for GDN checkpoints (LLM.prepare_chat): its last
    message's start (here a 24-token question before a 3-token assistant header) and its answer start
    (after the header), each where it is at least SPLIT_MIN tokens in."""
    return tuple(p for p in (length - 27, length - 3) if p >= SPLIT_MIN)


@contextmanager
def _attributes(obj: object, **values: object) -> Iterator[None]:
    """`obj`'s attributes set to `values` for the block, restored afterwards."""
    saved = {name: getattr(obj, name) for name in values}
    try:
        for name, value in values.items():
            setattr(obj, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(obj, name, value)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def _device_ms(fn: Callable[[], None], device: torch.device) -> float:
    """Milliseconds of fn's device work: CUDA events around it, or the wall clock on the CPU."""
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def _ceilings(device: torch.device) -> tuple[float, float]:
    """The copy bandwidth and the bf16 GEMM peak, measured now (NaN off CUDA). Their 2.4 GB of buffers
    come out of the workspace the KV cache leaves (cache/sizing.py); where even that is taken, no limits."""
    try:
        return copy_bandwidth(device), matmul_peak(device)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return float("nan"), float("nan")


def run_engine_bench(llm: LLM, lengths: tuple[int, ...] = TTFT_LENGTHS, batches: tuple[int, ...] = LOOP_BATCHES,
                     tokens: int = 128, repeats: int = 3, seed: int = 0,
                     progress: Callable[[str], None] = lambda _: None,
                     ceilings: tuple[float, float] | None = None) -> EngineBenchReport:
    """ceilings: (bytes/s, FLOP/s) for the limits instead of measuring them (a test's; the CPU has none)."""
    engine = llm.engine
    if max(lengths, default=0) >= engine.max_context:
        raise NinferError(f"prompt length {max(lengths)} does not fit the context limit {engine.max_context}")
    stats = engine.stats()
    report = EngineBenchReport(
        model=llm.name, device=_device_name(engine.device), weights=stats.weights,
        kv_dtype=stats.kv_dtype, cuda_graphs=stats.cuda_graphs, overlap=engine.overlap,
        date=datetime.date.today().isoformat(), torch=torch.__version__,
    )
    bandwidth, peak = ceilings or _ceilings(engine.device)
    limited = math.isfinite(bandwidth) and math.isfinite(peak)
    if limited:
        report.bandwidth_gb_s, report.matmul_tflop_s = bandwidth / 1e9, peak / 1e12
    runner = _Runner(engine, seed)
    for length in lengths:  # every first sight before any repeat: the first one after load
        progress(f"first prompt of {length} tokens")
        limit = prefill_limit_ms(engine.model, engine.config, engine.cache, length, bandwidth,
                                 peak) if limited else None
        report.ttft.append(TTFTRun(length, runner.ttft_ms(length), 0.0, limit_ms=limit))
    scheduler = engine.scheduler

    def median_ms(length: int, checkpoints: tuple[int, ...] = (), **setting: int | bool) -> float:
        """The median TTFT of `repeats` prompts, with the scheduler's attributes in `setting`."""
        with _attributes(scheduler, **setting):
            return statistics.median(runner.ttft_ms(length, checkpoints) for _ in range(repeats))

    for run in report.ttft:
        progress(f"prompts of {run.tokens} tokens")
        run.repeat_ms = median_ms(run.tokens)
    for run in report.ttft:
        if scheduler.graph_piece and run.tokens > scheduler.graph_piece:
            progress(f"prompts of {run.tokens} tokens, in graph pieces / one chunk")
            run.pieces_ms = median_ms(run.tokens, pieces_up_to=run.tokens)
            run.one_chunk_ms = median_ms(run.tokens, pieces_up_to=0)
    if engine.cache.prefix is not None:
        for run in report.ttft:
            marks = chat_checkpoints(run.tokens)
            if not marks:  # a chat this short takes no checkpoint: it is the plain prompt
                continue
            progress(f"chat-shaped prompts of {run.tokens} tokens, forks / split")
            run.chat_ms = median_ms(run.tokens, marks)
            run.chat_split_ms = median_ms(run.tokens, marks, forks=False)
        prefix = engine.cache.prefix
        for run in report.ttft:
            progress(f"prompts of {run.tokens} tokens sent twice")
            short = run.tokens < prefix.split_min
            with _attributes(prefix, **({"split_min": 0} if short else {})):
                sent, resent = [], []
                for _ in range(repeats):
                    prompt = runner.prompt(run.tokens)
                    sent.append(runner.ttft_ms(run.tokens, prompt=prompt))
                    resent.append(runner.ttft_ms(run.tokens, prompt=prompt))
            run.resent_ms = statistics.median(resent)
            run.short_split_ms = statistics.median(sent) if short else None
    for batch in batches:
        progress(f"decode through the loop, batch {batch}")
        tpot, tok_s = runner.loop_decode(batch, tokens)
        step = runner.step_ms(batch)
        # the loop's sequences: their prompt, then `tokens` answer tokens (the middle one's context)
        context = LOOP_PROMPT_TOKENS + tokens / 2
        limit = 1e3 * decode_step_bytes(engine.model, engine.config, engine.cache, batch, context) / bandwidth \
            if limited else None
        report.decode.append(LoopDecodeRun(batch, tpot, tok_s, step, tpot / step, limit))
    return report

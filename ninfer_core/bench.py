"""`ninfer bench`: prefill and decode speed of a model, set against the memory-bandwidth roofline.

The model is a preset with random weights (exact shapes of the released models, no download) or
a real checkpoint. It is driven through the engine's own forward, recipe, KV dtype and decode
CUDA graphs, without tokenizer or sampling beyond argmax, so the numbers are the model's own:
- prefill tok/s for each prompt length (one sequence, chunks of `prefill_chunk`);
- decode tok/s at each context length (batch 1) and aggregate decode tok/s at each batch size.
  The KV pages of the context are reserved but not prefilled: decode cost depends on the length,
  not the content, so a 32K-context decode is measured without a 32K prefill first. With CUDA
  graphs each decode run also gives the graph's replay alone (the GPU-bound step).

Roofline: a decode step must read every weight it touches once (the embedding row, the hit experts
only: E * (1 - (1 - k/E)^B) of them for B tokens), each row's KV (its context x bytes per token) and
its GDN state (read and written). Bandwidth is measured on the spot with a device-to-device copy.
"""

from __future__ import annotations

import datetime
import math
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import torch
from torch import nn

from .cache import CacheManager
from .cache.kv_pool import engine_kv_dtype
from .cache.manager import DEFAULT_PAGE_SIZE
from .config import ModelConfig
from .engine.cuda_graph import DecodeGraphs
from .engine.graph_capture import capture
from .errors import NinferError
from .hub.fit import count_params, matmul_params_per_token
from .layers.moe import Experts
from .models.base import ForwardBatch
from .models.loader import load_model, random_model, resolve_device, resolve_dtype
from .models.presets import PRESETS, preset
from .models.quantize import QuantRecipe, resolve_recipe, unique_tensors, weight_bytes

PREFILL_LENGTHS = (512, 8192, 65536)
DECODE_CONTEXTS = (4096, 32768)
DECODE_BATCHES = (1, 2, 4, 8)


@dataclass
class BenchSetup:
    model: str  # a preset name or a checkpoint path
    device: str = "auto"
    dtype: str = "auto"
    weights: str = "auto"
    kv_dtype: str = "auto"
    prefill_lengths: tuple[int, ...] = PREFILL_LENGTHS
    decode_contexts: tuple[int, ...] = DECODE_CONTEXTS
    decode_batches: tuple[int, ...] = DECODE_BATCHES
    batch_context: int = 4096  # context of the batch > 1 runs
    decode_steps: int = 32
    prefill_chunk: int = 8192
    cuda_graphs: bool = True
    seed: int = 0
    layers: int | None = None  # a preset's first N layers: its exact shapes on a machine too small for all


@dataclass
class PrefillRun:
    tokens: int
    seconds: float
    tok_s: float


@dataclass
class DecodeRun:
    batch: int
    context: int
    ms_per_step: float
    tok_s: float  # aggregate over the batch
    bytes_per_step: int
    gb_s: float
    roofline_fraction: float  # of the measured copy bandwidth
    # one replay of the step's CUDA graph, replayed back to back: the GPU's step without this loop's
    # host work (the batch's tensors, the argmax); None without decode graphs
    graph_ms_per_step: float | None = None


@dataclass
class BenchReport:
    model: str
    device: str
    dtype: str
    weights: str
    kv_dtype: str
    cuda_graphs: bool
    weight_bytes: int  # resident
    weight_bytes_per_token: int  # read by one batch-1 decode step (without KV / state)
    copy_bandwidth_gb_s: float
    roofline_tok_s: float  # batch 1, weights + state only, at the measured bandwidth
    prefill: list[PrefillRun] = field(default_factory=list)
    decode: list[DecodeRun] = field(default_factory=list)
    date: str = ""
    torch: str = ""
    python: str = ""

    def to_json(self) -> dict:
        return asdict(self)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large device-to-device copy (read + write), the practical bandwidth ceiling."""
    if device.type != "cuda":
        return float("nan")
    n = 1 << 30
    src, dst = torch.empty(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8, device=device)
    dst.copy_(src)
    _sync(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    _sync(device)
    return 2 * n * 10 / (start.elapsed_time(end) / 1e3)


def matmul_peak(device: torch.device) -> float:
    """FLOP/s of a large bf16 matrix product, the practical compute ceiling; NaN off CUDA."""
    if device.type != "cuda":
        return float("nan")
    n, repeats = 8192, 5
    a, b = (torch.randn(n, n, dtype=torch.bfloat16, device=device) for _ in range(2))
    a @ b
    _sync(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    _sync(device)
    return 2 * n**3 * repeats / (start.elapsed_time(end) / 1e3)


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def expected_hit(config: ModelConfig, batch: int) -> float:
    """The share of a layer's routed experts that `batch` tokens read, routing at random."""
    return 1 - (1 - config.num_experts_per_tok / config.num_experts) ** batch


def decode_weight_bytes(model: nn.Module, config: ModelConfig, batch: int) -> int:
    """Weight bytes one decode step of `batch` tokens reads (see the module docstring)."""
    hit = expected_hit(config, batch) if config.is_moe else 1.0
    expert_tensors = {id(t) for m in model.modules() if isinstance(m, Experts) for t in (*m.parameters(), *m.buffers())}
    head = {t.data_ptr() for t in (*model.lm_head.parameters(), *model.lm_head.buffers())}
    # the embedding table (plain or quantized): a row per token (a prompt's: at most every row), unless
    # lm_head reads all of it
    table = {t.data_ptr() for t in (*model.embed_tokens.parameters(), *model.embed_tokens.buffers())} - head
    total = 0.0
    for t in unique_tensors(model):
        if t.data_ptr() in table:
            total += min(batch, t.shape[0]) * _tensor_bytes(t[0])
        elif id(t) in expert_tensors:
            total += hit * _tensor_bytes(t)
        else:
            total += _tensor_bytes(t)
    return int(total)


def decode_step_bytes(model: nn.Module, config: ModelConfig, manager: CacheManager, batch: int, context: float) -> int:
    """Bytes a decode step of `batch` sequences at `context` tokens must move: the weights it touches,
    each row's KV of the context and its GDN state read and written (the roofline's count)."""
    per_row = manager.cache.kv.bytes_per_token * context + 2 * manager.cache.state.bytes_per_slot
    return int(decode_weight_bytes(model, config, batch) + batch * per_row)


def prefill_limit_ms(model: nn.Module, config: ModelConfig, manager: CacheManager, length: int, bandwidth: float,
                     peak: float) -> float:
    """A prompt's prefill at the card's limits: the weights its tokens touch read once, its KV written
    and its GDN state read and written at the copy bandwidth, or its FLOPs (matmuls, causal attention)
    at the GEMM peak, whichever takes longer. A lower bound: no kernel reaches both ceilings."""
    moved = (decode_weight_bytes(model, config, length) + length * manager.cache.kv.bytes_per_token
             + 2 * manager.cache.state.bytes_per_slot)
    attention_layers = sum(kind == "full_attention" for kind in config.layer_types)
    # causal attention: q k^T and p v over half the square, 2 FLOPs a product each
    flops = (2 * length * matmul_params_per_token(config)
             + 2 * length * length * config.num_heads * config.head_dim * attention_layers)
    return 1e3 * max(moved / bandwidth, flops / peak)


def _build(setup: BenchSetup) -> tuple[nn.Module, ModelConfig, torch.device, torch.dtype, QuantRecipe]:
    dev = resolve_device(setup.device)
    if setup.model in PRESETS:
        config = preset(setup.model)
        if setup.layers is not None:
            if not 1 <= setup.layers <= config.num_layers:
                raise NinferError(f"--layers must be 1..{config.num_layers} for {setup.model}, got {setup.layers}")
            config = replace(config, num_layers=setup.layers, layer_types=config.layer_types[: setup.layers])
        dtype = resolve_dtype(setup.dtype, dev)
        recipe = resolve_recipe(setup.weights, dev, dtype, count_params(config), exact=setup.dtype != "auto")
        return random_model(config, dev, dtype, recipe, setup.seed), config, dev, dtype, recipe
    if setup.layers is not None:
        raise NinferError("--layers takes a preset's first layers (--synthetic); a checkpoint runs whole")
    loaded = load_model(setup.model, setup.device, setup.dtype, weights=setup.weights)
    return loaded.model, loaded.config, loaded.device, loaded.dtype, loaded.recipe


class _Harness:
    """One cache sized for the largest run; sequences set up at a given context without prefill."""

    def __init__(self, model: nn.Module, config: ModelConfig, device: torch.device, dtype: torch.dtype,
                 setup: BenchSetup):
        self.model, self.config, self.device, self.setup = model, config, device, setup
        max_batch = max(setup.decode_batches, default=1)
        longest = max((*setup.prefill_lengths, *setup.decode_contexts, setup.batch_context), default=1)
        self.max_context = longest + setup.decode_steps + 2
        per_seq = math.ceil((setup.batch_context + setup.decode_steps + 2) / DEFAULT_PAGE_SIZE) * DEFAULT_PAGE_SIZE
        tokens = max(self.max_context, max_batch * per_seq)
        self.manager = CacheManager(config, max_tokens=tokens, max_seqs=max_batch, dtype=dtype, device=device,
                                    kv_dtype=engine_kv_dtype(setup.kv_dtype, device, dtype),
                                    scratch=device.type == "cuda")
        self.graphs = None
        if setup.cuda_graphs and device.type == "cuda":
            self.graphs = DecodeGraphs(model, self.manager, max_batch, self.max_context)
        self.generator = torch.Generator(device="cpu").manual_seed(setup.seed)

    def sequences(self, batch: int, context: int):
        seqs = [self.manager.allocate() for _ in range(batch)]
        for s in seqs:
            self.manager.reserve(s, context + self.setup.decode_steps + 2)
        return seqs

    def release(self, seqs) -> None:
        for s in seqs:
            self.manager.free(s)

    def batch(self, seqs, ids: torch.Tensor, cache_lens: torch.Tensor, logits: str) -> ForwardBatch:
        t = ids.shape[1]
        return ForwardBatch(
            input_ids=ids,
            positions=cache_lens[:, None] + torch.arange(t, device=self.device)[None],
            cache_lens=cache_lens,
            slots=torch.tensor([s.slot for s in seqs], device=self.device),
            block_table=self.manager.block_table(seqs),
            logits=logits,
        )

    def replay_ms(self, batch: int, replays: int = 20) -> float | None:
        """Milliseconds of one replay of the batch's decode graph (captured by an earlier `decode`),
        replayed back to back: the GPU's step time without the host work of building a batch. None
        where no graph took the batch."""
        assert self.graphs is not None
        bucket = self.graphs.bucket(batch)
        graph = next((g.graph for key, g in self.graphs.graphs.items() if key[:2] == (bucket, 0)), None)
        if graph is None:
            return None
        return cuda_median_ms(lambda: [graph.replay() for _ in range(replays)]) / replays

    def random_ids(self, rows: int, cols: int) -> torch.Tensor:
        return torch.randint(0, self.config.vocab_size, (rows, cols), generator=self.generator).to(self.device)

    @torch.inference_mode()
    def prefill(self, length: int, context: int = 0) -> PrefillRun:
        """`length` new tokens after `context` tokens already in the cache (a follow-up message)."""
        seqs = self.sequences(1, context + length)
        ids = self.random_ids(1, length)
        chunk = self.setup.prefill_chunk

        def run() -> torch.Tensor:
            out = None
            for start in range(0, length, chunk):
                piece = ids[:, start : start + chunk]
                last = start + piece.shape[1] == length
                lens = torch.tensor([context + start], device=self.device)
                out = self.model.forward(self.batch(seqs, piece, lens, "last" if last else "none"), self.manager.cache)
            return out.logits[:, -1].argmax(-1)

        warm = min(length, chunk)  # a full chunk: autotuned kernels (fla, grouped GEMM) settle first
        self.model.forward(self.batch(seqs, ids[:, :warm], torch.tensor([context], device=self.device), "last"),
                           self.manager.cache)
        self.manager.cache.state.reset(seqs[0].slot)
        seconds = _timed(run, self.device)
        self.release(seqs)
        return PrefillRun(tokens=length, seconds=seconds, tok_s=length / seconds)

    @torch.inference_mode()
    def decode(self, batch: int, context: int, bandwidth: float) -> DecodeRun:
        seqs = self.sequences(batch, context)
        tokens = self.random_ids(batch, 1)
        lens = torch.full((batch,), context, dtype=torch.long, device=self.device)

        def step(i: int) -> torch.Tensor:
            fb = self.batch(seqs, tokens, lens + i, "last")
            out = self.graphs.forward(fb) if self.graphs is not None and self.graphs.supports(fb) else None
            if out is None:
                out = self.model.forward(fb, self.manager.cache)
            return out.logits[:, -1].argmax(-1, keepdim=True)

        tokens = step(0)  # warm-up (captures the bucket's graph)
        steps = self.setup.decode_steps

        def run() -> None:
            nonlocal tokens
            for i in range(1, steps + 1):
                tokens = step(i)

        seconds = _timed(run, self.device) / steps
        self.release(seqs)
        graph_ms = self.replay_ms(batch) if self.graphs is not None else None
        moved = decode_step_bytes(self.model, self.config, self.manager, batch, context + steps // 2)
        return DecodeRun(batch=batch, context=context, ms_per_step=seconds * 1e3, tok_s=batch / seconds,
                         bytes_per_step=moved, gb_s=moved / seconds / 1e9,
                         roofline_fraction=moved / seconds / bandwidth if math.isfinite(bandwidth) else float("nan"),
                         graph_ms_per_step=graph_ms)


def graph_replay_ms(fn: Callable[[], object], replays: int = 20) -> float:
    """Mean milliseconds of one replay of a CUDA graph of fn: kernel time without launch overhead."""
    graph, _ = capture(fn)  # replayed once: the first launch's upload is not timed
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def cuda_median_ms(fn: Callable[[], object], repeats: int = 10, warmup: int = 2) -> float:
    """Median milliseconds of fn between two CUDA events on the current stream (kernel benches)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def run_bench(setup: BenchSetup, progress: Callable[[str], None] = lambda _: None) -> BenchReport:
    if not setup.prefill_lengths and not setup.decode_contexts and not setup.decode_batches:
        raise NinferError("nothing to measure: give at least one prefill length, decode context or batch")
    model, config, dev, dtype, recipe = _build(setup)
    harness = _Harness(model, config, dev, dtype, setup)
    bandwidth = copy_bandwidth(dev)
    weights_per_token = decode_weight_bytes(model, config, 1)
    batch_one = decode_step_bytes(model, config, harness.manager, 1, 0)  # weights + state: the context's KV aside
    report = BenchReport(
        model=setup.model if setup.layers is None else f"{setup.model} (first {setup.layers} layers)",
        device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        dtype=str(dtype).removeprefix("torch."),
        weights=recipe.label(dtype),
        kv_dtype=harness.manager.cache.kv.dtype_name,
        cuda_graphs=harness.graphs is not None,
        weight_bytes=weight_bytes(model),
        weight_bytes_per_token=weights_per_token,
        copy_bandwidth_gb_s=bandwidth / 1e9,
        roofline_tok_s=bandwidth / batch_one if math.isfinite(bandwidth) else float("nan"),
        date=datetime.date.today().isoformat(),
        torch=torch.__version__,
        python=platform.python_version(),
    )
    for length in setup.prefill_lengths:
        progress(f"prefill {length} tokens")
        report.prefill.append(harness.prefill(length))
    for context in setup.decode_contexts:
        progress(f"decode at {context} context")
        report.decode.append(harness.decode(1, context, bandwidth))
    for b in setup.decode_batches:
        if b > 1:
            progress(f"decode batch {b} at {setup.batch_context} context")
            report.decode.append(harness.decode(b, setup.batch_context, bandwidth))
    return report

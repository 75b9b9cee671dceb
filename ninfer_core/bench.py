"""`ninfer bench --synthetic`: prefill and decode speed of a model built with random weights.

It drives the model forward directly (no tokenizer, no sampling beyond argmax) so the numbers
are the model's own. Bytes per decoded token are counted from the parameters a token touches,
so the result can be set against the memory-bandwidth roofline.
"""

from __future__ import annotations

import datetime
import platform
import time
from dataclasses import asdict, dataclass

import torch

from .cache import CacheManager
from .config import ModelConfig
from .models.base import ForwardBatch
from .models.loader import build_model, init_random_, resolve_device, resolve_dtype
from .models.presets import preset


@dataclass
class BenchResult:
    model: str
    device: str
    dtype: str
    prompt_tokens: int
    decode_tokens: int
    prefill_tok_s: float
    decode_tok_s: float
    decode_ms_per_token: float
    weight_bytes_per_token: int
    weight_gb_s: float
    date: str
    torch: str
    python: str

    def to_json(self) -> dict:
        return asdict(self)


def active_param_count(config: ModelConfig, model: torch.nn.Module) -> int:
    """Parameters one decoded token reads: all but the embedding table and the unused experts."""
    total = 0
    for name, p in model.named_parameters():
        if name.startswith("embed_tokens") and not config.tie_word_embeddings:
            total += p.shape[-1]  # one row
        elif ".experts." in name:
            total += p.numel() * config.num_experts_per_tok // config.num_experts
        else:
            total += p.numel()
    return total


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_synthetic(
    name: str, device: str = "auto", dtype: str = "auto", prompt_tokens: int = 512, decode_tokens: int = 32,
    prefill_chunk: int = 1024, seed: int = 0,
) -> BenchResult:
    config = preset(name)
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    model = build_model(config, dev, torch_dtype)
    init_random_(model, seed)
    cache = CacheManager(config, max_tokens=prompt_tokens + decode_tokens + 1, max_seqs=1, dtype=torch_dtype,
                         device=dev)
    seq = cache.allocate()
    cache.reserve(seq, prompt_tokens + decode_tokens + 1)
    table = cache.block_table([seq])
    slots = torch.tensor([seq.slot], device=dev)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    prompt = torch.randint(0, config.vocab_size, (1, prompt_tokens), generator=gen).to(dev)

    def forward(ids: torch.Tensor, start: int, logits: str):
        t = ids.shape[1]
        batch = ForwardBatch(
            input_ids=ids,
            positions=torch.arange(start, start + t, device=dev)[None],
            cache_lens=torch.tensor([start], device=dev),
            slots=slots,
            block_table=table,
            logits=logits,
        )
        return model.forward(batch, cache.cache)

    with torch.inference_mode():
        forward(prompt[:, :8], 0, "last")  # warm-up (allocator, kernels), then start over
        cache.cache.state.reset(seq.slot)
        _sync(dev)
        t0 = time.perf_counter()
        for start in range(0, prompt_tokens, prefill_chunk):
            chunk = prompt[:, start : start + prefill_chunk]
            out = forward(chunk, start, "last" if start + chunk.shape[1] == prompt_tokens else "none")
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        _sync(dev)
        t1 = time.perf_counter()
        for i in range(decode_tokens):
            token = forward(token, prompt_tokens + i, "last").logits[:, -1].argmax(-1, keepdim=True)
        _sync(dev)
        t2 = time.perf_counter()
    decode_s = (t2 - t1) / decode_tokens
    bytes_per_token = active_param_count(config, model) * torch.finfo(torch_dtype).bits // 8
    return BenchResult(
        model=name,
        device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        dtype=str(torch_dtype).removeprefix("torch."),
        prompt_tokens=prompt_tokens,
        decode_tokens=decode_tokens,
        prefill_tok_s=prompt_tokens / (t1 - t0),
        decode_tok_s=1.0 / decode_s,
        decode_ms_per_token=decode_s * 1e3,
        weight_bytes_per_token=bytes_per_token,
        weight_gb_s=bytes_per_token / decode_s / 1e9,
        date=datetime.date.today().isoformat(),
        torch=torch.__version__,
        python=platform.python_version(),
    )

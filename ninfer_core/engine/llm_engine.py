"""The token-level engine: requests in, tokens and text deltas out, one batched step at a time.

A step runs at most one prefill chunk (the oldest sequence still reading its prompt) and one
decode forward over every sequence that is generating, so long prompts never stall the others.
With a speculator the decode forward is a verify forward: each sequence brings its drafts and may
gain several tokens per step (`speculative/speculator.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from ..cache import CacheManager
from ..config import GenerationDefaults, ModelConfig
from ..detokenizer import IncrementalDetokenizer
from ..errors import ContextLengthError, NinferError
from ..models.base import CausalLM, ForwardBatch, ForwardOutput
from ..models.quantize import weight_bytes
from ..stop_strings import StopStringFilter
from ..tokenizer import Tokenizer
from .request import GenerationRequest, SpecStats, StepOutput
from .sampling import Sampler
from .sequence import Sequence
from .speculative.rollback import commit_gdn
from .speculative.speculator import Speculator, Verified

if TYPE_CHECKING:
    from .cuda_graph import DecodeGraphs
    from ..models.vision import VisionTower


@dataclass
class EngineStats:
    """Counters the CLI, the server and the TUI read (all since start)."""

    requests_finished: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_chunks: int = 0
    decode_steps: int = 0
    decode_rows: int = 0  # sum over decode steps of the batch size
    max_decode_batch: int = 0
    running: int = 0
    kv_capacity_tokens: int = 0
    kv_used_tokens: int = 0
    kv_dtype: str = ""
    kv_bytes: int = 0
    cache_bytes: int = 0  # KV + GDN state (+ the drafter's cache)
    weights: str = ""  # the quantization recipe (models/quantize.py)
    weight_bytes: int = 0
    cuda_graphs: bool = False
    last_prefill_tok_s: float = 0.0
    last_decode_tok_s: float = 0.0
    spec: SpecStats | None = None  # speculative decoding totals (None: no drafter)


class LLMEngine:
    def __init__(
        self,
        model: CausalLM,
        config: ModelConfig,
        tokenizer: Tokenizer,
        cache: CacheManager,
        *,
        max_context: int,
        prefill_chunk: int = 1024,
        generation_defaults: GenerationDefaults | None = None,
        vision_tower: Callable[[], VisionTower] | None = None,
        speculator: Speculator | None = None,
        graphs: DecodeGraphs | None = None,
        weights: str = "",
    ):
        if prefill_chunk < 1:
            raise NinferError(f"prefill chunk must be >= 1 token, got {prefill_chunk}")
        self.model = model
        self.config = config
        self.tokenizer = tokenizer
        self.cache = cache
        self.max_context = max_context
        self.prefill_chunk = prefill_chunk
        self.defaults = generation_defaults or GenerationDefaults()
        self.vision_tower = vision_tower  # built on first use: only requests with media need it
        self.speculator = speculator
        self.graphs = graphs  # decode-step CUDA graphs (None: eager)
        self.device = cache.device
        self.sampler = Sampler()
        self.eos_ids = frozenset(self.defaults.eos_token_ids or config.eos_token_ids or tokenizer.eos_token_ids)
        self.running: list[Sequence] = []
        drafter_bytes = speculator.drafter.cache_bytes if speculator is not None else 0
        self._stats = EngineStats(
            kv_capacity_tokens=cache.capacity_tokens, kv_dtype=cache.cache.kv.dtype_name, kv_bytes=cache.kv_bytes,
            cache_bytes=cache.total_bytes + drafter_bytes, weights=weights, weight_bytes=weight_bytes(model),
            cuda_graphs=graphs is not None,
        )

    # -- requests ---------------------------------------------------------------------------

    def add_request(self, request: GenerationRequest) -> None:
        """Admit a request: checks its length and reserves KV for its prompt (raises if it cannot fit)."""
        n = len(request.prompt_token_ids)
        if n == 0:
            raise NinferError("the prompt is empty")
        if n >= self.max_context:
            raise ContextLengthError(
                f"the prompt has {n} tokens but the context limit is {self.max_context} tokens "
                f"(at least one must be left for the answer)",
                prompt_tokens=n,
                limit=self.max_context,
            )
        bad = [t for t in request.prompt_token_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise NinferError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")
        if request.multimodal is not None:
            if self.vision_tower is None:
                raise NinferError("this model has no vision tower: it cannot read images or videos")
            if (covered := len(request.multimodal.vision_rows)) != n:
                raise NinferError(f"the media layout covers {covered} tokens but the prompt has {n}")
        params = request.sampling.with_defaults(self.defaults)
        request.sampling = params
        draft_limit = self.speculator.limit(request) if self.speculator is not None else 0
        seq_cache = self.cache.allocate()
        try:
            self.cache.reserve(seq_cache, n)
        except NinferError:
            self.cache.free(seq_cache)
            raise
        room = self.max_context - n
        seq = Sequence(
            request=request,
            cache=seq_cache,
            detokenizer=IncrementalDetokenizer(self.tokenizer),
            stops=StopStringFilter(params.stop),
            generator=None if params.is_greedy else params.make_generator(self._generator_device()),
            max_new_tokens=min(params.max_tokens or room, room),
        )
        if self.speculator is not None and draft_limit:
            seq.draft_limit = draft_limit
            seq.spec = SpecStats(method=self.speculator.drafter.method, draft_tokens=draft_limit)
        seq.timings.prompt_tokens = n
        self.running.append(seq)

    def abort(self, request_id: str) -> None:
        """Drop a request at once and free its cache (a client went away)."""
        for seq in list(self.running):
            if seq.request_id == request_id:
                seq.finish_reason = "abort"
                self._release(seq)

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def stats(self) -> EngineStats:
        s = self._stats
        s.running = len(self.running)
        s.kv_used_tokens = self.cache.capacity_tokens - self.cache.free_tokens
        s.cuda_graphs = self.graphs is not None and self.graphs.enabled
        spec = replace(self.speculator.totals) if self.speculator is not None else None
        return EngineStats(**{**vars(s), "spec": spec})

    # -- stepping ---------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        prefilling = next((s for s in self.running if s.in_prefill), None)
        decoding = [s for s in self.running if not s.in_prefill]
        if prefilling is not None:
            outputs += self._prefill_chunk(prefilling)
        if decoding:
            outputs += self._decode(decoding)
        for seq in [s for s in self.running if s.finished]:
            self._release(seq)
        return outputs

    def generate(self, requests: Iterable[GenerationRequest]) -> Iterator[StepOutput]:
        """Run requests to completion on this engine, yielding outputs as they come."""
        for request in requests:
            self.add_request(request)
        while self.has_unfinished():
            yield from self.step()

    def _prefill_chunk(self, seq: Sequence) -> list[StepOutput]:
        start = seq.num_cached
        end = min(len(seq.prompt_ids), start + self.prefill_chunk)
        last = end == len(seq.prompt_ids)
        ids = torch.tensor([seq.prompt_ids[start:end]], dtype=torch.long, device=self.device)
        embeds, mrope = self._multimodal_inputs(seq, ids, start, end)
        capture = self.speculator.capture_layers(seq) if self.speculator is not None else ()
        batch = self._batch([seq], ids, "last" if last else "none", embeds, mrope, capture_layers=capture)
        out = self._run(batch)
        seq.num_cached = end
        self._stats.prefill_chunks += 1
        outputs = []
        if last:
            if seq.request.multimodal is not None:
                seq.request.multimodal.release()
            token = self._sample([seq], out.logits[:, -1])[0]
            seq.timings.prefill_s = time.perf_counter() - seq.started_at
            self._stats.prompt_tokens += len(seq.prompt_ids)
            self._stats.last_prefill_tok_s = seq.timings.prefill_tok_s
            outputs.append(self._append(seq, [token]))
        if self.speculator is not None:
            self.speculator.observe_prefill(seq, batch, out)
        return outputs

    def _decode(self, seqs: list[Sequence]) -> list[StepOutput]:
        self._stats.decode_steps += 1
        self._stats.decode_rows += len(seqs)
        self._stats.max_decode_batch = max(self._stats.max_decode_batch, len(seqs))
        if self.speculator is not None and any(s.draft_limit for s in seqs):
            return self.speculator.decode(seqs, self._verify_forward, self._append)
        for seq in seqs:
            self.cache.reserve(seq.cache, seq.num_tokens)
        ids = torch.tensor([[s.output_ids[-1]] for s in seqs], dtype=torch.long, device=self.device)
        batch = self._batch(seqs, ids, "last")
        logits = self._forward(batch).logits
        assert logits is not None
        for seq in seqs:
            seq.num_cached += 1
        tokens = self._sample(seqs, logits[:, -1])
        return [self._append(seq, [tok]) for seq, tok in zip(seqs, tokens)]

    def _verify_forward(self, seqs: list[Sequence], ids: torch.Tensor, capture_layers: tuple[int, ...]) -> Verified:
        if ids.shape[1] == 1 and not capture_layers:
            # no drafts this round: the one token is always kept, so a plain decode step (its graph)
            # advances the state directly and there is nothing to commit
            batch = self._batch(seqs, ids, "last")
            return Verified(batch, self._forward(batch), lambda counts: None)
        batch = self._batch(seqs, ids, "all", verify=True, capture_layers=capture_layers)
        out = self._forward(batch)
        if out.gdn_records is None:  # a graph replay: its commit graph keeps the accepted tokens
            assert self.graphs is not None
            graphs = self.graphs
            return Verified(batch, out, lambda counts: graphs.commit(batch, counts))
        records = out.gdn_records
        return Verified(batch, out, lambda counts: commit_gdn(self.model, self.cache.cache.state, records,
                                                              batch.slots, counts))

    def _forward(self, batch: ForwardBatch) -> ForwardOutput:
        """A decode or verify forward: by CUDA graph replay where one fits, else eagerly."""
        out = self.graphs.forward(batch) if self.graphs is not None and self.graphs.supports(batch) else None
        return out if out is not None else self._run(batch)

    def _multimodal_inputs(
        self, seq: Sequence, ids: torch.Tensor, start: int, end: int
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Prompt chunk inputs of a request with media: embeddings (vision rows in place of the pads)
        and 3-axis positions. The tower runs once, on the first chunk."""
        mm = seq.request.multimodal
        if mm is None:
            return None, None
        assert self.vision_tower is not None  # checked in add_request
        with torch.inference_mode():
            mm.encode(self.vision_tower())
            return mm.chunk_embeddings(self.model.embed_tokens, ids, start), mm.chunk_positions(start, end, self.device)

    def _batch(
        self,
        seqs: list[Sequence],
        ids: torch.Tensor,
        logits: str,
        inputs_embeds: torch.Tensor | None = None,
        mrope_positions: torch.Tensor | None = None,
        verify: bool = False,
        capture_layers: tuple[int, ...] = (),
    ) -> ForwardBatch:
        t = ids.shape[1]
        cache_lens = torch.tensor([s.num_cached for s in seqs], dtype=torch.long, device=self.device)
        positions = cache_lens[:, None] + torch.arange(t, device=self.device)[None, :]
        if any(deltas := [s.rope_delta for s in seqs]):
            positions = positions + torch.tensor(deltas, dtype=torch.long, device=self.device)[:, None]
        return ForwardBatch(
            input_ids=ids,
            positions=positions,
            cache_lens=cache_lens,
            slots=torch.tensor([s.cache.slot for s in seqs], dtype=torch.long, device=self.device),
            block_table=self.cache.block_table([s.cache for s in seqs]),
            mrope_positions=mrope_positions,
            inputs_embeds=inputs_embeds,
            logits=logits,
            verify=verify,
            capture_layers=capture_layers,
        )

    def _run(self, batch: ForwardBatch) -> ForwardOutput:
        with torch.inference_mode():
            return self.model.forward(batch, self.cache.cache)

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        tokens = self.sampler.sample(
            logits.float(),
            [s.request.sampling for s in seqs],
            [s.history() for s in seqs],
            [s.generator for s in seqs],
        )
        return tokens.tolist()

    def _append(self, seq: Sequence, tokens: list[int]) -> StepOutput:
        """Record generated tokens (one, or a speculative round's run) in order until one stops the
        sequence (the rest are dropped); return them with their text delta."""
        taken: list[int] = []
        text = ""
        for token in tokens:
            taken.append(token)
            text += self._push(seq, token)
            if seq.finished:
                break
        if seq.finished and seq.stops.matched is None:
            check = seq.stops.feed(seq.detokenizer.flush())
            text += check.text + ("" if check.stop else seq.stops.flush())
        return StepOutput(
            request_id=seq.request_id,
            new_token_ids=taken,
            text_delta=text,
            finished=seq.finished,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            timings=seq.timings if seq.finished else None,
            spec=seq.spec if seq.finished else None,
        )

    def _push(self, seq: Sequence, token: int) -> str:
        """One token: stop checks and its text."""
        seq.output_ids.append(token)
        self._stats.generated_tokens += 1
        params = seq.request.sampling
        if token in params.stop_token_ids or (token in self.eos_ids and not params.ignore_eos):
            seq.finish_reason, seq.stop_reason = "stop", token
            return ""
        check = seq.stops.feed(seq.detokenizer.add(token))
        if check.stop is not None:
            seq.finish_reason, seq.stop_reason = "stop", check.stop
        elif len(seq.output_ids) >= seq.max_new_tokens:
            seq.finish_reason = "length"
        return check.text

    def _release(self, seq: Sequence) -> None:
        if seq.timings.prefill_s:
            seq.timings.completion_tokens = len(seq.output_ids)
            seq.timings.decode_s = time.perf_counter() - seq.started_at - seq.timings.prefill_s
            self._stats.last_decode_tok_s = seq.timings.decode_tok_s or self._stats.last_decode_tok_s
        self._stats.requests_finished += 1
        if self.speculator is not None:
            self.speculator.release(seq)
        self.cache.free(seq.cache)
        self.running.remove(seq)

    def _generator_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

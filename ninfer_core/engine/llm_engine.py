"""The token-level engine: requests in, tokens and text deltas out, one batched step at a time.

A step runs the scheduler's plan (scheduler.py) as one forward: the decode rows of every
generating sequence plus prompt chunks of others (a varlen batch, `DecoderModel.forward_parts`),
then samples one token per row that asks for one. With a speculator the decode rows are a verify
(speculative/speculator.py) and each sequence may gain several tokens.

The host never waits for the GPU in a plain decode step: step N+1 is launched (its input ids
are step N's sampled ids, still on the device) before step N's ids are read, so the CPU work of
a step (scheduling, building inputs, stop checks, detokenizing, streaming) overlaps the GPU
running the next one (SGLang's overlap scheduler). Grammar-constrained rows keep the overlap: a
row's mask needs step N's token accepted by its grammar (engine/grammar.py), so such a step queues
its forward, then completes step N (tokens accepted) and fills the masks while that forward runs,
and only then queues the masking and sampling. A step falls back to running alone when it needs
the previous tokens on the host before its forward: speculative rounds (none is launched while a
sequence that drafts runs or waits), or a plan that may preempt. Sequences that stop get one
wasted row in the already launched step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from ..cache import CacheManager
from ..config import GenerationDefaults, ModelConfig
from ..detokenizer import IncrementalDetokenizer
from ..errors import ContextLengthError, NinferError, logged_internal_error
from ..models.base import CausalLM, ForwardBatch, ForwardOutput, StateFork, StepWindows
from ..models.quantize import weight_bytes
from ..ops.dispatch import upload
from ..ops.gdn import MAX_STEP_TOKENS
from ..stop_strings import StopStringFilter
from ..tokenizer import Tokenizer
from .fork_windows import TAIL_WINDOWS, step_windows
from .grammar import constrain
from .logprobs import LogprobRows, TokenLogprob, log_softmax_rows
from .request import GenerationRequest, SpecStats, StepOutput
from .penalties import PenaltyTables
from .prompt_logprobs import ChunkScores, score_chunks, scored_chunk
from .sampling import Sampler, SamplingParams, plain_greedy
from .scheduler import PrefillChunk, Scheduler, StepPlan
from .sequence import Sequence
from .speculative.base import Draft, place_pending
from .speculative.rollback import commit_gdn
from .speculative.speculator import Speculator

if TYPE_CHECKING:
    from .cuda_graph import DecodeGraphs
    from .prefill_graph import PrefillGraphs
    from ..models.vision import VisionTower

log = logging.getLogger(__name__)

# prompt lengths of the load-time warm-up: fused steps / short-prompt graphs, then eager chunks
# whose MoE rows take each block size of the grouped kernels (ops/moe_triton.py)
WARM_UP_LENGTHS = (5, 40, 300, 1000, 2000)


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
    waiting: int = 0
    preemptions: int = 0
    prefix_cache: bool = False
    prefix_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0  # of which served from it
    prefix_cached_bytes: int = 0  # indexed KV pages + checkpoint states
    prefix_checkpoints: int = 0
    prefix_checkpoint_budget_bytes: int = 0  # the GDN state checkpoints' memory (--prefix-cache-gb)
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


@dataclass
class LaunchedStep:
    """A plain step whose forward and sampling are queued on the device: the rows that sample
    (`rows[i]` gets `tokens[i]`), their ids on the device and the copy to the host under way
    (with the logprobs of the rows that asked)."""

    plan: StepPlan
    rows: list[Sequence]
    tokens: torch.Tensor  # [R] int64 on the device (-1: the row's logits were not finite)
    host: torch.Tensor  # [R] the copy on the host (pinned on CUDA)
    done: torch.cuda.Event | None
    logprobs: LogprobRows | None = None  # on the host once `done`
    prompt_scores: list[ChunkScores] = field(default_factory=list)  # on the host once `done`


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
        prefill_graphs: PrefillGraphs | None = None,
        weights: str = "",
        overlap: bool | None = None,
    ):
        """`prefill_chunk`: the token budget of one step (decode rows + prompt chunks); `overlap`:
        launch the next plain step before reading this one's tokens (default: on CUDA)."""
        if prefill_chunk < 1:
            raise NinferError(f"prefill chunk must be >= 1 token, got {prefill_chunk}")
        self.model = model
        self.config = config
        self.tokenizer = tokenizer
        self.cache = cache
        # a single request can never use more than the whole cache, whatever --max-context says
        self.max_context = min(max_context, cache.capacity_tokens)
        self.prefill_chunk = prefill_chunk
        self.defaults = generation_defaults or GenerationDefaults()
        self.vision_tower = vision_tower  # built on first use: only requests with media need it
        self.speculator = speculator
        self.graphs = graphs  # decode-step CUDA graphs (None: eager)
        self.prefill_graphs = prefill_graphs  # short prompt chunks' CUDA graphs (None: eager)
        self.device = cache.device
        self.overlap = self.device.type == "cuda" if overlap is None else overlap
        self.sampler = Sampler()
        # a checkpoint inside a prompt chunk is a fork of the GDN state, not a chunk end (layers/gdn.py)
        self.scheduler = Scheduler(cache, prefill_chunk, forks=cache.prefix is not None, fork_tail=MAX_STEP_TOKENS,
                                   graph_piece=prefill_graphs.buckets[-1] if prefill_graphs and prefill_graphs.buckets else 0,
                                   scored_chunk=scored_chunk(config.vocab_size))
        self.eos_ids = frozenset(self.defaults.eos_token_ids or config.eos_token_ids or tokenizer.eos_token_ids)
        self._launched: LaunchedStep | None = None
        self._penalties: PenaltyTables | None = None  # allocated for the first request with penalties
        drafter_bytes = speculator.drafter.cache_bytes if speculator is not None else 0
        self._stats = EngineStats(
            kv_capacity_tokens=cache.capacity_tokens, kv_dtype=cache.cache.kv.dtype_name, kv_bytes=cache.kv_bytes,
            cache_bytes=cache.total_bytes + drafter_bytes, weights=weights, weight_bytes=weight_bytes(model),
            cuda_graphs=graphs is not None,
        )

    # -- requests ---------------------------------------------------------------------------

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def max_running(self) -> int:
        """Sequences decoded together at most (the cache's slots, or fewer: --max-concurrency)."""
        return self.scheduler.max_running

    @max_running.setter
    def max_running(self, value: int) -> None:
        self.scheduler.max_running = min(value, self.cache.max_seqs)

    def add_request(self, request: GenerationRequest) -> None:
        """Queue a request: checks its length, ids and media (raises NinferError if it can never run)."""
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
        if request.embed and (params.max_tokens != 1 or request.grammar is not None):
            raise NinferError("an embedding request samples one token (max_tokens 1) and no grammar")
        request.sampling = params
        # a constrained row needs its mask from the previous token (so does one with min_tokens): it never drafts
        masked = request.grammar is not None or params.min_tokens > 0
        draft_limit = self.speculator.limit(request) if self.speculator is not None and not masked else 0
        room = self.max_context - n
        seq = Sequence(
            request=request,
            cache=None,
            detokenizer=IncrementalDetokenizer(self.tokenizer),
            stops=StopStringFilter(params.stop),
            generator=None if params.is_greedy else params.make_generator(self._generator_device()),
            max_new_tokens=min(params.max_tokens or room, room),
            grammar=request.grammar.matcher() if request.grammar is not None else None,
            prompt_logprobs=None if params.prompt_logprobs is None else [None] * (n - 1),
        )
        if self.speculator is not None and draft_limit:
            seq.draft_limit = draft_limit
            seq.spec = SpecStats(method=self.speculator.drafter.method, draft_tokens=draft_limit)
        seq.timings.prompt_tokens = n
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        """Drop a request at once; its cache is freed as soon as no launched step uses it."""
        seq = self.scheduler.find(request_id)
        if seq is None or seq.finished:
            return
        seq.finish_reason = "abort"
        if seq.cache is None:
            self.scheduler.remove_waiting(seq)
        elif seq.inflight == 0:
            self._release(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._launched is not None

    def stats(self) -> EngineStats:
        s = self._stats
        s.running = len(self.scheduler.running)
        s.waiting = len(self.scheduler.waiting)
        s.preemptions = self.scheduler.preemptions
        prefix = self.cache.prefix
        if prefix is not None:
            s.prefix_cache = True
            s.prefix_queried_tokens, s.prefix_hit_tokens = prefix.queried_tokens, prefix.hit_tokens
            s.prefix_cached_bytes, s.prefix_checkpoints = self.cache.prefix_cached_bytes, len(prefix.checkpoints)
            s.prefix_checkpoint_budget_bytes = prefix.capacity * self.cache.cache.state.bytes_per_slot
        s.kv_used_tokens = self.cache.active_tokens
        s.cuda_graphs = self.graphs is not None
        spec = replace(self.speculator.totals) if self.speculator is not None else None
        return EngineStats(**{**vars(s), "spec": spec})

    # -- stepping ---------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Plan and launch a step; return the outputs of the step that completed meanwhile (this
        one, or the one launched by the previous call when steps overlap)."""
        outputs: list[StepOutput] = []
        if not self._may_overlap():
            outputs += self.sync()
        plan = self.scheduler.schedule()
        if plan.empty:
            if self._launched is None and self.scheduler.running and not outputs:
                raise NinferError("the scheduler found nothing to run: the KV cache cannot hold any waiting prompt")
        elif self._speculating(plan) and self._launched is None:
            outputs += self._speculative_step(plan)
        elif self._launched is not None and any(c.seq.draft_limit for c in plan.prefills):
            # a drafting prompt was admitted beside a step in flight: its chunk is a speculative step
            # (the drafter learns the prompt), which needs that step's tokens: plan again once read
            outputs += self.sync()
        else:  # with a step in flight, a sequence that wants drafts gets them a round later
            rows, logits, scored, decoded = self._launch_forward(plan)
            if self._launched is not None and any(s.grammar is not None or s.bans_end for s in rows):
                outputs += self.sync()  # the masks need its tokens (counted): done while the forward runs
            launched = self._launch_sampling(plan, rows, logits, scored)
            if decoded is not None and self.speculator is not None:
                # drafting rows without drafts: the drafter catches up from the sampled tokens
                self.speculator.observe_step(plan.decodes, *decoded, launched.tokens[: len(plan.decodes)])
            if self._launched is not None:
                outputs += self._complete(self._launched)
            self._launched = launched
            if not self._may_overlap():
                outputs += self._complete(launched)
                self._launched = None
        if plan.empty:
            outputs += self.sync()
        return outputs

    def sync(self) -> list[StepOutput]:
        """Complete the step in flight without launching another (its outputs are returned)."""
        if self._launched is None:
            return []
        launched, self._launched = self._launched, None
        return self._complete(launched)

    def warm_up(self, lengths: Iterable[int] = WARM_UP_LENGTHS) -> None:
        """Run a few throw-away prompts through every path a request can take (fused steps, chunked
        GDN and attention prefill, the MoE decode kernels and grouped GEMM, sampling with and
        without penalties), so that first-use costs (Triton autotuning, kernel loading, cuBLAS
        plans) are paid at load, not by the first user. Each length runs alone, then all together
        and all but the longest together (mixed steps run eagerly, and the MoE's Triton block size
        follows a step's token count: 1,345 and 3,345 tokens take different ones). A prompt of one
        whole prefill chunk goes first: the caching allocator then holds the largest activations a
        step can need (H200, 35B-A3B: a first 8K prompt after load took 21 ms longer than later ones)."""
        vocab = self.config.vocab_size
        generator = torch.Generator().manual_seed(0)
        longest = min(self.prefill_chunk, self.max_context - 3)
        lengths = tuple(lengths)
        for batch in ((longest,), *((n,) for n in lengths), lengths, lengths[:-1]):
            for i, n in enumerate(min(n, self.max_context - 3) for n in batch):
                params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True) if i % 2 else SamplingParams(
                    temperature=1.0, top_p=0.9, presence_penalty=0.5, max_tokens=2, ignore_eos=True, seed=0)
                self.add_request(GenerationRequest(torch.randint(0, vocab, (n,), generator=generator).tolist(), params))
            for _ in self.generate([]):
                pass
        self._forget_warm_up()

    def warm_thread(self) -> None:
        """Throw-away requests in the calling thread, the one that will drive the engine: per-thread
        state (PyTorch's cuBLAS handle and current stream, autograd's inference mode) is made here,
        not by the first user's request (the load thread ran `warm_up`). A short prompt; on a GPU
        also one of 512 tokens with a chat's checkpoint (a message start): served chats take that
        path (a prompt split at the checkpoint, GDN states kept), raw warm-up prompts do not. (On a
        CPU that prompt would add seconds to a start, as `warm_up` would.)"""
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        requests = [GenerationRequest([0] * 4, params)]
        if self.device.type == "cuda":
            long = min(512, self.max_context - 3)
            requests.append(GenerationRequest([0] * long, params, checkpoints=(long // 2,)))
        for _ in self.generate(requests):
            pass
        self._forget_warm_up()

    def _forget_warm_up(self) -> None:
        """Statistics and cached prefixes as if the throw-away requests never ran."""
        self._stats = replace(self._stats, requests_finished=0, prompt_tokens=0, generated_tokens=0, prefill_chunks=0,
                              decode_steps=0, decode_rows=0, max_decode_batch=0, preemptions=0,
                              last_prefill_tok_s=0.0, last_decode_tok_s=0.0)
        if self.speculator is not None:
            spec = self.speculator
            spec.totals = SpecStats(method=spec.drafter.method, draft_tokens=spec.draft_tokens)
        self.cache.forget_prefixes()  # random prompts: nothing a user will send

    def generate(self, requests: Iterable[GenerationRequest]) -> Iterator[StepOutput]:
        """Run requests to completion on this engine, yielding outputs as they come."""
        for request in requests:
            self.add_request(request)
        while self.has_unfinished():
            yield from self.step()

    def _may_overlap(self) -> bool:
        """Whether the next step can be launched before the last one's tokens are on the host."""
        if not self.overlap:
            return False
        running = self.scheduler.running
        decoding = [s for s in running if not s.finished and not s.in_prefill]
        # a speculative step reads the last tokens on the host: none while a drafting sequence is in
        # its prompt or one that decodes wants drafts (one still waiting, once admitted, has `step`
        # plan again after the read: waiting for a slot, it leaves the running rows' steps overlapped)
        entering = any(s.draft_limit and s.in_prefill for s in running)
        return not entering and not self._drafting(decoding) and self.scheduler.can_grow(decoding)

    def _speculating(self, plan: StepPlan) -> bool:
        return self.speculator is not None and (any(c.seq.draft_limit for c in plan.prefills)
                                                or self._drafting(plan.decodes))

    def _drafting(self, seqs: list[Sequence]) -> bool:
        """Whether a round of these decoding sequences is a speculative step: one wants drafts, or its
        drafter cannot follow plain steps. Otherwise it is a plain step (overlapped on a GPU), the
        drafter catching up from its sampled tokens (`Speculator.observe_step`)."""
        spec = self.speculator
        if spec is None or not any(s.draft_limit for s in seqs):
            return False
        return not spec.follows_plain_steps or any(k > 0 for k in spec.wanted(seqs))

    # -- a plain step: launch, then complete -------------------------------------------------

    def _launch_forward(self, plan: StepPlan) -> tuple[list[Sequence], list[torch.Tensor], list[ChunkScores],
                                                      tuple[ForwardBatch, ForwardOutput] | None]:
        """Queue the plan's forward; the rows that sample and their logits (not yet ready), the
        scores of the prompt tokens it read for requests that asked (being copied to the host), and
        the decode rows' batch and output."""
        assert not any(c.seq.draft_limit for c in plan.prefills), "a drafting prompt is a speculative step's"
        parts: list[ForwardBatch] = []
        if plan.decodes:
            parts.append(self._decode_batch(plan.decodes, self._launched))
        parts, outs = self._forward_with_chunks(parts, plan.prefills)
        rows = list(plan.decodes)
        logits = [outs[0].logits[:, -1]] if plan.decodes else []
        prefilled = outs[len(outs) - len(plan.prefills):]
        scored = score_chunks(plan.prefills, prefilled, to_host=True)
        for chunk, out in zip(plan.prefills, prefilled):
            if chunk.last:
                rows.append(chunk.seq)
                logits.append(out.logits[:, -1])
        for seq in plan.decodes:
            seq.num_cached += 1
        self._prefilled(plan.prefills)
        self._count(plan)
        for seq in plan.sequences:
            seq.inflight += 1
        for seq in rows:
            seq.num_pending += 1
        return rows, logits, scored, (parts[0], outs[0]) if plan.decodes else None

    def _launch_sampling(self, plan: StepPlan, rows: list[Sequence], logits: list[torch.Tensor],
                         scored: list[ChunkScores]) -> LaunchedStep:
        """Queue the sampling of the forward's rows and the copy of their tokens to the host."""
        tokens, logprobs = torch.empty(0, dtype=torch.long), None
        if rows:  # one part's logits as they are (a graph's static output: sampled before the next replay)
            tokens, logprobs = self._sample(rows, logits[0] if len(logits) == 1 else torch.cat(logits))
        if self.device.type != "cuda" or not (rows or scored):  # nothing to wait for on the host
            return LaunchedStep(plan, rows, tokens, tokens, None, logprobs, scored)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        logprobs = logprobs.to_host() if logprobs is not None else None
        done = torch.cuda.Event()
        done.record()
        return LaunchedStep(plan, rows, tokens, host, done, logprobs, scored)

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> tuple[torch.Tensor, LogprobRows | None]:
        """One token per row on the device ([R] int64, -1 where the logits are not finite) and the
        logprobs of the rows that ask for them (of the logits as they come: before the grammar
        masks, the penalties and the sampler's transforms). Constrained rows are masked in place
        (a row whose sequence has ended meanwhile is wasted: not masked); the penalties come from
        the device tables, so the newest tokens need not be on the host."""
        params = [s.request.sampling for s in seqs]
        argmax_only = plain_greedy(params) and all(p.logprobs is None for p in params) and all(
            s.grammar is None for s in seqs)
        if not argmax_only:
            logits = logits.float()  # the sampler's kernel, the penalties and the masks take fp32
        scores = log_softmax_rows(logits, [p.logprobs for p in params])
        logits = self._ban_ends(seqs, logits)
        logits = constrain(logits, [None if s.finished else s.grammar for s in seqs])
        penalised = [i for i, p in enumerate(params) if p.has_penalties]
        slots = None
        tables = self._ready_penalties(seqs)
        if tables is not None:
            index, slots = upload([penalised, [seqs[i].cache.slot for i in penalised]], torch.long, self.device)
            logits = logits.index_copy(0, index, tables.apply(logits.index_select(0, index), slots,
                                                                 [params[i] for i in penalised]))
        tokens = self.sampler.sample(logits, params, [s.history() for s in seqs], [s.generator for s in seqs],
                                     penalised=True)
        if tables is not None:
            tables.record(slots, tokens.index_select(0, index))
        return tokens, scores.pick(tokens) if scores is not None else None

    def _ban_ends(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """The logits ([R, V], or [R, T, V] of a verify) with the end-of-answer and stop ids at -inf
        in the rows whose answer may not end yet (min_tokens); the others' as they are."""
        rows = [i for i, s in enumerate(seqs) if s.bans_end]
        if not rows:
            return logits
        out = logits.clone()  # a graph's static output, or logits that logprobs read as they came
        for i in rows:
            ids = sorted(self.eos_ids | set(seqs[i].request.sampling.stop_token_ids))
            out[i, ..., ids] = float("-inf")
        return out

    def _ready_penalties(self, seqs: list[Sequence]) -> PenaltyTables | None:
        """The penalty tables, each penalised sequence's row holding its history (filled from the host
        on its first use, or again after a preemption); None when no sequence has penalties."""
        penalised = [s for s in seqs if s.request.sampling.has_penalties]
        if not penalised:
            return None
        if self._penalties is None:
            self._penalties = PenaltyTables(self.cache.max_seqs, self.config.vocab_size, self.device)
        for seq in penalised:
            if not seq.penalties_ready:
                self._penalties.reset(seq.cache.slot, seq.prompt_ids, seq.output_ids)
                seq.penalties_ready = True
        return self._penalties

    def _complete(self, step: LaunchedStep) -> list[StepOutput]:
        if step.done is not None:
            step.done.synchronize()
        outputs = []
        now = time.perf_counter()
        tokens = step.host.tolist()
        logprobs = step.logprobs.entries(tokens) if step.logprobs is not None else {}
        for scores in step.prompt_scores:  # before the first tokens, which hand them out
            scores.fill()
        for row, (seq, token) in enumerate(zip(step.rows, tokens)):
            seq.num_pending -= 1
            if seq.finished:
                continue
            if token < 0:
                outputs.append(self._fail_sampling(seq))
                continue
            self._first_token(seq, now)
            outputs.append(self._append(seq, [token], [logprobs[row]] if row in logprobs else None))
            if self.speculator is not None and row < len(step.plan.decodes):  # a round without drafts
                self.speculator.record(seq, outputs[-1], Draft([]), 1, learned=True)
            self.scheduler.note_progress(seq)
        for chunk in step.plan.prefills:
            if chunk.last and chunk.seq.request.multimodal is not None:
                chunk.seq.request.multimodal.release()
        self._retire(step.plan.sequences)
        return outputs

    def _retire(self, seqs: list[Sequence]) -> None:
        """One launched step less on each; sequences that ended and are no longer in flight go."""
        for seq in seqs:
            seq.inflight -= 1
        for seq in seqs:
            if seq.finished and seq.inflight == 0 and seq in self.scheduler.running:
                self._release(seq)

    # -- a speculative step (synchronous: drafts need the previous tokens) -------------------

    def _speculative_step(self, plan: StepPlan) -> list[StepOutput]:
        spec = self.speculator
        assert spec is not None
        seqs = plan.decodes
        ks = self.scheduler.reserve_drafts(seqs, spec.wanted(seqs)) if seqs else []
        penalties = self._ready_penalties(seqs)  # the drafts' and the judge's histories, kept rows added below
        drafts = spec.propose(seqs, ks, penalties) if seqs else []
        parts: list[ForwardBatch] = []
        verify = False
        if seqs:
            width = 1 + max(d.count for d in drafts)
            capture = spec.drafter.capture_layers
            verify = width > 1 or bool(capture)
            # drafts still on the device go in after the copy (their places hold the last token until then)
            ids = [[s.output_ids[-1], *d.host_or(s.output_ids[-1])] + [s.output_ids[-1]] * (width - 1 - d.count)
                   for s, d in zip(seqs, drafts)]
            parts.append(self._rows_batch(seqs, ids, "all" if verify else "last", verify=verify,
                                          capture_layers=capture if verify else ()))
            place_pending(parts[0].input_ids, drafts)
        parts, outs = self._forward_with_chunks(parts, plan.prefills)
        self._count(plan)
        for scores in score_chunks(plan.prefills, outs[len(outs) - len(plan.prefills):], to_host=False):
            scores.fill()
        outputs: list[StepOutput] = []
        if seqs:
            batch, out = parts[0], outs[0]
            assert out.logits is not None
            verdict = spec.judge(seqs, drafts, self._ban_ends(seqs, out.logits), penalties)
            # the GDN commit and the drafter's catch-up from the verdict on the device: the GPU runs
            # them while the host waits for the verdict and then does its bookkeeping
            if verify:
                self._commit(batch, out, verdict.counts)
            settle = spec.observe(seqs, verdict, batch, out)
            kept = verdict.kept()  # the round's one wait for the device
            settle(kept)
            logprobs = self._verify_logprobs(seqs, kept, out.logits)
            for seq, asked, draft, tokens, lps in zip(seqs, ks, drafts, kept, logprobs):
                seq.num_cached += len(tokens)
                if tokens[-1] < 0:
                    outputs.append(self._fail_sampling(seq))
                    continue
                output = self._append(seq, tokens, lps)
                spec.record(seq, output, draft, len(tokens), asked=asked)
                outputs.append(output)
                self.scheduler.note_progress(seq)
            if penalties is not None:
                penalised = [(s, o) for s, o in zip(seqs, outputs)
                             if s.request.sampling.has_penalties and s.cache is not None and not s.finished]
                penalties.add([s.cache.slot for s, _ in penalised], [o.new_token_ids for _, o in penalised])
            for seq in seqs:
                if seq.cache is not None:
                    self.cache.truncate(seq.cache, seq.num_tokens)
        prefilled = list(zip(plan.prefills, parts[len(parts) - len(plan.prefills):],
                             outs[len(outs) - len(plan.prefills):]))
        sampled = [(c, o) for c, _, o in prefilled if c.last]
        tokens: list[int] = []
        first_logprobs: dict[int, TokenLogprob] = {}
        if sampled:
            ids, scores = self._sample([c.seq for c, _ in sampled], torch.cat([o.logits[:, -1] for _, o in sampled]))
            tokens = ids.tolist()
            first_logprobs = scores.entries(tokens) if scores is not None else {}
        now = time.perf_counter()
        firsts = {c.seq.request_id: (token, first_logprobs.get(row)) for row, ((c, _), token)
                  in enumerate(zip(sampled, tokens))}
        self._prefilled(plan.prefills)
        for chunk, batch, out in prefilled:
            seq = chunk.seq
            if seq.request_id in firsts:
                token, entry = firsts[seq.request_id]
                if token < 0:
                    outputs.append(self._fail_sampling(seq))
                    continue
                self._first_token(seq, now)
                outputs.append(self._append(seq, [token], [entry] if entry is not None else None))
                if seq.request.multimodal is not None:
                    seq.request.multimodal.release()
            spec.observe_prefill(seq, batch, out)
        for seq in plan.sequences:
            seq.inflight += 1
        self._retire(plan.sequences)
        return outputs

    @staticmethod
    def _verify_logprobs(seqs: list[Sequence], kept: list[list[int]],
                         logits: torch.Tensor) -> list[list[TokenLogprob] | None]:
        """Per sequence of a verify, the logprobs of its kept tokens (token t was drawn from row t
        of its logits [B, T, V]); None for sequences that did not ask."""
        asking = [b for b, s in enumerate(seqs) if s.request.sampling.logprobs is not None]
        out: list[list[TokenLogprob] | None] = [None] * len(seqs)
        if not asking:
            return out
        ids = [t for b in asking for t in kept[b]]
        scores = log_softmax_rows(torch.cat([logits[b, : len(kept[b])] for b in asking]),
                                  [seqs[b].request.sampling.logprobs for b in asking for _ in kept[b]])
        assert scores is not None
        entries = scores.pick(upload(ids, torch.long, logits.device)).entries(ids)
        start = 0
        for b in asking:
            out[b] = [entries[start + t] for t in range(len(kept[b]))]
            start += len(kept[b])
        return out

    def _prefilled(self, chunks: list[PrefillChunk]) -> None:
        """Prompt chunks are in the cache (or queued): index their pages, and checkpoint the GDN
        state at the end of a prompt and every `checkpoint_interval` tokens of a long one."""
        prefix = self.cache.prefix
        for chunk in chunks:
            seq = chunk.seq
            for fork, slot in zip(chunk.forks, chunk.fork_slots):  # the forward wrote the state there into it
                seq.num_cached = fork
                self.scheduler.note_progress(seq, checkpoint=True, filled=slot)
            seq.num_cached = chunk.end
            wanted = (seq.prefill_len - 1, seq.prefill_len, *seq.request.checkpoints)
            checkpoint = prefix is not None and (chunk.end in wanted or chunk.end % prefix.interval == 0)
            self.scheduler.note_progress(seq, checkpoint)

    def _commit(self, batch: ForwardBatch, out: ForwardOutput, counts: torch.Tensor) -> None:
        """Advance the GDN slots of a verify through each row's kept tokens."""
        if out.gdn_records is None:  # a graph replay: its commit graph keeps the accepted tokens
            assert self.graphs is not None
            self.graphs.commit(batch, counts)
        else:
            commit_gdn(self.model, self.cache.cache.state, out.gdn_records, batch.slots, counts)

    # -- batches and the forward --------------------------------------------------------------

    def _decode_batch(self, seqs: list[Sequence], previous: LaunchedStep | None) -> ForwardBatch:
        """One new token per sequence: its last token, read from the previous step's device ids
        when that step is still in flight (in steady decode, the same rows in the same order: the
        previous ids as they are, no kernel)."""
        pending = {id(s): i for i, s in enumerate(previous.rows)} if previous is not None else {}
        source = [pending.get(id(s), -1) if s.num_pending else -1 for s in seqs]
        ids = [[s.output_ids[-1] if src < 0 else 0] for s, src in zip(seqs, source)]
        batch = self._rows_batch(seqs, ids, "last")
        if previous is None or all(src < 0 for src in source):
            return batch
        if source == list(range(len(previous.rows))):
            batch.input_ids = previous.tokens[:, None]
        else:
            src = upload(source, torch.long, self.device)
            fresh = previous.tokens.index_select(0, src.clamp(min=0))
            batch.input_ids = torch.where(src[:, None] >= 0, fresh[:, None], batch.input_ids)
        return batch

    def _rows_batch(self, seqs: list[Sequence], ids: list[list[int]], logits: str, verify: bool = False,
                    capture_layers: tuple[int, ...] = ()) -> ForwardBatch:
        """B sequences x T new tokens at their cache positions. Ids, positions, cache lengths and
        slots are built on the host and cross in one copy; the batch's tensors are views of it
        (each a plain array, as the kernels read them), so no kernel runs to build them."""
        b, width = len(seqs), len(ids[0])
        lens = [s.num_cached for s in seqs]
        positions = [n + s.rope_delta + t for n, s in zip(lens, seqs) for t in range(width)]
        flat = upload([t for row in ids for t in row] + positions + lens + [s.cache.slot for s in seqs], torch.long,
                      self.device)
        n = b * width
        slots = flat[2 * n + b :]
        return ForwardBatch(
            input_ids=flat[:n].view(b, width), positions=flat[n : 2 * n].view(b, width),
            cache_lens=flat[2 * n : 2 * n + b], slots=slots, block_table=self.cache.rows(slots, max(lens) + width),
            logits=logits, verify=verify, capture_layers=capture_layers, host_cache_lens=tuple(lens),
        )

    def _prefill_batch(self, chunk: PrefillChunk) -> ForwardBatch:
        seq = chunk.seq
        ids = [seq.token_at(i) for i in range(chunk.start, chunk.end)]
        batch = self._rows_batch([seq], [ids], "all" if seq.scores_prompt else "last" if chunk.last else "none",
                                 capture_layers=self.speculator.capture_layers(seq) if self.speculator else ())
        batch.fork = self._fork(chunk)
        mm = seq.request.multimodal
        if mm is not None:
            assert self.vision_tower is not None  # checked in add_request
            with torch.inference_mode():
                mm.encode(self.vision_tower())
                batch.inputs_embeds = mm.chunk_embeddings(self.model.embed_tokens, batch.input_ids, chunk.start)
                batch.mrope_positions = mm.chunk_positions(chunk.start, chunk.end, self.device)
        return batch

    def _forward_with_chunks(self, parts: list[ForwardBatch], chunks: list[PrefillChunk]
                             ) -> tuple[list[ForwardBatch], list[ForwardOutput]]:
        """`parts` and the prompt chunks' batches, and their outputs of one forward. If building or
        running them fails (a media encoder, a kernel), the checkpoint slots reserved for the chunks'
        forks go back: no checkpoint will hold them."""
        try:
            parts = parts + [self._prefill_batch(c) for c in chunks]
            outs = self._forward(parts)
            self._embeddings(chunks, outs[len(outs) - len(chunks):])
            return parts, outs
        except BaseException:
            for chunk in chunks:
                for slot in chunk.fork_slots:
                    assert self.cache.prefix is not None
                    self.cache.prefix.return_slot(slot)
                chunk.fork_slots.clear()
            raise

    def _embeddings(self, chunks: list[PrefillChunk], outs: list[ForwardOutput]) -> None:
        """The embedding of a prompt that asked for one (GenerationRequest.embed), from the chunk that
        holds its last token: the final norm of that token's hidden state, in fp32, copied to the host
        before the step's tokens (so there when they are). A graph's outputs are read before its next replay."""
        for chunk, out in zip(chunks, outs):
            seq = chunk.seq
            last = len(seq.request.prompt_token_ids) - 1
            if not seq.request.embed or not chunk.start <= last < chunk.end:
                continue
            with torch.inference_mode():
                normed = self.model.norm(out.hidden_states[0, last - chunk.start][None]).float()[0]
            if normed.device.type == "cuda":
                host = torch.empty(normed.shape, dtype=normed.dtype, pin_memory=True)
                normed = host.copy_(normed, non_blocking=True)
            seq.embedding = normed

    def _fork(self, chunk: PrefillChunk) -> StateFork | None:
        """The chunk's checkpoints as a state fork, each with a reserved checkpoint slot (those that
        get none are not kept): by the fused steps from the first one when it is near the end (one
        window of them, or up to TAIL_WINDOWS: `step_windows`), else by the chunked rule twice, a
        second one (near the end) by the fused steps after that."""
        for _ in chunk.forks:
            slot = self.cache.reserve_checkpoint_slot()
            if slot is None:
                break
            chunk.fork_slots.append(slot)
        del chunk.forks[len(chunk.fork_slots):]
        if not chunk.forks:
            return None
        n, end = len(chunk.forks), chunk.end - chunk.start
        forks = [p - chunk.start for p in chunk.forks]
        windows = step_windows(forks, chunk.fork_slots, end, chunk.seq.cache.slot)
        values = upload(forks + chunk.fork_slots + [v for column in windows or () for v in column], torch.long,
                        self.device)
        then = StateFork(values[1:2], values[3:4], host_tokens=forks[1]) if n == 2 else None
        steps = None if windows is None else StepWindows(*values[2 * n:].view(3, TAIL_WINDOWS, 1))
        tail = steps is not None or (n == 1 and end - forks[0] <= MAX_STEP_TOKENS)
        return StateFork(values[:1], values[n : n + 1], tail=tail, then=then, host_tokens=forks[0], steps=steps)

    def _forward(self, parts: list[ForwardBatch]) -> list[ForwardOutput]:
        """The parts' outputs: by CUDA graph replays when every part has a graph (the decode /
        verify rows, short prompt chunks: a replay each, no host work to speak of, though the
        weights are read once per part), else one eager forward over all of them."""
        graphs = [self._graphs_for(part) for part in parts]
        if all(g is not None for g in graphs):
            outs = []
            for g, part in zip(graphs, parts):
                out = g.forward(part)
                # static buffers: a later replay of the same graph would overwrite them
                outs.append(out if len(parts) == 1 else replace(
                    out, logits=None if out.logits is None else out.logits.clone(),
                    hidden_states=out.hidden_states.clone()))
            return outs
        with torch.inference_mode():
            return self.model.forward_parts(parts, self.cache.cache)

    def _graphs_for(self, part: ForwardBatch) -> DecodeGraphs | PrefillGraphs | None:
        for graphs in (self.graphs, self.prefill_graphs):
            if graphs is not None and graphs.supports(part):
                return graphs
        return None

    # -- outputs ----------------------------------------------------------------------------

    def _count(self, plan: StepPlan) -> None:
        self._stats.prefill_chunks += len(plan.prefills)
        if plan.decodes:
            self._stats.decode_steps += 1
            self._stats.decode_rows += len(plan.decodes)
            self._stats.max_decode_batch = max(self._stats.max_decode_batch, len(plan.decodes))

    def _first_token(self, seq: Sequence, now: float) -> None:
        """The prompt is read: the prefill phase of the request's timings ends."""
        if seq.timings.prefill_s:
            return  # a preempted request recomputing its prompt keeps its first timing
        seq.timings.prefill_s = now - seq.started_at
        self._stats.prompt_tokens += len(seq.prompt_ids)
        self._stats.last_prefill_tok_s = seq.timings.prefill_tok_s

    def _append(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> StepOutput:
        """Record generated tokens (one, or a speculative round's run) in order until one stops the
        sequence (the rest are dropped); return them with their text delta (and logprobs). A
        constrained sequence's grammar accepts each token first. A bug in one request's token
        handling (grammar, detokenizer, stop strings) fails that request alone."""
        try:
            return self._record(seq, tokens, logprobs)
        except Exception:  # noqa: BLE001 - whatever it was, the other requests of the batch go on
            return self._fail(seq, logged_internal_error(log, f"request {seq.request_id} failed in the engine"),
                              logged=True)

    def _record(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None) -> StepOutput:
        taken: list[int] = []
        text = ""
        for token in tokens:
            if seq.grammar is not None and not seq.grammar.accept(token):
                return self._fail(seq, f"token {token} does not match the request's grammar")
            taken.append(token)
            text += self._push(seq, token)
            if seq.finished:
                break
        if seq.finished and seq.stops.matched is None:
            check = seq.stops.feed(seq.detokenizer.flush())
            text += check.text + ("" if check.stop else seq.stops.flush())
        if seq.finished:
            self._finish_timings(seq)
        prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, None  # with the first token
        embedding, seq.embedding = seq.embedding, None
        assert prompt_logprobs is None or all(e is not None for e in prompt_logprobs), "a prompt token was not scored"
        return StepOutput(
            request_id=seq.request_id,
            new_token_ids=taken,
            text_delta=text,
            finished=seq.finished,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            timings=seq.timings if seq.finished else None,
            spec=seq.spec if seq.finished else None,
            logprobs=logprobs[: len(taken)] if logprobs is not None else None,
            prompt_logprobs=prompt_logprobs,  # type: ignore[arg-type]  # every entry set (asserted)
            embedding=None if embedding is None else embedding.tolist(),
        )

    def _push(self, seq: Sequence, token: int) -> str:
        """One token: stop checks and its text."""
        seq.output_ids.append(token)
        self._stats.generated_tokens += 1
        params = seq.request.sampling
        done = seq.grammar is not None and seq.grammar.terminated  # the grammar took its stop token
        if done or token in params.stop_token_ids or (token in self.eos_ids and not params.ignore_eos):
            seq.finish_reason, seq.stop_reason = "stop", token
            return ""
        check = seq.stops.feed(seq.detokenizer.add(token))
        if check.stop is not None:
            seq.finish_reason, seq.stop_reason = "stop", check.stop
        elif len(seq.output_ids) >= seq.max_new_tokens:
            seq.finish_reason = "length"
        return check.text

    def _fail_sampling(self, seq: Sequence) -> StepOutput:
        """The row drew no token: its logits were not finite, or its grammar (with UTF-8) left none."""
        if seq.grammar is not None:
            return self._fail(seq, "no token fits the request's grammar here (or the logits were NaN / infinite)")
        return self._fail(seq, "the model produced logits that are NaN or infinite")

    def _fail(self, seq: Sequence, message: str, logged: bool = False) -> StepOutput:
        """End one request with an error, logged once (`logged`: with its traceback already); the
        others in the batch go on."""
        if not logged:
            log.warning("request %s failed in the engine: %s", seq.request_id, message)
        seq.finish_reason = "error"
        self._finish_timings(seq)
        return StepOutput(request_id=seq.request_id, new_token_ids=[], text_delta="", finished=True,
                          finish_reason="error", error=message, timings=seq.timings)

    def _finish_timings(self, seq: Sequence) -> None:
        if seq.timings.prefill_s:
            seq.timings.completion_tokens = len(seq.output_ids)
            seq.timings.decode_s = time.perf_counter() - seq.started_at - seq.timings.prefill_s
            self._stats.last_decode_tok_s = seq.timings.decode_tok_s or self._stats.last_decode_tok_s

    def _release(self, seq: Sequence) -> None:
        self._stats.requests_finished += 1
        if seq.finish_reason in ("stop", "length"):  # the end of an answer: a later turn may repeat it
            self.scheduler.note_progress(seq, checkpoint=True)
        if self.speculator is not None:
            self.speculator.release(seq)
        self.scheduler.release(seq)

    def _generator_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

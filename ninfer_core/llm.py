"""The public engine API: load a model, chat or complete, stream events, read stats.

The CLI (and later the server and the TUI) use only this module; it turns messages into a
prompt with the model's chat template, runs the token engine, and parses the output into
reasoning, content and tool calls as it streams.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .cache import CacheManager
from .cache.manager import DEFAULT_PAGE_SIZE
from .cache.prefix_cache import SPLIT_MIN
from .cache.kv_pool import engine_kv_dtype
from .cache.sizing import plan_cache
from .cache.state_pool import state_bytes_per_slot
from .chat.output_parser import (
    ContentDelta,
    OutputParser,
    ParsedOutput,
    ParserEvent,
    ReasoningDelta,
    ToolCallEnd,
    collect,
)
from .chat.constraints import ConstraintError, JsonOutput, OutputConstraint, structural_tag
from .chat.reasoning import prompt_opens_reasoning
from .chat.template import ChatTemplate, load_chat_template, open_final_message
from .engine.cuda_graph import DecodeGraphs
from .engine.grammar import Grammar, GrammarCompiler, GrammarError
from .engine.logprobs import TokenLogprob
from .engine.prefill_graph import PrefillGraphs
from .engine.llm_engine import EngineStats, LLMEngine
from .engine.request import GenerationRequest, SpecStats, StepOutput, Timings
from .engine.sampling import Sampler, SamplingParams
from .engine.speculative import build_speculator, load_draft_weights
from .config import QWEN_ARCHS
from .embeddings import EMBED_SAMPLING
from .errors import EngineError, NinferError
from .media.limits import MediaError
from .media.sources import split_media
from .models.loader import LoadedModel, load_model
from .models.multimodal import MultimodalPrompt
from .models.vision_support import VisionSupport
from .ops.dispatch import kernels_available

log = logging.getLogger(__name__)

DEFAULT_MAX_CONTEXT = {"cpu": 8192, "cuda": 32768}
CPU_PREFILL_CHUNK = 1024
# An 8K prompt in one forward instead of two: the second chunk re-reads every weight and the MoE
# runs at 4K rows where its blocks are half as full (H200, 8,192 tokens: 237 vs 269 ms TTFT).
# Its activations (~1 GiB for the 35B-A3B) are kept to GPUs with room for them.
LARGE_GPU_PREFILL_CHUNK, GPU_PREFILL_CHUNK, LARGE_GPU_BYTES = 8192, 4096, 48 << 30
DEFAULT_PREFIX_CACHE_GB = {"cpu": 0.25, "cuda": 2.0}
MAX_CHECKPOINTS = 256


@dataclass
class EngineOptions:
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    max_context: int | None = None  # tokens per sequence (prompt + answer); None: model limit, capped
    kv_capacity: int | None = None  # KV tokens over all sequences; None: auto (cache/sizing.py)
    kv_dtype: str = "auto"  # auto (engine_kv_dtype) | fp32 | bf16 | fp16 | fp8 | int8
    weights: str = "auto"  # auto | bf16 | int8 | int4 (models/quantize.py)
    cuda_graphs: bool = True  # decode by CUDA graph replay on the GPU
    max_seqs: int = 1
    prefill_chunk: int | None = None  # tokens per prefill forward; None: default_prefill_chunk
    chat_template: str | Path | None = None
    vision: bool = False  # load the vision tower at start (else on the first request with media)
    mmproj: str | Path | None = None  # a GGUF model's vision projector (None: an mmproj*.gguf beside it)
    random_weights: bool = False  # config + tokenizer only, random tensors: full-size benchmarks
    spec: str | None = None  # speculative decoding: "mtp" | "dflash" | "ngram" (None: off)
    draft_tokens: int | None = None  # drafts per round (None: 3 for mtp, 15 for dflash, 4 for ngram)
    draft_model: str | Path | None = None  # DFlash companion checkpoint directory
    adaptive_draft: bool = False  # K per request in 0..draft_tokens from its recent acceptance
    prefix_cache: bool = True  # reuse the KV pages and GDN state of repeated prompt prefixes
    prefix_cache_gb: float | None = None  # memory for GDN state checkpoints (None: 2 GiB GPU, 0.25 GiB CPU)

    def checkpoint_slots(self, state_bytes: int, device: torch.device) -> int:
        """How many GDN state checkpoints the prefix cache may keep (0: no prefix cache)."""
        if not self.prefix_cache:
            return 0
        budget = (self.prefix_cache_gb or DEFAULT_PREFIX_CACHE_GB[device.type]) * 2**30
        return max(1, min(MAX_CHECKPOINTS, int(budget // state_bytes))) if state_bytes else MAX_CHECKPOINTS

    def check(self) -> None:
        """Flags that would be silently ignored or fail late: refused before loading."""
        if self.spec is None and (self.draft_tokens is not None or self.draft_model is not None
                                  or self.adaptive_draft):
            raise NinferError("--draft-tokens / --draft-model / --adaptive-draft need --spec mtp|dflash|ngram")
        if self.prefix_cache_gb is not None and not self.prefix_cache_gb > 0:
            raise NinferError(f"--prefix-cache-gb must be a positive number, got {self.prefix_cache_gb}")


def default_prefill_chunk(device: torch.device) -> int:
    """Tokens per prefill forward: 8,192 on GPUs of 48 GiB or more, 4,096 on smaller ones, 1,024 on the CPU."""
    if device.type != "cuda":
        return CPU_PREFILL_CHUNK
    large = torch.cuda.get_device_properties(device).total_memory >= LARGE_GPU_BYTES
    return LARGE_GPU_PREFILL_CHUNK if large else GPU_PREFILL_CHUNK


def _interval(prefill_chunk: int) -> int:
    """Tokens between the checkpoints of a long prompt: its chunks, rounded up to whole pages."""
    return math.ceil(prefill_chunk / DEFAULT_PAGE_SIZE) * DEFAULT_PAGE_SIZE


@dataclass
class ChatResult:
    text: str
    reasoning: str
    tool_calls: list[dict[str, Any]]
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    timings: Timings
    reasoning_tokens: int = 0  # generated tokens up to the end of the reasoning block
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    spec: SpecStats | None = None  # speculative decoding of this request (None: off)
    logprobs: list[TokenLogprob] | None = None  # per answer token, when the request asked

    def to_json(self) -> dict[str, Any]:
        t = self.timings
        return {
            "text": self.text,
            "reasoning": self.reasoning,
            "tool_calls": self.tool_calls,
            "prompt_token_ids": self.prompt_token_ids,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "usage": {"prompt_tokens": len(self.prompt_token_ids), "completion_tokens": len(self.token_ids)},
            "timings": {
                "prefill_s": t.prefill_s,
                "decode_s": t.decode_s,
                "prefill_tok_s": t.prefill_tok_s,
                "decode_tok_s": t.decode_tok_s,
            },
            "spec": self.spec.to_json() if self.spec is not None else None,
        }


@dataclass
class ChatFinished:
    result: ChatResult


@dataclass(frozen=True)
class LogprobsDelta:
    """The logprobs of a step's answer tokens (requests with SamplingParams.logprobs), before the
    text events of the same step."""

    logprobs: list[TokenLogprob]


ChatEvent = ReasoningDelta | ContentDelta | ToolCallEnd | ChatFinished
# What ChatAssembler.feed yields: every parser event (tool calls stream as Start / ArgsDelta / End)
ChatStreamEvent = ParserEvent | LogprobsDelta | ChatFinished


@dataclass
class ChatRequest:
    messages: Sequence[Mapping[str, Any]]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    tools: Sequence[Mapping[str, Any]] | None = None
    enable_thinking: bool = True
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    constraint: OutputConstraint | None = None  # the answer after the reasoning must match it
    continue_final: bool = False  # the last message is an assistant's text that the answer continues


def tool_call_json(index: int, name: str, arguments: str) -> dict[str, Any]:
    """OpenAI's shape for one tool call."""
    return {"id": f"call_{index}", "type": "function", "function": {"name": name, "arguments": arguments}}


# an assistant answer no template alters, to find where an answer starts in a rendered history
_PROBE = "ninfer-answer-probe"


def _common_prefix_length(a: Sequence[Any], b: Sequence[Any]) -> int:
    """How many leading items two strings or lists share, by bisection over slice comparisons:
    done in C, where a Python loop over a long chat's ids or characters cost ~5-8 ms a request."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        mid = (low + high + 1) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid - 1
    return low


@dataclass(frozen=True)
class PreparedChat:
    """A chat request turned into engine input: the prompt, its ids, and how the output starts."""

    prompt: str
    prompt_token_ids: list[int]
    starts_in_reasoning: bool
    tools: Sequence[Mapping[str, Any]] | None = None
    multimodal: MultimodalPrompt | None = None  # images / videos, their pads expanded in the ids
    checkpoints: tuple[int, ...] = ()  # where the next request may diverge: before the last message, the answer
    grammar: Grammar | None = None  # the request's constraint, compiled
    tool_calls: bool = True  # whether the output may hold tool calls (not under a JSON constraint)


class ChatAssembler:
    """Turns one request's engine outputs into parser events and, at the end, a ChatResult.

    Shared by LLM.chat and the concurrent service (which runs it on the consumer's side), so the
    CLI, the TUI and the server cannot disagree on reasoning, content or tool calls.
    """

    def __init__(self, prepared: PreparedChat):
        self.prepared = prepared
        self._parser = OutputParser(starts_in_reasoning=prepared.starts_in_reasoning, tools=prepared.tools,
                                    tool_calls=prepared.tool_calls)
        self._parsed = ParsedOutput()
        self.logprobs: list[TokenLogprob] | None = None
        self.token_ids: list[int] = []
        self.reasoning_tokens = 0  # generated tokens up to and including the one that closes </think>
        self._undecided = 0  # tokens fed while it was unknown whether the output opens with <think>

    def feed(self, out: StepOutput) -> list[ChatStreamEvent]:
        before = self._parser.phase
        self.token_ids += out.new_token_ids
        events: list[ParserEvent] = self._parser.feed(out.text_delta) if out.text_delta else []
        if out.finished:
            events += self._parser.finish()
        self._count_reasoning(before, len(out.new_token_ids))
        collect(events, self._parsed)
        logprobs = out.text_logprobs()
        if out.logprobs is not None:
            self.logprobs = (self.logprobs or []) + logprobs
        head: list[ChatStreamEvent] = [LogprobsDelta(logprobs)] if logprobs else []
        return [*head, *events, ChatFinished(self._result(out))] if out.finished else [*head, *events]

    def _count_reasoning(self, before: str, n: int) -> None:
        """The parser's phase before each token says whether the token was reasoning."""
        if before == "reasoning":
            self.reasoning_tokens += n
        elif before == "undecided":
            self._undecided += n
            if self._parser.phase == "reasoning":  # the output opened with <think>
                self.reasoning_tokens += self._undecided

    def _result(self, last: StepOutput) -> ChatResult:
        assert last.timings is not None
        calls = [tool_call_json(i, c.name, c.arguments) for i, c in enumerate(self._parsed.tool_calls)]
        finish = "tool_calls" if calls and last.finish_reason == "stop" else last.finish_reason
        return ChatResult(
            text=self._parsed.content,
            reasoning=self._parsed.reasoning,
            tool_calls=calls,
            prompt_token_ids=self.prepared.prompt_token_ids,
            token_ids=self.token_ids,
            finish_reason=finish or "stop",
            timings=last.timings,
            reasoning_tokens=self.reasoning_tokens,
            stop_reason=last.stop_reason,
            spec=last.spec,
            logprobs=self.logprobs,
        )


class LLM:
    def __init__(self, loaded: LoadedModel, options: EngineOptions):
        self.loaded = loaded
        self.options = options
        self.tokenizer = loaded.tokenizer
        self.template: ChatTemplate = load_chat_template(loaded.tokenizer, options.chat_template)
        device = loaded.device
        model_limit = loaded.config.max_position_embeddings
        if options.max_context is not None and options.max_context > model_limit:
            raise NinferError(f"--max-context {options.max_context} exceeds the model's limit of {model_limit} tokens")
        graphs = options.cuda_graphs and device.type == "cuda" and kernels_available()
        checkpoints = options.checkpoint_slots(state_bytes_per_slot(loaded.config, loaded.dtype), device)
        kv_dtype = engine_kv_dtype(options.kv_dtype, device, loaded.dtype)
        # the drafter's weights before the cache is sized: the KV pages get what is left after them, and
        # after a vision tower's room (it is built on the first image, or below with --vision)
        draft = None if options.spec is None else load_draft_weights(options.spec, options.draft_model, loaded,
                                                                     options.random_weights)
        self.vision = VisionSupport.of(loaded)
        plan = plan_cache(loaded.config, device, loaded.dtype, kv_dtype=kv_dtype,
                          max_seqs=options.max_seqs, max_context=options.max_context,
                          default_context=DEFAULT_MAX_CONTEXT[device.type], kv_capacity=options.kv_capacity,
                          extra_state_slots=checkpoints,
                          draft_kv_bytes_per_token=draft.kv_bytes_per_token if draft is not None else 0,
                          later_bytes=self.vision.tower_bytes() if self.vision is not None else 0)
        self.max_context = plan.max_context
        prefill_chunk = options.prefill_chunk or default_prefill_chunk(device)
        cache = CacheManager(loaded.config, max_tokens=plan.kv_tokens, max_seqs=options.max_seqs, dtype=loaded.dtype,
                             device=device, kv_dtype=plan.kv_dtype, scratch=graphs, max_seq_tokens=self.max_context,
                             checkpoints=checkpoints, checkpoint_interval=_interval(prefill_chunk))
        log.info("KV cache: %d tokens (%s, %.2f GiB) + %d GDN state slots (%.2f GiB); context limit %d tokens",
                 cache.capacity_tokens, cache.cache.kv.dtype_name, cache.kv_bytes / 2**30, options.max_seqs,
                 cache.state_bytes / 2**30, self.max_context)
        if options.vision:
            if self.vision is None:
                raise NinferError(f"{loaded.name} has no vision tower (--vision needs a multimodal checkpoint, or a "
                                  f"GGUF model with its mmproj file)")
            self.vision.tower()
        decode_graphs = DecodeGraphs(loaded.model, cache, options.max_seqs, self.max_context) if graphs else None
        speculator = None
        if draft is not None:
            speculator = build_speculator(draft, options.draft_tokens, loaded, cache, Sampler(), decode_graphs,
                                          options.adaptive_draft)
        prefill_graphs = None
        if decode_graphs is not None:
            widths = range(2, speculator.draft_tokens + 2) if speculator is not None else ()
            layers = speculator.drafter.capture_layers if speculator is not None else ()
            count = decode_graphs.capture_all(widths, layers)
            prefill_graphs = PrefillGraphs(loaded.model, cache, self.max_context, decode_graphs.pool)
            count += prefill_graphs.capture_all()
            log.info("captured %d CUDA graphs (batch buckets %s, prompt chunk buckets %s)", count,
                     decode_graphs.buckets, prefill_graphs.buckets)
        self.engine = LLMEngine(
            loaded.model,
            loaded.config,
            loaded.tokenizer,
            cache,
            max_context=self.max_context,
            prefill_chunk=prefill_chunk,
            generation_defaults=loaded.generation_defaults,
            vision_tower=self.vision.tower if self.vision else None,
            speculator=speculator,
            graphs=decode_graphs,
            prefill_graphs=prefill_graphs,
            weights=loaded.recipe.label(loaded.dtype),
        )
        # xgrammar is loaded by the first constrained request; the answer ends on the engine's end tokens
        self.grammars = GrammarCompiler(self.tokenizer, loaded.config.vocab_size, self.engine.eos_ids)
        if device.type == "cuda":
            self.engine.warm_up()
        try:  # the chat path's first-use costs (compiling Qwen's template: ~20 ms) at load, not in a request
            self.prepare_chat(ChatRequest(messages=[{"role": "user", "content": "hi"}]))
        except NinferError:
            pass  # a template that cannot render fails each chat request with its own message

    @classmethod
    def load(cls, model: str | None = None, options: EngineOptions | None = None) -> LLM:
        options = options or EngineOptions()
        options.check()  # before the (long) model load
        return cls(load_model(model, options.device, options.dtype, options.random_weights, options.weights,
                              options.mmproj), options)

    @property
    def name(self) -> str:
        return self.loaded.name

    @property
    def no_vision_reason(self) -> str:
        """Why this model cannot read images or videos, and what would let it."""
        gguf_qwen = self.loaded.source.is_file() and self.loaded.config.arch in QWEN_ARCHS
        hint = ("its vision tower is llama.cpp's mmproj file: put it beside the model file, or pass --mmproj"
                if gguf_qwen else "use a multimodal model")
        return f"{self.name} has no vision tower: it cannot read images or videos ({hint})"

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def compile_constraint(self, constraint: OutputConstraint, *, reasoning: bool) -> Grammar:
        """The grammar of a constraint (cached); ConstraintError names the request field at fault."""
        try:
            return self.grammars.compile(structural_tag(constraint, reasoning=reasoning))
        except GrammarError as e:
            raise ConstraintError(str(e), constraint.source) from None

    def render_prompt(self, request: ChatRequest, messages: Sequence[Mapping[str, Any]] | None = None) -> str:
        messages = request.messages if messages is None else messages
        prompt = self.template.render(
            messages,
            tools=request.tools,
            add_generation_prompt=not request.continue_final,
            enable_thinking=request.enable_thinking,
            **request.template_kwargs,
        )
        return open_final_message(prompt, messages[-1]) if request.continue_final else prompt

    def prepare_chat(self, request: ChatRequest) -> PreparedChat:
        """Template + tokenizer work of one chat request (no engine state: safe from any thread)."""
        messages, media = split_media(request.messages)
        if media and self.vision is None:  # before rendering: a text-only template fails on media parts
            raise MediaError(self.no_vision_reason)
        prompt = self.render_prompt(request, messages)
        ids, multimodal = self.tokenizer.encode_prompt(prompt), None
        if media:
            ids, multimodal = self.vision.prompt(ids, media, self.tokenizer.encode)
        reasoning = prompt_opens_reasoning(prompt)
        constraint = request.constraint
        return PreparedChat(
            prompt=prompt,
            prompt_token_ids=ids,
            starts_in_reasoning=reasoning,
            tools=request.tools,
            multimodal=multimodal,
            checkpoints=() if media else (self._history_end(request, messages, prompt, ids)
                                          + self._answer_start(request, messages, prompt, ids)),
            grammar=None if constraint is None else self.compile_constraint(constraint, reasoning=reasoning),
            tool_calls=not isinstance(constraint, JsonOutput),
        )

    def _history_end(self, request: ChatRequest, messages: Sequence[Mapping[str, Any]], prompt: str,
                     ids: list[int]) -> tuple[int, ...]:
        """The token position where the last message starts, when the conversation before it renders
        as a prefix of the prompt: requests sharing a system prompt, or an agent's context, differ
        from there on, so the prefix cache checkpoints the GDN state there (a hybrid model can only
        resume where a checkpoint was taken). Not for a history under SPLIT_MIN tokens: a fork that
        far from the prompt's end costs ~3 ms of GPU time (the 35B on an H100: a 37-token chat
        15.5 ms against 12.2 without it), more than a resume that short saves on its first reuse."""
        if len(messages) < 2 or len(ids) <= SPLIT_MIN:
            return ()
        try:
            history = self.template.render(messages[:-1], tools=request.tools, add_generation_prompt=False,
                                           enable_thinking=request.enable_thinking, **request.template_kwargs)
        except NinferError:
            return ()
        if not history or not prompt.startswith(history):
            return ()
        common = _common_prefix_length(self.tokenizer.encode_prompt(history), ids)
        return (common,) if SPLIT_MIN <= common < len(ids) else ()

    def _answer_start(self, request: ChatRequest, messages: Sequence[Mapping[str, Any]], prompt: str,
                      ids: list[int]) -> tuple[int, ...]:
        """The token position where the next turn's history will differ from this prompt: after the
        assistant header, before what the generation prompt adds that the history does not keep
        (Qwen's `<think>` opener: a thinking model's history drops the reasoning). The next turn
        then resumes there, not before this turn's last message, which may be long (pasted code).
        Short prompts skip it, as the scheduler's split of the last token (an extra step each)."""
        if len(ids) < SPLIT_MIN or request.continue_final:  # a continued message: the next turn rewrites it
            return ()
        try:
            # the history of the next turn: this answer, then a new question after it
            turn = self.template.render([*messages, {"role": "assistant", "content": _PROBE},
                                         {"role": "user", "content": _PROBE}], tools=request.tools,
                                        add_generation_prompt=False, enable_thinking=request.enable_thinking,
                                        **request.template_kwargs)
        except NinferError:
            return ()
        start = _common_prefix_length(prompt, turn)
        if start == len(prompt) or _PROBE not in turn[start:]:
            return ()
        suffix = self.tokenizer.encode(prompt[start:])
        # the suffix's own tokens must be the prompt's last ones (no merge across the boundary)
        return (len(ids) - len(suffix),) if 0 < len(suffix) < len(ids) and ids[-len(suffix):] == suffix else ()

    def complete(
        self, prompt_token_ids: list[int], sampling: SamplingParams, multimodal: MultimodalPrompt | None = None,
        checkpoints: tuple[int, ...] = (),
        grammar: Grammar | None = None,
    ) -> Iterator[StepOutput]:
        """Raw token generation for one prompt (no template, no parsing); `grammar` constrains it.
        Raises EngineError when the engine fails the request (as the service does)."""
        request = GenerationRequest(prompt_token_ids=prompt_token_ids, sampling=sampling, multimodal=multimodal,
                                    checkpoints=checkpoints, grammar=grammar)
        for out in self.engine.generate([request]):
            if out.error is not None:
                raise EngineError(out.error)
            yield out

    def embed(self, prompts: Sequence[list[int]]) -> list[list[float]]:
        """Each prompt's embedding (embeddings.py: the final norm of its last token's hidden state, not
        normalized), the prompts read in one batch. Raises EngineError when the engine fails one."""
        requests = [GenerationRequest(list(ids), EMBED_SAMPLING, embed=True, draft_tokens=0) for ids in prompts]
        found: dict[str, list[float]] = {}
        for out in self.engine.generate(requests):
            if out.error is not None:
                raise EngineError(out.error)
            if out.embedding is not None:
                found[out.request_id] = out.embedding
        return [found[r.request_id] for r in requests]

    def chat(self, request: ChatRequest) -> Iterator[ChatEvent]:
        """Stream reasoning / content deltas and completed tool calls, then a ChatFinished."""
        prepared = self.prepare_chat(request)
        assembler = ChatAssembler(prepared)
        for out in self.complete(prepared.prompt_token_ids, request.sampling, prepared.multimodal,
                                 prepared.checkpoints, prepared.grammar):
            for event in assembler.feed(out):
                if isinstance(event, (ReasoningDelta, ContentDelta, ToolCallEnd, ChatFinished)):
                    yield event

    def chat_result(self, request: ChatRequest) -> ChatResult:
        for event in self.chat(request):
            if isinstance(event, ChatFinished):
                return event.result
        raise AssertionError("chat() ended without ChatFinished")

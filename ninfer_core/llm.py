"""The public engine API: load a model, chat or complete, stream events, read stats.

The CLI (and later the server and the TUI) use only this module; it turns messages into a
prompt with the model's chat template, runs the token engine, and parses the output into
reasoning, content and tool calls as it streams.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .cache import CacheManager
from .chat.output_parser import (
    ContentDelta,
    OutputParser,
    ParsedOutput,
    ParserEvent,
    ReasoningDelta,
    ToolCallEnd,
    collect,
)
from .chat.reasoning import prompt_opens_reasoning
from .chat.template import ChatTemplate, load_chat_template
from .engine.llm_engine import EngineStats, LLMEngine
from .engine.request import GenerationRequest, StepOutput, Timings
from .engine.sampling import SamplingParams
from .errors import NinferError
from .models.loader import LoadedModel, load_model

DEFAULT_MAX_CONTEXT = {"cpu": 8192, "cuda": 32768}


@dataclass
class EngineOptions:
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    max_context: int | None = None  # tokens per sequence (prompt + answer); None: model limit, capped
    kv_capacity: int | None = None  # KV tokens over all sequences; None: max_context * max_seqs
    max_seqs: int = 1
    prefill_chunk: int = 1024
    chat_template: str | Path | None = None


@dataclass
class ChatResult:
    text: str
    reasoning: str
    tool_calls: list[dict[str, Any]]
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    timings: Timings

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
        }


@dataclass
class ChatFinished:
    result: ChatResult


ChatEvent = ReasoningDelta | ContentDelta | ToolCallEnd | ChatFinished


@dataclass
class ChatRequest:
    messages: Sequence[Mapping[str, Any]]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    tools: Sequence[Mapping[str, Any]] | None = None
    enable_thinking: bool = True
    template_kwargs: dict[str, Any] = field(default_factory=dict)


def tool_call_json(index: int, name: str, arguments: str) -> dict[str, Any]:
    """OpenAI's shape for one tool call."""
    return {"id": f"call_{index}", "type": "function", "function": {"name": name, "arguments": arguments}}


class LLM:
    def __init__(self, loaded: LoadedModel, options: EngineOptions):
        self.loaded = loaded
        self.options = options
        self.tokenizer = loaded.tokenizer
        self.template: ChatTemplate = load_chat_template(loaded.tokenizer, options.chat_template)
        model_limit = loaded.config.max_position_embeddings
        self.max_context = options.max_context or min(model_limit, DEFAULT_MAX_CONTEXT[loaded.device.type])
        if self.max_context > model_limit:
            raise NinferError(f"--max-context {self.max_context} exceeds the model's limit of {model_limit} tokens")
        cache = CacheManager(
            loaded.config,
            max_tokens=options.kv_capacity or self.max_context * options.max_seqs,
            max_seqs=options.max_seqs,
            dtype=loaded.dtype,
            device=loaded.device,
        )
        self.engine = LLMEngine(
            loaded.model,
            loaded.config,
            loaded.tokenizer,
            cache,
            max_context=self.max_context,
            prefill_chunk=options.prefill_chunk,
            generation_defaults=loaded.generation_defaults,
        )

    @classmethod
    def load(cls, model: str | None = None, options: EngineOptions | None = None) -> LLM:
        options = options or EngineOptions()
        return cls(load_model(model, options.device, options.dtype), options)

    @property
    def name(self) -> str:
        return self.loaded.name

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def render_prompt(self, request: ChatRequest) -> str:
        return self.template.render(
            request.messages,
            tools=request.tools,
            add_generation_prompt=True,
            enable_thinking=request.enable_thinking,
            **request.template_kwargs,
        )

    def complete(self, prompt_token_ids: list[int], sampling: SamplingParams) -> Iterator[StepOutput]:
        """Raw token generation for one prompt (no template, no parsing)."""
        request = GenerationRequest(prompt_token_ids=prompt_token_ids, sampling=sampling)
        yield from self.engine.generate([request])

    def chat(self, request: ChatRequest) -> Iterator[ChatEvent]:
        """Stream reasoning / content deltas and completed tool calls, then a ChatFinished."""
        prompt = self.render_prompt(request)
        prompt_ids = self.tokenizer.encode(prompt)
        parser = OutputParser(starts_in_reasoning=prompt_opens_reasoning(prompt), tools=request.tools)
        parsed = ParsedOutput()
        token_ids: list[int] = []
        last: StepOutput | None = None
        for out in self.complete(prompt_ids, request.sampling):
            token_ids += out.new_token_ids
            events = parser.feed(out.text_delta) if out.text_delta else []
            if out.finished:
                events += parser.finish()
                last = out
            yield from self._visible(events, parsed)
        assert last is not None and last.timings is not None
        calls = [tool_call_json(i, c.name, c.arguments) for i, c in enumerate(parsed.tool_calls)]
        finish = "tool_calls" if calls and last.finish_reason == "stop" else last.finish_reason
        yield ChatFinished(
            ChatResult(
                text=parsed.content,
                reasoning=parsed.reasoning,
                tool_calls=calls,
                prompt_token_ids=prompt_ids,
                token_ids=token_ids,
                finish_reason=finish or "stop",
                timings=last.timings,
            )
        )

    def chat_result(self, request: ChatRequest) -> ChatResult:
        for event in self.chat(request):
            if isinstance(event, ChatFinished):
                return event.result
        raise AssertionError("chat() ended without ChatFinished")

    @staticmethod
    def _visible(events: list[ParserEvent], parsed: ParsedOutput) -> Iterator[ChatEvent]:
        collect(events, parsed)
        for event in events:
            if isinstance(event, (ReasoningDelta, ContentDelta, ToolCallEnd)):
                yield event

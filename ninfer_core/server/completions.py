"""POST /v1/completions: the legacy text-completion API (raw prompt, no chat template).

`prompt` may be a list of prompts. `logprobs: N` reports each generated token's logprob and its N
most likely alternatives (N <= 20); with `echo`, the prompt's tokens' too (SamplingParams.
prompt_logprobs: the prompt is then read whole, past the prefix cache), which is how evaluation
harnesses score a continuation. `n` answers are n requests of a prompt in one batch
(generation.start_choices); choice `index` i answers prompt i // n. `best_of` may only equal `n` (no
ranking of extra answers)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..engine.request import StepOutput
from ..engine.service import EngineService, TokenStream
from ..tokenizer import Tokenizer
from .body import read_model
from .chat_input import (
    guided_constraint,
    one_constraint,
    response_format_constraint,
    sampling_params,
)
from .errors import ApiError
from .generation import (
    Started,
    collect_choices,
    merged_events,
    start_choices,
    stream_response,
)
from .ids import new_id
from .logprobs import completion_logprobs
from .schemas import MAX_CHOICES, CompletionRequest
from .sse import DONE, sse

router = APIRouter()


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    text: str  # what `echo` repeats ("" without echo)


def read_prompts(prompt: str | list[str] | list[int] | list[list[int]], tokenizer: Tokenizer,
                 vocab_size: int, *, echo: bool = False, name: str = "prompt") -> list[Prompt]:
    """The request's prompts (a string or a list of ids is one; a list of them, several), each with
    its text for `echo`. Ids are checked against the vocabulary before anything (the tokenizer's
    decode included) reads them; a prompt of ids is decoded only for echo (it is on the path to the
    first token: 512 ids, 0.05 ms). `name`: the field's (errors name it)."""
    many = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
    if isinstance(prompt, list) and not prompt:
        raise ApiError(400, f"{name} is an empty list", param=name)
    prompts = []
    for i, one in enumerate(prompt if many else [prompt]):  # type: ignore[union-attr]
        param = f"{name}[{i}]" if many else name
        if not one:
            raise ApiError(400, f"{param} is empty", param=param)
        if isinstance(one, str):
            prompts.append(Prompt(tokenizer.encode(one, add_special_tokens=True), one if echo else ""))
            continue
        outside = next((t for t in one if t >= vocab_size), None)  # the schema already refused t < 0
        if outside is not None:
            raise ApiError(400, f"{name} token id {outside} is outside the vocabulary [0, {vocab_size})", param=param)
        ids = list(one)
        prompts.append(Prompt(ids, tokenizer.decode(ids, skip_special_tokens=True) if echo else ""))
    return prompts


def usage(prompts: list[Prompt], completion: int, finished: StepOutput | None) -> dict[str, Any]:
    """Each prompt once (its `n` answers read it once each, but OpenAI counts it once); the cached
    tokens are those of the first choice (`finished`: its last output, which has the timings)."""
    prompt = sum(len(p.ids) for p in prompts)
    cached = finished.timings.cached_tokens if finished is not None and finished.timings is not None else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


@router.post("/v1/completions", response_model=None)
async def completions(request: Request) -> Response:
    body = await read_model(request, CompletionRequest)
    n = body.n or 1
    if body.best_of not in (None, n):
        raise ApiError(400, f"best_of={body.best_of} is not supported: ranking answers beyond n is not done "
                            f"(leave it out, or set it to n={n})", param="best_of")
    if body.suffix:
        raise ApiError(400, "suffix (fill-in-the-middle) is not supported", param="suffix")
    sampling = sampling_params(body, body.max_tokens, body.stop, logprobs=body.logprobs,
                               prompt_logprobs=body.logprobs if body.echo else None)
    constraint = one_constraint(response_format_constraint(body.response_format), guided_constraint(body))
    prompts: list[Prompt] = []

    def submit(service: EngineService) -> list[TokenStream]:
        llm = service.llm
        prompts.extend(read_prompts(body.prompt, llm.tokenizer, llm.loaded.config.vocab_size, echo=body.echo))
        if len(prompts) * n > MAX_CHOICES:
            raise ApiError(400, f"{len(prompts)} prompts x n={n} answers is more than {MAX_CHOICES} choices",
                           param="n")
        # a raw prompt opens no reasoning block: the constraint holds from the first token
        grammar = None if constraint is None else llm.compile_constraint(constraint, reasoning=False)
        return service.submit_choices([prompt.ids for prompt in prompts], sampling, n, grammar=grammar)

    choices = await start_choices(request, body.model, submit)
    head = {"id": new_id("cmpl-"), "object": "text_completion", "created": int(time.time()), "model": choices[0].model}
    scoring = Scoring(choices[0].lease.service.llm.tokenizer) if body.logprobs is not None else None
    of_choice = [prompt for prompt in prompts for _ in range(n)]  # choice i answers prompt i // n
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = _chunks(choices, of_choice, prompts, head, include_usage, scoring)
        return stream_response(choices, chunks, lambda err: sse({"error": err.error_object()}) + DONE)
    answers: list[list[StepOutput]] = await collect_choices(request, choices)
    return JSONResponse({
        **head,
        "choices": [{"index": i, "text": prompt.text + "".join(o.text_delta for o in outputs),
                     "logprobs": None if scoring is None else scoring.whole(prompt, outputs),
                     "finish_reason": outputs[-1].finish_reason}
                    for i, (prompt, outputs) in enumerate(zip(of_choice, answers))],
        "usage": usage(prompts, sum(len(o.new_token_ids) for outputs in answers for o in outputs), answers[0][-1]),
    })


@dataclass(frozen=True)
class Scoring:
    """A choice's logprobs in the legacy shape: with echo, its prompt's tokens first (the first has
    none), then the answer's, each answer token's text_offset counted from the echoed text's end."""

    tokenizer: Tokenizer

    def prompt(self, prompt: Prompt, first: StepOutput) -> dict[str, Any] | None:
        """The echoed prompt's part (None without echo), from the choice's first output."""
        if not prompt.text or first.prompt_logprobs is None:
            return None
        return completion_logprobs(self.tokenizer, first.prompt_logprobs, unscored=prompt.ids[0])

    def answer(self, out: StepOutput, offset: int) -> dict[str, Any]:
        return completion_logprobs(self.tokenizer, out.text_logprobs(), offset)

    def whole(self, prompt: Prompt, outputs: list[StepOutput]) -> dict[str, Any]:
        answer = completion_logprobs(self.tokenizer, [e for o in outputs for e in o.text_logprobs()], len(prompt.text))
        echoed = self.prompt(prompt, outputs[0])
        return answer if echoed is None else {key: echoed[key] + answer[key] for key in answer}


async def _chunks(choices: list[Started], of_choice: list[Prompt], prompts: list[Prompt], head: dict[str, Any],
                  include_usage: bool, scoring: Scoring | None) -> AsyncIterator[bytes]:
    """Each choice's text under its `index` as it comes, an echoed prompt first (with logprobs: sent
    with the choice's first output, which brings the prompt's); `scoring` when logprobs were asked."""
    offsets = [0] * len(choices)  # characters of each choice sent so far (the logprobs' text_offset)
    echo_pending = [bool(p.text) for p in of_choice]

    def chunk(i: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None = None) -> bytes:
        offsets[i] += len(text)
        data = {**head, "choices": [{"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}
        return sse({**data, "usage": None} if include_usage else data)

    if scoring is None:  # the echoes need nothing from the engine
        for i, prompt in enumerate(of_choice):
            if echo_pending[i]:
                echo_pending[i] = False
                yield chunk(i, prompt.text, None)
    generated, finished = 0, None
    async for i, out in merged_events(choices):
        generated += len(out.new_token_ids)
        if i == 0:
            finished = out
        if echo_pending[i]:
            assert scoring is not None
            echo_pending[i] = False
            yield chunk(i, of_choice[i].text, None, scoring.prompt(of_choice[i], out))
        if out.text_delta or out.finished or (scoring is not None and out.text_logprobs()):
            logprobs = None if scoring is None else scoring.answer(out, offsets[i])
            yield chunk(i, out.text_delta, out.finish_reason if out.finished else None, logprobs)
    if include_usage:
        yield sse({**head, "choices": [], "usage": usage(prompts, generated, finished)})
    yield DONE

"""POST /v1/completions: the legacy text-completion API (raw prompt, no chat template).

`logprobs: N` reports each generated token's logprob and its N most likely alternatives (N <= 20;
the prompt's own logprobs, asked with `echo`, are not computed). `n` answers are n requests of the
prompt in one batch (generation.start_choices), each under its choice `index`; `best_of` may only
equal `n` (no ranking of extra answers)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..engine.request import StepOutput
from ..engine.service import EngineService, TokenStream
from ..tokenizer import Tokenizer
from .body import read_model
from .chat_input import sampling_params
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
from .schemas import CompletionRequest
from .sse import DONE, sse

router = APIRouter()


def prompt_ids(prompt: str | list[str] | list[int] | list[list[int]], tokenizer: Tokenizer,
               vocab_size: int, *, echo: bool = False) -> tuple[list[int], str]:
    """The prompt's token ids and, with `echo`, its text (else ""); one prompt per request. Ids are
    checked against the vocabulary before anything (the tokenizer's decode included) reads them.
    A prompt of ids is decoded only for echo (it is on the path to the first token: 512 ids, 0.05 ms)."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise ApiError(400, f"one prompt per request is supported, got {len(prompt)}", param="prompt")
        prompt = prompt[0]  # type: ignore[assignment]
    if not prompt:
        raise ApiError(400, "the prompt is empty", param="prompt")
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=True), prompt if echo else ""
    outside = next((t for t in prompt if t >= vocab_size), None)  # the schema already refused t < 0
    if outside is not None:
        raise ApiError(400, f"prompt token id {outside} is outside the vocabulary [0, {vocab_size})", param="prompt")
    ids = list(prompt)  # type: ignore[arg-type]
    return ids, tokenizer.decode(ids, skip_special_tokens=True) if echo else ""


def usage(prompt: int, completion: int, last: StepOutput | None) -> dict[str, Any]:
    cached = last.timings.cached_tokens if last is not None and last.timings is not None else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


@router.post("/v1/completions", response_model=None)
async def completions(request: Request) -> Response:
    body = await read_model(request, CompletionRequest)
    n = body.n or 1
    if body.best_of not in (None, n):
        raise ApiError(400, f"best_of={body.best_of} is not supported: ranking answers beyond n is not done "
                            f"(leave it out, or set it to n={n})", param="best_of")
    if body.logprobs is not None and body.echo:
        raise ApiError(400, "logprobs with echo (the prompt's logprobs) are not supported", param="logprobs")
    if body.suffix:
        raise ApiError(400, "suffix (fill-in-the-middle) is not supported", param="suffix")
    sampling = sampling_params(body, body.max_tokens, body.stop, logprobs=body.logprobs)
    echo = ""  # the prompt's text, when the answer repeats it

    def submit(service: EngineService) -> list[TokenStream]:
        nonlocal echo
        llm = service.llm
        ids, echo = prompt_ids(body.prompt, llm.tokenizer, llm.loaded.config.vocab_size, echo=body.echo)
        return service.submit_choices(ids, sampling, n)

    choices = await start_choices(request, body.model, submit)
    head = {"id": new_id("cmpl-"), "object": "text_completion", "created": int(time.time()), "model": choices[0].model}
    tokenizer = choices[0].lease.service.llm.tokenizer
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = _chunks(choices, head, echo, include_usage, tokenizer if body.logprobs is not None else None)
        return stream_response(choices, chunks, lambda err: sse({"error": err.error_object()}) + DONE)
    answers: list[list[StepOutput]] = await collect_choices(request, choices)
    tokens = [o for outputs in answers for o in outputs]
    return JSONResponse({
        **head,
        "choices": [{"index": i, "text": echo + "".join(o.text_delta for o in outputs),
                     "logprobs": None if body.logprobs is None else completion_logprobs(
                         tokenizer, [e for o in outputs for e in o.text_logprobs()]),
                     "finish_reason": outputs[-1].finish_reason} for i, outputs in enumerate(answers)],
        "usage": usage(choices[0].prompt_tokens, sum(len(o.new_token_ids) for o in tokens), answers[0][-1]),
    })


async def _chunks(choices: list[Started], head: dict[str, Any], echo: str, include_usage: bool,
                  tokenizer: Tokenizer | None) -> AsyncIterator[bytes]:
    """Each choice's text under its `index` as it comes (with echo, the prompt first); `tokenizer`:
    given when the request asked for logprobs (each chunk carries its tokens')."""
    offsets = [0] * len(choices)  # characters of each choice sent so far (the logprobs' text_offset)

    def chunk(i: int, text: str, finish_reason: str | None, out: StepOutput | None = None) -> bytes:
        logprobs = None
        if tokenizer is not None and out is not None:
            logprobs = completion_logprobs(tokenizer, out.text_logprobs(), offsets[i])
        offsets[i] += len(text)
        data = {**head, "choices": [{"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}
        return sse({**data, "usage": None} if include_usage else data)

    if echo:
        for i in range(len(choices)):
            yield chunk(i, echo, None)
    generated, first_last = 0, None
    async for i, out in merged_events(choices):
        generated += len(out.new_token_ids)
        if i == 0:
            first_last = out
        if out.text_delta or out.finished or (tokenizer is not None and out.text_logprobs()):
            yield chunk(i, out.text_delta, out.finish_reason if out.finished else None, out)
    if include_usage:
        yield sse({**head, "choices": [], "usage": usage(choices[0].prompt_tokens, generated, first_last)})
    yield DONE

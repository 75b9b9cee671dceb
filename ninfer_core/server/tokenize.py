"""POST /tokenize and /detokenize: what a prompt costs in tokens, and text back from ids, in vLLM's
shapes (`prompt` / `messages`; `count`, `max_model_len`, `tokens`, `token_strs`) and llama.cpp's
(`content`, `add_special`; the text back as `content` too), so token-counting clients of either work.
A chat is rendered as for an answer (the template's generation prompt included, media counted as the
chat endpoint would read them). GET /tokenizer_info (vLLM's) names the special tokens and gives the
chat template: with it and /tokenize, lm-eval's `local-completions` tokenizes on the server."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from .body import read_model
from .errors import ApiError
from .generation import lease
from .logprobs import token_text
from .media_fetch import resolve_media
from .openai_chat import build_chat_request
from .schemas import ChatCompletionRequest, DetokenizeRequest, TokenizeRequest

router = APIRouter()


@router.post("/tokenize")
async def tokenize(request: Request) -> JSONResponse:
    body = await read_model(request, TokenizeRequest)
    given = [name for name in ("prompt", "content", "messages") if getattr(body, name) is not None]
    if len(given) != 1:
        raise ApiError(400, "give exactly one of prompt, content (text) or messages (a chat)",
                       param=given[1] if len(given) > 1 else "prompt")
    held = await lease(request, body.model)
    try:
        llm = held.service.llm
        if body.messages is None:
            special = next((v for v in (body.add_special_tokens, body.add_special) if v is not None), True)
            text = body.prompt if body.prompt is not None else body.content
            ids = await run_in_threadpool(llm.tokenizer.encode, text, add_special_tokens=special)
        else:
            chat = build_chat_request(ChatCompletionRequest(messages=body.messages, tools=body.tools,
                                                            chat_template_kwargs=body.chat_template_kwargs))
            await resolve_media(request, chat, held.service)
            ids = (await run_in_threadpool(llm.prepare_chat, chat)).prompt_token_ids
        answer: dict[str, Any] = {"count": len(ids), "max_model_len": held.service.context_limit, "tokens": ids,
                                  "token_strs": [token_text(llm.tokenizer, t) for t in ids]
                                  if body.return_token_strs else None}
    finally:
        held.release()
    return JSONResponse(answer)


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request, model: str | None = None) -> JSONResponse:
    held = await lease(request, model)
    try:
        llm = held.service.llm
        tokenizer, template = llm.tokenizer, llm.template
        answer = {"tokenizer_class": "ninfer", "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
                  "pad_token": None, "model_max_length": held.service.context_limit,
                  "chat_template": template.templates.get("default")}
    finally:
        held.release()
    return JSONResponse(answer)


@router.post("/detokenize")
async def detokenize(request: Request) -> JSONResponse:
    body = await read_model(request, DetokenizeRequest)
    held = await lease(request, body.model)
    try:
        llm = held.service.llm
        vocab = llm.loaded.config.vocab_size
        outside = next((t for t in body.tokens if t >= vocab), None)  # the schema refused t < 0
        if outside is not None:
            raise ApiError(400, f"token id {outside} is outside the vocabulary [0, {vocab})", param="tokens")
        text = await run_in_threadpool(llm.tokenizer.decode, body.tokens, skip_special_tokens=False)
    finally:
        held.release()
    return JSONResponse({"prompt": text, "content": text})

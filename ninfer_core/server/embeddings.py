"""POST /v1/embeddings (OpenAI) and Ollama's POST /api/embed and /api/embeddings: each input's embedding
(ninfer_core/embeddings.py: the final norm of its last token's hidden state), the inputs read in one
batch through the engine like any prompt (prefix cache included).

OpenAI: `input` is a string, a list of them, a list of token ids or a list of such lists; the answer
holds unit vectors (`dimensions`: the first ones, then normalized; `encoding_format: base64`: each as
its little-endian float32 bytes) and `usage` counts the prompt tokens. An input must fit the context.
Ollama /api/embed: `input` a string or a list of them; unit vectors; an input past the context keeps
its first tokens unless `truncate` is false. The older /api/embeddings: one `prompt`, the raw values.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..embeddings import EMBED_SAMPLING, normalized
from ..engine.service import EngineService, TokenStream
from ..errors import NinferError
from ..llm import LLM
from .body import read_model
from .completions import read_prompts
from .errors import ApiError
from .generation import collect_choices, start_choices
from .schemas import EmbeddingRequest, OllamaEmbeddingsRequest, OllamaEmbedRequest

router = APIRouter()

Tokenize = Callable[[EngineService], list[list[int]]]


async def _embeddings(request: Request, model: str | None, tokenize: Tokenize,
                      keep_alive: float | None = None) -> tuple[str, list[list[int]], list[list[float]]]:
    """(the served model's name, each input's ids, its raw embedding): the inputs are tokenized with
    the model's tokenizer once it is taken, submitted together (all or none) and collected."""
    prompts: list[list[int]] = []

    def submit(service: EngineService) -> list[TokenStream]:
        prompts.extend(tokenize(service))
        return service.submit_choices(prompts, EMBED_SAMPLING, 1, embed=True)

    choices = await start_choices(request, model, submit)
    if keep_alive is not None:
        choices[0].lease.keep_alive(keep_alive)
    outputs = await collect_choices(request, choices)
    vectors = [next(out.embedding for out in outs if out.embedding is not None) for outs in outputs]
    return choices[0].model, prompts, vectors


def _unit(vector: list[float], dimensions: int | None) -> list[float]:
    try:
        return normalized(vector, dimensions)
    except NinferError as e:
        raise ApiError(400, str(e), param="dimensions") from None


@router.post("/v1/embeddings")
async def openai_embeddings(request: Request) -> JSONResponse:
    body = await read_model(request, EmbeddingRequest)

    def tokenize(service: EngineService) -> list[list[int]]:
        llm = service.llm
        return [p.ids for p in read_prompts(body.input, llm.tokenizer, llm.loaded.config.vocab_size, name="input")]

    name, prompts, vectors = await _embeddings(request, body.model, tokenize)
    data = []
    for i, vector in enumerate(vectors):
        unit = _unit(vector, body.dimensions)
        encoded = base64.b64encode(np.asarray(unit, dtype="<f4").tobytes()).decode() \
            if body.encoding_format == "base64" else unit
        data.append({"object": "embedding", "index": i, "embedding": encoded})
    tokens = sum(len(p) for p in prompts)
    return JSONResponse({"object": "list", "data": data, "model": name,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def _ollama_ids(texts: str | list[str], llm: LLM, limit: int, truncate: bool, name: str) -> list[list[int]]:
    """Each text's ids (completions.read_prompts); past the context (limit - 1 tokens: one is left for
    the step's token) the first ones, or a 400 when `truncate` is false."""
    out = []
    for i, prompt in enumerate(read_prompts(texts, llm.tokenizer, llm.loaded.config.vocab_size, name=name)):
        ids = prompt.ids
        if len(ids) >= limit:
            where = name if isinstance(texts, str) else f"{name}[{i}]"
            if not truncate:
                raise ApiError(400, f"{where} has {len(ids)} tokens, more than the context limit of {limit - 1} "
                                    "for an input (truncate: true keeps the first ones)", param=where)
            ids = ids[: limit - 1]
        out.append(ids)
    return out


def _ollama_tokenize(texts: str | list[str], truncate: bool, name: str) -> Tokenize:
    return lambda service: _ollama_ids(texts, service.llm, service.context_limit, truncate, name)


@router.post("/api/embed")
async def ollama_embed(request: Request) -> JSONResponse:
    started = time.perf_counter()
    body = await read_model(request, OllamaEmbedRequest)
    if not body.input:  # before the model is taken
        raise ApiError(400, "input is empty", param="input")
    name, prompts, vectors = await _embeddings(request, body.model,
                                               _ollama_tokenize(body.input, body.truncate, "input"), body.keep_alive)
    return JSONResponse({"model": name, "embeddings": [_unit(v, body.dimensions) for v in vectors],
                         "total_duration": int((time.perf_counter() - started) * 1e9), "load_duration": 0,
                         "prompt_eval_count": sum(len(p) for p in prompts)})


@router.post("/api/embeddings")
async def ollama_embeddings(request: Request) -> JSONResponse:
    body = await read_model(request, OllamaEmbeddingsRequest)
    _, _, vectors = await _embeddings(request, body.model, _ollama_tokenize(body.prompt, True, "prompt"),
                                      body.keep_alive)
    return JSONResponse({"embedding": vectors[0]})

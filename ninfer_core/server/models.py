"""The models a server offers and holds: GET /health, /v1/models (every model it serves by name,
the loaded ones with their real context limit and capabilities), /v1/models/{id}, and ninfer's own
GET /api/ps (what is loaded, where, how much memory, until when) and POST /api/stop (unload one)."""

from __future__ import annotations

from typing import Any

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from ..capabilities import Capabilities
from .body import read_json
from .errors import ApiError
from .generation import pool_of
from .keep_alive import FOREVER
from .model_pool import ModelPool, Resident

router = APIRouter()


def model_card(pool: ModelPool, name: str) -> dict[str, Any]:
    card: dict[str, Any] = {"id": name, "object": "model", "created": pool.created, "owned_by": "ninfer"}
    service = pool.service(name)
    if service is None:
        return {**card, "loaded": False}
    limit = service.context_limit
    # vLLM's, LM Studio's and OpenRouter's spellings of the context limit; Ollama's capability names
    return {**card, "loaded": True, "max_model_len": limit, "context_length": limit, "max_context_length": limit,
            "capabilities": Capabilities.of(service.llm).names()}


def resident_json(resident: Resident, keep_alive_s: float) -> dict[str, Any]:
    """A loaded model for `ninfer ps`: memory is weights + the KV in memory (on the CPU, what has been
    written; `kv_bytes` is the pool's capacity) + GDN state."""
    service = resident.service
    engine = service.stats().engine
    cache = service.engine.cache
    kv_resident, state_bytes = cache.resident_kv_bytes, cache.state_bytes
    memory = engine.weight_bytes + kv_resident + state_bytes
    on_gpu = service.llm.loaded.device.type == "cuda"
    return {
        "name": resident.name, "device": str(service.llm.loaded.device), "weights": engine.weights,
        "model": resident.name, "size": memory, "size_vram": memory if on_gpu else 0,  # Ollama's names
        "weight_bytes": engine.weight_bytes, "kv_bytes": engine.kv_bytes, "kv_resident_bytes": kv_resident,
        "state_bytes": state_bytes, "memory_bytes": memory,
        "context_length": service.context_limit,
        "loaded_at": resident.loaded_at, "last_used": resident.last_used,
        "expires_at": resident.expires_at(keep_alive_s), "requests": resident.leases,
    }


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    pool = pool_of(request)
    pool.check_default()  # 503 with an error body while the startup model loads
    services = pool.services()
    stats = [s.stats() for s in services]
    return JSONResponse({"status": "ok", "model": pool.default, "loaded": [r.name for r in pool.residents()],
                         "running": sum(s.engine.running for s in stats), "waiting": sum(s.waiting for s in stats)})


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    pool = pool_of(request)
    return JSONResponse({"object": "list", "data": [model_card(pool, name) for name in pool.names.names()]})


@router.get("/v1/models/{model_id:path}")
async def get_model(request: Request, model_id: str) -> JSONResponse:
    pool = pool_of(request)
    name, _ = pool.resolve(model_id)  # 404 model_not_found, with what is served
    return JSONResponse(model_card(pool, name))


@router.get("/api/ps")
async def loaded_models(request: Request) -> JSONResponse:
    pool = pool_of(request)
    keep = pool.options.keep_alive_s
    return JSONResponse({"models": [resident_json(r, keep) for r in pool.residents()], "loading": pool.loading(),
                         "max_loaded": pool.options.max_loaded,
                         "keep_alive_s": None if keep == FOREVER else keep,
                         "threads": torch.get_num_threads()})


@router.post("/api/stop")
async def stop_model(request: Request) -> JSONResponse:
    body = await read_json(request, request.app.state.max_body_bytes)
    model = body.get("model") if isinstance(body, dict) else None
    if not isinstance(model, str) or not model:
        raise ApiError(400, "expected {\"model\": NAME}", param="model")
    pool = pool_of(request)
    name, _ = pool.resolve(model)
    if not await run_in_threadpool(pool.unload, name):  # joins the engine thread
        raise ApiError(404, f"'{name}' is not loaded", param="model", code="model_not_loaded")
    return JSONResponse({"stopped": name})

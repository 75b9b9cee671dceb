"""GET /health and the model list: the one served model with its real context limit."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from .errors import ApiError
from .state import ModelSlot

router = APIRouter()


def model_card(slot: ModelSlot) -> dict[str, Any]:
    service = slot.require()
    limit = service.context_limit
    # vLLM's, LM Studio's and OpenRouter's spellings of the context limit
    return {"id": slot.model_id, "object": "model", "created": slot.created, "owned_by": "ninfer",
            "max_model_len": limit, "context_length": limit, "max_context_length": limit}


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    slot: ModelSlot = request.app.state.slot
    slot.require()  # 503 with an error body while loading
    stats = slot.service.stats()  # type: ignore[union-attr]
    return JSONResponse({"status": "ok", "model": slot.model_id, "running": stats.engine.running,
                         "waiting": stats.waiting})


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [model_card(request.app.state.slot)]})


@router.get("/v1/models/{model_id:path}")
async def get_model(request: Request, model_id: str) -> JSONResponse:
    slot: ModelSlot = request.app.state.slot
    card = model_card(slot)
    if model_id != slot.model_id:
        raise ApiError(404, f"the model '{model_id}' does not exist; this server serves '{slot.model_id}'",
                       param="model", code="model_not_found")
    return JSONResponse(card)

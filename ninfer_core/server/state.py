"""What the app serves: the model slot (empty while the model loads) and its identity."""

from __future__ import annotations

import time

from ..engine.service import EngineService
from .errors import ApiError


class ModelSlot:
    def __init__(self, model_id: str | None = None):
        self.service: EngineService | None = None
        self.model_id = model_id or "loading"
        self.error: str | None = None
        self.created = int(time.time())

    def ready(self, service: EngineService, model_id: str | None = None) -> None:
        self.model_id = model_id or service.llm.name
        self.service = service

    def failed(self, message: str) -> None:
        self.error = message

    def require(self) -> EngineService:
        if self.service is not None:
            return self.service
        if self.error is not None:
            raise ApiError(503, f"the model failed to load: {self.error}", code="model_load_failed")
        raise ApiError(503, "the model is still loading; retry shortly", code="model_loading",
                       headers={"Retry-After": "2"})

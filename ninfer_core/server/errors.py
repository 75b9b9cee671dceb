"""Every failure as an OpenAI-shaped body: {"error": {"message", "type", "param", "code"}}.

Flat error bodies break openai-js clients, so even FastAPI's own 404 / 405 / validation errors
are rewritten. Engine errors map to statuses here, in one place: context overflow is 400
`context_length_exceeded` with the numbers in the message and in the error object, a full queue
is 429 with Retry-After, a stopped or loading engine is 503.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..chat.template import ChatTemplateError, ToolsNotSupportedError
from ..engine.service import QueueFullError, ServiceStoppedError
from ..errors import ContextLengthError, NinferError
from ..media.limits import MediaError

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}
_CODES = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code if code is not None else _CODES.get(status)
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers or {}
        self.extra = extra or {}

    def error_object(self) -> dict[str, Any]:
        return {"message": self.message, "type": self.type, "param": self.param, "code": self.code, **self.extra}

    def body(self) -> dict[str, Any]:
        """OpenAI's shape; the top-level `type` also makes it an Anthropic error body."""
        return {"error": self.error_object(), "type": "error"}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def to_api_error(exc: BaseException) -> ApiError:
    """The HTTP status and body for any exception a request can raise."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ContextLengthError):
        return ApiError(
            400,
            f"{exc} (prompt_tokens={exc.prompt_tokens}, limit={exc.limit})",
            param="messages",
            code="context_length_exceeded",
            extra={"prompt_tokens": exc.prompt_tokens, "context_limit": exc.limit},
        )
    if isinstance(exc, QueueFullError):
        return ApiError(429, str(exc), code="queue_full", headers={"Retry-After": str(exc.retry_after)})
    if isinstance(exc, ServiceStoppedError):
        return ApiError(503, str(exc), code="unavailable")
    if isinstance(exc, ToolsNotSupportedError):
        return ApiError(400, str(exc), param="tools", code="tools_not_supported")
    if isinstance(exc, ChatTemplateError):
        return ApiError(400, str(exc), param="messages", code="invalid_messages")
    if isinstance(exc, MediaError):
        return ApiError(400, str(exc), param="messages", code="invalid_media")
    if isinstance(exc, NinferError):
        return ApiError(400, str(exc))
    return ApiError(500, f"internal server error: {type(exc).__name__}: {exc}")


def validation_error(errors: Any) -> ApiError:
    """Pydantic's error list -> one 400 naming the first bad field, OpenAI-style."""
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: {message}", code="invalid_json")
    where = f"'{param}'" if param else "the request"
    return ApiError(400, f"invalid value for {where}: {message}", param=param, code="invalid_type")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"unknown URL: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return ApiError(exc.status_code, message, headers=dict(exc.headers or {})).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors()).response()

    @app.exception_handler(NinferError)
    async def _engine_error(_: Request, exc: NinferError) -> JSONResponse:
        return to_api_error(exc).response()

    @app.exception_handler(Exception)  # a bug: Starlette logs the traceback after this answer
    async def _any_error(_: Request, exc: Exception) -> JSONResponse:
        return to_api_error(exc).response()

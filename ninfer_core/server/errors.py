"""Every failure as an OpenAI-shaped body: {"error": {"message", "type", "param", "code"}}.

Flat error bodies break openai-js clients, so even FastAPI's own 404 / 405 / validation errors
are rewritten. Engine errors map to statuses here, in one place: the request's faults
(NinferError) are 400s, context overflow `context_length_exceeded` with the numbers in the message
and in the error object; a full queue is 429 with Retry-After, a stopped or loading engine is 503;
the engine failing a request it had accepted (EngineError) is a 500 `server_error`. An unexpected
exception (a bug) is a 500 whose body says only that: its traceback is logged under an id the
message names. On the Anthropic routes the error's type is Anthropic's name for its status
(`authentication_error`, `not_found_error`, `api_error`, ...), which Anthropic clients switch on.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..chat.constraints import ConstraintError
from ..chat.template import ChatTemplateError, ToolsNotSupportedError
from ..engine.sampling import SamplingParamError
from ..engine.service import QueueFullError, ServiceStoppedError
from ..errors import ContextLengthError, EngineError, NinferError
from ..media.limits import MediaError
from .ids import new_id

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error",
          404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error"}
_CODES = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
# Anthropic's error type of every status the server answers on /v1/messages: Anthropic's own table, plus
# 405 (wrong method) and 499 (client gone) as request errors and 503 (model loading / stopped) as api_error
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error", 499: "invalid_request_error", 500: "api_error", 503: "api_error"}
_ANTHROPIC_ROUTE = "/v1/messages"


def is_anthropic(path: str) -> bool:
    """Whether a request path is an Anthropic endpoint (its errors use Anthropic's type names)."""
    return path == _ANTHROPIC_ROUTE or path.startswith(_ANTHROPIC_ROUTE + "/")


def printable(text: str) -> str:
    """`text` without lone surrogates (shown escaped), so that an error body always encodes as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


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
        self.message = printable(message)
        self.param = None if param is None else printable(param)
        self.code = code if code is not None else _CODES.get(status)
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers or {}
        self.extra = extra or {}

    def error_object(self, anthropic: bool = False) -> dict[str, Any]:
        kind = self.type
        if anthropic:
            kind = _ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"message": self.message, "type": kind, "param": self.param, "code": self.code, **self.extra}

    def body(self, anthropic: bool = False) -> dict[str, Any]:
        """OpenAI's shape; the top-level `type` also makes it an Anthropic error body (`anthropic`:
        with Anthropic's name of the error type)."""
        return {"error": self.error_object(anthropic), "type": "error"}

    def response(self, anthropic: bool = False) -> JSONResponse:
        return JSONResponse(self.body(anthropic), status_code=self.status, headers=self.headers)


def to_api_error(exc: BaseException) -> ApiError:
    """The HTTP status and body for any exception a request can raise.

    An unexpected one is a bug: its traceback is logged under a fresh id, and the 500 carries only
    that id (exception text may hold paths or request data)."""
    known = _known_error(exc)
    if known is not None:
        return known
    error_id = new_id("err_")
    log.error("internal error %s", error_id, exc_info=exc)
    return ApiError(500, f"internal server error (logged as {error_id})", code="internal_error")


def _known_error(exc: BaseException) -> ApiError | None:
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
    if isinstance(exc, EngineError):  # logged where it happened; its message is ours, safe to show
        return ApiError(500, str(exc), code="internal_error")
    if isinstance(exc, ToolsNotSupportedError):
        return ApiError(400, str(exc), param="tools", code="tools_not_supported")
    if isinstance(exc, ChatTemplateError):
        return ApiError(400, str(exc), param="messages", code="invalid_messages")
    if isinstance(exc, MediaError):
        return ApiError(400, str(exc), param="messages", code="invalid_media")
    if isinstance(exc, SamplingParamError):
        return ApiError(400, str(exc), param=exc.field, code="invalid_value")
    if isinstance(exc, ConstraintError):
        return ApiError(400, str(exc), param=exc.param, code="invalid_schema")
    if isinstance(exc, NinferError):
        return ApiError(400, str(exc))
    return None


# -- pydantic's errors -> one 400 ---------------------------------------------------------------

# What pydantic puts into an error's location for a union member ("str", "list[ContentPart]",
# "constrained-int", a model name): not a field of the request, so not part of `param`.
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|none|dict|list)$|[\[\]-]|^[A-Z]")


def param_path(loc: Sequence[str | int]) -> str:
    """('messages', 0, 'content') -> 'messages[0].content' (how the server names a field in errors)."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _field_loc(loc: Sequence[Any]) -> tuple[str | int, ...]:
    return tuple(p for p in loc if p not in ("body", "query", "path")
                 and not (isinstance(p, str) and _UNION_MEMBER.search(p)))


def validation_error(errors: Sequence[dict[str, Any]]) -> ApiError:
    """Pydantic's error list -> one 400 naming one bad field, OpenAI-style.

    A value that fits no member of a union gets one error per member; the one reported is the
    member that got furthest (deepest location, a value error before a type error), and members
    that all fail at the same place are merged ("a valid string or a valid list")."""
    if not errors:
        return ApiError(400, "invalid request", code="invalid_type")
    if errors[0].get("type") == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: {errors[0].get('msg')}", code="invalid_json")
    field = _field_loc(errors[0]["loc"])[:1]
    candidates = [e for e in errors if _field_loc(e["loc"])[:1] == field]

    def rank(error: dict[str, Any]) -> tuple[int, bool]:
        return len(_field_loc(error["loc"])), not str(error.get("type", "")).endswith("_type")

    best = max(rank(e) for e in candidates)
    top = [e for e in candidates if rank(e) == best]
    loc = _field_loc(top[0]["loc"])
    messages: list[str] = []
    for error in top:
        if _field_loc(error["loc"]) == loc and error["msg"] not in messages:
            messages.append(error["msg"])
    message = " or ".join([messages[0], *(m.removeprefix("Input should be ") for m in messages[1:])])
    message = re.sub(r" or instance of \w+", "", message)
    param = param_path(loc) or None
    where = f"'{param}'" if param else "the request"
    code = "invalid_value" if best[1] else "invalid_type"  # out of range / not allowed, or a wrong type
    return ApiError(400, f"invalid value for {where}: {message}", param=param, code=code)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response(is_anthropic(request.url.path))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"unknown URL: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return ApiError(exc.status_code, message, headers=dict(exc.headers or {})).response(
            is_anthropic(request.url.path))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors()).response(is_anthropic(request.url.path))

    @app.exception_handler(NinferError)
    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, exc: Exception) -> JSONResponse:
        return to_api_error(exc).response(is_anthropic(request.url.path))

"""ASGI middleware: no exception leaves the app before its response has started.

An unexpected exception becomes the JSON 500 of errors.to_api_error (traceback logged under an
id, no exception text in the body). It is answered here, inside the request counter and the CORS
middleware, rather than by Starlette's outermost error middleware, so that a 500 is counted in
/metrics like any other status and a browser client can read it.

A client that hangs up while its request body is still arriving (ClientDisconnect) is no server
error: it is logged at debug level and counted as 499 (nginx's "client closed request"); the
answer goes nowhere.
"""

from __future__ import annotations

import logging

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import ApiError, is_anthropic, to_api_error

log = logging.getLogger(__name__)


class ErrorBoundary:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except ClientDisconnect:
            log.debug("client disconnected before sending its whole request: %s %s", scope["method"], scope["path"])
            if not started:
                error = ApiError(499, "the client closed the request", code="client_closed_request")
                await error.response(is_anthropic(scope["path"]))(scope, receive, send)
        except Exception as exc:
            if started:  # too late for a status: uvicorn logs it and closes the connection
                raise
            await to_api_error(exc).response(is_anthropic(scope["path"]))(scope, receive, send)

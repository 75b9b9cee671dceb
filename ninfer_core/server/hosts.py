"""Which clients may talk to the server: two guards against web pages driving it through a browser.

Host (DNS rebinding). A web page at http://attacker.example:8080 whose DNS name is re-pointed to
127.0.0.1 is, to the browser, same-origin with itself: CORS never applies, and the page could drive
a local server that has no API key. What gives it away is the Host header, which still says
attacker.example. So, like Ollama's host check, the server answers only Host names it knows:
loopback names (`localhost`, `*.localhost`), IP literals (a rebinding attack needs a DNS name), the
address it listens on, and the names given with `--allowed-hosts` (`*` turns the check off). A
server listening on every interface (`--host 0.0.0.0` / `::`) is public on purpose and answers any
Host, unless `--allowed-hosts` names the ones it should answer. Other requests get 403
`host_not_allowed`.

Origin (cross-site requests). Any page the user visits can POST to http://127.0.0.1:PORT/v1/... as a
CORS "simple request" (Content-Type text/plain): the browser sends it without a preflight, and
though CORS keeps the answer from the page, the server would still run the generation (a denial of
service; with tools, worse). A browser marks such a request with the page's `Origin`; clients outside
a browser (curl, the OpenAI / Anthropic SDKs, editors) send none. So a request with an Origin that is
neither a loopback page's (http(s)://localhost, 127.0.0.1 or [::1], any port) nor one given with
`--cors-origin` (`*`: any) gets 403 `origin_not_allowed` before its body is read; `Origin: null`
(sandboxed frames, file:// pages) is refused too. CORS preflights (OPTIONS) are left to the CORS
middleware, which refuses foreign origins itself. A web UI whose pages reach the server through a
reverse proxy on their own origin sends that origin: add it with `--cors-origin`.

Both checks come before the API key's: a key does not make a browser's cross-site request welcome.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import ApiError, is_anthropic

_EVERY_INTERFACE = ("0.0.0.0", "::", "")

# pages served from this machine: browsers may use the server from them unless --cors-origin says otherwise
LOCAL_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?"


def host_name(header: str) -> str:
    """The name of a Host header value, without port, brackets or trailing dot, lower-case."""
    header = header.strip().lower()
    if header.startswith("["):  # [::1]:8080
        return header[1 : header.find("]")] if "]" in header else header
    if header.count(":") == 1:
        header = header.rsplit(":", 1)[0]
    return header.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class HostPolicy:
    """Which Host names the server answers (see the module doc); `names` None = any."""

    names: frozenset[str] | None
    listen_host: str

    @classmethod
    def for_server(cls, listen_host: str, allowed_hosts: Sequence[str] | None) -> HostPolicy:
        allowed = [host_name(h) for h in allowed_hosts or () if h.strip()]
        if "*" in allowed or (not allowed and listen_host.strip("[]") in _EVERY_INTERFACE):
            return cls(None, listen_host)
        return cls(frozenset({"localhost", host_name(listen_host), *allowed}), listen_host)

    def allows(self, name: str) -> bool:
        return (self.names is None or name in self.names or name.endswith(".localhost") or _is_ip(name)
                or not name)  # no Host header at all (HTTP/1.0): not a browser


@dataclass(frozen=True)
class OriginPolicy:
    """Which web page origins may send requests (see the module doc): loopback ones and `origins`
    (the --cors-origin list, compared exactly as the CORS middleware does); `origins` None = any."""

    origins: frozenset[str] | None

    @classmethod
    def for_server(cls, cors_origins: Sequence[str] | None) -> OriginPolicy:
        origins = frozenset(cors_origins or ())
        return cls(None if "*" in origins else origins)

    def allows(self, origin: str) -> bool:
        return self.origins is None or origin in self.origins or re.fullmatch(LOCAL_ORIGINS, origin) is not None


def _header(scope: Scope, name: bytes) -> str | None:
    return next((v.decode("latin-1") for k, v in scope["headers"] if k == name), None)


def _is_preflight(scope: Scope) -> bool:
    return scope["method"] == "OPTIONS" and _header(scope, b"access-control-request-method") is not None


class ClientCheck:
    """ASGI middleware applying the HostPolicy, then the OriginPolicy, to every HTTP request."""

    def __init__(self, app: ASGIApp, hosts: HostPolicy, origins: OriginPolicy):
        self.app = app
        self.hosts = hosts
        self.origins = origins

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        refusal = self._refusal(scope) if scope["type"] == "http" else None
        if refusal is not None:
            await refusal.response(is_anthropic(scope["path"]))(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> ApiError | None:
        name = host_name(_header(scope, b"host") or "")
        if not self.hosts.allows(name):
            return ApiError(403, f"this server does not answer to the host name '{name}' (a guard against DNS "
                                 f"rebinding); start it with --allowed-hosts {name} to allow it", code="host_not_allowed")
        origin = _header(scope, b"origin")
        if origin is not None and not _is_preflight(scope) and not self.origins.allows(origin):
            return ApiError(403, f"this server does not take requests from web pages of the origin '{origin}' (a guard "
                                 f"against cross-site requests); start it with --cors-origin {origin} to allow them",
                            code="origin_not_allowed")
        return None

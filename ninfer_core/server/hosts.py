"""DNS-rebinding guard: answer only requests whose Host header names this server.

A web page at http://attacker.example:8080 whose DNS name is re-pointed to 127.0.0.1 is, to the
browser, same-origin with itself: CORS never applies, and the page could drive a local server
that has no API key. What gives it away is the Host header, which still says attacker.example.
So, like Ollama's host check, the server answers only Host names it knows: loopback names
(`localhost`, `*.localhost`), IP literals (a rebinding attack needs a DNS name), the address it
listens on, and the names given with `--allowed-hosts` (`*` turns the check off). A server
listening on every interface (`--host 0.0.0.0` / `::`) is public on purpose and answers any Host,
unless `--allowed-hosts` names the ones it should answer. Other requests get 403 `host_not_allowed`.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import ApiError

_EVERY_INTERFACE = ("0.0.0.0", "::", "")


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


class HostCheck:
    """ASGI middleware applying a HostPolicy to every HTTP request."""

    def __init__(self, app: ASGIApp, policy: HostPolicy):
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), "")
            name = host_name(header)
            if not self.policy.allows(name):
                message = (f"this server does not answer to the host name '{name}' (a guard against DNS "
                           f"rebinding); start it with --allowed-hosts {name} to allow it")
                await ApiError(403, message, code="host_not_allowed").response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

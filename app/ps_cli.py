"""`ninfer ps` and `ninfer stop MODEL`: ask a running `ninfer serve` what it holds, or to unload a model.

They talk to the server over HTTP (GET /api/ps, POST /api/stop), found where `ninfer serve` listens
by default or as its NINFER_HOST / NINFER_PORT / NINFER_API_KEY say, so the same environment drives both.
"""

from __future__ import annotations

import sys
import time
from typing import Annotated, Any, Optional

import typer

from .output import fail
from .units import human_bytes

HostOpt = Annotated[str, typer.Option(help="Where the server listens.", envvar="NINFER_HOST")]
PortOpt = Annotated[int, typer.Option(help="The server's port.", envvar="NINFER_PORT")]
KeyOpt = Annotated[Optional[str], typer.Option(help="The server's API key.", envvar="NINFER_API_KEY")]


def _base_url(host: str, port: int) -> str:
    host = "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _call(method: str, host: str, port: int, api_key: str | None, path: str, body: Any = None) -> dict[str, Any]:
    import httpx

    url = _base_url(host, port)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.request(method, url + path, json=body, headers=headers, timeout=60)
    except httpx.HTTPError as e:
        fail(f"no ninfer server at {url} ({type(e).__name__}); start one with `ninfer serve`, or give --host / --port")
    try:
        data = response.json()
    except ValueError:
        fail(f"{url}{path}: HTTP {response.status_code}, not a ninfer server answer")
    if response.status_code >= 400:
        error = data.get("error", {}) if isinstance(data, dict) else {}
        fail(f"{url}: {error.get('message', f'HTTP {response.status_code}')}")
    return data


def _until(expires_at: float | None) -> str:
    """When the server unloads the model (None: only when another model needs its place)."""
    if expires_at is None:
        return "when replaced"
    left = expires_at - time.time()
    return "now" if left <= 0 else f"{left / 60:.0f} min" if left >= 60 else f"{left:.0f} s"


def ps_command(host: HostOpt = "127.0.0.1", port: PortOpt = 8080, api_key: KeyOpt = None,
               json_out: Annotated[bool, typer.Option("--json", help="Print the server's JSON.")] = False) -> None:
    """The models a running server holds: where, how much memory, how long they stay, requests now."""
    import json

    from rich.console import Console
    from rich.table import Table

    data = _call("GET", host, port, api_key, "/api/ps")
    if json_out:
        print(json.dumps(data))
        return
    models = data.get("models", [])
    if not models and not data.get("loading"):
        typer.secho("no model loaded", err=True)
        return
    table = Table(box=None, header_style="bold")
    for column in ("NAME", "DEVICE", "MEMORY", "WEIGHTS", "KV CACHE (IN USE / SIZE)", "CONTEXT", "REQUESTS",
                   "UNLOADS"):
        table.add_column(column, no_wrap=True)
    for m in models:
        kv = f"{human_bytes(m['kv_resident_bytes'])} / {human_bytes(m['kv_bytes'])}"
        table.add_row(m["name"], m["device"], human_bytes(m["memory_bytes"]), human_bytes(m["weight_bytes"]), kv,
                      f"{m['context_length']:,}", str(m["requests"]), _until(m["expires_at"]))
    for name in data.get("loading", []):
        table.add_row(name, "-", "-", "-", "-", "-", "-", "(loading)")
    (Console() if sys.stdout.isatty() else Console(width=250)).print(table)


def stop_command(model: Annotated[str, typer.Argument(help="A loaded model (see `ninfer ps`).")],
                 host: HostOpt = "127.0.0.1", port: PortOpt = 8080, api_key: KeyOpt = None) -> None:
    """Unload a model from a running server now (its requests in flight end with an error)."""
    data = _call("POST", host, port, api_key, "/api/stop", {"model": model})
    print(f"stopped {data['stopped']}")


def register(cli: typer.Typer) -> None:
    cli.command("ps")(ps_command)
    cli.command("stop")(stop_command)

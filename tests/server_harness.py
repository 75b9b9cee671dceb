"""Shared pieces of the server tests: the tiny model, a served LLM, SSE reading, a scripted engine.

Servers run on real uvicorn on a free loopback port (ServerHandle.start(..., port=0)).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from ninfer_core.engine.llm_engine import EngineStats
from ninfer_core.engine.request import GenerationRequest, StepOutput, Timings
from ninfer_core.llm import LLM, EngineOptions
from tiny_model_dir import write_tiny_model_dir

MAX_CONTEXT = 256
MAX_SEQS = 8


def load_tiny_llm(directory: Path, **overrides: Any) -> LLM:
    # the exact fp32 path, its KV cache too (the CPU default is fp16): the tests compare with transformers
    options = dict(device="cpu", dtype="float32", kv_dtype="fp32", max_seqs=MAX_SEQS, max_context=MAX_CONTEXT)
    return LLM.load(str(directory), EngineOptions(**{**options, **overrides}))


def write_model(tmp_path_factory: Any, name: str = "tiny_server", max_positions: int = 512) -> tuple[Path, Any]:
    directory = tmp_path_factory.mktemp(name)
    hf_model, _ = write_tiny_model_dir(directory, moe=True, max_positions=max_positions)
    return directory, hf_model.eval()


def serve(directory: Path, max_context: int = MAX_CONTEXT) -> Iterator[Any]:
    """The body of a module's server fixture (`yield from serve(...)`): the tiny model in `directory`
    served as "m" on a free loopback port, stopped afterwards."""
    from ninfer_core.server.app import ServerHandle

    handle = ServerHandle.start(load_tiny_llm(directory, max_context=max_context), port=0, model_id="m")
    try:
        yield handle
    finally:
        handle.stop()


def serve_tiny(tmp_path_factory: Any, name: str, max_context: int) -> Iterator[Any]:
    """`serve` of a fresh tiny model."""
    directory, _ = write_model(tmp_path_factory, name, max_positions=max_context)
    yield from serve(directory, max_context)


def sse_events(response: httpx.Response) -> Iterator[tuple[str | None, str]]:
    """(event name, data) of each SSE frame of a streamed httpx response."""
    event: str | None = None
    for line in response.iter_lines():
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            yield event, line[6:]
            event = None


def sse_json(response: httpx.Response) -> list[Any]:
    """The JSON payloads of a stream ('[DONE]' kept as the string)."""
    return [data if data == "[DONE]" else json.loads(data) for _, data in sse_events(response)]


def wait_for(condition: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


class ScriptedEngine:
    """A stand-in for LLMEngine that "generates" fixed text pieces, one token per piece.

    Only for the tests of the API *formatting* of reasoning and tool calls: a random tiny model
    never writes a tool call, so these tests inject the model output at the engine boundary.
    Everything around it (service, template, parser, server, clients) is the real code.
    """

    def __init__(self, llm: LLM, pieces: list[str]):
        self.cache = llm.engine.cache
        self.device = llm.engine.device
        self.max_context = llm.engine.max_context
        self.pieces = pieces
        self.max_running = llm.engine.max_running
        self.running: dict[str, int] = {}  # request id -> pieces emitted
        self.prompts: list[list[int]] = []

    def add_request(self, request: GenerationRequest) -> None:
        self.prompts.append(request.prompt_token_ids)
        self.running[request.request_id] = 0

    def abort(self, request_id: str) -> None:
        self.running.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def step(self) -> list[StepOutput]:
        outputs = []
        for request_id, done in list(self.running.items()):
            finished = done + 1 == len(self.pieces)
            outputs.append(StepOutput(
                request_id=request_id, new_token_ids=[1], text_delta=self.pieces[done], finished=finished,
                finish_reason="stop" if finished else None,
                timings=Timings(completion_tokens=len(self.pieces)) if finished else None,
            ))
            self.running[request_id] = done + 1
            if finished:
                del self.running[request_id]
        return outputs

    def stats(self) -> EngineStats:
        return EngineStats(running=len(self.running), kv_capacity_tokens=self.cache.capacity_tokens)


def pieces_of(text: str, size: int = 3) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]

"""Remote mode: chat through any OpenAI-compatible server (vLLM, SGLang, llama.cpp, Ollama, ninfer).

Streams /v1/chat/completions over SSE with httpx. Reasoning arrives as `reasoning_content`
(DeepSeek, llama.cpp, SGLang) or `reasoning` (vLLM, Ollama); thinking on/off is sent as
`chat_template_kwargs.enable_thinking`, which Qwen servers honour. Local image / video paths
travel as data: URLs (the server cannot read this machine's files).
"""

from __future__ import annotations

import base64
import json
import mimetypes
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx

from ninfer_core.capabilities import Capabilities
from ninfer_core.chat.output_parser import ContentDelta, ReasoningDelta
from ninfer_core.engine.sampling import SamplingParams
from ninfer_core.errors import NinferError
from ninfer_core.llm import ChatRequest

from .backend import GenerationEvent, TurnDone, TurnResult

CONTEXT_KEYS = ("max_model_len", "context_length", "max_context_length")  # vLLM, LM Studio / OpenRouter, ninfer
MIN_DECODE_SPAN_S = 0.5  # a stream that arrives faster than this (a proxy's burst) gives no decode rate of its own
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "seed", "max_tokens")


def api_base(endpoint: str) -> str:
    """`http://host:port`, `.../v1` or `.../v1/` -> `.../v1`."""
    base = endpoint.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise NinferError(f"--endpoint must be an http(s) URL, got '{endpoint}'")
    return base if base.endswith("/v1") else base + "/v1"


def _error_text(response: httpx.Response) -> str:
    try:
        data = response.json()
        error = data.get("error", data)
        return error.get("message", str(error)) if isinstance(error, Mapping) else str(error)
    except (json.JSONDecodeError, ValueError, AttributeError):
        return response.text[:300] or response.reason_phrase


def decode_rate(tokens: int, started: float, first: float | None, ended: float) -> float:
    """Tokens per second of a streamed answer, as the client saw it: (tokens - 1) over the time from the
    first token to the last, unless they came in one burst (buffered by a proxy or the server: 5 tokens
    in 0.4 ms read as 12,000 tok/s), then all tokens over the whole request."""
    if tokens < 1 or first is None:
        return 0.0
    if tokens > 1 and ended - first >= MIN_DECODE_SPAN_S:
        return (tokens - 1) / (ended - first)
    return tokens / (ended - started) if ended > started else 0.0


def card_capabilities(card: Mapping[str, Any]) -> Capabilities | None:
    """What a model card says the model can do (ninfer's and Ollama's `capabilities`), None if it does not say."""
    names = card.get("capabilities")
    if not isinstance(names, list):
        return None
    return Capabilities(tools="tools" in names, vision="vision" in names, thinking="thinking" in names)


def data_url(path: str) -> str:
    mime = mimetypes.guess_type(path)[0] or "application/octet-stream"
    try:
        payload = base64.b64encode(Path(path).read_bytes()).decode()
    except OSError as e:
        raise NinferError(f"{path}: cannot read the attachment ({e.strerror})") from None
    return f"data:{mime};base64,{payload}"


def _remote_part(part: Mapping[str, Any]) -> Mapping[str, Any]:
    kind = part.get("type")
    if kind in ("image_url", "video_url"):
        url = part[kind]["url"]
        if not url.startswith(("data:", "http://", "https://")):
            return {"type": kind, kind: {"url": data_url(url)}}
    return part


def remote_messages(messages: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [
        {**m, "content": [_remote_part(p) for p in m["content"]]} if isinstance(m.get("content"), list) else dict(m)
        for m in messages
    ]


def request_body(model: str, request: ChatRequest) -> dict[str, Any]:
    s: SamplingParams = request.sampling
    body: dict[str, Any] = {
        "model": model,
        "messages": remote_messages(list(request.messages)),
        "stream": True,
        "stream_options": {"include_usage": True},
        "chat_template_kwargs": {"enable_thinking": request.enable_thinking},
    }
    body.update({k: getattr(s, k) for k in _SAMPLING_KEYS if getattr(s, k) is not None})
    if s.stop:
        body["stop"] = list(s.stop)
    return body


class RemoteGeneration:
    def __init__(self, client: httpx.Client, body: dict[str, Any], where: str):
        self._client = client
        self._body = body
        self._where = where
        self._response: httpx.Response | None = None
        self._lock = threading.Lock()
        self.cancelled = False
        self._prompt_tokens = 0
        self._completion = 0
        self._reasoning = 0

    @property
    def prompt_tokens(self) -> int:
        return self._prompt_tokens

    @property
    def completion_tokens(self) -> int:
        return self._completion

    @property
    def reasoning_tokens(self) -> int:
        return self._reasoning

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            response = self._response
        if response is not None:
            try:
                response.close()  # the reading thread's next read fails; the server sees the disconnect
            except Exception:  # noqa: BLE001 - closing from another thread may race the reader
                pass

    def __iter__(self) -> Iterator[GenerationEvent]:
        started = time.perf_counter()
        first: float | None = None
        text, reasoning, finish, usage = [], [], "stop", None
        try:
            with self._client.stream("POST", "/chat/completions", json=self._body) as response:
                with self._lock:
                    if self.cancelled:
                        return
                    self._response = response
                if response.status_code >= 400:
                    response.read()
                    raise NinferError(f"{self._where}: HTTP {response.status_code}: {_error_text(response)}")
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        error = chunk["error"]
                        raise NinferError(f"{self._where}: {error.get('message', error) if isinstance(error, dict) else error}")
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices") or []:
                        delta = choice.get("delta") or {}
                        piece = delta.get("reasoning_content") or delta.get("reasoning")
                        if piece:
                            first = first or time.perf_counter()
                            self._completion += 1
                            self._reasoning += 1
                            reasoning.append(piece)
                            yield ReasoningDelta(piece)
                        if delta.get("content"):
                            first = first or time.perf_counter()
                            self._completion += 1
                            text.append(delta["content"])
                            yield ContentDelta(delta["content"])
                        finish = choice.get("finish_reason") or finish
        except Exception as e:  # noqa: BLE001 - a response closed by cancel() fails in transport-specific ways
            if self.cancelled:
                return
            if isinstance(e, (httpx.HTTPError, httpx.StreamError)):
                raise NinferError(f"{self._where}: connection failed ({type(e).__name__}: {e})") from None
            raise
        if self.cancelled:
            return
        ended = time.perf_counter()
        if usage:
            self._prompt_tokens = usage.get("prompt_tokens", 0)
            self._completion = usage.get("completion_tokens", self._completion)
            details = usage.get("completion_tokens_details") or {}
            self._reasoning = details.get("reasoning_tokens", self._reasoning) or self._reasoning
        ttft = (first or ended) - started
        yield TurnDone(TurnResult(
            text="".join(text), reasoning="".join(reasoning), finish_reason=finish,
            prompt_tokens=self._prompt_tokens, completion_tokens=self._completion, reasoning_tokens=self._reasoning,
            prefill_tok_s=self._prompt_tokens / ttft if ttft > 0 and self._prompt_tokens else 0.0,
            decode_tok_s=decode_rate(self._completion, started, first, ended),
        ))


class RemoteBackend:
    remote = True
    device = "remote"
    supports_media = None  # the server's answer tells

    def __init__(self, endpoint: str, api_key: str | None = None, model: str | None = None,
                 connect_timeout: float = 10.0):
        self.base = api_base(endpoint)
        self.location = self.base
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # no read timeout: a long prompt on a busy server may take minutes before its first token
        self.client = httpx.Client(base_url=self.base, headers=headers,
                                   timeout=httpx.Timeout(connect_timeout, read=None))
        cards = self._models()
        card = next((c for c in cards if c.get("id") == model), None) if model else (cards[0] if cards else None)
        if model and card is None:
            served = ", ".join(str(c.get("id")) for c in cards) or "none"
            raise NinferError(f"{self.base}: no model '{model}' (the server lists: {served})")
        if card is None:
            raise NinferError(f"{self.base}: the server lists no models; name one as MODEL")
        self.name = str(card["id"])
        self.capabilities = card_capabilities(card)
        self.context_limit = next((int(card[k]) for k in CONTEXT_KEYS if isinstance(card.get(k), int)), None)

    def _models(self) -> list[dict[str, Any]]:
        try:
            response = self.client.get("/models")
        except httpx.HTTPError as e:
            self.client.close()
            raise NinferError(f"{self.base}: cannot reach the server ({type(e).__name__}: {e})") from None
        if response.status_code >= 400:
            self.client.close()
            raise NinferError(f"{self.base}/models: HTTP {response.status_code}: {_error_text(response)}")
        data = response.json().get("data")
        return [c for c in data if isinstance(c, dict)] if isinstance(data, list) else []

    def start(self, request: ChatRequest) -> RemoteGeneration:
        return RemoteGeneration(self.client, request_body(self.name, request), self.base)

    def service_stats(self) -> None:
        return None

    def close(self) -> None:
        self.client.close()

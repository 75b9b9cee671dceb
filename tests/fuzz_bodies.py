"""Hypothesis strategies for fuzzing the HTTP server: request bodies of every endpoint, each a
well-formed request (touching every field the endpoint reads) with one to three mutations: a
field replaced by any JSON value or by another of its own type (so it passes the type checks and
reaches what comes after), removed, or a field added. The values lean on what broke the
server before: integers past 64 bits, lone surrogates, empty and huge strings, deep nesting, the
wrong container type, URLs it must not fetch. Plus whole bodies that are not JSON at all.

`check_response` is the property: never a 5xx, every error in the endpoint's error shape without
exception text, every 200 a complete JSON body or a stream without a server error event.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import httpx
from hypothesis import strategies as st

Path = tuple[str | int, ...]

CHAT = {
    "model": "m", "max_tokens": 3, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 1,
    "presence_penalty": 0.1, "frequency_penalty": 0.1, "repetition_penalty": 1.1, "stop": ["\n\n"],
    "stop_token_ids": [1], "ignore_eos": False, "logit_bias": {"5": 1}, "n": 2, "stream": False,
    "stream_options": {"include_usage": True}, "response_format": {"type": "text"}, "reasoning_effort": "low",
    "chat_template_kwargs": {"enable_thinking": False},
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": "", "reasoning_content": "r", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ],
    "tools": [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}],
    "tool_choice": "auto",
}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}, "b": {"type": "string", "maxLength": 3},
                                          "c": {"enum": ["x", "y"]}}, "required": ["a"]}
CHAT_STRUCTURED = {
    "model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2,
    "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}},
    "chat_template_kwargs": {"enable_thinking": False},
}
CHAT_FORCED_TOOL = {
    "model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}], "parallel_tool_calls": False,
    "tools": [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}],
    "tool_choice": {"type": "function", "function": {"name": "f"}}, "stream": True,
}
CHAT_MEDIA = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [
    {"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
    {"type": "video_url", "video_url": {"url": "http://127.0.0.1:9/a.mp4"}}]}]}
COMPLETION = {"model": "m", "prompt": "hello", "max_tokens": 3, "echo": True, "stop": "x", "logit_bias": {"1": -1},
              "seed": 3, "temperature": 0.7, "stream": False, "n": 1, "best_of": 1, "suffix": None}
COMPLETION_IDS = {"prompt": [[1, 2, 3], [4, 5]], "n": 2, "echo": True, "max_tokens": 2, "stream": True,
                  "stream_options": {"include_usage": True}, "logprobs": 2}
TOKENIZE = {"model": "m", "messages": CHAT["messages"], "tools": CHAT["tools"], "return_token_strs": True,
            "chat_template_kwargs": {"enable_thinking": False}}
TOKENIZE_TEXT = {"content": "hello", "add_special": False, "add_special_tokens": True}
DETOKENIZE = {"model": "m", "tokens": [1, 2, 3]}
COMPLETION_GUIDED = {"prompt": "x", "max_tokens": 3, "guided_choice": ["ab", "c"], "guided_regex": None,
                     "structured_outputs": {"grammar": None, "json": None}}
OLLAMA_CHAT = {"model": "m", "stream": False, "think": False, "format": "json", "options": {
    "temperature": 0.5, "top_k": 5, "top_p": 0.9, "num_predict": 3, "stop": ["x"], "seed": 1, "repeat_penalty": 1.1},
    "messages": [{"role": "user", "content": "hi", "images": None},
                 {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
                 {"role": "tool", "content": "42", "tool_name": "f"}],
    "tools": CHAT["tools"], "keep_alive": 0}
OLLAMA_SHOW = {"model": "m", "verbose": True}
OLLAMA_GENERATE = {"model": "m", "prompt": "hello", "system": "s", "raw": False, "stream": True,
                   "options": {"num_predict": 2}, "keep_alive": "5m"}
CHAT_GUIDED = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
               "structured_outputs": {"regex": "[a-z]{1,4}", "choice": None}, "guided_grammar": None,
               "guided_json": None, "chat_template_kwargs": {"enable_thinking": False}}
RESPONSE = {
    "model": "m", "max_output_tokens": 3, "instructions": "be brief", "store": False, "stream": False,
    "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "t"}]},
        {"type": "function_call", "name": "f", "call_id": "c", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "r"},
    ],
    "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}], "tool_choice": "auto",
    "reasoning": {"effort": "low"}, "text": {"format": {"type": "text"}}, "metadata": {"k": "v"},
}
MESSAGE = {
    "model": "m", "max_tokens": 3, "temperature": 0.5, "stop_sequences": ["x"], "stream": False,
    "system": [{"type": "text", "text": "s"}], "metadata": {"user_id": "u"},
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": ""},
                                          {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "r"},
                                     {"type": "text", "text": "ok"}]},
    ],
    "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
    "tool_choice": {"type": "auto"}, "thinking": {"type": "disabled"},
}
COUNT = {k: v for k, v in MESSAGE.items() if k in ("model", "messages", "system", "tools", "thinking")}
RESPONSE_STRUCTURED = {
    "model": "m", "max_output_tokens": 3, "input": "hi", "store": False, "parallel_tool_calls": True,
    "text": {"format": {"type": "json_schema", "name": "s", "schema": SCHEMA, "strict": True}},
}
MESSAGE_FORCED_TOOL = {
    "model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}],
    "tools": [{"name": "f", "input_schema": SCHEMA}], "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
}

# (method, path, base body) of every POST endpoint
ENDPOINTS = [
    ("/v1/chat/completions", CHAT), ("/v1/chat/completions", CHAT_MEDIA), ("/v1/completions", COMPLETION),
    ("/v1/completions", COMPLETION_IDS), ("/v1/responses", RESPONSE), ("/v1/messages", MESSAGE),
    ("/v1/messages/count_tokens", COUNT), ("/v1/chat/completions", CHAT_STRUCTURED),
    ("/v1/chat/completions", CHAT_FORCED_TOOL), ("/v1/responses", RESPONSE_STRUCTURED),
    ("/v1/messages", MESSAGE_FORCED_TOOL), ("/tokenize", TOKENIZE), ("/tokenize", TOKENIZE_TEXT),
    ("/detokenize", DETOKENIZE), ("/v1/completions", COMPLETION_GUIDED), ("/v1/chat/completions", CHAT_GUIDED),
    ("/api/chat", OLLAMA_CHAT), ("/api/generate", OLLAMA_GENERATE), ("/api/show", OLLAMA_SHOW),
]


def _keys(value: Any) -> set[str]:
    if isinstance(value, dict):
        return set(value) | {k for v in value.values() for k in _keys(v)}
    if isinstance(value, list):
        return {k for v in value for k in _keys(v)}
    return set()


KNOWN_KEYS = sorted(set().union(*(_keys(body) for _, body in ENDPOINTS)) | {
    "image", "video", "url", "path", "file_id", "source", "data", "media_type", "detail", "is_error", "budget_tokens"})

EDGE_INTS = [0, 1, -1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30]
EDGE_TEXT = ["", "\ud800", "a\udfffb", "x" * 5000, "text", "image_url", "function", "tool", "user", "assistant",
             "data:image/png;base64,AA==", "data:,x", "file:///etc/passwd", "/etc/passwd", "http://169.254.169.254/",
             "{", "{\"a\": [1, {}]}", "[]", "null", "NaN", "5", "auto", "none", "required", "enabled", "json_object",
             "json_schema", "string", "object", "integer", "^[a-z]+$", "(", "any"]

scalars = st.one_of(
    st.none(), st.booleans(), st.sampled_from(EDGE_INTS), st.integers(-(2**70), 2**70), st.integers(-3, 300),
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([0.0, -0.0, 1e-300, 1e308, 0.5, 2.5]),
    st.sampled_from(EDGE_TEXT), st.text(max_size=12),
)
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(st.sampled_from(KNOWN_KEYS) | st.text(max_size=6), children, max_size=3),
    max_leaves=10,
)


def _paths(value: Any, prefix: Path = ()) -> list[Path]:
    """Every place in a document (below the root)."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    out: list[Path] = []
    for key, child in items:
        out.append((*prefix, key))
        out.extend(_paths(child, (*prefix, key)))
    return out


def _parent(body: Any, path: Path) -> Any:
    for key in path[:-1]:
        body = body[key]
    return body


def same_kind(value: Any) -> st.SearchStrategy[Any]:
    """Values of the JSON type `value` has: they pass the type checks and reach what comes after."""
    if isinstance(value, bool):
        return st.booleans()
    if isinstance(value, int):
        return st.sampled_from(EDGE_INTS) | st.integers(-(2**70), 2**70)
    if isinstance(value, float):
        return st.floats(allow_nan=False, allow_infinity=False)
    if isinstance(value, str):
        return st.sampled_from(EDGE_TEXT) | st.text(max_size=12)
    if isinstance(value, list):
        return st.lists(st.sampled_from(value), max_size=4) if value else st.just([])
    return st.just({}) if isinstance(value, dict) else json_values


@st.composite
def mutated(draw: st.DrawFn, base: dict[str, Any]) -> dict[str, Any]:
    body = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(body)
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent, key = _parent(body, path), path[-1]
        action = draw(st.sampled_from(["replace", "same kind", "same kind", "delete", "add"]))
        if action == "replace":
            parent[key] = draw(json_values)
        elif action == "same kind":
            parent[key] = copy.deepcopy(draw(same_kind(parent[key])))
        elif action == "delete":
            del parent[key]
        elif isinstance(parent[key], dict):
            parent[key][draw(st.sampled_from(KNOWN_KEYS))] = draw(json_values)
        elif isinstance(parent[key], list):
            parent[key].append(draw(json_values))
    return body


def deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


raw_bodies = st.one_of(
    st.binary(max_size=64), st.text(max_size=64).map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.integers(90, 200_000).map(deep),
    st.sampled_from([b"", b"null", b"[]", b"{}", b'{"messages": NaN}', b'{"max_tokens": Infinity}', b"\xff\xfe",
                     b'{"a": 1e999}', b'{"prompt": ' + b"9" * 5000 + b"}", b'{"messages": [' + b"{}," * 2000 + b"{}]}"]),
)


def encode(body: Any) -> bytes:
    return json.dumps(body, ensure_ascii=True).encode()


def check_response(response: httpx.Response, stream_body: bytes | None = None) -> None:
    """The fuzzing property (see the module doc); `stream_body`: the bytes of an SSE response."""
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if 300 <= response.status_code < 400:  # FastAPI's trailing-slash redirect
        return
    if response.status_code >= 400:
        body = response.json()
        error = body["error"]
        assert {"message", "type", "param", "code"} <= error.keys() and body["type"] == "error", body
        assert "Traceback" not in error["message"], error
        return
    if stream_body is None:
        response.json()
        return
    if response.headers["content-type"].startswith("application/x-ndjson"):  # Ollama's lines
        for line in stream_body.decode().splitlines():
            error = json.loads(line).get("error")
            assert error is None or error.get("type") not in ("server_error", "api_error"), line
        return
    for line in stream_body.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            frame = json.loads(line[6:])
            error = frame.get("error") if isinstance(frame.get("error"), dict) else None
            # a 5xx error event: OpenAI's type, or Anthropic's on /v1/messages
            assert error is None or error.get("type") not in ("server_error", "api_error"), frame

"""Images and videos through the HTTP server (tiny random multimodal Qwen3.5, CPU, real uvicorn):
Chat Completions `image_url` / `video_url` / `video` parts, Responses `input_image`, Anthropic
`image` blocks; http(s) URLs served by a local http.server thread; and the refusals (local files,
failed downloads, bad media, a model without vision tower), after which the server keeps serving.

Reference: LLM.chat in-process on the same checkpoint with the same media given as local paths
(test_multimodal proves that path against transformers), greedy with ignore_eos, thinking off.
"""

from __future__ import annotations

import base64
import io
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import anthropic
import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from media_reference import moving_pattern, write_video
from ninfer_core.engine.sampling import SamplingParams
from ninfer_core.engine.service import EngineService
from ninfer_core.llm import ChatRequest, ChatResult
from ninfer_core.server.app import ServerHandle
from ninfer_core.media import processor as media_processor
from ninfer_core.server import media_fetch
from ninfer_core.server.media_fetch import MediaFetchLimits
from server_harness import load_tiny_llm, write_model
from tiny_model_dir import write_tiny_multimodal_dir

NEW = 8
# the test web server listens on 127.0.0.1: the servers under test may fetch from private addresses,
# except `guarded` (the default policy)
FETCH = MediaFetchLimits(timeout_s=1.0, max_redirects=2, max_bytes=64 * 1024, allow_private_urls=True)
PART = "messages[0].content[1]"


def png(width: int, height: int, seed: int = 0, mode: str = "RGB") -> bytes:
    out = io.BytesIO()
    if mode == "RGB":
        pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(out, format="PNG")
    else:
        Image.new(mode, (width, height)).save(out, format="PNG")
    return out.getvalue()


def data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@dataclass
class Media:
    image: bytes
    image_path: Path
    video: bytes
    video_path: Path


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Media:
    directory = tmp_path_factory.mktemp("server_media")
    image_path = directory / "wide.png"
    image_path.write_bytes(png(40, 17))  # grid 4 x 10: 10 vision tokens
    video_path = write_video(directory / "clip.mp4", moving_pattern(15, 20, 28), fps=6)
    return Media(image_path.read_bytes(), image_path, video_path.read_bytes(), video_path)


# -- a local http(s) media server ----------------------------------------------------------------

class MediaHandler(BaseHTTPRequestHandler):
    files: ClassVar[dict[str, tuple[str, bytes]]] = {}  # path -> (content type, body)
    hits: ClassVar[list[str]] = []  # the paths asked for

    def do_GET(self) -> None:
        self.hits.append(self.path)
        if self.path in ("/redirect", "/loop", "/redirect-ip"):
            self.send_response(302)
            ip_image = f"http://127.0.0.1:{self.server.server_address[1]}/image.png"  # another host name
            self.send_header("Location", {"/redirect": "/image.png", "/loop": "/loop", "/redirect-ip": ip_image}[self.path])
            self.end_headers()
        elif self.path == "/slow":  # headers at once, then a byte every 0.2 s
            self._head("image/png", 1000)
            self._trickle(b"\x89", 25, 0.2)
        elif self.path == "/big":  # the size declared up front
            self._head("image/png", 200_000)
            self._trickle(b"\x00" * 1000, 200, 0)
        elif self.path == "/big-undeclared":  # HTTP/1.0 without Content-Length: the body ends at close
            self._head("image/png", None)
            self._trickle(b"\x00" * 1000, 200, 0)
        elif self.path in self.files:
            content_type, body = self.files[self.path]
            self._head(content_type, len(body))
            self.wfile.write(body)
        else:
            self.send_error(404)

    def _head(self, content_type: str, length: int | None) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        if length is not None:
            self.send_header("Content-Length", str(length))
        self.end_headers()

    def _trickle(self, chunk: bytes, times: int, pause: float) -> None:
        try:
            for _ in range(times):
                self.wfile.write(chunk)
                self.wfile.flush()
                time.sleep(pause)
        except OSError:  # the client gave up
            pass

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def web(media):
    MediaHandler.files = {"/image.png": ("image/png", media.image), "/clip.mp4": ("video/mp4", media.video),
                          "/page.html": ("text/html; charset=utf-8", b"<html>not an image</html>")}
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), MediaHandler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


# -- the model, its in-process references, and two servers on one engine -------------------------

def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def user(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


DESCRIBE = {"type": "text", "text": "Describe"}
WATCH = {"type": "text", "text": "Watch"}
OPTIONS = {"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}}


@dataclass
class Served:
    service: EngineService
    default: ServerHandle  # local files refused
    local: ServerHandle  # allow_local_media=True
    guarded: ServerHandle  # the default media policy: no private / loopback URLs
    image: ChatResult  # LLM.chat references, media as local paths
    video: ChatResult
    other_image: ChatResult


@pytest.fixture(scope="module")
def served(tmp_path_factory, media):
    tiny = write_tiny_multimodal_dir(tmp_path_factory.mktemp("tiny_mm_server"), moe=True)
    llm = load_tiny_llm(tiny.directory, max_seqs=4, max_context=512)
    other = tmp_path_factory.mktemp("other") / "other.png"
    other.write_bytes(png(40, 17, seed=1))

    def reference(messages: list[dict]) -> ChatResult:
        sampling = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
        return llm.chat_result(ChatRequest(messages, sampling, enable_thinking=False))

    image = reference(user(DESCRIBE, image_part(str(media.image_path))))
    video = reference(user(WATCH, {"type": "video", "video": str(media.video_path)}))
    other_image = reference(user(DESCRIBE, image_part(str(other))))
    service = EngineService(llm).start()
    default = ServerHandle.start(service, port=0, model_id="m", media_fetch=FETCH)
    local = ServerHandle.start(service, port=0, model_id="m", media_fetch=FETCH, allow_local_media=True)
    guarded = ServerHandle.start(service, port=0, model_id="m", media_fetch=MediaFetchLimits(timeout_s=1.0))
    yield Served(service, default, local, guarded, image, video, other_image)
    default.stop()
    local.stop()
    guarded.stop()
    service.stop()


def client(handle: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=handle.url + "/v1", api_key="x", max_retries=0)


def chat(handle: ServerHandle, messages: list[dict]) -> openai.types.chat.ChatCompletion:
    return client(handle).chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=NEW,
                                                  extra_body=OPTIONS)


def assert_matches(response, reference: ChatResult) -> None:
    message = response.choices[0].message
    assert (message.content or "", (message.model_extra or {}).get("reasoning_content") or "") == (
        reference.text, reference.reasoning)
    assert response.usage.prompt_tokens == len(reference.prompt_token_ids)
    assert response.usage.completion_tokens == NEW


def post(handle: ServerHandle, path: str, body: dict) -> httpx.Response:
    return httpx.post(handle.url + path, json=body, timeout=30)


def assert_error(response: httpx.Response, code: str | None, param: str | None, *texts: str) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["param"] == param, error
    for text in texts:
        assert text in error["message"], (text, error["message"])
    return error


def chat_body(*parts: dict, **extra) -> dict:
    return {"messages": user(*parts), "max_tokens": NEW, "temperature": 0, **OPTIONS, **extra}


def assert_idle(served: Served) -> None:
    stats = served.service.stats()
    assert stats.engine.running == 0 and stats.engine.kv_used_tokens == 0


# -- accepted media --------------------------------------------------------------------------------

def test_data_url_image_and_video_match_llm_chat_with_local_paths(served, media):
    # the references tell images apart, so a server that lost or swapped the image would fail
    assert served.image.text != served.other_image.text
    assert_matches(chat(served.default, user(DESCRIBE, image_part(data_url("image/png", media.image)))), served.image)
    bare = {"type": "image_url", "image_url": data_url("image/png", media.image)}  # URL as a bare string
    assert_matches(chat(served.default, user(DESCRIBE, bare)), served.image)
    video = data_url("video/mp4", media.video)
    for part in ({"type": "video_url", "video_url": {"url": video}}, {"type": "video", "video": video}):
        assert_matches(chat(served.default, user(WATCH, part)), served.video)
    assert_idle(served)


def test_http_media_are_fetched(served, media, web):
    MediaHandler.hits.clear()
    assert_matches(chat(served.default, user(DESCRIBE, image_part(f"{web}/image.png"))), served.image)
    assert_matches(chat(served.default, user(DESCRIBE, image_part(f"{web}/redirect"))), served.image)
    assert MediaHandler.hits == ["/image.png", "/redirect", "/image.png"]
    video = {"type": "video_url", "video_url": {"url": f"{web}/clip.mp4"}}
    assert_matches(chat(served.default, user(WATCH, video)), served.video)


def test_local_paths_only_with_allow_local_media(served, media):
    path = str(media.image_path)
    for part in (image_part(path), image_part(f"file://{path}"), {"type": "image", "path": path}):
        response = post(served.default, "/v1/chat/completions", chat_body(DESCRIBE, part))
        assert_error(response, "local_media_not_allowed", PART, "--allow-local-media", path)
    assert_matches(chat(served.local, user(DESCRIBE, image_part(path))), served.image)
    assert_matches(chat(served.local, user(DESCRIBE, image_part(f"file://{path}"))), served.image)
    missing = post(served.local, "/v1/chat/completions", chat_body(DESCRIBE, image_part(path + ".missing")))
    assert_error(missing, "invalid_media", PART, "not found")


def test_responses_input_image(served, media, web):
    body = {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "Describe"},
        {"type": "input_image", "image_url": data_url("image/png", media.image), "detail": "auto"}]}],
        "max_output_tokens": NEW, "temperature": 0, "ignore_eos": True, "reasoning": {"effort": "none"}}
    first = post(served.default, "/v1/responses", body).json()
    assert first["output"][-1]["content"][0]["text"] == served.image.text
    assert first["usage"]["input_tokens"] == len(served.image.prompt_token_ids)
    # a continuation sees the stored (already fetched) image again
    again = post(served.default, "/v1/responses", {"input": "And?", "previous_response_id": first["id"],
                                                    "max_output_tokens": 2, "reasoning": {"effort": "none"}})
    assert again.status_code == 200 and again.json()["usage"]["input_tokens"] > first["usage"]["input_tokens"]
    file_id = {**body, "input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]}
    assert_error(post(served.default, "/v1/responses", file_id), "unsupported_content", "input[0].content[0]",
                 "file_id")


def test_anthropic_image_blocks(served, media, web):
    messages_client = anthropic.Anthropic(base_url=served.default.url, api_key="x", max_retries=0)
    encoded = base64.b64encode(media.image).decode()
    sources = [{"type": "base64", "media_type": "image/png", "data": encoded}, {"type": "url", "url": f"{web}/image.png"}]
    for source in sources:
        messages = [{"role": "user", "content": [{"type": "text", "text": "Describe"},
                                                 {"type": "image", "source": source}]}]
        reply = messages_client.messages.create(model="m", max_tokens=NEW, messages=messages,
                                                extra_body={"temperature": 0, "ignore_eos": True})
        assert reply.content[0].text == served.image.text
        assert reply.usage.input_tokens == len(served.image.prompt_token_ids)
    counted = messages_client.messages.count_tokens(model="m", messages=messages)
    assert counted.input_tokens == len(served.image.prompt_token_ids)
    bad = {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}],
           "max_tokens": 2}
    assert_error(post(served.default, "/v1/messages", bad), "invalid_media", "messages[0].content[0].source", "base64")


def test_ollama_images(served, media):
    """Ollama's base64 `images` (no media type: sniffed) reach the tower: the prompt is the reference's
    and the answer its text up to any end-of-answer token (Ollama has no ignore_eos)."""
    encoded = base64.b64encode(media.image).decode()
    options = {"temperature": 0, "num_predict": NEW}
    for path, body, key in (
            ("/api/chat", {"messages": [{"role": "user", "content": "Describe", "images": [encoded]}]}, "message"),
            ("/api/generate", {"prompt": "Describe", "images": [encoded]}, "response")):
        r = post(served.default, path, {"model": "m", "stream": False, "think": False, "options": options, **body})
        assert r.status_code == 200, r.text
        answer = r.json()[key]
        text = answer["content"] if key == "message" else answer
        assert r.json()["prompt_eval_count"] == len(served.image.prompt_token_ids)
        assert served.image.text.startswith(text) and text
    assert_idle(served)


# -- refused media ---------------------------------------------------------------------------------

def test_failed_downloads_are_400_naming_the_part_and_url(served, media, web):
    cases = {
        "/missing.png": "HTTP 404",
        "/page.html": "'text/html'",
        "/big": "200000 bytes, over the limit of 65536 bytes",
        "/big-undeclared": "larger than the limit of 65536 bytes",
        "/slow": "within 1 s",
        "/loop": "more than 2 redirects",
    }
    for path, reason in cases.items():
        started = time.monotonic()
        response = post(served.default, "/v1/chat/completions", chat_body(DESCRIBE, image_part(web + path)))
        assert_error(response, "media_fetch_failed", PART, f"{web}{path}", reason)
        assert time.monotonic() - started < 5
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}/a.png"
    response = post(served.default, "/v1/chat/completions", chat_body(DESCRIBE, image_part(closed)))
    assert_error(response, "media_fetch_failed", PART, closed)
    streamed = post(served.default, "/v1/chat/completions", chat_body(DESCRIBE, image_part(web + "/missing.png"),
                                                                       stream=True))
    assert_error(streamed, "media_fetch_failed", PART, "HTTP 404")
    assert_matches(chat(served.default, user(DESCRIBE, image_part(f"{web}/image.png"))), served.image)
    assert_idle(served)


def test_private_addresses_are_refused_by_default(served, web, monkeypatch):
    """Server-side request forgery: URLs on loopback, private and link-local addresses are refused
    before any connection (by name or literal, IPv4 or IPv6), and so is a redirect to one."""
    port = web.rsplit(":", 1)[1]
    hits = len(MediaHandler.hits)
    for url in (f"{web}/image.png", f"http://localhost:{port}/image.png", f"http://[::1]:{port}/image.png",
                f"http://[::ffff:127.0.0.1]:{port}/image.png", "http://169.254.169.254/latest/meta-data",
                "http://10.1.2.3/a.png", "http://192.168.0.1/a.png"):
        response = post(served.guarded, "/v1/chat/completions", chat_body(DESCRIBE, image_part(url)))
        assert_error(response, "media_url_not_allowed", PART, url, "non-public address", "--allow-private-media-urls")
    assert len(MediaHandler.hits) == hits  # nothing reached the web server
    # let the name "localhost" pass the check, as a public name would: its redirect to 127.0.0.1 is refused
    check = media_fetch._refuse_private_hosts

    async def public_localhost(request: httpx.Request) -> None:
        if request.url.host != "localhost":
            await check(request)

    monkeypatch.setattr(media_fetch, "_refuse_private_hosts", public_localhost)
    url = f"http://localhost:{port}/redirect-ip"
    response = post(served.guarded, "/v1/chat/completions", chat_body(DESCRIBE, image_part(url)))
    assert_error(response, "media_url_not_allowed", PART, "127.0.0.1 is a non-public address")
    assert MediaHandler.hits[hits:] == ["/redirect-ip"]
    assert_matches(chat(served.default, user(DESCRIBE, image_part(f"{web}/image.png"))), served.image)
    assert_idle(served)


def test_bad_media_are_400_naming_the_part(served, media):
    cases = [
        (image_part(data_url("image/png", media.image[: len(media.image) // 2])), "image"),  # truncated
        (image_part(data_url("image/png", png(50_000, 10, mode="L"))), "aspect ratio"),
        (image_part(data_url("image/png", png(12_000, 9_000, mode="1"))), "megapixels"),
        ({"type": "video_url", "video_url": {"url": data_url("video/mp4", b"\x00\x00\x00\x18ftypmp42" + b"\x01" * 300)}},
         "video"),
        (image_part("data:image/png,notbase64"), "base64"),
    ]
    for part, reason in cases:
        response = post(served.default, "/v1/chat/completions", chat_body(DESCRIBE, part))
        assert response.status_code == 400, response.text
        message = response.json()["error"]["message"]
        assert message.startswith(PART) and reason in message, message
    assert_error(post(served.default, "/v1/chat/completions", chat_body(DESCRIBE, image_part("ftp://host/a.png"))),
                 "invalid_media", PART, "scheme 'ftp'")
    assert_error(post(served.default, "/v1/chat/completions", chat_body(DESCRIBE, {"type": "image_url"})),
                 "invalid_media", PART, "no URL")
    many = [image_part("data:image/png;base64,AA==")] * 65  # refused before any is read
    assert_error(post(served.default, "/v1/chat/completions", chat_body(DESCRIBE, *many)), "invalid_media",
                 "messages", "65 images / videos, over the limit of 64")
    assert_matches(chat(served.default, user(DESCRIBE, image_part(data_url("image/png", media.image)))), served.image)
    assert_idle(served)


def test_images_are_costed_from_their_headers_before_any_is_decoded(served, monkeypatch):
    """Decoding is the expensive step (a 15 KB 1-bit PNG can hold 100 megapixels): a request whose
    images cannot fit the context, or hold too many pixels together, is refused from the headers."""
    decoded = []
    prepare = media_processor.prepare_image
    monkeypatch.setattr(media_processor, "prepare_image", lambda *a, **kw: decoded.append(1) or prepare(*a, **kw))
    per_image = served.service.llm.vision.processor.config.image.max_pixels // 64  # tokens of a large image
    count = served.service.context_limit // per_image + 1
    crowd = [image_part(data_url("image/png", png(200, 200, seed=9)))] * count
    response = post(served.default, "/v1/chat/completions", chat_body(DESCRIBE, *crowd))
    assert_error(response, "context_length_exceeded", "messages", f"images alone take {count * per_image} tokens")
    bomb = image_part(data_url("image/png", png(10_000, 10_000, mode="1")))  # ~15 KB each on the wire
    assert_error(post(served.default, "/v1/chat/completions", chat_body(DESCRIBE, bomb, bomb, bomb)),
                 "invalid_media", "messages", "300+ megapixels, over the limit of 200")
    assert decoded == []
    fits = user(DESCRIBE, image_part(data_url("image/png", png(40, 17, seed=3))))
    assert chat(served.default, fits).usage.completion_tokens == NEW
    assert decoded == [1]  # a request that fits is decoded
    assert_idle(served)


def test_text_only_model_refuses_media_clearly(tmp_path_factory, media, web):
    directory, _ = write_model(tmp_path_factory, "tiny_text_only")
    handle = ServerHandle.start(load_tiny_llm(directory), port=0, model_id="m")
    try:
        MediaHandler.hits.clear()
        response = post(handle, "/v1/chat/completions", chat_body(DESCRIBE, image_part(f"{web}/image.png")))
        assert_error(response, "unsupported_content", PART, "no vision tower")
        assert MediaHandler.hits == []  # nothing downloaded for a model that cannot use it
        blocks = [{"type": "text", "text": "Describe"}, {"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": base64.b64encode(media.image).decode()}}]
        anthropic_body = {"messages": [{"role": "user", "content": blocks}], "max_tokens": 2}
        assert_error(post(handle, "/v1/messages", anthropic_body), "unsupported_content", PART, "no vision tower")
        assert post(handle, "/v1/chat/completions", {"messages": user(DESCRIBE), "max_tokens": 2}).status_code == 200
    finally:
        handle.stop()

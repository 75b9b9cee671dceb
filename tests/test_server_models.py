"""Issue 17 items 5 and 6 on a real server (uvicorn on loopback, the official openai / anthropic
clients, `ninfer ps / stop` in subprocesses): models served by name and loaded on demand, an unknown
name answered with OpenAI's 404, keep-alive and --max-loaded, and tools refused for a model whose
chat template would drop them.

Two tiny random checkpoints are added to a private NINFER_HOME as local models: `alpha` (Qwen3.5
MoE, our fallback template: tools and thinking) and `beta` (dense, a plain ChatML template that has
no place for tools). Greedy answers of each are compared with the same model loaded on its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from ninfer_core.engine.sampling import SamplingParams
from ninfer_core.hub import LocalModels
from ninfer_core.llm import LLM, ChatRequest, EngineOptions
from ninfer_core.server.app import ServerHandle
from ninfer_core.server.model_pool import CatalogNames, PoolOptions
from server_harness import wait_for
from tiny_model_dir import write_tiny_model_dir

HI = [{"role": "user", "content": "Say hi"}]
GREEDY = dict(max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
OPTIONS = EngineOptions(device="cpu", dtype="float32", max_context=1024, max_seqs=2)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CHATML_WITHOUT_TOOLS = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("ninfer_home")
    models = tmp_path_factory.mktemp("checkpoints")
    write_tiny_model_dir(models / "alpha", moe=True, max_positions=2048)
    write_tiny_model_dir(models / "beta", moe=False, max_positions=2048)
    (models / "beta" / "chat_template.jinja").write_text(CHATML_WITHOUT_TOOLS)
    local = LocalModels(home / "local_models.json")
    local.add(models / "alpha")
    local.add(models / "beta")
    return home


@pytest.fixture(autouse=True)
def private_home(home, monkeypatch):
    monkeypatch.setenv("NINFER_HOME", str(home))


@pytest.fixture(scope="module")
def references(home) -> dict[str, list[int]]:
    """Each model's greedy answer to HI, from the model loaded on its own."""
    paths = LocalModels(home / "local_models.json").entries()
    out = {}
    for name in ("alpha", "beta"):
        llm = LLM.load(str(paths[name]), OPTIONS)
        out[name] = llm.chat_result(ChatRequest(HI, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                                                enable_thinking=False)).text
    return out


def serve(home: Path, **pool) -> ServerHandle:
    alpha = str(LocalModels(home / "local_models.json").entries()["alpha"])
    handle = ServerHandle.start(lambda: LLM.load(alpha, OPTIONS), port=0, model_id="alpha",
                                names=CatalogNames(("alpha", alpha)), loader=lambda spec: LLM.load(spec, OPTIONS),
                                pool_options=PoolOptions(**pool))
    wait_for(lambda: httpx.get(handle.url + "/health").status_code == 200, what="the startup model")
    return handle


def loaded(handle: ServerHandle) -> list[str]:
    return [m["name"] for m in httpx.get(handle.url + "/api/ps").json()["models"]]


def chat(client: openai.OpenAI, model: str, **kw):
    return client.chat.completions.create(model=model, messages=HI, reasoning_effort="none", **GREEDY, **kw)


def test_each_request_is_answered_by_the_model_it_names(home, references):
    handle = serve(home, max_loaded=1)
    client = openai.OpenAI(base_url=handle.url + "/v1", api_key="x", max_retries=0)
    try:
        listed = {m.id for m in client.models.list().data}
        assert {"alpha", "beta"} <= listed
        assert loaded(handle) == ["alpha"]
        first = chat(client, "alpha")
        assert (first.model, first.choices[0].message.content) == ("alpha", references["alpha"])
        second = chat(client, "beta")  # loaded on demand; one resident by default: alpha makes room
        assert (second.model, second.choices[0].message.content) == ("beta", references["beta"])
        assert loaded(handle) == ["beta"]
        assert references["alpha"] != references["beta"]  # the two really are different models
        claude = anthropic.Anthropic(base_url=handle.url, api_key="x", max_retries=0)
        message = claude.messages.create(model="alpha", max_tokens=6, messages=HI,
                                         extra_body={"ignore_eos": True, "temperature": 0})
        assert message.model == "alpha" and message.content[0].text == references["alpha"]
        assert loaded(handle) == ["alpha"]
        streamed = client.chat.completions.create(model="beta", messages=HI, stream=True, **GREEDY,
                                                  reasoning_effort="none")
        chunks = list(streamed)
        assert {c.model for c in chunks} == {"beta"}
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == references["beta"]
    finally:
        handle.stop()


def test_an_unknown_model_is_openais_404_listing_what_is_served(home):
    handle = serve(home)
    try:
        client = openai.OpenAI(base_url=handle.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.NotFoundError) as caught:
            chat(client, "gpt-4o")
        error = caught.value.body
        assert caught.value.code == "model_not_found" and error["param"] == "model"
        assert "gpt-4o" in error["message"] and "alpha" in error["message"] and "beta" in error["message"]
        assert {"alpha", "beta"} <= set(error["available"])
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("gpt-4o")
        assert client.models.retrieve("beta").id == "beta"
        with pytest.raises(anthropic.NotFoundError):
            anthropic.Anthropic(base_url=handle.url, api_key="x", max_retries=0).messages.create(
                model="claude-sonnet-4", max_tokens=4, messages=HI)
        assert loaded(handle) == ["alpha"]  # nothing was loaded for the unknown names
    finally:
        handle.stop()


def test_keep_alive_unloads_on_demand_models_and_max_loaded_keeps_several(home):
    handle = serve(home, max_loaded=2, keep_alive_s=1.0)
    client = openai.OpenAI(base_url=handle.url + "/v1", api_key="x", max_retries=0)
    try:
        chat(client, "beta")
        ps = httpx.get(handle.url + "/api/ps").json()
        assert sorted(m["name"] for m in ps["models"]) == ["alpha", "beta"]
        beta = next(m for m in ps["models"] if m["name"] == "beta")
        alpha = next(m for m in ps["models"] if m["name"] == "alpha")
        assert alpha["expires_at"] is None and beta["expires_at"] <= time.time() + 1  # the startup model stays
        assert beta["device"] == "cpu" and beta["memory_bytes"] == beta["weight_bytes"] + beta["kv_resident_bytes"] + \
            beta["state_bytes"] > 0
        assert 0 < beta["kv_resident_bytes"] < beta["kv_bytes"]  # CPU pages take memory once written
        wait_for(lambda: loaded(handle) == ["alpha"], timeout=20, what="beta's keep-alive to expire")
        assert chat(client, "beta").model == "beta"  # and it comes back on demand
    finally:
        handle.stop()


def ninfer(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ninfer_app", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env}, stdin=subprocess.DEVNULL)


def test_ps_and_stop_commands(home):
    handle = serve(home, max_loaded=2)
    try:
        chat(openai.OpenAI(base_url=handle.url + "/v1", api_key="x", max_retries=0), "beta")
        port = str(handle.port)
        table = ninfer("ps", "--port", port)
        assert table.returncode == 0, table.stderr
        assert "alpha" in table.stdout and "beta" in table.stdout and "cpu" in table.stdout
        assert "when replaced" in table.stdout  # the startup model has no keep-alive expiry
        as_json = json.loads(ninfer("ps", "--port", port, "--json").stdout)
        assert sorted(m["name"] for m in as_json["models"]) == ["alpha", "beta"]
        stopped = ninfer("stop", "beta", "--port", port)
        assert stopped.returncode == 0 and "stopped beta" in stopped.stdout, stopped.stderr
        assert loaded(handle) == ["alpha"]
        again = ninfer("stop", "beta", "--port", port)
        assert again.returncode == 1 and "'beta' is not loaded" in again.stderr and "Traceback" not in again.stderr
        nobody = ninfer("ps", "--port", "9")  # nothing listens on the discard port
        assert nobody.returncode == 1 and "no ninfer server" in nobody.stderr
    finally:
        handle.stop()


def test_tools_a_template_cannot_render_are_refused_not_dropped(home):
    """Issue 17 item 5: `beta`'s template has no place for tools; a request with tools is a clear 400."""
    handle = serve(home, max_loaded=2)
    client = openai.OpenAI(base_url=handle.url + "/v1", api_key="x", max_retries=0)
    try:
        with pytest.raises(openai.BadRequestError) as caught:
            chat(client, "beta", tools=TOOLS)
        assert caught.value.code == "tools_not_supported" and caught.value.body["param"] == "tools"
        assert "tools" in caught.value.body["message"]
        with pytest.raises(anthropic.BadRequestError) as claude:
            anthropic.Anthropic(base_url=handle.url, api_key="x", max_retries=0).messages.create(
                model="beta", max_tokens=4, messages=HI,
                tools=[{"name": "get_weather", "input_schema": {"type": "object", "properties": {}}}])
        assert "tools" in str(claude.value)
        assert chat(client, "alpha", tools=TOOLS).model == "alpha"  # a template with tools takes them
        chat(client, "beta")
        cards = {m["id"]: m for m in httpx.get(handle.url + "/v1/models").json()["data"]}
        assert "tools" in cards["alpha"]["capabilities"] and "thinking" in cards["alpha"]["capabilities"]
        assert cards["beta"]["capabilities"] == ["completion"]
    finally:
        handle.stop()


def test_cli_refuses_tools_the_template_cannot_render(home, tmp_path):
    path = tmp_path / "chat.json"
    path.write_text(json.dumps({"messages": HI, "tools": TOOLS}))
    proc = ninfer("run", "beta", "--messages", str(path), "--max-tokens", "2", "--device", "cpu")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: ") and "cannot call them" in proc.stderr

"""Ollama's model management API and keep_alive on the real server, driven by the official `ollama`
client: list / show answer from the models' files without loading them (checked against the files
themselves and against the model loaded on its own), pull streams the hub's pull from a local
stand-in for the hub (tests/fake_hub.py) and the pulled model answers as its source does, delete /
copy change the catalog, keep_alive decides when a model unloads (checked through /api/ps).

Private NINFER_HOME and HF cache; local models `alpha` (Qwen3.5 MoE, the startup model), `beta`
(dense, a ChatML template with no tools) and `gamma` (with a vision tower)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import httpx
import ollama
import pytest
from huggingface_hub import constants
from safetensors import safe_open

from fake_hub import FakeHub
from ninfer_core.capabilities import Capabilities
from ninfer_core.engine.sampling import SamplingParams
from ninfer_core.hub import LocalModels, PullOptions, Registry, RetryPolicy
from ninfer_core.llm import LLM, ChatRequest, EngineOptions
from ninfer_core.server.app import ServerHandle
from ninfer_core.server.errors import ApiError
from ninfer_core.server.keep_alive import FOREVER, parse_keep_alive
from ninfer_core.server.model_pool import CatalogNames, PoolOptions
from ninfer_core.server.ollama_models import pull_spec
from server_harness import wait_for
from tiny_model_dir import write_tiny_model_dir, write_tiny_multimodal_dir

HI = [{"role": "user", "content": "Say hi"}]
GREEDY = {"temperature": 0, "num_predict": 6}
OPTIONS = EngineOptions(device="cpu", dtype="float32", max_context=512, max_seqs=2)
CHATML_WITHOUT_TOOLS = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PULLED = "org/tiny-pulled"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("checkpoints")
    write_tiny_model_dir(root / "alpha", moe=True, max_positions=2048)
    write_tiny_model_dir(root / "beta", moe=False, max_positions=2048, seed=1)
    (root / "beta" / "chat_template.jinja").write_text(CHATML_WITHOUT_TOOLS)
    write_tiny_multimodal_dir(root / "gamma", moe=False)
    write_tiny_model_dir(root / "upstream", moe=False, max_positions=2048, seed=2)  # what the hub serves
    return root


@pytest.fixture
def home(tmp_path, checkpoints, monkeypatch) -> Path:
    home = tmp_path / "ninfer_home"
    monkeypatch.setenv("NINFER_HOME", str(home))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    for name in ("alpha", "beta", "gamma"):
        LocalModels().add(checkpoints / name)
    return home


@pytest.fixture
def hub(checkpoints):
    with FakeHub() as fake:
        fake.add_repo(PULLED, {p.name: p.read_bytes() for p in (checkpoints / "upstream").iterdir()})
        yield fake


@pytest.fixture
def server(home, checkpoints, hub):
    alpha = str(checkpoints / "alpha")
    handle = ServerHandle.start(lambda: LLM.load(alpha, OPTIONS), port=0, model_id="alpha",
                                names=CatalogNames(("alpha", alpha)), loader=lambda spec: LLM.load(spec, OPTIONS),
                                pool_options=PoolOptions(max_loaded=3))
    handle.app.state.pull_options = PullOptions(endpoint=hub.url, max_workers=1,
                                                retry=RetryPolicy(attempts=3, base_s=0.001, max_s=0.01))
    wait_for(lambda: httpx.get(handle.url + "/health").status_code == 200, what="the startup model")
    yield handle
    handle.stop()


@pytest.fixture
def client(server) -> ollama.Client:
    return ollama.Client(host=server.url)


def ps(server) -> dict[str, dict]:
    return {m["name"]: m for m in httpx.get(server.url + "/api/ps").json()["models"]}


def greedy_answer(path: Path) -> str:
    llm = LLM.load(str(path), OPTIONS)
    return llm.chat_result(ChatRequest(HI, SamplingParams(temperature=0, max_tokens=6), enable_thinking=False)).text


def safetensors_params(directory: Path) -> int:
    """The checkpoint's parameters but the MTP head's (a draft model beside the decoder)."""
    total = 0
    for f in directory.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            total += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys() if not k.startswith("mtp."))
    return total


# ---- keep_alive ---------------------------------------------------------------------------------


@pytest.mark.parametrize("text, seconds", [
    ("5m", 300.0), ("1h30m", 5400.0), ("500ms", 0.5), ("90", 90.0), (90, 90.0), (2.5, 2.5), ("0", 0.0), (0, 0.0),
    ("-1", FOREVER), (-5, FOREVER), ("-1m", FOREVER), ("forever", FOREVER), ("1.5h", 5400.0), (" 10s ", 10.0),
])
def test_keep_alive_reads_ollamas_durations(text, seconds):
    assert parse_keep_alive(text) == seconds


@pytest.mark.parametrize("text", ["", "5x", "m", "5m3", "soon", "nan", True, "1h-5m"])
def test_keep_alive_refuses_what_is_not_a_duration(text):
    with pytest.raises(ValueError, match="duration"):
        parse_keep_alive(text)


def test_keep_alive_of_a_request_decides_when_its_model_unloads(server, client):
    answer = client.chat(model="beta", messages=HI, options=GREEDY, think=False, keep_alive="1h")
    assert answer.done
    expires = ps(server)["beta"]["expires_at"]
    assert time.time() + 3500 < expires < time.time() + 3601
    client.chat(model="beta", messages=HI, options=GREEDY, think=False, keep_alive=-1)
    assert ps(server)["beta"]["expires_at"] is None  # forever
    client.chat(model="beta", messages=HI, options=GREEDY, think=False)  # none given: the server's 5 minutes
    assert time.time() + 250 < ps(server)["beta"]["expires_at"] < time.time() + 301
    client.generate(model="beta", prompt="Hi", options=GREEDY, think=False, keep_alive=0)
    wait_for(lambda: "beta" not in ps(server), timeout=10, what="beta to unload after its keep_alive 0 request")
    # the startup model too (it loads again on demand)
    assert client.chat(model="alpha", messages=HI, options=GREEDY, think=False, keep_alive="0s").done
    wait_for(lambda: "alpha" not in ps(server), timeout=10, what="alpha to unload")
    again = client.chat(model="alpha", messages=HI, options=GREEDY, think=False)
    assert again.message.content == answer_of(client, "alpha") and "alpha" in ps(server)


def answer_of(client: ollama.Client, model: str) -> str:
    return client.chat(model=model, messages=HI, options=GREEDY, think=False).message.content


def test_load_and_unload_requests(server, client):
    loaded = client.generate(model="beta")  # no prompt: Ollama's "load the model"
    assert loaded.done and loaded.done_reason == "load" and loaded.response == "" and "beta" in ps(server)
    unloaded = client.generate(model="beta", keep_alive=0)
    assert unloaded.done_reason == "unload" and "beta" not in ps(server)
    unloaded = client.chat(model="beta", messages=[], keep_alive=0)  # not loaded: nothing to do, same answer
    assert unloaded.done_reason == "unload" and "beta" not in ps(server)
    kept = client.chat(model="beta", messages=[], keep_alive="2h")
    assert kept.done_reason == "load" and ps(server)["beta"]["expires_at"] > time.time() + 7000
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model="beta", messages=HI, keep_alive="soon")
    assert caught.value.status_code == 400 and "keep_alive" in str(caught.value)
    for bad in (True, [1], "1h-5m"):  # (the client itself would send True as 1.0)
        refused = httpx.post(server.url + "/api/generate", json={"model": "beta", "prompt": "Hi", "keep_alive": bad})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "keep_alive"
    with pytest.raises(ollama.ResponseError) as caught:
        client.generate(model="nope", keep_alive=0)
    assert caught.value.status_code == 404


# ---- list, show ---------------------------------------------------------------------------------


def test_list_gives_each_models_size_digest_and_details_and_loads_nothing(server, client, checkpoints):
    listed = {m.model: m for m in client.list().models}
    assert {"alpha", "beta", "gamma"} <= set(listed)
    for name in ("alpha", "beta", "gamma"):
        files = [p for p in (checkpoints / name).iterdir() if p.is_file()]
        model = listed[name]
        assert model.size == sum(p.stat().st_size for p in files)
        config = json.loads((checkpoints / name / "config.json").read_text())
        assert model.details.format == "safetensors" and model.details.family == config["model_type"].removesuffix("_text")
        text = config.get("text_config", config)
        dtype = config.get("dtype") or config.get("torch_dtype") or text.get("dtype") or text["torch_dtype"]
        assert model.details.quantization_level == {"float32": "FP32", "bfloat16": "BF16"}[dtype]
        assert len(model.digest) == 64 and model.modified_at is not None
    params = safetensors_params(checkpoints / "beta")
    assert listed["beta"].details.parameter_size == (f"{params / 1e6:.0f}M" if params >= 1e6 else f"{params / 1e3:.0f}K")
    assert len({m.digest for m in listed.values()}) == len(listed)
    assert set(ps(server)) == {"alpha"}  # listing loaded nothing
    # a changed model gets a new digest
    generation = checkpoints / "beta" / "generation_config.json"
    before = listed["beta"].digest
    generation.write_text(json.dumps({"temperature": 0.6}))
    try:
        assert {m.model: m for m in client.list().models}["beta"].digest != before
    finally:
        generation.unlink()


@pytest.mark.parametrize("name", ["beta", "gamma", "alpha"])
def test_show_answers_from_the_files_as_the_loaded_model_does(server, client, checkpoints, name):
    """An unloaded model's template, capabilities and context come from its files (nothing loads);
    they are what the model loaded on its own reports."""
    reference = LLM.load(str(checkpoints / name), OPTIONS)
    expected_caps = Capabilities.of(reference).names()
    if name != "alpha":
        shown = client.show(name)
        assert name not in ps(server)  # show loaded nothing
        assert shown.capabilities == expected_caps
        assert shown.template == reference.template.templates["default"]
        arch = reference.loaded.config.arch
        assert shown.modelinfo["general.architecture"] == arch
        assert shown.modelinfo[f"{arch}.context_length"] == reference.loaded.config.max_position_embeddings
        assert shown.modelinfo["general.parameter_count"] > 0 and shown.details.family == arch
        client.chat(model=name, messages=HI, options=GREEDY, think=False)
    loaded = client.show(name)
    assert name in ps(server)
    assert loaded.capabilities == expected_caps and loaded.template == reference.template.templates["default"]
    arch = reference.loaded.config.arch
    assert loaded.modelinfo[f"{arch}.context_length"] == ps(server)[name]["context_length"] == 512  # the engine's limit
    assert expected_caps == {"beta": ["completion"], "gamma": ["completion", "tools", "vision", "thinking"],
                             "alpha": ["completion", "tools", "thinking"]}[name]
    with pytest.raises(ollama.ResponseError) as caught:
        client.show("nope")
    assert caught.value.status_code == 404


# ---- pull ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, spec", [
    ("hf.co/org/x:Q4_K_M", ("org/x", "Q4_K_M")), ("huggingface.co/org/x", ("org/x", None)),
    ("org/x", ("org/x", None)), ("org/x:latest", ("org/x", None)), ("qwen3.6:27b", ("qwen3.6-27b", None)),
    ("qwen3.6-27b", ("qwen3.6-27b", None)), ("qwen3.6:latest", ("qwen3.6", None)),
])
def test_pull_names_map_to_hub_specs(name, spec):
    assert pull_spec(name) == spec


def test_pull_name_that_is_no_alias_is_a_404():
    with pytest.raises(ApiError) as caught:
        pull_spec("qwen3.6:999b")
    assert caught.value.status == 404


def test_pull_streams_progress_and_the_pulled_model_answers_as_its_source(server, client, hub, checkpoints):
    sizes = {p.name: p.stat().st_size for p in (checkpoints / "upstream").iterdir() if p.is_file()}
    parts = list(client.pull(f"hf.co/{PULLED}", stream=True))
    statuses = [p.status for p in parts]
    assert statuses[0] == "pulling manifest" and statuses[-2:] == ["writing manifest", "success"]
    for name, size in sizes.items():  # every file's progress reaches its size
        progress = [p for p in parts if p.digest == name and p.total is not None]
        assert progress and progress[-1].total == size and progress[-1].completed == size
        assert [p.completed for p in progress] == sorted(p.completed for p in progress)
    assert "verifying sha256 digest" in statuses
    listed = {m.model: m for m in client.list().models}
    assert listed[PULLED].size == sum(sizes.values())
    answer = client.chat(model=PULLED, messages=HI, options=GREEDY, think=False).message.content
    assert answer == greedy_answer(checkpoints / "upstream")
    # pulled again: nothing is downloaded (the files are verified in place)
    served = len([r for r in hub.log if r.file])
    assert client.pull(PULLED).status == "success"
    assert len([r for r in hub.log if r.file]) == served


def test_pull_failures_are_errors_and_leave_no_model(server, client, hub):
    with pytest.raises(ollama.ResponseError) as caught:
        client.pull("org/missing")
    assert caught.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as caught:
        list(client.pull("org/missing", stream=True))
    assert "org/missing" in str(caught.value)
    hub.faults.corrupt.add("model.safetensors")
    with pytest.raises(ollama.ResponseError) as caught:
        list(client.pull(PULLED, stream=True))
    assert "model.safetensors" in str(caught.value)
    with pytest.raises(ollama.ResponseError) as caught:
        client.pull(PULLED)
    assert caught.value.status_code == 502
    with pytest.raises(ollama.ResponseError) as caught:
        client.pull("not a repo!")
    assert caught.value.status_code == 400
    assert PULLED not in {m.model for m in client.list().models} and Registry().entries() == []


def test_a_client_that_leaves_stops_the_pull_and_the_next_pull_resumes(server, client, hub, checkpoints):
    hub.faults.chunk_delay = 0.2  # 16 KiB every 200 ms: the weights take seconds
    with httpx.stream("POST", server.url + "/api/pull", json={"model": PULLED}, timeout=30) as response:
        for line in response.iter_lines():
            status = json.loads(line)
            if status.get("digest") == "model.safetensors" and status.get("completed", 0) > 0:
                break  # leave mid-download
    time.sleep(1.0)  # the pull notices the cancel within a chunk

    def sent() -> int:
        return sum(r.body_bytes for r in hub.log if r.file == "model.safetensors")

    stopped_at = sent()
    time.sleep(0.5)
    assert sent() == stopped_at < (checkpoints / "upstream" / "model.safetensors").stat().st_size  # no more is fetched
    assert Registry().entries() == []
    hub.faults.chunk_delay = 0.0
    assert client.pull(PULLED).status == "success"
    resumed = [r for r in hub.log if r.file == "model.safetensors"][-1]
    assert resumed.range is not None and resumed.range.startswith("bytes=") and resumed.range != "bytes=0-"
    assert PULLED in {m.model for m in client.list().models}


# ---- delete, copy -------------------------------------------------------------------------------


def test_delete_removes_pulled_files_forgets_local_models_and_unloads_them(server, client, checkpoints):
    client.pull(PULLED)
    path = Registry().entries()[0].path
    client.chat(model=PULLED, messages=HI, options=GREEDY, think=False)
    assert PULLED in ps(server)
    assert client.delete(PULLED).status == "success"
    assert PULLED not in ps(server) and not path.exists() and Registry().entries() == []
    client.chat(model="beta", messages=HI, options=GREEDY, think=False)
    client.delete("beta")
    assert "beta" not in ps(server) and "beta" not in {m.model for m in client.list().models}
    assert (checkpoints / "beta" / "config.json").exists()  # a local model is forgotten, its files stay
    LocalModels().add(checkpoints / "beta")
    for missing in ("nope", PULLED):
        with pytest.raises(ollama.ResponseError) as caught:
            client.delete(missing)
        assert caught.value.status_code == 404
    for body in ({}, {"model": ""}):
        refused = httpx.request("DELETE", server.url + "/api/delete", json=body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"
        assert httpx.post(server.url + "/api/pull", json=body).status_code == 400


def test_copy_gives_a_model_a_second_name(server, client):
    client.copy("beta", "beta-copy")
    assert {"beta", "beta-copy"} <= {m.model for m in client.list().models}
    assert answer_of(client, "beta-copy") == answer_of(client, "beta")
    for source, destination in (("beta", "alpha"), ("nope", "x")):
        with pytest.raises(ollama.ResponseError) as caught:
            client.copy(source, destination)
        assert caught.value.status_code == (404 if source == "nope" else 400)

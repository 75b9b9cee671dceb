"""Pull / verify / registry / aliases / fit, against a local fake of the Hugging Face hub.

The fake (tests/fake_hub.py) logs every request, so resume and "not downloaded again" are
checked on what crossed the wire: Range headers and body bytes per file. Hashes are recomputed
here with hashlib; parameter counts are checked against transformers' own models.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import typer
from huggingface_hub import constants, try_to_load_from_cache
from typer.testing import CliRunner

from fake_hub import FakeHub
from tiny_model_dir import write_tiny_model_dir
from ninfer_core.hub import (
    ALIASES,
    Done,
    Failed,
    FileStarted,
    FileVerified,
    GpuMemory,
    HubError,
    IntegrityError,
    Progress,
    PullCancelled,
    PullOptions,
    PullStarted,
    Registry,
    Retry,
    RetryPolicy,
    count_params,
    estimate_fit,
    fit_for,
    pull,
    resolve_local,
    verify,
)
from ninfer_core.hub.fit import DEFAULT_CONTEXT, RUNTIME_RESERVE_BYTES, gdn_state_bytes, kv_bytes_per_token
from ninfer_core.hub.pulling import parse_spec
from ninfer_core.weights.mmproj_files import find_mmproj

REPO = "org/tiny-qwen3"
SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
TINY_CONFIG = {
    "model_type": "qwen3", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}
INFERENCE = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "model.safetensors.index.json", SHARD1, SHARD2}


def repo_files(seed: int = 0, config: dict = TINY_CONFIG) -> dict[str, bytes]:
    rng = random.Random(seed)
    return {
        "config.json": json.dumps(config).encode(),
        "generation_config.json": b'{"temperature": 0.7}',
        "tokenizer.json": b'{"version": "1.0", "model": {}}',
        "tokenizer_config.json": b'{"eos_token": "<|im_end|>"}',
        "model.safetensors.index.json": b'{"weight_map": {}}',
        SHARD1: rng.randbytes(600_000),
        SHARD2: rng.randbytes(1_000_000),
        # not needed for inference: never downloaded
        "README.md": b"# tiny",
        "pytorch_model.bin": rng.randbytes(3000),
        "original/consolidated.safetensors": rng.randbytes(2000),
    }


def digest(name: str, data: bytes) -> str:
    if name.endswith((".safetensors", ".gguf")):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@pytest.fixture
def env(tmp_path, monkeypatch) -> Path:
    """A private registry and HF cache, online, no token, no telemetry."""
    monkeypatch.setenv("NINFER_HOME", str(tmp_path / "ninfer"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path


@pytest.fixture
def hub():
    with FakeHub() as fake:
        yield fake


def options(hub: FakeHub, **kwargs) -> PullOptions:
    return PullOptions(endpoint=hub.url, retry=RetryPolicy(attempts=kwargs.pop("attempts", 6), base_s=0.001,
                                                           max_s=0.01), **kwargs)


def fetched(hub: FakeHub) -> list[str]:
    """Files whose content was served, in order."""
    return [r.file for r in hub.log if r.file]


# ---- pull ---------------------------------------------------------------------------------------


def test_pull_fetches_inference_files_verifies_them_and_marks_ready(env, hub):
    files = repo_files()
    commit = hub.add_repo(REPO, files)
    events = []
    entry = pull(REPO, on_event=events.append, options=options(hub))

    assert set(entry.files) == INFERENCE and set(fetched(hub)) == INFERENCE and len(fetched(hub)) == len(INFERENCE)
    repo_dir = env / "hub" / "models--org--tiny-qwen3"
    assert entry.path == repo_dir / "snapshots" / commit
    assert (repo_dir / "refs" / "main").read_text() == commit
    for name in INFERENCE:
        link = entry.path / name
        assert link.is_symlink() and Path(os.readlink(link)).name == digest(name, files[name])
        assert link.read_bytes() == files[name]
    # huggingface_hub itself finds the files in its cache layout
    assert try_to_load_from_cache(REPO, "config.json", cache_dir=env / "hub") == str(entry.path / "config.json")

    ready = Registry().load(REPO)
    assert ready is not None and ready.commit == commit and ready.status == "yes"
    assert (ready.summary.arch, ready.summary.quantization, ready.summary.context) == ("qwen3", "bf16", 4096)
    assert isinstance(events[0], PullStarted) and isinstance(events[-1], Done)
    assert events[0].total_bytes == sum(len(files[n]) for n in INFERENCE)
    verified = [e for e in events if isinstance(e, FileVerified)]
    assert sorted(e.name for e in verified) == sorted(INFERENCE) and not any(e.cached for e in verified)
    assert all(e.digest == digest(e.name, files[e.name]) for e in verified)
    for name in INFERENCE:
        done = [e.bytes_done for e in events if isinstance(e, Progress) and e.name == name]
        assert done == sorted(done) and done[-1] == len(files[name])


def test_interrupted_pull_resumes_with_range_and_skips_finished_files(env, hub):
    files = repo_files()
    hub.add_repo(REPO, files)
    hub.faults.chunk_delay = 0.003  # slow enough to interrupt mid-file
    cancel = threading.Event()

    def interrupt(event):
        if isinstance(event, Progress) and event.name == SHARD2 and event.bytes_done >= 200_000:
            cancel.set()

    with pytest.raises(PullCancelled, match="resumes"):
        pull(REPO, on_event=interrupt, cancel=cancel, options=options(hub, max_workers=1))
    assert Registry().load(REPO) is None  # nothing marked ready
    partial = env / "hub" / "models--org--tiny-qwen3" / "blobs" / f"{digest(SHARD2, files[SHARD2])}.incomplete"
    kept = partial.stat().st_size
    assert 200_000 <= kept < len(files[SHARD2])

    hub.log.clear()
    hub.faults.chunk_delay = 0.0
    events = []
    entry = pull(REPO, on_event=events.append, options=options(hub, max_workers=1))
    (request,) = hub.requests_for(SHARD2)
    assert fetched(hub) == [SHARD2]  # finished files are not downloaded again...
    assert request.range == f"bytes={kept}-" and request.status == 206
    assert request.body_bytes == len(files[SHARD2]) - kept  # ...and only the remainder of the cut one
    assert not [e for e in events if isinstance(e, Progress) and e.phase == "hash"]  # ...nor re-hashed
    assert [e.resume_from for e in events if isinstance(e, FileStarted)] == [kept]
    assert (entry.path / SHARD2).read_bytes() == files[SHARD2]
    assert Registry().load(REPO) is not None and not partial.exists()


def test_retries_5xx_and_truncated_bodies(env, hub):
    files = repo_files()
    hub.add_repo(REPO, files)
    hub.faults.fail_next = 3
    hub.faults.truncate_next = 2
    hub.faults.truncate_after = 150_000
    events = []
    entry = pull(REPO, on_event=events.append, options=options(hub, max_workers=1))

    retries = [e for e in events if isinstance(e, Retry)]
    assert [(e.name, e.attempt) for e in retries[:3]] == [("metadata", 1), ("metadata", 2), ("metadata", 3)]
    assert all("HTTP 503" in e.reason for e in retries[:3])
    assert [e.delay_s for e in retries[:3]] == [0.001, 0.002, 0.004]  # exponential backoff
    assert [e.name for e in retries[3:]] == [SHARD1, SHARD1]  # the cut body, then the cut resume
    assert [(r.range, r.body_bytes) for r in hub.requests_for(SHARD1)] == [
        (None, 150_000), ("bytes=150000-", 150_000), ("bytes=300000-", 300_000)]
    assert [(r.range, r.body_bytes) for r in hub.requests_for(SHARD2)] == [(None, len(files[SHARD2]))]
    assert all((entry.path / name).read_bytes() == files[name] for name in INFERENCE)


def test_gives_up_after_the_retry_budget(env, hub):
    hub.add_repo(REPO, repo_files())
    hub.faults.fail_next = 100
    events = []
    with pytest.raises(HubError, match="HTTP 503 .*gave up after 3 attempts"):
        pull(REPO, on_event=events.append, options=options(hub, attempts=3))
    assert len(hub.log) == 3 and isinstance(events[-1], Failed)
    assert Registry().entries() == []


def test_hash_mismatch_fails_loudly_and_marks_nothing_ready(env, hub):
    files = repo_files()
    hub.add_repo(REPO, files)
    hub.faults.corrupt = {SHARD2}
    events = []
    expected = digest(SHARD2, files[SHARD2])
    with pytest.raises(IntegrityError, match=f"{SHARD2}: sha256 mismatch: the hub lists {expected}") as raised:
        pull(REPO, on_event=events.append, options=options(hub, max_workers=1))
    assert "nothing was marked ready" in str(raised.value)
    assert isinstance(events[-1], Failed) and SHARD2 in events[-1].message
    assert Registry().load(REPO) is None and Registry().entries() == []
    blobs = env / "hub" / "models--org--tiny-qwen3" / "blobs"
    assert not (blobs / expected).exists() and not (blobs / f"{expected}.incomplete").exists()
    assert (blobs / digest(SHARD1, files[SHARD1])).exists()  # the good file stays, verified

    hub.faults.corrupt = set()
    hub.log.clear()
    entry = pull(REPO, options=options(hub))
    assert fetched(hub) == [SHARD2] and hub.requests_for(SHARD2)[0].range is None
    assert (entry.path / SHARD2).read_bytes() == files[SHARD2]


def test_corrupted_cached_file_fails_verify_and_pull_repairs_it(env, hub):
    files = repo_files()
    hub.add_repo(REPO, files)
    entry = pull(REPO, options=options(hub))
    blob = (entry.path / SHARD1).resolve()
    data = bytearray(blob.read_bytes())
    data[1234] ^= 1
    blob.write_bytes(bytes(data))

    report = verify(REPO)
    assert not report.ok and [c.name for c in report.failed] == [SHARD1]
    assert report.failed[0].actual == hashlib.sha256(data).hexdigest()
    assert Registry().load(REPO).status == "FAILED"
    with pytest.raises(HubError, match="failed verification.*ninfer pull"):
        resolve_local(REPO)

    hub.log.clear()
    events = []
    pull(REPO, on_event=events.append, options=options(hub))
    assert fetched(hub) == [SHARD1]
    assert any(isinstance(e, Retry) and "cached copy does not match" in e.reason for e in events)
    assert verify(REPO).ok and resolve_local(REPO) == entry.path


def test_new_commit_replaces_the_old_one_and_prunes_its_files(env, hub):
    files = repo_files()
    hub.add_repo(REPO, files)
    old = pull(REPO, options=options(hub))
    changed = dict(files, **{SHARD2: random.Random(7).randbytes(900_000)})
    new_commit = hub.push(REPO, changed)
    hub.log.clear()
    new = pull(REPO, options=options(hub))
    assert new.commit == new_commit and fetched(hub) == [SHARD2]
    assert not old.path.exists() and (new.path / SHARD2).read_bytes() == changed[SHARD2]
    blobs = {p.name for p in (env / "hub" / "models--org--tiny-qwen3" / "blobs").iterdir()}
    assert digest(SHARD2, files[SHARD2]) not in blobs and digest(SHARD1, files[SHARD1]) in blobs
    assert (env / "hub" / "models--org--tiny-qwen3" / "refs" / "main").read_text() == new_commit


def test_gated_repo_needs_a_token(env, hub, monkeypatch):
    hub.add_repo("org/gated", repo_files(), token="hf_test_token")
    with pytest.raises(HubError, match="gated.*HF_TOKEN"):
        pull("org/gated", options=options(hub))
    assert Registry().entries() == []
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")  # huggingface_hub's usual way to pass a token
    assert pull("org/gated", options=options(hub)).status == "yes"


def test_pull_refuses_to_start_without_disk_space(env, hub, monkeypatch):
    import shutil

    hub.add_repo(REPO, repo_files())
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12, 1000))
    with pytest.raises(HubError, match=r"needs 0.0 GB more in .* but only 0.0 GB are free .*HF_HUB_CACHE"):
        pull(REPO, options=options(hub))
    assert fetched(hub) == []


def test_unsupported_architecture_is_refused_before_any_weights(env, hub):
    hub.add_repo("org/gpt2", repo_files(config={"model_type": "gpt2", "n_embd": 64}))
    with pytest.raises(HubError, match="ninfer cannot run this checkpoint .no weights downloaded.: .*gpt2"):
        pull("org/gpt2", options=options(hub))
    assert not any(name.endswith(".safetensors") for name in fetched(hub))


def write_gguf(path: Path, file_type: int, split: bool = False) -> None:
    """A header-size GGUF model; `split`: as two shards (PATH's stem-0000i-of-00002.gguf)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama", split_max_tensors=1 if split else 0)
    writer.add_context_length(2048)
    writer.add_file_type(file_type)
    writer.add_vocab_size(32)
    writer.add_embedding_length(8)
    writer.add_block_count(0)  # an embedding table only: enough for metadata and size checks
    writer.add_head_count(2)
    writer.add_feed_forward_length(16)
    writer.add_tensor("token_embd.weight", np.zeros((32, 8), dtype=np.float32))
    if split:
        writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_file_by_quantization_name(env, hub, tmp_path):
    write_gguf(tmp_path / "q4.gguf", file_type=15)  # MOSTLY_Q4_K_M
    write_gguf(tmp_path / "q8.gguf", file_type=7)  # MOSTLY_Q8_0
    hub.add_repo("org/tiny-GGUF", {"tiny-Q4_K_M.gguf": (tmp_path / "q4.gguf").read_bytes(),
                                   "tiny-Q8_0.gguf": (tmp_path / "q8.gguf").read_bytes(), "README.md": b"#"})
    with pytest.raises(HubError, match="choose one with --file: tiny-Q4_K_M.gguf .*tiny-Q8_0.gguf"):
        pull("org/tiny-GGUF", options=options(hub))
    with pytest.raises(HubError, match="'tiny' matches several files"):
        pull("org/tiny-GGUF", gguf_file="tiny", options=options(hub))

    entry = pull("org/tiny-GGUF", gguf_file="q4_k_m", options=options(hub))
    assert entry.key == "org/tiny-GGUF:tiny-Q4_K_M.gguf" and fetched(hub) == ["tiny-Q4_K_M.gguf"]
    assert entry.path.is_file() and entry.path.name == "tiny-Q4_K_M.gguf"
    s = entry.summary
    assert (s.arch, s.quantization, s.context, s.params) == ("llama", "Q4_K_M", 2048, 32 * 8)
    assert resolve_local("org/tiny-GGUF:tiny-Q4_K_M.gguf") == entry.path
    assert Registry().find("org/tiny-gguf:tiny-q4_k_m.gguf").key == entry.key
    # a GGUF's mixed quantization is counted at its size on disk, unless another width is asked for
    assert fit_for(entry.key).weight_bytes == entry.path.stat().st_size
    assert fit_for(entry.key, quantization="bf16").weight_bytes == 2 * (32 * 8 + 8)  # tied embeddings + norm


def test_gguf_pull_brings_the_vision_projector_of_its_folder(env, hub, tmp_path):
    """llama.cpp repositories keep the vision tower in mmproj files: the one of the model's folder
    comes with the model (bf16 before f16 / f32), is never taken for a model, and the model
    finds it after the pull."""
    write_gguf(tmp_path / "m.gguf", file_type=1)
    write_gguf(tmp_path / "q8.gguf", file_type=7)
    model = (tmp_path / "m.gguf").read_bytes()
    hub.add_repo("org/vl-GGUF", {"vl-F16.gguf": model, "vl-Q4_K_M.gguf": model,
                                 "big/vl-Q8_0.gguf": (tmp_path / "q8.gguf").read_bytes(),
                                 "mmproj-F16.gguf": b"f16 projector", "mmproj-BF16.gguf": b"bf16 projector",
                                 "mmproj-F32.gguf": b"f32 projector"})
    with pytest.raises(HubError, match="choose one with --file") as refused:
        pull("org/vl-GGUF", options=options(hub))
    assert "mmproj" not in str(refused.value) and "vl-Q4_K_M.gguf" in str(refused.value)
    with pytest.raises(HubError, match="'mmproj-F16.gguf' is a vision projector, not a model"):
        pull("org/vl-GGUF", gguf_file="mmproj-F16.gguf", options=options(hub))
    entry = pull("org/vl-GGUF", gguf_file="F16", options=options(hub))  # the model, not mmproj-F16
    assert entry.key == "org/vl-GGUF:vl-F16.gguf" and entry.path.name == "vl-F16.gguf"
    assert sorted(fetched(hub)) == ["mmproj-BF16.gguf", "vl-F16.gguf"] and set(entry.files) == set(fetched(hub))
    assert find_mmproj(entry.path) == entry.path.parent / "mmproj-BF16.gguf"
    assert (entry.path.parent / "mmproj-BF16.gguf").read_bytes() == b"bf16 projector"
    hub.log.clear()
    big = pull("org/vl-GGUF", gguf_file="big/vl-Q8_0.gguf", options=options(hub))
    assert fetched(hub) == ["big/vl-Q8_0.gguf"] and list(big.files) == ["big/vl-Q8_0.gguf"]  # none in its folder


def test_a_split_gguf_pulls_whole_by_any_of_its_names(env, hub, tmp_path):
    """A split model (NAME-0000i-of-0000N.gguf) is one model: listed by its first shard, pulled with
    every shard whichever one --file names, loaded and sized as a whole; one with a shard missing
    from the repository is refused before any download."""
    write_gguf(tmp_path / "q8.gguf", file_type=7, split=True)
    shards = [(tmp_path / f"q8-0000{i}-of-00002.gguf").read_bytes() for i in (1, 2)]
    hub.add_repo("org/big-GGUF", {"Q8_0/big-Q8_0-00001-of-00002.gguf": shards[0],
                                  "Q8_0/big-Q8_0-00002-of-00002.gguf": shards[1],
                                  "Q4/big-Q4-00001-of-00002.gguf": shards[0],
                                  "mmproj-F16.gguf": b"projector", "Q8_0/mmproj-F16.gguf": b"f16 projector"})
    with pytest.raises(HubError, match="choose one with --file") as refused:
        pull("org/big-GGUF", options=options(hub))
    assert "Q8_0/big-Q8_0-00001-of-00002.gguf (2 files, " in str(refused.value)
    assert "00002-of" not in str(refused.value)
    with pytest.raises(HubError, match="'Q4/big-Q4-00001-of-00002.gguf' is the first of 2 shards, but the "
                                       "repository holds 1 of them"):
        pull("org/big-GGUF", gguf_file="Q4", options=options(hub))
    assert fetched(hub) == []
    for wanted in ("Q8_0", "Q8_0/big-Q8_0-00002-of-00002.gguf"):
        hub.log.clear()
        entry = pull("org/big-GGUF", gguf_file=wanted, options=options(hub))
        assert entry.key == "org/big-GGUF:Q8_0/big-Q8_0-00001-of-00002.gguf"
        assert entry.path.name == "big-Q8_0-00001-of-00002.gguf"
        assert list(entry.files) == ["Q8_0/big-Q8_0-00001-of-00002.gguf", "Q8_0/big-Q8_0-00002-of-00002.gguf",
                                     "Q8_0/mmproj-F16.gguf"]
    assert (entry.path.parent / "big-Q8_0-00002-of-00002.gguf").read_bytes() == shards[1]
    s = entry.summary
    assert (s.arch, s.quantization, s.params) == ("llama", "Q8_0", 32 * 8 + 8)  # both shards' tensors
    assert fit_for(entry.key).weight_bytes == sum(len(b) for b in shards)


# ---- aliases ------------------------------------------------------------------------------------


def test_aliases_resolve_to_repositories():
    assert parse_spec("qwen3.6-27b") == ("Qwen/Qwen3.6-27B", "main")
    assert parse_spec("Qwen3.6-35B-A3B-FP8@v1") == ("Qwen/Qwen3.6-35B-A3B-FP8", "v1")
    assert parse_spec("qwen3.5-9b", revision="abc") == ("Qwen/Qwen3.5-9B", "abc")
    assert parse_spec("someone/model@dev") == ("someone/model", "dev")
    with pytest.raises(HubError, match="not a known alias"):
        parse_spec("qwen9")
    with pytest.raises(HubError, match="names revision 'a' but --revision says 'b'"):
        parse_spec("org/x@a", revision="b")
    assert len({a.repo_id for a in ALIASES.values()}) == len(ALIASES)
    assert all((a.quantization == "fp8") == a.name.endswith("-fp8") for a in ALIASES.values())
    assert {"qwen3.6-35b-a3b", "qwen3.6-35b-a3b-fp8", "qwen3.6-27b", "qwen3.6-27b-fp8", "qwen3.5-0.8b",
            "qwen3.5-2b", "qwen3.5-4b", "qwen3.5-9b", "qwen3.5-27b", "qwen3.5-35b-a3b"} == set(ALIASES)


def test_pulled_alias_is_found_by_alias_and_repo_id(env, hub):
    hub.add_repo("Qwen/Qwen3.5-0.8B", repo_files())
    entry = pull("qwen3.5-0.8b", options=options(hub))
    registry = Registry()
    assert registry.find("qwen3.5-0.8b").key == registry.find("qwen/qwen3.5-0.8b").key == "Qwen/Qwen3.5-0.8B"
    assert registry.find(f"qwen3.5-0.8b@{entry.commit[:8]}").key == entry.key
    assert entry.display_name == "qwen3.5-0.8b"
    assert resolve_local("qwen3.5-0.8b") == entry.path and resolve_local("someone/else") is None


# ---- memory fit ---------------------------------------------------------------------------------


def test_fit_estimate_matches_a_hand_computation():
    """Qwen3.6-35B-A3B: 34.66 B parameters and 20 KB of bf16 KV per token (MODEL-FACTS.md)."""
    cfg = ALIASES["qwen3.6-35b-a3b"].config
    h, v = 2048, 248320
    attention = h * 16 * 256 * 2 + 2 * h * 2 * 256 + 16 * 256 * h + 2 * 256  # q+gate, k, v, o, q/k norms
    conv = 2 * 16 * 128 + 32 * 128
    gdn = h * conv + h * 32 * 128 + 2 * h * 32 + conv * 4 + 2 * 32 + 128 + 32 * 128 * h
    moe = h * 256 + 256 * 3 * h * 512 + 3 * h * 512 + h  # router, experts, shared expert and its gate
    params = 2 * v * h + h + 40 * (2 * h + moe) + 10 * attention + 30 * gdn
    assert count_params(cfg) == params == 34_660_610_688
    assert kv_bytes_per_token(cfg, "bf16") == 10 * 2 * 2 * 256 * 2 == 20_480
    assert kv_bytes_per_token(cfg, "fp8") == 10 * 2 * 2 * (256 + 4) == 10_400  # + an fp32 scale per token-head
    assert kv_bytes_per_token(cfg, "int8") == 10_400
    state = 30 * (conv * 3 * 2 + 32 * 128 * 128 * 4)
    assert gdn_state_bytes(cfg) == state

    gpu = GpuMemory("test GPU", free_bytes=40 * 10**9, total_bytes=48 * 10**9)
    fp8 = estimate_fit(cfg, "fp8", context=65536, sequences=2, gpu=gpu)
    kv = 20_480 * 65536 * 2
    assert (fp8.weight_bytes, fp8.kv_bytes, fp8.state_bytes) == (params, kv, 2 * state)
    assert fp8.total_bytes == params + kv + 2 * state + RUNTIME_RESERVE_BYTES and fp8.fits
    assert fp8.max_context == (40 * 10**9 - params - 2 * state - RUNTIME_RESERVE_BYTES) // (20_480 * 2)
    bf16 = estimate_fit(cfg, "bf16", gpu=gpu)
    assert bf16.weight_bytes == 2 * params and not bf16.fits and bf16.max_context == 0
    assert bf16.context == DEFAULT_CONTEXT
    assert estimate_fit(cfg, "int4").weight_bytes == params // 2 and estimate_fit(cfg, "int4").fits is None
    with pytest.raises(HubError, match="unknown quantization 'q3'"):
        estimate_fit(cfg, "q3")


def test_default_fit_context_is_the_engines_gpu_default():
    from ninfer_core.llm import DEFAULT_MAX_CONTEXT

    assert DEFAULT_CONTEXT == DEFAULT_MAX_CONTEXT["cuda"]


@pytest.mark.parametrize("moe,tied", [(False, False), (False, True), (True, False), (True, True)])
def test_param_count_matches_transformers_qwen3_5(moe, tied):
    from hf_reference import ninfer_config, tiny_qwen3_5_config
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM

    hf_config = tiny_qwen3_5_config(moe, tied)
    model = (Qwen3_5MoeForCausalLM if moe else Qwen3_5ForCausalLM)(hf_config)
    assert count_params(ninfer_config(hf_config)) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_param_count_matches_transformers_llama_family(arch):
    from transformers import AutoConfig, AutoModelForCausalLM

    from ninfer_core.config import config_from_hf_dict

    hf_config = AutoConfig.for_model(arch, vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = AutoModelForCausalLM.from_config(hf_config)
    cfg = config_from_hf_dict(hf_config.to_dict(), Path("<tiny>"))
    assert count_params(cfg) == sum(p.numel() for p in model.parameters())


# ---- command line -------------------------------------------------------------------------------


def ninfer_subprocess(args: list[str], hub: FakeHub, home: Path, **extra_env) -> subprocess.CompletedProcess:
    """The real `ninfer`, with the hub and its cache chosen through huggingface_hub's env variables."""
    env = dict(os.environ, HF_ENDPOINT=hub.url, HF_HOME=str(home / "hf"), NINFER_HOME=str(home / "ninfer"),
               HF_HUB_DISABLE_TELEMETRY="1", **extra_env)
    env.pop("HF_TOKEN", None)
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run([sys.executable, "-m", "ninfer_app", *args], capture_output=True, text=True, env=env,
                          timeout=120)


def assert_one_line_error(stderr: str, *needles: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in stderr, stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_offline_pull_fails_with_a_clear_message(tmp_path, hub):
    hub.add_repo(REPO, repo_files())
    proc = ninfer_subprocess(["pull", REPO], hub, tmp_path, HF_HUB_OFFLINE="1")
    assert proc.returncode != 0
    assert_one_line_error(proc.stderr, "offline mode", "HF_HUB_OFFLINE", REPO)
    assert hub.log == []


def test_cli_pull_ls_show_verify_rm(tmp_path, hub, monkeypatch):
    files = repo_files()
    hub.add_repo(REPO, files)
    proc = ninfer_subprocess(["pull", REPO], hub, tmp_path)
    assert proc.returncode == 0, proc.stderr
    snapshot = tmp_path / "hf" / "hub" / "models--org--tiny-qwen3" / "snapshots"
    assert f"ready at {snapshot}" in proc.stdout

    monkeypatch.setenv("NINFER_HOME", str(tmp_path / "ninfer"))
    app = typer.Typer()
    from ninfer_app.models_cli import register

    register(app)
    runner = CliRunner()

    def pulled() -> list[dict]:
        return [m for m in json.loads(runner.invoke(app, ["ls", "--json"]).stdout) if m["source"] == "pulled"]

    listed = pulled()
    assert [(m["name"], m["arch"], m["quantization"], m["context"], m["verified"], m["ready"]) for m in listed] == [
        (REPO, "qwen3", "bf16", 4096, "yes", True)]
    assert listed[0]["size_bytes"] == sum(len(files[n]) for n in INFERENCE)
    table = runner.invoke(app, ["ls"]).stdout
    assert "NAME" in table and REPO in table and "qwen3" in table

    shown = json.loads(runner.invoke(app, ["show", REPO, "--json", "--context", "1024"]).stdout)
    assert {f["name"]: f["digest"] for f in shown["files"]} == {n: digest(n, files[n]) for n in INFERENCE}
    assert shown["fit"]["context"] == 1024 and shown["fit"]["kv_bytes"] == 1024 * 2 * 2 * 2 * 16 * 2
    assert "sha256:" + digest(SHARD2, files[SHARD2]) in runner.invoke(app, ["show", REPO]).stdout

    checked = runner.invoke(app, ["verify", REPO])
    assert checked.exit_code == 0 and "all 7 files match" in checked.stdout
    blob = (snapshot / listed[0]["commit"] / SHARD2).resolve()
    blob.write_bytes(b"\0" * blob.stat().st_size)
    failed = runner.invoke(app, ["verify", REPO, "--json"])
    assert failed.exit_code == 1 and json.loads(failed.stdout.splitlines()[0])["ok"] is False
    assert_one_line_error(failed.stderr, SHARD2, "ninfer pull")
    assert pulled()[0]["verified"] == "FAILED"

    removed = runner.invoke(app, ["rm", REPO])
    assert removed.exit_code == 0 and "removed org/tiny-qwen3" in removed.stdout
    assert pulled() == []
    assert not (tmp_path / "hf" / "hub" / "models--org--tiny-qwen3").exists()
    again = runner.invoke(app, ["rm", REPO])
    assert again.exit_code == 1
    assert_one_line_error(again.stderr, "no model 'org/tiny-qwen3'")


def test_cli_show_and_list_aliases_without_pulling(tmp_path, monkeypatch):
    monkeypatch.setenv("NINFER_HOME", str(tmp_path / "ninfer"))
    from ninfer_app.models_cli import register

    app = typer.Typer()
    register(app)
    runner = CliRunner()
    aliases = json.loads(runner.invoke(app, ["ls", "--aliases", "--json"]).stdout)
    row = next(a for a in aliases if a["name"] == "qwen3.6-27b-fp8")
    assert row["repo_id"] == "Qwen/Qwen3.6-27B-FP8" and row["weight_bytes"] == row["params"] and not row["pulled"]
    shown = json.loads(runner.invoke(app, ["show", "qwen3.6-35b-a3b", "--quant", "int4", "--kv-dtype", "fp8",
                                           "--json"]).stdout)
    assert shown["pulled"] is False and shown["fit"]["weight_bytes"] == 34_660_610_688 // 2
    assert shown["fit"]["kv_bytes"] == 10_400 * DEFAULT_CONTEXT  # fp8 pages + their per-token-head scales


def test_run_a_pulled_model_by_name(tmp_path, hub):
    """`ninfer pull` then `ninfer run REPO`: the engine finds the verified snapshot by name."""
    source = tmp_path / "src"
    write_tiny_model_dir(source, moe=True)
    hub.add_repo("org/tiny-runnable", {p.name: p.read_bytes() for p in source.iterdir() if p.is_file()})
    assert ninfer_subprocess(["pull", "org/tiny-runnable"], hub, tmp_path).returncode == 0
    # greedy: a random draw from the random tiny model may pick its EOS first (CI saw 1 token of 3 once)
    proc = ninfer_subprocess(["run", "org/tiny-runnable", "--prompt", "hi", "--max-tokens", "3", "--device", "cpu",
                              "--temperature", "0", "--json"], hub, tmp_path, HF_HUB_OFFLINE="1")
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["token_ids"]) == 3
    offline = ninfer_subprocess(["run", "org/other", "--prompt", "hi"], hub, tmp_path, HF_HUB_OFFLINE="1")
    notice, error = [line for line in offline.stderr.splitlines() if line.strip()]
    assert offline.returncode == 1 and "org/other is not on this machine yet: pulling it" in notice
    assert_one_line_error(error, "offline mode", "HF_HUB_OFFLINE")


def test_run_pulls_a_hub_model_it_does_not_have_first(tmp_path, hub):
    """`ninfer run org/name` of a model not on this machine pulls it (as `ollama run` does), then
    answers; the next run downloads nothing. A name the hub lacks is the pull's one-line error."""
    source = tmp_path / "src"
    write_tiny_model_dir(source, moe=False)
    hub.add_repo("org/tiny-auto", {p.name: p.read_bytes() for p in source.iterdir() if p.is_file()})
    args = ["--prompt", "hi", "--max-tokens", "3", "--device", "cpu", "--temperature", "0", "--json"]
    first = ninfer_subprocess(["run", "org/tiny-auto", *args], hub, tmp_path)
    assert first.returncode == 0, first.stderr
    assert "pulling it" in first.stderr and "memory:" in first.stderr
    assert set(fetched(hub)) == {p.name for p in source.iterdir()}
    served = len(hub.log)
    again = ninfer_subprocess(["run", "org/tiny-auto", *args], hub, tmp_path)
    assert again.returncode == 0 and "pulling" not in again.stderr and len(hub.log) == served
    assert json.loads(again.stdout)["token_ids"] == json.loads(first.stdout)["token_ids"]
    direct = ninfer_subprocess(["run", str(source), *args], hub, tmp_path)
    assert json.loads(direct.stdout)["token_ids"] == json.loads(first.stdout)["token_ids"]  # the same model
    missing = ninfer_subprocess(["run", "org/nothing-here", *args], hub, tmp_path)
    assert missing.returncode == 1 and "no such model repository" in missing.stderr.splitlines()[-1]

"""Test helper: llama.cpp's own HF -> GGUF converter, the independent reference for GGUF layouts.

llama.cpp ships `convert_hf_to_gguf.py` (with its `conversion/` package and `gguf-py`) in its
source tree; the llama-cpp-python sdist on PyPI vendors that tree. We fetch the pinned sdist with
pip (PyPI only, its sha256 checked), keep the three converter parts in a cache directory, and run
the converter in a subprocess with its own gguf-py first on the path. Without network the tests
that need it skip, unless NINFER_REQUIRE_CONVERTER=1 (CI) makes that an error.

Use from a test module:  `from llama_cpp_convert import convert_hf_to_gguf, llama_cpp_converter`;
`converter_ready_qwen` writes a tiny Qwen3.5 checkpoint the converter accepts.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest
from tiny_checkpoints import write_tiny_qwen

SDIST = "llama_cpp_python-0.3.36.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
VENDORED = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
VOCAB = 248320  # the real tokenizer's
TEMPLATE = (Path(__file__).parent.parent / "assets" / "chat_template.jinja").read_text()
CACHE = Path(os.environ.get("NINFER_TEST_CACHE", Path.home() / ".cache" / "ninfer-tests")) / "llama-cpp-python-0.3.36"


def _fetch(target: Path) -> None:
    """The converter's files from the pinned sdist into `target` (atomically: a temp dir renamed)."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        "llama-cpp-python==0.3.36", "-d", tmp], check=True, timeout=900, capture_output=True)
        sdist = Path(tmp) / SDIST
        digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
        if digest != SDIST_SHA256:
            raise RuntimeError(f"{SDIST}: sha256 {digest}, expected {SDIST_SHA256}")
        unpacked = Path(tmp) / "unpacked"
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.isfile() and m.name.startswith(VENDORED)
                       and m.name[len(VENDORED):].startswith(PARTS)]
            tar.extractall(unpacked, members=members, filter="data")
        target.parent.mkdir(parents=True, exist_ok=True)
        (unpacked / VENDORED).rename(target)


@pytest.fixture(scope="session")
def llama_cpp_converter() -> Path:
    """The directory holding llama.cpp's convert_hf_to_gguf.py, conversion/ and gguf-py/."""
    if not (CACHE / PARTS[0]).is_file():
        try:
            _fetch(CACHE)
        except (OSError, subprocess.SubprocessError, RuntimeError) as e:
            if os.environ.get("NINFER_REQUIRE_CONVERTER"):
                raise
            pytest.skip(f"llama.cpp's converter could not be fetched from PyPI ({e})")
    return CACHE


def convert_hf_to_gguf(converter: Path, model_dir: Path, out: Path, outtype: str, mmproj: bool = False,
                       extra: tuple[str, ...] = ()) -> Path:
    """Run llama.cpp's converter on an HF checkpoint directory; `outtype`: f32, bf16, q8_0 ...;
    `mmproj`: write the vision tower's projector file instead of the text model; `extra`: more
    converter arguments (e.g. --split-max-tensors N: shards OUT's stem-0000i-of-0000N.gguf)."""
    env = {**os.environ, "PYTHONPATH": str(converter / "gguf-py")}
    done = subprocess.run([sys.executable, str(converter / PARTS[0]), str(model_dir), "--outtype", outtype,
                           "--outfile", str(out), *(["--mmproj"] if mmproj else []), *extra],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def converter_ready_qwen(directory: Path, tokenizer_dir: Path, *, moe: bool, vision: dict | None = None):
    """A tiny Qwen3.5 checkpoint the converter takes: the real Qwen3.6 vocabulary (it checks that every
    token id fits) and chat template; multimodal (the release layout) for MoE or when `vision` (tower
    config overrides) is given. Returns (directory, transformers reference)."""
    reference = write_tiny_qwen(directory, moe=moe, multimodal=moe or vision is not None,
                                text_overrides=dict(vocab_size=VOCAB), vision_overrides=vision)
    for file in tokenizer_dir.iterdir():
        shutil.copy(file, directory / file.name)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return directory, reference

"""`ninfer run --image / --video` on a tiny multimodal checkpoint (subprocess), and the API path."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from media_reference import moving_pattern, write_video
from ninfer_core.engine.sampling import SamplingParams
from ninfer_core.llm import LLM, ChatRequest, EngineOptions
from test_cli import assert_clean_error, ninfer
from tiny_model_dir import write_tiny_model_dir, write_tiny_multimodal_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_multimodal_dir(tmp_path_factory.mktemp("tiny_mm_cli"), moe=True)


@pytest.fixture(scope="module")
def image_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("img") / "pic.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 28, 3), dtype=np.uint8)).save(path)
    return path


def test_run_with_image_matches_the_api(tiny, image_path):
    proc = ninfer("run", str(tiny.directory), "--image", str(image_path), "--prompt", "What is this?",
                  "--max-tokens", "6", "--temperature", "0", "--device", "cpu", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    # 40 x 28 -> smart_resize to 40 x 32 (multiples of patch 4 x merge 2) -> (10 x 8) / 4 merged tokens
    assert out["prompt_token_ids"].count(tiny.ids["<|image_pad|>"]) == 20
    llm = LLM.load(str(tiny.directory), EngineOptions(device="cpu", dtype="float32", max_context=512))
    message = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": str(image_path)}},
                                           {"type": "text", "text": "What is this?"}]}
    result = llm.chat_result(ChatRequest([message], SamplingParams(temperature=0, max_tokens=6)))
    assert result.prompt_token_ids == out["prompt_token_ids"] and result.token_ids == out["token_ids"]


def test_run_with_video(tiny, tmp_path):
    video = tmp_path / "clip.mp4"
    write_video(video, moving_pattern(8, 32, 32), fps=4)
    proc = ninfer("run", str(tiny.directory), "--video", str(video), "--prompt", "What happens?", "--max-tokens", "3",
                  "--temperature", "0", "--device", "cpu", "--json")
    assert proc.returncode == 0, proc.stderr
    assert tiny.ids["<|video_pad|>"] in json.loads(proc.stdout)["prompt_token_ids"]


def test_bad_media_is_one_clear_error(tiny, tmp_path, image_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes(image_path.read_bytes()[:60])
    assert_clean_error(ninfer("run", str(tiny.directory), "--image", str(broken), "--prompt", "x", "--device", "cpu"),
                       "broken.png")
    assert_clean_error(ninfer("run", str(tiny.directory), "--image", str(tmp_path / "missing.png"), "--prompt", "x",
                              "--device", "cpu"), "missing.png")


def test_text_only_model_refuses_media(tmp_path, image_path):
    write_tiny_model_dir(tmp_path / "text", moe=False)
    assert_clean_error(ninfer("run", str(tmp_path / "text"), "--image", str(image_path), "--prompt", "x",
                              "--device", "cpu"), "vision")
    assert_clean_error(ninfer("run", str(tmp_path / "text"), "--vision", "--prompt", "x", "--device", "cpu"),
                       "vision")

"""llama.cpp's vision projector files (`mmproj-*.gguf`) beside a Qwen3.5 GGUF model.

A tiny random multimodal checkpoint (patch 16 like the real tower, so Qwen3.5's pixel budgets give
a few dozen vision tokens; CLIP's mean / std, so a reader that ignored the file's would differ)
goes through llama.cpp's own converter twice: the text model, and `--mmproj` for the tower (f32
and Q8_0). Read back, the projector must be the checkpoint's tower (config, preprocessing, every
tensor), and an image prompt through the engine must give transformers' greedy tokens.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from hf_reference import assert_close_rel
from llama_cpp_convert import convert_hf_to_gguf, converter_ready_qwen, llama_cpp_converter  # noqa: F401
from PIL import Image
from qwen_assets import qwen_tokenizer_dir  # noqa: F401  (fixture)
from test_cli import ninfer

from ninfer_core.capabilities import Capabilities
from ninfer_core.engine.sampling import SamplingParams
from ninfer_core.errors import ModelLoadError
from ninfer_core.llm import LLM, ChatRequest, EngineOptions
from ninfer_core.media import MediaError
from ninfer_core.media.config import IMAGE_FILE, VIDEO_FILE, MediaConfig
from ninfer_core.models.loader import load_model, read_config_and_tokenizer
from ninfer_core.models.vision import VisionConfig, load_vision_tower
from ninfer_core.weights.checkpoint import open_checkpoint
from ninfer_core.weights.gguf_mmproj import MmprojFile
from ninfer_core.weights.gguf_reader import FastGGUFReader
from ninfer_core.weights.mmproj_files import find_mmproj, pick_mmproj
from ninfer_core.weights.vision_weights import VisionWeights

CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
IMAGE = {"image_mean": CLIP_MEAN, "image_std": CLIP_STD, "patch_size": 16, "temporal_patch_size": 2,
         "merge_size": 2, "size": {"shortest_edge": 65536, "longest_edge": 16777216}}  # Qwen3.5's sizes
VIDEO = {**IMAGE, "size": {"shortest_edge": 4096, "longest_edge": 25165824}, "fps": 2.0, "min_frames": 4,
         "max_frames": 768}
WIDTH = 32  # the tiny text model's hidden size


@pytest.fixture(scope="module")
def projected(tmp_path_factory, llama_cpp_converter, qwen_tokenizer_dir):  # noqa: F811
    """(checkpoint dir, transformers reference, text GGUF, {"f32" | "q8_0": projector}): the f32
    projector lies beside the model, the Q8_0 one in a folder of its own."""
    directory, reference = converter_ready_qwen(tmp_path_factory.mktemp("mm_ckpt"), qwen_tokenizer_dir, moe=False,
                                                vision=dict(patch_size=16))
    (directory / IMAGE_FILE).write_text(json.dumps(IMAGE))
    (directory / VIDEO_FILE).write_text(json.dumps(VIDEO))
    models, other = tmp_path_factory.mktemp("gguf"), tmp_path_factory.mktemp("gguf_q8")
    text = convert_hf_to_gguf(llama_cpp_converter, directory, models / "tiny-F32.gguf", "f32")
    projectors = {t: convert_hf_to_gguf(llama_cpp_converter, directory, folder / f"mmproj-{t.upper()}.gguf", t,
                                        mmproj=True)
                  for t, folder in (("f32", models), ("q8_0", other))}
    return directory, reference.eval(), text, projectors


def test_config_and_preprocessing_are_the_checkpoints(projected):
    directory, _, _, projectors = projected
    mmproj = MmprojFile(projectors["f32"], WIDTH)
    assert mmproj.config == VisionConfig.from_model_dir(directory)
    assert mmproj.config.patch_size == 16 and mmproj.config.hidden_act == "gelu_pytorch_tanh"
    expected, got = MediaConfig.from_model_dir(directory), mmproj.media_config()
    for kind in ("image", "video"):
        want, have = getattr(expected, kind), getattr(got, kind)
        for field in want.__dataclass_fields__:
            if field in ("image_mean", "image_std"):  # stored as float32
                assert getattr(have, field) == pytest.approx(getattr(want, field), rel=1e-7), (kind, field)
            else:
                assert getattr(have, field) == getattr(want, field), (kind, field)
    assert got.image.image_mean != MediaConfig().image.image_mean  # the file's, not the defaults


def test_every_tower_tensor_is_the_checkpoints(projected):
    directory, _, _, projectors = projected
    expected, got = VisionWeights(open_checkpoint(directory)), MmprojFile(projectors["f32"], WIDTH)
    assert got.names() == expected.names()
    for name in sorted(expected.names()):
        want = expected.get(name, torch.float32)
        assert torch.equal(got.get(name), want), name
    assert got.get("patch_embed.proj.weight").shape[2] == 2  # the two frames' kernels stacked back


@torch.no_grad()
def test_quantized_projector_runs_close_to_transformers(projected):
    """A Q8_0 projector (its linears quantized by the converter) dequantized into the tower: the
    tower's output is transformers' to within Q8_0's rounding."""
    _, reference, _, projectors = projected
    assert {t.tensor_type.name for t in FastGGUFReader(projectors["q8_0"]).tensors} >= {"Q8_0", "F32"}
    mmproj = MmprojFile(projectors["q8_0"], WIDTH)
    tower = load_vision_tower(mmproj.config, mmproj, torch.device("cpu"), torch.float32)
    grids = [(1, 4, 6), (2, 2, 2)]
    x = torch.randn(sum(t * h * w for t, h, w in grids), mmproj.config.patch_values, generator=torch.manual_seed(0))
    want = reference.model.visual(x, grid_thw=torch.tensor(grids)).pooler_output
    assert_close_rel(tower(x, grids), want, 0.03)


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("mm_img") / "pic.png"
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (40, 56, 3), dtype=np.uint8)).save(path)
    return path


def _image_request(image: Path, tokens: int) -> ChatRequest:
    message = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": str(image)}},
                                           {"type": "text", "text": "What is in the picture?"}]}
    return ChatRequest([message], SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))


def test_image_prompt_gives_transformers_greedy_tokens(projected, image):
    """The model file alone: its projector is found beside it; the image is read with the file's
    preprocessing and tower, and the answer is transformers' (same prompt ids and pixels)."""
    _, reference, text, _ = projected
    llm = LLM.load(str(text), EngineOptions(device="cpu", dtype="float32", max_context=256))
    assert llm.vision is not None and Capabilities.of(llm).vision
    assert read_config_and_tokenizer(text)[0].has_vision  # what `ninfer show` / /api/show report
    request = _image_request(image, 8)
    prepared = llm.prepare_chat(request)
    ids, mm = prepared.prompt_token_ids, prepared.multimodal
    pad = llm.tokenizer.token_to_id("<|image_pad|>")
    (item,) = mm.media
    assert ids.count(pad) == item.grid_thw[1] * item.grid_thw[2] // 4 > 16  # Qwen3.5's pixel budget at patch 16
    ids_t = torch.tensor([ids])
    with torch.no_grad():
        want = reference.generate(input_ids=ids_t, mm_token_type_ids=(ids_t == pad).long(),
                                  pixel_values=item.pixel_values, image_grid_thw=torch.tensor([item.grid_thw]),
                                  max_new_tokens=8, min_new_tokens=8, do_sample=False, eos_token_id=None)
    assert llm.chat_result(request).token_ids == want[0, len(ids):].tolist()


def test_projector_named_on_the_command_line(projected, image):
    """`ninfer run model.gguf --mmproj FILE --image PIC`: the projector from another folder (Q8_0)."""
    _, _, text, projectors = projected
    proc = ninfer("run", str(text), "--mmproj", str(projectors["q8_0"]), "--image", str(image), "--prompt", "What?",
                  "--max-tokens", "3", "--temperature", "0", "--device", "cpu", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert len(out["token_ids"]) == 3 and out["prompt_token_ids"].count(248056) > 16  # <|image_pad|>
    bad = ninfer("run", str(text), "--mmproj", str(text), "--prompt", "hi", "--device", "cpu")
    assert bad.returncode != 0 and "not a vision projector (mmproj) file" in bad.stderr


def _other_projector(path: Path, kind: str = "mlp") -> Path:
    """A projector of another model family (llava's): only its metadata matters here."""
    writer = GGUFWriter(str(path), "clip")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_string("clip.projector_type", kind)
    writer.add_tensor("mm.0.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_projectors_that_do_not_fit(projected, tmp_path, image, caplog):
    """Named: one clear error. Found beside the model: passed over with a warning, the text model
    still runs, and a request with an image says what is missing."""
    directory, _, text, projectors = projected
    with pytest.raises(ModelLoadError, match="a 'mlp' vision projector; Qwen3.5 / 3.6 need 'qwen3vl_merger'"):
        load_model(str(text), "cpu", "float32", mmproj=_other_projector(tmp_path / "llava.gguf"))
    with pytest.raises(ModelLoadError, match="feeds a text model 32 wide, the model is 64 wide"):
        MmprojFile(projectors["f32"], 64)
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        load_model(str(text), "cpu", "float32", mmproj=tmp_path / "missing.gguf")
    with pytest.raises(ModelLoadError, match="--mmproj goes with a GGUF model"):
        load_model(str(directory), "cpu", "float32", mmproj=projectors["f32"])
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(text, alone / "tiny.gguf")
    _other_projector(alone / "mmproj-llava-f16.gguf")
    with caplog.at_level(logging.WARNING):
        llm = LLM.load(str(alone / "tiny.gguf"), EngineOptions(device="cpu", dtype="float32", max_context=256))
    assert llm.vision is None and "not using mmproj-llava-f16.gguf as the vision projector" in caplog.text
    with pytest.raises(MediaError, match="no vision tower.*llama.cpp's mmproj file: put it beside the model file"):
        llm.chat_result(_image_request(image, 2))


def test_which_file_is_the_projector(tmp_path):
    names = ["mmproj-F32.gguf", "mmproj-BF16.gguf", "mmproj-F16.gguf", "model-Q4_K_M.gguf", "README.md"]
    assert pick_mmproj(names) == "mmproj-BF16.gguf"
    assert pick_mmproj(["mmproj-Qwen3.5-9B-Q8_0.gguf", "mmproj-Qwen3.5-9B-f32.gguf"]) == "mmproj-Qwen3.5-9B-Q8_0.gguf"
    assert pick_mmproj(["x/mmproj-odd.gguf", "x/mmproj-F32.gguf"]) == "x/mmproj-F32.gguf"
    assert pick_mmproj(["model.gguf", "mmproj.json"]) is None
    (tmp_path / "model.gguf").write_bytes(b"")
    assert find_mmproj(tmp_path / "model.gguf") is None
    for name in ("mmproj-F32.gguf", "Mmproj-model-f16.gguf"):
        (tmp_path / name).write_bytes(b"")
    assert find_mmproj(tmp_path / "model.gguf") == tmp_path / "Mmproj-model-f16.gguf"
    assert find_mmproj(tmp_path / "mmproj-F32.gguf") is None  # a projector is no model

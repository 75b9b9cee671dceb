"""Media in prompts, end to end on tiny random multimodal checkpoints (fp32, CPU).

References: transformers' `Qwen3_5MoeForConditionalGeneration` / `Qwen3_5ForConditionalGeneration`
for mRoPE positions and rope deltas (`get_rope_index`), full-prompt logits (vision tower + pad
scattering + language model) and greedy `generate`; our side runs the checkpoint directory
through ninfer's loader, `VisionSupport` and the token engine (chunked prefill, batched decode).
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from hf_reference import assert_close_rel
from media_reference import moving_pattern, write_video
from ninfer_core.cache import CacheManager
from ninfer_core.engine.llm_engine import LLMEngine
from ninfer_core.engine.request import GenerationRequest
from ninfer_core.engine.sampling import SamplingParams
from ninfer_core.errors import ModelLoadError, NinferError
from ninfer_core.media import MediaError, MediaSource
from ninfer_core.models.base import ForwardBatch
from ninfer_core.models.loader import load_model
from ninfer_core.models.multimodal import MultimodalPrompt
from ninfer_core.models.vision_support import VisionSupport
from tiny_model_dir import TinyMultimodal, write_tiny_multimodal_dir

@pytest.fixture(scope="module", params=[True, False], ids=["moe", "dense"])
def tiny(request, tmp_path_factory) -> TinyMultimodal:
    return write_tiny_multimodal_dir(tmp_path_factory.mktemp("tiny_mm"), moe=request.param)


@pytest.fixture(scope="module")
def ninfer(tiny):
    loaded = load_model(str(tiny.directory), "cpu", "float32")
    return loaded, VisionSupport.from_model_dir(tiny.directory, loaded.device, loaded.dtype)


@pytest.fixture(scope="module")
def media_files(tmp_path_factory) -> dict[str, MediaSource]:
    directory = tmp_path_factory.mktemp("mm_media")
    rng = np.random.default_rng(0)

    def image(name: str, width: int, height: int) -> MediaSource:
        data = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(data, format="PNG")
        return MediaSource("image", name, data=data.getvalue())

    video = write_video(directory / "clip.mp4", moving_pattern(15, 20, 28), fps=6)  # 2.5 s -> 5 frames -> 3 pairs
    return {
        "wide": image("wide", 40, 17),  # -> 16 x 40: grid 4 x 10, 10 tokens
        "wide_other": image("wide_other", 40, 17),  # the same size, other pixels
        "small": image("small", 12, 30),  # -> 32 x 16: grid 8 x 4, 8 tokens
        "clip": MediaSource("video", "clip", path=video),
    }


IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
PROMPTS = {
    "image": (["wide"], f"Describe {IMAGE} please"),
    "two images": (["wide", "small"], f"{IMAGE}and{IMAGE}?"),
    "video": (["clip"], f"Watch {VIDEO}"),
    "text after media": (
        ["small", "clip"],
        f"<|im_start|>user\n{IMAGE}then{VIDEO}<|im_end|>"
        "\n<|im_start|>assistant\nThe capital of France is Paris.<|im_end|>\n<|im_start|>user\nAnd the fox?",
    ),
}


def multimodal_prompt(ninfer, media_files, case: str) -> tuple[list[int], MultimodalPrompt]:
    loaded, support = ninfer
    names, text = PROMPTS[case]
    return support.prompt(loaded.tokenizer.encode(text), [media_files[n] for n in names], loaded.tokenizer.encode)


def hf_inputs(tiny: TinyMultimodal, ids: list[int], mm: MultimodalPrompt) -> dict[str, torch.Tensor]:
    """transformers' model inputs for the same prompt (the processor's output layout)."""
    ids_t = torch.tensor([ids])
    types = torch.zeros_like(ids_t)
    types[ids_t == tiny.ids["<|image_pad|>"]] = 1
    types[ids_t == tiny.ids["<|video_pad|>"]] = 2
    out = {"input_ids": ids_t, "mm_token_type_ids": types}
    for kind, key in (("image", "pixel_values"), ("video", "pixel_values_videos")):
        items = [m for m in mm.media if m.kind == kind]
        if items:
            out[key] = torch.cat([m.pixel_values for m in items])
            out[f"{kind}_grid_thw"] = torch.tensor([m.grid_thw for m in items])
    return out


@pytest.mark.parametrize("case", sorted(PROMPTS))
def test_positions_and_rope_delta_match_transformers(tiny, ninfer, media_files, case):
    ids, mm = multimodal_prompt(ninfer, media_files, case)
    inputs = hf_inputs(tiny, ids, mm)
    positions, delta = tiny.hf.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], inputs.get("image_grid_thw"), inputs.get("video_grid_thw")
    )
    assert torch.equal(mm.positions, positions[:, 0])
    assert mm.rope_delta == int(delta) and mm.rope_delta < 0


def forward_prompt(ninfer, ids: list[int], mm: MultimodalPrompt, chunk: int) -> torch.Tensor:
    """Our logits [T, V] for the prompt, fed `chunk` tokens at a time."""
    loaded, support = ninfer
    model = loaded.model
    manager = CacheManager(model.config, 512, 1, page_size=16, dtype=torch.float32)
    seq = manager.allocate()
    mm.encode(support.tower())
    logits = []
    with torch.inference_mode():
        for start in range(0, len(ids), chunk):
            part = torch.tensor([ids[start : start + chunk]])
            end = start + part.shape[1]
            manager.reserve(seq, end)
            batch = ForwardBatch(
                input_ids=part,
                positions=torch.arange(start, end)[None],
                cache_lens=torch.tensor([start]),
                slots=torch.tensor([seq.slot]),
                block_table=manager.block_table([seq]),
                mrope_positions=mm.chunk_positions(start, end, torch.device("cpu")),
                inputs_embeds=mm.chunk_embeddings(model.embed_tokens, part, start),
                logits="all",
            )
            logits.append(model(batch, manager.cache).logits[0])
    return torch.cat(logits)


@pytest.mark.parametrize("case", ["two images", "text after media"])
def test_vision_embeddings_and_logits_match_transformers(tiny, ninfer, media_files, case):
    ids, mm = multimodal_prompt(ninfer, media_files, case)
    inputs = hf_inputs(tiny, ids, mm)
    with torch.no_grad():
        expected = tiny.hf(**inputs, use_cache=False).logits[0]
        hf_vision = torch.cat(
            [tiny.hf.model.visual(m.pixel_values, grid_thw=torch.tensor([m.grid_thw])).pooler_output for m in mm.media]
        )
    mm.encode(ninfer[1].tower())
    assert_close_rel(mm.embeddings, hf_vision, 1e-5)
    for chunk in (len(ids), 7):  # whole prompt, and chunks that cut through vision groups
        assert_close_rel(forward_prompt(ninfer, ids, mm, chunk), expected, 1e-4)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def make_engine(ninfer, vision: bool = True, prefill_chunk: int = 16, checkpoints: int = 0) -> LLMEngine:
    loaded, support = ninfer
    cache = CacheManager(loaded.config, 2048, 5, dtype=torch.float32, device=loaded.device, checkpoints=checkpoints)
    return LLMEngine(
        loaded.model, loaded.config, loaded.tokenizer, cache, max_context=512, prefill_chunk=prefill_chunk,
        vision_tower=support.tower if vision else None,
    )


def run(engine: LLMEngine, requests: list[GenerationRequest]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for out in engine.generate(requests):
        tokens[out.request_id] += out.new_token_ids
    return tokens


def test_greedy_tokens_match_transformers_generate(tiny, ninfer, media_files):
    """Each case alone, then all of them plus a text-only prompt decoding together in one batch."""
    new = 12
    cases = sorted(PROMPTS)
    expected = {}
    for case in cases:
        ids, mm = multimodal_prompt(ninfer, media_files, case)
        with torch.no_grad():
            ref = tiny.hf.generate(
                **hf_inputs(tiny, ids, mm), max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None
            )
        expected[case] = ref[0, len(ids) :].tolist()
        request = GenerationRequest(ids, greedy(new), multimodal=mm)
        assert run(make_engine(ninfer), [request])[request.request_id] == expected[case], case
    engine = make_engine(ninfer, prefill_chunk=9)
    requests = {}
    for case in cases:
        ids, mm = multimodal_prompt(ninfer, media_files, case)
        requests[case] = GenerationRequest(ids, greedy(new), multimodal=mm)
    text_only = GenerationRequest([5, 17, 42, 99, 3, 250, 7], greedy(new))
    results = run(engine, [*requests.values(), text_only])
    for case, request in requests.items():
        assert results[request.request_id] == expected[case], f"batched: {case}"
    with torch.no_grad():
        ref = tiny.hf.generate(input_ids=torch.tensor([text_only.prompt_token_ids]), max_new_tokens=new,
                               min_new_tokens=new, do_sample=False, eos_token_id=None)
    assert results[text_only.request_id] == ref[0, 7:].tolist()


def test_bad_media_leave_the_engine_working(tiny, ninfer, media_files):
    loaded, support = ninfer
    engine = make_engine(ninfer)
    broken = MediaSource("image", "broken.png", data=b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
    prompt = loaded.tokenizer.encode("look <|vision_start|><|image_pad|><|vision_end|>")
    with pytest.raises(MediaError, match="broken.png"):
        support.prompt(prompt, [broken], loaded.tokenizer.encode)
    with pytest.raises(MediaError, match="1 image placeholder.* but 2 image"):
        support.prompt(prompt, [media_files["wide"], media_files["small"]], loaded.tokenizer.encode)
    ids, mm = multimodal_prompt(ninfer, media_files, "image")
    with pytest.raises(NinferError, match="no vision tower"):
        make_engine(ninfer, vision=False).add_request(GenerationRequest(ids, greedy(4), multimodal=mm))
    with pytest.raises(NinferError, match="covers"):
        engine.add_request(GenerationRequest(ids[:-1], greedy(4), multimodal=mm))
    request = GenerationRequest(ids, greedy(6), multimodal=mm)
    assert len(run(engine, [request])[request.request_id]) == 6


def test_preprocessing_must_fit_the_tower(tiny, tmp_path):
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((tiny.directory / name).read_bytes())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"patch_size": 16}))
    with pytest.raises(ModelLoadError, match="does not match the vision tower"):
        VisionSupport.from_model_dir(tmp_path, torch.device("cpu"), torch.float32)


def test_prefix_cache_hits_the_same_picture_only(tiny, ninfer, media_files):
    """The same image again (a new request, a new decode of the file) reuses the prompt; another
    image of the same size (the same pad tokens) stops the hit before its first vision row; every
    answer equals the cache-off engine's."""
    loaded, support = ninfer
    text = f"Describe {IMAGE} please, in as many words as you like" + " and more" * 100  # a long prompt
    cached, plain = make_engine(ninfer, checkpoints=8), make_engine(ninfer)

    def ask(engine, name):
        ids, mm = support.prompt(loaded.tokenizer.encode(text), [media_files[name]], loaded.tokenizer.encode)
        request = GenerationRequest(ids, greedy(6), multimodal=mm)
        outs = list(engine.generate([request]))
        return ids, [t for o in outs for t in o.new_token_ids], outs[-1].timings.cached_tokens

    for name, expect in (("wide", "miss"), ("wide", "hit"), ("wide_other", "before the image")):
        ids, got, hit = ask(cached, name)
        assert got == ask(plain, name)[1]
        first_vision = ids.index(loaded.tokenizer.encode("<|image_pad|>")[0])
        if expect == "miss":
            assert hit == 0
        elif expect == "hit":
            assert hit > first_vision
        else:
            assert hit <= first_vision

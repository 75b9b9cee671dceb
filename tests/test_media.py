"""Image and video preprocessing against transformers' Qwen3-VL processors (see media_reference.py).

Pixel values are compared bit for bit: the same decoder, the same resampling kernel, the same
float arithmetic in the same order. Images of awkward sizes and modes use a small pixel budget
(the rules are the same; the tensors stay small); one image and the videos use Qwen3.5's own
budgets.
"""

from __future__ import annotations

import base64
import io
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from media_reference import (
    hf_image,
    hf_image_grid,
    hf_image_text,
    hf_video,
    hf_video_grid,
    moving_pattern,
    write_video,
)
from ninfer_core.media import (
    MediaConfig,
    MediaError,
    MediaLimits,
    MediaProcessor,
    MediaSource,
    PreprocessConfig,
    source_from_url,
    split_media,
)
from ninfer_core.media.config import IMAGE_DEFAULTS, VIDEO_DEFAULTS
from ninfer_core.media.image import prepare_image, smart_resize
from ninfer_core.media.video import prepare_video, resized_size
from ninfer_core.models.multimodal import VisionTokenIds, expand_placeholders
from qwen_assets import qwen_tokenizer, qwen_tokenizer_dir  # noqa: F401 (fixtures)

SMALL = PreprocessConfig(min_pixels=32 * 32, max_pixels=160 * 160)
LIMITS = MediaLimits()


def picture(width: int, height: int, seed: int = 0, channels: int = 3) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(width - 1, 1), y * 255 / max(height - 1, 1), (x + y) % 64 * 4], -1)
    if channels == 4:
        base = np.concatenate([base, (x * 7 + y * 3)[..., None] % 256], -1)
    return np.clip(base + rng.normal(0, 20, (height, width, channels)), 0, 255).astype(np.uint8)


def save(image: Image.Image, path: Path, **kwargs) -> Path:
    image.save(path, **kwargs)
    return path


def exif_rotated_jpeg(path: Path) -> Path:
    image = Image.fromarray(picture(61, 37, seed=3))
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    return save(image, path, format="JPEG", quality=90, exif=exif)


def animated_gif(path: Path) -> Path:
    frames = [Image.fromarray(picture(45, 29, seed=s)).convert("P", palette=Image.Palette.ADAPTIVE) for s in range(3)]
    frames[0].info["transparency"] = 0
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=100, loop=0, transparency=0)
    return path


IMAGE_FILES = {
    "tiny_1x1.png": lambda p: save(Image.fromarray(picture(1, 1)), p),
    "tiny_7x3.png": lambda p: save(Image.fromarray(picture(7, 3, seed=1)), p),
    "wide_600x3.png": lambda p: save(Image.fromarray(picture(600, 3, seed=2)), p),  # aspect ratio 200, the limit
    "tall_5x700.png": lambda p: save(Image.fromarray(picture(5, 700, seed=4)), p),
    "huge_1501x1103.png": lambda p: save(Image.fromarray(picture(1501, 1103, seed=5)), p),  # shrunk to the budget
    "rgba_83x47.png": lambda p: save(Image.fromarray(picture(83, 47, seed=6, channels=4), "RGBA"), p),
    "palette_transparent.png": lambda p: save(
        Image.fromarray(picture(66, 50, seed=7)).convert("P", palette=Image.Palette.ADAPTIVE), p, transparency=3
    ),
    "gray_alpha.png": lambda p: save(Image.fromarray(picture(40, 90, seed=8, channels=4), "RGBA").convert("LA"), p),
    "gray_16bit.png": lambda p: save(Image.fromarray((picture(50, 30, seed=9)[..., 0].astype(np.uint16) * 257)), p),
    "exif_rotated.jpg": exif_rotated_jpeg,
    "cmyk.jpg": lambda p: save(Image.fromarray(picture(70, 52, seed=10)).convert("CMYK"), p, format="JPEG"),
    "lossy.webp": lambda p: save(Image.fromarray(picture(77, 41, seed=11)), p, format="WEBP", quality=80),
    "alpha.webp": lambda p: save(Image.fromarray(picture(64, 64, seed=12, channels=4), "RGBA"), p, format="WEBP"),
    "animated.gif": animated_gif,
}


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("media")


@pytest.mark.parametrize("name", sorted(IMAGE_FILES))
def test_image_pixels_match_transformers(media_dir, name):
    path = IMAGE_FILES[name](media_dir / name)
    expected, grid = hf_image(path, SMALL)
    ours = prepare_image(path.read_bytes(), SMALL, LIMITS, name)
    assert ours.grid_thw == grid
    assert ours.pixel_values.dtype == torch.float32
    assert torch.equal(ours.pixel_values, expected)


def test_image_pixels_match_transformers_at_qwen_budget(media_dir):
    path = save(Image.fromarray(picture(300, 211, seed=13)), media_dir / "default.png")
    expected, grid = hf_image(path, IMAGE_DEFAULTS)
    ours = prepare_image(path.read_bytes(), IMAGE_DEFAULTS, LIMITS)
    assert ours.grid_thw == grid and grid[1] * grid[2] * 256 >= IMAGE_DEFAULTS.min_pixels
    assert torch.equal(ours.pixel_values, expected)


def test_exif_orientation_and_alpha_are_applied(media_dir):
    """Independent of transformers: the rotated JPEG comes out portrait, transparent pixels white."""
    rotated = prepare_image(exif_rotated_jpeg(media_dir / "r.jpg").read_bytes(), SMALL, LIMITS)
    _, h, w = rotated.grid_thw
    assert h > w  # 61 x 37 landscape stored, displayed 37 x 61
    clear = Image.new("RGBA", (64, 64), (10, 20, 30, 0))
    data = io.BytesIO()
    clear.save(data, format="PNG")
    white = prepare_image(data.getvalue(), SMALL, LIMITS)
    assert torch.equal(white.pixel_values, torch.ones_like(white.pixel_values))  # (1 - 0.5) / 0.5


def test_smart_resize_matches_transformers_over_many_sizes():
    rng = np.random.default_rng(0)
    sizes = [(1, 1), (31, 33), (16, 3200), (3, 600), (4096, 4096), (5000, 4000), (10, 1999), (65, 6000)]
    sizes += [tuple(int(v) for v in rng.integers(1, 9000, 2)) for _ in range(200)]
    for h, w in sizes:
        if max(h, w) / min(h, w) > 200:
            continue
        assert smart_resize(h, w, IMAGE_DEFAULTS, "x") == hf_image_grid(h, w, IMAGE_DEFAULTS), (h, w)
        frames = int(rng.integers(2, 800))
        expected = hf_video_grid(frames, h, w, VIDEO_DEFAULTS)
        assert resized_size(frames, h, w, VIDEO_DEFAULTS, "x") == expected, (frames, h, w)


def test_expanded_image_ids_match_transformers(qwen_tokenizer, qwen_tokenizer_dir, media_dir):
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(qwen_tokenizer_dir / "tokenizer.json"))
    paths = [IMAGE_FILES[n](media_dir / n) for n in ("rgba_83x47.png", "tiny_7x3.png")]
    items = [prepare_image(p.read_bytes(), SMALL, LIMITS) for p in paths]
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    template = f"<|im_start|>user\n{image}a{image}b"
    parts = template.split("<|image_pad|>")
    reference = parts[0] + hf_image_text(hf_image(paths[0], SMALL)[1], 2) + parts[1]
    reference += hf_image_text(hf_image(paths[1], SMALL)[1], 2) + parts[2]
    ours = expand_placeholders(qwen_tokenizer.encode(template), items, VisionTokenIds(), qwen_tokenizer.encode)
    assert ours == hf_tok(reference)["input_ids"]


VIDEOS = {
    # name: (frames, fps, height, width, codec, transformers' PyAV reader usable)
    "clip.mp4": (40, 10, 72, 100, "mpeg4", True),  # 4 s -> 8 frames
    "odd.mp4": (25, 10, 90, 52, "libx264", True),  # 2.5 s -> 5 frames: the last repeated
    "tiny.mp4": (9, 3, 18, 26, "mpeg4", True),  # sides under one merge window: scaled up first
    "clip.webm": (31, 12, 48, 64, "libvpx-vp9", False),  # webm / mkv store no frame count
    "clip.mkv": (16, 8, 40, 56, "ffv1", False),
}


@pytest.mark.parametrize("name", sorted(VIDEOS))
def test_video_pixels_and_prompt_match_transformers(media_dir, name, qwen_tokenizer, qwen_tokenizer_dir):
    from transformers import PreTrainedTokenizerFast

    frames, fps, height, width, codec, pyav_reader = VIDEOS[name]
    path = write_video(media_dir / name, moving_pattern(frames, height, width), fps, codec)
    reference = hf_video(path, VIDEO_DEFAULTS, pyav_reader)
    ours = prepare_video(path, VIDEO_DEFAULTS, LIMITS, name)
    assert ours.grid_thw == reference["grid_thw"]
    assert torch.equal(ours.pixel_values, reference["pixel_values"])
    assert torch.equal(prepare_video(path.read_bytes(), VIDEO_DEFAULTS, LIMITS).pixel_values, ours.pixel_values)
    hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(qwen_tokenizer_dir / "tokenizer.json"))
    text = "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>What happens?"
    expected = hf_tok(text.replace("<|video_pad|>", reference["text"]))["input_ids"]
    assert expand_placeholders(qwen_tokenizer.encode(text), [ours], VisionTokenIds(), qwen_tokenizer.encode) == expected


def test_video_sampling_rules(media_dir):
    """2 fps over the clip, at least 4 frames, at most 768, never more than the clip has."""
    short = write_video(media_dir / "short.mp4", moving_pattern(3, 32, 32), 30)  # 0.1 s: all 3 frames, padded to 4
    assert prepare_video(short, VIDEO_DEFAULTS, LIMITS).grid_thw[0] == 2
    long = write_video(media_dir / "long.mp4", moving_pattern(200, 32, 32), 10)  # 20 s -> 40 frames -> 20 pairs
    prepared = prepare_video(long, VIDEO_DEFAULTS, LIMITS)
    assert prepared.grid_thw[0] == 20
    assert prepared.timestamps[0] == pytest.approx((0 + 5 / 10) / 2, abs=0.06)
    capped = PreprocessConfig(min_pixels=4096, max_pixels=24 << 20, max_frames=6)
    assert prepare_video(long, capped, LIMITS).grid_thw[0] == 3


# -- bad media ----------------------------------------------------------------------------------


def png_bytes(width: int, height: int) -> bytes:
    data = io.BytesIO()
    Image.new("RGB", (width, height), (9, 9, 9)).save(data, format="PNG")
    return data.getvalue()


def zero_width_png() -> bytes:
    """A well-formed PNG whose header says 0 x 5 pixels."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", 0, 5, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "empty"),
        (png_bytes(120, 80)[:60], "truncated"),
        (png_bytes(50_000, 10), "aspect ratio 5000:1"),
        (b"%PDF-1.4 not an image at all", "not an image"),
        (zero_width_png(), "zero size"),
    ],
)
def test_bad_images_raise_clear_errors(data, message):
    with pytest.raises(MediaError, match=message):
        prepare_image(data, SMALL, LIMITS, "upload.png")


def test_image_limits():
    with pytest.raises(MediaError, match="megapixels, over the limit"):
        prepare_image(png_bytes(400, 300), SMALL, MediaLimits(max_image_pixels=100_000), "big.png")
    with pytest.raises(MediaError, match="MiB, over the limit"):
        prepare_image(png_bytes(40, 30), SMALL, MediaLimits(max_image_bytes=10), "big.png")


def test_bad_videos_raise_clear_errors(media_dir):
    good = write_video(media_dir / "ok.mkv", moving_pattern(8, 32, 32), 8, "ffv1").read_bytes()
    unknown_codec = good.replace(b"V_FFV1", b"V_ZZZZ")
    with pytest.raises(MediaError, match="codec is not supported"):
        prepare_video(unknown_codec, VIDEO_DEFAULTS, LIMITS, "x.mkv")
    mp4 = write_video(media_dir / "ok.mp4", moving_pattern(20, 32, 32), 10).read_bytes()
    with pytest.raises(MediaError, match="x.mp4"):
        prepare_video(mp4[: len(mp4) // 3], VIDEO_DEFAULTS, LIMITS, "x.mp4")
    with pytest.raises(MediaError, match="not a video container"):
        prepare_video(b"\x00\x01garbage" * 50, VIDEO_DEFAULTS, LIMITS, "x.mp4")
    one_frame = write_video(media_dir / "one.mp4", moving_pattern(1, 32, 32), 10)
    with pytest.raises(MediaError, match="at least 2"):
        prepare_video(one_frame, VIDEO_DEFAULTS, LIMITS)
    with pytest.raises(MediaError, match="over the limit of 1 s"):
        prepare_video(mp4, VIDEO_DEFAULTS, MediaLimits(max_video_seconds=1), "x.mp4")
    with pytest.raises(MediaError, match="empty"):
        prepare_video(b"", VIDEO_DEFAULTS, LIMITS)


# -- sources, config, processor, cache -----------------------------------------------------------


def test_sources_from_message_parts(media_dir):
    png = png_bytes(30, 20)
    path = media_dir / "part.png"
    path.write_bytes(png)
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    messages = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "compare"},
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "image", "image": str(path)},
                {"type": "video", "video": f"file://{path}"},
                {"type": "image_url", "image_url": str(path)},
            ],
        },
    ]
    rendered, sources = split_media(messages)
    assert [s.kind for s in sources] == ["image", "image", "video", "image"]
    assert [s.read() for s in sources] == [png] * 4
    assert rendered[1]["content"] == [
        {"type": "text", "text": "compare"}, {"type": "image"}, {"type": "image"}, {"type": "video"}, {"type": "image"}
    ]
    assert rendered[0] == messages[0]
    for bad, message in [
        ("https://example.com/a.png", "server only"),
        (str(media_dir / "missing.png"), "not found"),
        ("data:image/png,abc", "base64"),
        ("ftp://host/a.png", "scheme"),
    ]:
        with pytest.raises(MediaError, match=message):
            source_from_url("image", bad)


def test_media_config_from_model_dir(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(
        '{"size": {"longest_edge": 1000000, "shortest_edge": 5000}, "patch_size": 14, "image_mean": [0.1, 0.2, 0.3]}'
    )
    (tmp_path / "processor_config.json").write_text('{"video_processor": {"fps": 1, "max_frames": 64}}')
    config = MediaConfig.from_model_dir(tmp_path)
    assert (config.image.max_pixels, config.image.min_pixels, config.image.patch_size) == (1000000, 5000, 14)
    assert config.image.image_mean == (0.1, 0.2, 0.3) and config.image.image_std == (0.5, 0.5, 0.5)
    assert (config.video.fps, config.video.max_frames, config.video.max_pixels) == (1.0, 64, 24 << 20)
    assert MediaConfig.from_model_dir(tmp_path / "nothing") == MediaConfig()


def test_processor_caches_by_content_and_bounds_tokens(media_dir):
    processor = MediaProcessor(MediaConfig(image=SMALL), MediaLimits(max_vision_tokens=100))
    a = MediaSource("image", "a", data=png_bytes(128, 128))
    first = processor.prepare(a)
    again = processor.prepare(MediaSource("image", "same bytes", data=png_bytes(128, 128)))
    assert again is first and (processor.cache.hits, processor.cache.misses) == (1, 1)
    assert first.num_tokens == 16
    with pytest.raises(MediaError, match="over the limit of 100"):
        processor.prepare_all([a] * 7)
    with pytest.raises(MediaError, match="over the limit of 2"):
        MediaProcessor(limits=MediaLimits(max_media_items=2)).prepare_all([a] * 3)

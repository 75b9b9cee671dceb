"""Vision timings on a GPU: preprocessing (CPU) and the Qwen3.5 / 3.6 vision tower (real shape,
random weights, bf16) for one 1024x1024 image and a 10 s 1280x720 30 fps video.

Where torchvision imports (the GPU machine), it also compares our pixels with transformers'
torchvision processors: the video processor (ours is meant to be identical) and the fast image
processor (ours follows the PIL one; the two differ by rounding).

    python3 scripts/bench_vision.py [--json OUT.json]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import av
import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ninfer_core.media import MediaLimits  # noqa: E402
from ninfer_core.media.config import IMAGE_DEFAULTS, VIDEO_DEFAULTS  # noqa: E402
from ninfer_core.media.image import prepare_image  # noqa: E402
from ninfer_core.media.video import prepare_video  # noqa: E402
from ninfer_core.models.vision import VisionConfig, VisionTower  # noqa: E402


def pattern(height: int, width: int, t: int, rng: np.random.Generator) -> np.ndarray:
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([(x + 7 * t) % 256, (y + 3 * t) % 256, (x ^ y) % 256], -1).astype(np.float32)
    return np.clip(base + rng.normal(0, 10, base.shape), 0, 255).astype(np.uint8)


def write_video(path: Path, frames: int, fps: int, height: int, width: int) -> None:
    rng = np.random.default_rng(0)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps, options={"qscale": "3"})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for t in range(frames):
            for packet in stream.encode(av.VideoFrame.from_ndarray(pattern(height, width, t, rng), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def tower_ms(tower: VisionTower, item, repeats: int = 10) -> float:
    pixels = item.pixel_values.cuda()
    with torch.inference_mode():
        for _ in range(3):
            tower(pixels, [item.grid_thw])
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            tower(pixels, [item.grid_thw])
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def compare_with_torchvision(image_bytes: bytes, video_path: Path, image_item, video_item) -> dict:
    try:
        from transformers import Qwen2VLImageProcessorFast, Qwen3VLVideoProcessor
    except Exception as e:  # torchvision or transformers missing
        return {"skipped": f"{type(e).__name__}: {e}"}
    out = {}
    fast = Qwen2VLImageProcessorFast(
        size={"shortest_edge": IMAGE_DEFAULTS.min_pixels, "longest_edge": IMAGE_DEFAULTS.max_pixels},
        patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3,
    )
    ref = fast(images=[Image.open(io.BytesIO(image_bytes))], return_tensors="pt")["pixel_values"]
    out["image_vs_fast_processor_max_abs"] = float((ref - image_item.pixel_values).abs().max())
    with av.open(str(video_path)) as container:
        stream = container.streams.video[0]
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])
        fps = float(stream.average_rate)
    processor = Qwen3VLVideoProcessor(
        size={"shortest_edge": VIDEO_DEFAULTS.min_pixels, "longest_edge": VIDEO_DEFAULTS.max_pixels},
        patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3,
    )
    result = processor(
        videos=[frames], video_metadata=[{"total_num_frames": len(frames), "fps": fps}], return_tensors="pt"
    )
    got = result["pixel_values_videos"]
    out["video_grid_equal"] = result["video_grid_thw"][0].tolist() == list(video_item.grid_thw)
    out["video_pixels_identical"] = got.shape == video_item.pixel_values.shape and bool(
        torch.equal(got, video_item.pixel_values)
    )
    if got.shape == video_item.pixel_values.shape:
        out["video_max_abs"] = float((got - video_item.pixel_values).abs().max())
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    limits = MediaLimits()
    with torch.device("cuda"):
        tower = VisionTower(VisionConfig()).to(torch.bfloat16).eval()
    report: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}

    data = io.BytesIO()
    Image.fromarray(pattern(1024, 1024, 0, np.random.default_rng(1))).save(data, format="PNG")
    image_bytes = data.getvalue()
    prep_s, image = timed(lambda: prepare_image(image_bytes, IMAGE_DEFAULTS, limits), 5)
    report["image"] = {
        "size": "1024x1024 png", "grid_thw": image.grid_thw, "llm_tokens": image.num_tokens,
        "preprocess_ms": prep_s * 1e3, "tower_ms": tower_ms(tower, image),
    }

    with tempfile.TemporaryDirectory() as tmp:
        video_path = Path(tmp) / "clip.mp4"
        write_video(video_path, frames=300, fps=30, height=720, width=1280)
        prep_s, video = timed(lambda: prepare_video(video_path, VIDEO_DEFAULTS, limits), 3)
        report["video"] = {
            "size": "10 s, 1280x720, 30 fps, mpeg4", "grid_thw": video.grid_thw, "llm_tokens": video.num_tokens,
            "preprocess_ms": prep_s * 1e3, "tower_ms": tower_ms(tower, video),
        }
        report["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20
        try:
            report["vs_torchvision"] = compare_with_torchvision(image_bytes, video_path, image, video)
        except Exception as e:  # a transformers version whose processors take other arguments
            report["vs_torchvision"] = {"failed": f"{type(e).__name__}: {e}"}
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)


if __name__ == "__main__":
    main()

"""transformers' Qwen3-VL preprocessing, as the reference for ninfer's media tests.

Images: `Qwen2VLImageProcessorPil` (transformers' PIL/numpy backend), fed the way its loader
feeds it (the first frame, EXIF orientation applied, alpha left for the processor to composite).

Videos: transformers' only Qwen3-VL video processor is the torchvision one, and torchvision does
not import beside this torch build; so the pipeline is assembled from `Qwen3VLVideoProcessor`'s
own pieces, called unbound: `sample_frames` (frame choice), the module's `smart_resize`,
`patchify`, `_fuse_mean_std_and_rescale_factor` (normalisation constants), plus
`Qwen3VLProcessor._calculate_timestamps` / `replace_video_token` (prompt text), and
`read_video_pyav` (decoding). The two torchvision calls are reproduced from torchvision 0.28's
source: `resize` on a CPU uint8 tensor with bicubic + antialias calls
`torch.nn.functional.interpolate` on the uint8 tensor directly (`_do_native_uint8_resize_on_cpu`),
and `normalize` is `tensor.sub_(mean).div_(std)`.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import av
import numpy as np
import torch
from PIL import Image, ImageOps

from ninfer_core.media.config import PreprocessConfig


def hf_image_processor(config: PreprocessConfig):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        size={"shortest_edge": config.min_pixels, "longest_edge": config.max_pixels},
        patch_size=config.patch_size,
        temporal_patch_size=config.temporal_patch_size,
        merge_size=config.merge_size,
        image_mean=list(config.image_mean),
        image_std=list(config.image_std),
        rescale_factor=config.rescale_factor,
    )


def hf_image(path: Path, config: PreprocessConfig) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """(pixel_values, grid_thw) from transformers for one image file."""
    image = ImageOps.exif_transpose(Image.open(path))
    out = hf_image_processor(config)(images=[image], return_tensors="pt")
    return out["pixel_values"], tuple(out["image_grid_thw"][0].tolist())


def hf_image_grid(height: int, width: int, config: PreprocessConfig) -> tuple[int, int]:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    return smart_resize(height, width, config.factor, config.min_pixels, config.max_pixels)


def hf_video_grid(frames: int, height: int, width: int, config: PreprocessConfig) -> tuple[int, int]:
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    return smart_resize(
        frames, height, width, config.temporal_patch_size, config.factor, config.min_pixels, config.max_pixels
    )


def _processor_settings(config: PreprocessConfig) -> SimpleNamespace:
    return SimpleNamespace(fps=config.fps, min_frames=config.min_frames, max_frames=config.max_frames)


def decode_all_frames(path: Path) -> tuple[np.ndarray, float]:
    """Every frame as RGB [N, H, W, 3] and the stream's average rate: transformers' input for an
    already-decoded video (used for containers that store no frame count, where `read_video_pyav`
    cannot sample)."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        return np.stack(frames), float(stream.average_rate)


def hf_video(path: Path, config: PreprocessConfig, pyav_reader: bool = True) -> dict:
    """pixel_values_videos, video_grid_thw, the sampled frame indices, fps, and the prompt text
    replacing one `<|video_pad|>` (transformers' Qwen3-VL processor)."""
    from transformers.image_processing_backends import TorchvisionBackend
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata, read_video_pyav

    settings = _processor_settings(config)

    def sample(metadata, **kwargs):
        return Qwen3VLVideoProcessor.sample_frames(settings, metadata)

    if pyav_reader:
        video, metadata = read_video_pyav(str(path), sample_indices_fn=sample)
    else:
        frames, fps = decode_all_frames(path)
        metadata = VideoMetadata(total_num_frames=len(frames), fps=fps, height=frames.shape[1], width=frames.shape[2])
        metadata.frames_indices = sample(metadata)
        video = frames[metadata.frames_indices]
    x = torch.from_numpy(video).permute(0, 3, 1, 2).contiguous()
    height, width = hf_video_grid(x.shape[0], x.shape[2], x.shape[3], config)
    if (height, width) != tuple(x.shape[-2:]):
        size = [height, width]
        x = torch.nn.functional.interpolate(x, size=size, mode="bicubic", align_corners=False, antialias=True)
    mean, std, _ = TorchvisionBackend._fuse_mean_std_and_rescale_factor.__wrapped__(
        None, True, tuple(config.image_mean), tuple(config.image_std), True, config.rescale_factor, x.device
    )
    x = x.to(torch.float32).sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))
    patches, gt, gh, gw = Qwen3VLVideoProcessor.patchify(
        None, x[None], config.patch_size, config.merge_size, config.temporal_patch_size
    )
    grid = torch.tensor([[gt, gh, gw]])
    processor = SimpleNamespace(
        video_processor=SimpleNamespace(merge_size=config.merge_size, temporal_patch_size=config.temporal_patch_size),
        vision_start_token="<|vision_start|>",
        vision_end_token="<|vision_end|>",
        video_token="<|video_pad|>",
    )
    processor._calculate_timestamps = lambda *a: Qwen3VLProcessor._calculate_timestamps(processor, *a)
    text = Qwen3VLProcessor.replace_video_token(processor, {"video_grid_thw": grid, "video_metadata": [metadata]}, 0)
    return {
        "pixel_values": patches[0],
        "grid_thw": (gt, gh, gw),
        "indices": np.asarray(metadata.frames_indices),
        "fps": metadata.fps,
        "text": text,
    }


def hf_image_text(grid_thw: tuple[int, int, int], merge_size: int) -> str:
    """The text replacing one `<|image_pad|>` (transformers' Qwen3-VL processor)."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    processor = SimpleNamespace(image_processor=SimpleNamespace(merge_size=merge_size), image_token="<|image_pad|>")
    return Qwen3VLProcessor.replace_image_token(processor, {"image_grid_thw": torch.tensor([grid_thw])}, 0)


def write_video(path: Path, frames: np.ndarray, fps: int, codec: str = "mpeg4", options: dict | None = None) -> Path:
    """Encode RGB frames [N, H, W, 3] with PyAV (container from the file suffix)."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps, options=options or {})
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def moving_pattern(num_frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """Frames with gradients, edges and noise that move, so resizing and sampling both show."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    frames = []
    for t in range(num_frames):
        r = (x * 255 / max(width - 1, 1) + 9 * t) % 256
        g = (y * 255 / max(height - 1, 1) + 5 * t) % 256
        b = ((x // 6 + y // 6 + t) % 2) * 200
        noise = rng.normal(0, 12, (height, width, 3))
        frames.append(np.clip(np.stack([r, g, b], -1) + noise, 0, 255).astype(np.uint8))
    return np.stack(frames)

"""Videos -> patch rows and frame-pair timestamps, as transformers' Qwen3-VL video processor
(`Qwen3VLVideoProcessor` fed by its PyAV reader) computes them.

Steps: decode with PyAV (mp4, webm, mkv, mov, ... whatever codec FFmpeg decodes); pick
`frames / fps x 2` frames (clamped to 4..768 and to the frame count) uniformly spaced over the
whole clip; resize every picked frame with bicubic antialiased interpolation (torch's uint8 kernel,
which is what torchvision runs on the CPU) to one size chosen by `smart_resize` over the pixel
budget of all frames together; normalise as torchvision's fused rescale + normalise does
((x - 255 mean) / (255 std), float32); cut into patch rows, an odd frame count padded by repeating
the last frame. Each pair of frames becomes one group of tokens in the prompt, introduced by the
mean time of its two frames (`<1.2 seconds>`).

Frames are resized as they are decoded, so a long high-resolution clip never sits in memory at
its source size.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np
import torch
import torch.nn.functional as F

from .config import PreprocessConfig
from .image import patchify, smart_resize
from .limits import MediaError, MediaLimits
from .prepared import PreparedMedia

VideoSource = bytes | str | Path


def sample_indices(total_frames: int, fps: float, config: PreprocessConfig) -> np.ndarray:
    """Indices of the frames to use: `config.fps` per second of video, within [min_frames, max_frames]."""
    count = int(total_frames / fps * config.fps)
    count = min(max(count, config.min_frames), config.max_frames, total_frames)
    return np.linspace(0, total_frames - 1, count).round().astype(int)


def pair_timestamps(indices: np.ndarray, fps: float, temporal_patch_size: int) -> tuple[float, ...]:
    """Seconds of each temporal patch: the mean of its first and last frame's time (last frame repeated to fill)."""
    idx = list(indices) + [indices[-1]] * (-len(indices) % temporal_patch_size)
    times = [i / fps for i in idx]
    k = temporal_patch_size
    return tuple(float((times[i] + times[i + k - 1]) / 2) for i in range(0, len(times), k))


def resized_size(num_frames: int, height: int, width: int, config: PreprocessConfig, name: str) -> tuple[int, int]:
    """Frame size after resizing: sides below one merge window are first scaled up, then `smart_resize`
    over the budget of all frames."""
    factor = config.factor
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    return smart_resize(height, width, config, name, frames=num_frames, temporal_factor=config.temporal_patch_size)


def normalize_video(frames: torch.Tensor, config: PreprocessConfig) -> torch.Tensor:
    """uint8 [T, C, H, W] -> float32 (x - mean / rescale) / (std / rescale): torchvision's fused arithmetic."""
    shape = (-1, 1, 1)
    mean = (torch.tensor(config.image_mean) * (1.0 / config.rescale_factor)).view(shape)
    std = (torch.tensor(config.image_std) * (1.0 / config.rescale_factor)).view(shape)
    return (frames.float() - mean) / std


@dataclass
class _Stream:
    total_frames: int
    fps: float


def prepare_video(
    source: VideoSource, config: PreprocessConfig, limits: MediaLimits, name: str = "video"
) -> PreparedMedia:
    if isinstance(source, bytes):
        limits.check_bytes("video", len(source), name)
    try:
        return _prepare(source, config, limits, name)
    except av.FFmpegError as e:
        raise MediaError(
            f"{name}: cannot decode the video, the file is corrupt, truncated or unsupported ({e})"
        ) from None


def _prepare(source: VideoSource, config: PreprocessConfig, limits: MediaLimits, name: str) -> PreparedMedia:
    info = _probe(source, limits, name)
    indices = sample_indices(info.total_frames, info.fps, config)
    frames, decoded = _decode(source, indices, config, name)
    if len(frames) < len(indices):  # the header over-counted: sample again over the frames that exist
        indices = sample_indices(decoded, info.fps, config)
        frames, _ = _decode(source, indices, config, name)
    pixels = normalize_video(torch.stack(frames), config)
    rows, grid = patchify(pixels, config)
    timestamps = pair_timestamps(indices, info.fps, config.temporal_patch_size)
    return PreparedMedia("video", rows, grid, config.merge_size, timestamps)


def _open(source: VideoSource, name: str) -> av.container.InputContainer:
    try:
        container = av.open(io.BytesIO(source) if isinstance(source, bytes) else str(source))
    except av.FFmpegError as e:
        raise MediaError(f"{name}: not a video container FFmpeg reads ({e})") from None
    if not container.streams.video:
        container.close()
        raise MediaError(f"{name}: the file has no video stream")
    stream = container.streams.video[0]
    if stream.codec_context is None:
        container.close()
        raise MediaError(f"{name}: the video codec is not supported (no decoder for it in this FFmpeg build)")
    stream.thread_type = "AUTO"
    return container


def _probe(source: VideoSource, limits: MediaLimits, name: str) -> _Stream:
    with _open(source, name) as container:
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate
        if not rate:
            raise MediaError(f"{name}: the video does not state its frame rate")
        fps = float(rate)
        height, width = stream.height, stream.width
        if height < 1 or width < 1:
            raise MediaError(f"{name}: the video has no picture size ({width}x{height})")
        if height * width > limits.max_video_frame_pixels:
            raise MediaError(
                f"{name}: frames of {width}x{height} are over the limit of {limits.max_video_frame_pixels} pixels"
            )
        total = stream.frames
        if total <= 0:  # containers such as webm / mkv do not store a frame count
            total = sum(1 for _ in container.decode(stream))
        if total / fps > limits.max_video_seconds:
            raise MediaError(
                f"{name}: the video lasts {total / fps:.0f} s, over the limit of {limits.max_video_seconds:.0f} s"
            )
        if total < 1:
            raise MediaError(f"{name}: the video has no frames")
        return _Stream(total, fps)


def _decode(
    source: VideoSource, indices: np.ndarray, config: PreprocessConfig, name: str
) -> tuple[list[torch.Tensor], int]:
    """The picked frames ([C, H, W] uint8, resized to the size the first one sets) and how many
    frames were decoded."""
    if len(indices) < config.temporal_patch_size:
        raise MediaError(
            f"{name}: the video has {len(indices)} frame(s); at least {config.temporal_patch_size} are needed"
        )
    wanted, last = set(indices.tolist()), int(indices[-1])
    frames: list[torch.Tensor] = []
    decoded = 0
    source_shape: torch.Size | None = None
    size = (0, 0)
    with _open(source, name) as container:
        for i, frame in enumerate(container.decode(container.streams.video[0])):
            decoded = i + 1
            if i > last:
                break
            if i not in wanted:
                continue
            rgb = torch.from_numpy(frame.to_ndarray(format="rgb24")).permute(2, 0, 1)
            if source_shape is None:
                source_shape = rgb.shape
                size = resized_size(len(indices), rgb.shape[1], rgb.shape[2], config, name)
            elif rgb.shape != source_shape:
                raise MediaError(
                    f"{name}: the frame size changes inside the video ({tuple(source_shape)} -> {tuple(rgb.shape)})"
                )
            frames.append(_resize(rgb, size))
    return frames, decoded


def _resize(frame: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    if tuple(frame.shape[-2:]) == size:
        return frame
    return F.interpolate(frame[None].contiguous(), size=size, mode="bicubic", align_corners=False, antialias=True)[0]

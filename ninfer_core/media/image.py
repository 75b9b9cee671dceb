"""Images -> patch rows for the vision tower, exactly as transformers' Qwen2-VL/Qwen3-VL image
processor (the PIL backend, `Qwen2VLImageProcessorPil`) computes them.

Steps: decode the first frame with Pillow (png, jpeg, webp, gif, bmp, tiff, ...), apply the EXIF
orientation, composite any transparency onto white, resize with Pillow's bicubic filter to the
`smart_resize` size (sides multiples of patch x merge = 32, pixel count inside the checkpoint's
budget, aspect ratio kept), rescale to [0, 1] in float64 then float32, normalise with the
checkpoint's mean / std, and cut into patch rows. A still image is one temporal patch: its frame
is repeated to fill the 2 frames a patch row holds.
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from .config import PreprocessConfig
from .limits import MediaError, MediaLimits
from .prepared import PreparedMedia

MAX_ASPECT_RATIO = 200  # the processor's limit: longer / shorter side


def smart_resize(
    height: int,
    width: int,
    config: PreprocessConfig,
    name: str,
    frames: int = 1,
    temporal_factor: int = 1,
) -> tuple[int, int]:
    """The resized (height, width): multiples of `config.factor`, aspect ratio kept as closely as
    possible, pixel count within [min_pixels, max_pixels]. For video the budget covers all frames:
    the check uses the frame count rounded to `temporal_factor`, the scale the frame count itself
    (transformers' rule)."""
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise MediaError(
            f"{name}: aspect ratio {ratio:.0f}:1 ({width}x{height}) is over the model's limit of {MAX_ASPECT_RATIO}:1"
        )
    factor = config.factor
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > config.max_pixels:
        beta = math.sqrt(frames * height * width / config.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < config.min_pixels:
        beta = math.sqrt(config.min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def patchify(frames: torch.Tensor, config: PreprocessConfig) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """frames [T, C, H, W] (H, W multiples of patch x merge) -> rows [t*h*w, C*tp*P*P] and (t, h, w).

    T is padded to a multiple of the temporal patch by repeating the last frame. Row order: time,
    then 2x2 merge windows in raster order, then the patches inside a window (so each window's
    rows are contiguous); inside a row: channel, frame, patch row, patch column (the Conv3d order).
    """
    tp, p, m = config.temporal_patch_size, config.patch_size, config.merge_size
    if pad := -frames.shape[0] % tp:
        frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)])
    num_frames, channels, height, width = frames.shape
    gt, gh, gw = num_frames // tp, height // p, width // p
    x = frames.reshape(gt, tp, channels, gh // m, m, p, gw // m, m, p)
    # -> t, window row, window col, row in window, col in window, channel, frame, y in patch, x in patch
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, channels * tp * p * p).contiguous(), (gt, gh, gw)


def image_size(image: bytes | Path, limits: MediaLimits, name: str) -> tuple[int, int]:
    """(width, height) from the header alone, checked against the per-image pixel limit: what an
    image will cost is known before it is decoded."""
    with _opened(image, limits, name) as opened, opened:
        return opened.size


def open_image(data: bytes, limits: MediaLimits, name: str) -> Image.Image:
    """The first frame, upright (EXIF orientation applied), fully decoded; bad files -> MediaError."""
    limits.check_bytes("image", len(data), name)
    with _opened(data, limits, name) as image:
        image.load()
        return ImageOps.exif_transpose(image)


@contextmanager
def _opened(image: bytes | Path, limits: MediaLimits, name: str) -> Iterator[Image.Image]:
    """The image opened lazily (header read, nothing decoded), its size checked; Pillow's errors
    inside the block -> MediaError."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own pixel limit decides
            opened = Image.open(io.BytesIO(image) if isinstance(image, bytes) else image)
            width, height = opened.size
            if width < 1 or height < 1:
                raise MediaError(f"{name}: the image is empty ({width}x{height} pixels)")
            if width * height > limits.max_image_pixels:
                raise MediaError(
                    f"{name}: {width}x{height} is {width * height / 1e6:.0f} megapixels, over the limit of "
                    f"{limits.max_image_pixels / 1e6:.0f}"
                )
            yield opened
    except UnidentifiedImageError:
        raise MediaError(
            f"{name}: not an image Pillow can identify (png, jpeg, webp, gif, bmp, tiff, ...), "
            "or its header is invalid (e.g. a zero size)"
        ) from None
    except Image.DecompressionBombError as e:
        raise MediaError(f"{name}: {e}") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise MediaError(f"{name}: cannot decode the image, the file is corrupt or truncated ({e})") from None


def image_tokens(width: int, height: int, config: PreprocessConfig, name: str) -> int:
    """Language-model tokens of an image of this size: its resized area over one merge window's
    (orientation does not change it)."""
    resized_height, resized_width = smart_resize(height, width, config, name)
    return resized_height * resized_width // config.factor**2


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency (alpha band or palette transparency) composited onto white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def normalize_image(pixels: np.ndarray, config: PreprocessConfig) -> np.ndarray:
    """uint8 [H, W, C] -> float32, rescaled in float64 then normalised in float32 (the PIL processor's arithmetic)."""
    scaled = (pixels.astype(np.float64) * config.rescale_factor).astype(np.float32)
    mean = np.asarray(config.image_mean, dtype=np.float32)
    std = np.asarray(config.image_std, dtype=np.float32)
    return (scaled - mean) / std


def prepare_image(data: bytes, config: PreprocessConfig, limits: MediaLimits, name: str = "image") -> PreparedMedia:
    rgb = to_rgb(open_image(data, limits, name))
    height, width = smart_resize(rgb.height, rgb.width, config, name)
    resized = np.asarray(rgb.resize((width, height), Image.Resampling.BICUBIC))
    pixels = torch.from_numpy(normalize_image(resized, config)).permute(2, 0, 1)[None]
    rows, grid = patchify(pixels, config)
    return PreparedMedia("image", rows, grid, config.merge_size)

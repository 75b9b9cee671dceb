"""The quantized-weights artifact: a model's state after quantization, saved next to the checkpoint.

Quantizing a 35B checkpoint reads ~70 GB and runs a kernel per tensor; the artifact holds just
the result (~20 GB for int4), so a second start is one sequential read straight to the device.
It lives in `<checkpoint>/.ninfer/` (or the user cache when the checkpoint directory is read-only),
named by the recipe, the model dtype and a fingerprint of the checkpoint: the safetensors headers
(every tensor's name, dtype, shape and offsets), the file sizes and config.json. Hashing the
headers rather than 70 GB of data keeps the check instant; any re-export, re-quantization or edit
of the checkpoint changes the headers or the sizes. A damaged or stale artifact is ignored (and
rewritten), never trusted.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
from pathlib import Path

import torch
from safetensors.torch import load_file, load_model, save_file, save_model
from torch import nn

log = logging.getLogger(__name__)

ARTIFACT_DIR = ".ninfer"


def fingerprint(checkpoint: Path) -> str:
    digest = hashlib.sha256()
    for file in sorted(checkpoint.glob("*.safetensors")) + [checkpoint / "config.json"]:
        if not file.exists():
            continue
        digest.update(f"{file.name}\0{file.stat().st_size}\0".encode())
        with file.open("rb") as f:
            if file.suffix == ".safetensors":
                (length,) = struct.unpack("<Q", f.read(8))
                digest.update(f.read(min(length, 100 << 20)))
            else:
                digest.update(f.read())
    return digest.hexdigest()[:16]


def artifact_path(checkpoint: Path, recipe_key: str, dtype: torch.dtype) -> Path:
    name = f"{recipe_key}-{str(dtype).removeprefix('torch.')}-{fingerprint(checkpoint)}.safetensors"
    local = checkpoint / ARTIFACT_DIR
    if os.access(checkpoint, os.W_OK) or os.access(local, os.W_OK):
        return local / name
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ninfer" / "quantized"
    return cache / f"{checkpoint.name}-{name}"


def _mtp_path(path: Path) -> Path:
    return path.with_suffix(".mtp.safetensors")


def load(model: nn.Module, path: Path) -> bool:
    """Fill a (recipe-shaped, materialised) model from its artifact; False when there is none or it
    does not fit this model (then the caller quantizes from the checkpoint again)."""
    if not path.exists():
        return False
    device = next(model.parameters()).device
    try:
        missing, unexpected = load_model(model, path, strict=False, device=str(device))
        if missing or unexpected:
            raise ValueError(f"{len(missing)} missing and {len(unexpected)} unexpected tensors")
        if hasattr(model, "mtp_weights") and _mtp_path(path).exists():
            model.mtp_weights = load_file(_mtp_path(path))
    except Exception as exc:  # noqa: BLE001 - any damage means: rebuild from the checkpoint
        log.warning("ignoring the quantized artifact %s (%s); quantizing the checkpoint again", path, exc)
        return False
    log.info("loaded quantized weights from %s", path)
    return True


def save(model: nn.Module, path: Path) -> None:
    """Write the artifact atomically (temp file + rename); a failure only costs the next start time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        save_model(model, str(tmp))
        mtp = getattr(model, "mtp_weights", {})
        if mtp:
            mtp_tmp = _mtp_path(path).with_name(_mtp_path(path).name + ".tmp")
            save_file({k: v.contiguous() for k, v in mtp.items()}, str(mtp_tmp))
            mtp_tmp.replace(_mtp_path(path))
        tmp.replace(path)
    except OSError as exc:
        log.warning("could not save the quantized artifact %s: %s", path, exc)
        return
    log.info("saved quantized weights to %s", path)

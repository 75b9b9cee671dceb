"""A Hugging Face safetensors checkpoint directory, memory-mapped and read one tensor at a time.

Layouts: `model.safetensors.index.json` + shards, a single `model.safetensors`, or several
`*.safetensors` without an index. Opening parses only the headers (and checks them: shards
present, tensors where the index says, every FP8 weight with its scale), so a broken download
fails at once with the file named, while no tensor data is read until `get`.
Block-scaled FP8 weights are dequantized on `get`; their `*_scale_inv` companions are hidden.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..errors import ModelLoadError
from .fp8 import (
    DEQUANT_DEFAULT_DTYPE,
    FP8_DTYPES,
    SCALE_SUFFIX,
    block_size_from_quantization,
    dequantize_fp8,
    scale_name,
)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class Checkpoint:
    """Tensors by checkpoint name. `get` returns a tensor that may alias a private (copy-on-write)
    mapping of the file: the file never changes, but treat the result as read-only or copy it."""

    def __init__(
        self, directory: Path, files: dict[str, Path], handles: dict[Path, safe_open], block: tuple[int, int]
    ):
        self.directory = directory
        self._files = files
        self._handles = handles
        self._block = block
        self._fp8: set[str] = set()
        for name, path in files.items():
            if handles[path].get_slice(name).get_dtype() in FP8_DTYPES:
                if scale_name(name) not in files:
                    raise ModelLoadError(
                        f"{path}: FP8 weight '{name}' has no scale tensor '{scale_name(name)}' in the checkpoint"
                    )
                self._fp8.add(name)
        self._names = {n for n in files if not n.endswith(SCALE_SUFFIX)}

    def names(self) -> set[str]:
        """Every tensor name, FP8 scale tensors excluded."""
        return set(self._names)

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """One tensor, converted to `dtype` (FP8 weights dequantized; to bfloat16 when dtype is None)."""
        if name not in self._names:
            raise ModelLoadError(f"{self.directory}: tensor '{name}' not found in the checkpoint")
        tensor = self._read(name)
        if name in self._fp8:
            scale = self._read(scale_name(name))
            return dequantize_fp8(tensor, scale, self._block, dtype or DEQUANT_DEFAULT_DTYPE, name)
        return tensor if dtype is None else tensor.to(dtype)

    def _read(self, name: str) -> torch.Tensor:
        path = self._files[name]
        try:
            return self._handles[path].get_tensor(name)
        except SafetensorError as e:
            raise ModelLoadError(f"{path}: cannot read tensor '{name}' ({e})") from None


def _open_shards(paths: list[Path]) -> dict[Path, safe_open]:
    handles = {}
    for path in paths:
        try:
            handles[path] = safe_open(str(path), framework="pt")
        except SafetensorError as e:
            raise ModelLoadError(f"{path}: not a valid safetensors file, corrupt or truncated ({e})") from None
    return handles


def _files_from_index(index_path: Path) -> tuple[dict[str, Path], dict[Path, safe_open]]:
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{index_path}: not a valid safetensors index ({type(e).__name__}: {e})") from None
    if not isinstance(weight_map, dict):
        raise ModelLoadError(f"{index_path}: 'weight_map' must map tensor names to shard files")
    files = {name: index_path.parent / str(shard) for name, shard in weight_map.items()}
    for name, path in files.items():
        if not path.is_file():
            raise ModelLoadError(
                f"{index_path}: shard '{path.name}' (holding '{name}') not found (incomplete download?)"
            )
    handles = _open_shards(sorted(set(files.values())))
    stored = {path: set(handle.keys()) for path, handle in handles.items()}
    for name, path in files.items():
        if name not in stored[path]:
            raise ModelLoadError(f"{index_path}: tensor '{name}' is listed in {path.name} but not stored there")
    return files, handles


def _files_without_index(directory: Path) -> tuple[dict[str, Path], dict[Path, safe_open]]:
    single = directory / SINGLE_FILE
    paths = [single] if single.is_file() else sorted(directory.glob("*.safetensors"))
    if not paths:
        raise ModelLoadError(f"{directory}: no {INDEX_FILE} and no *.safetensors files")
    handles = _open_shards(paths)
    files: dict[str, Path] = {}
    for path, handle in handles.items():
        for name in handle.keys():
            if name in files:
                raise ModelLoadError(
                    f"{directory}: tensor '{name}' is stored in both {files[name].name} and {path.name}"
                )
            files[name] = path
    return files, handles


def open_checkpoint(model_dir: str | Path, quantization: dict | None = None) -> Checkpoint:
    """Open the safetensors of an HF checkpoint directory.

    `quantization` is the config's `quantization_config` (ModelConfig.quantization): it gives the
    FP8 block size (default 128 x 128) and rejects methods we cannot dequantize.
    """
    directory = Path(model_dir)
    if not directory.is_dir():
        raise ModelLoadError(f"{directory}: model directory not found")
    block = block_size_from_quantization(quantization, str(directory / "config.json"))
    index = directory / INDEX_FILE
    files, handles = _files_from_index(index) if index.is_file() else _files_without_index(directory)
    return Checkpoint(directory, files, handles, block)

"""llama.cpp's vision projector files for Qwen3.5 / 3.6 (architecture `clip`, projector
`qwen3vl_merger`): the vision tower's config, its preprocessing, and its tensors under the
tower's own names (the `load_weights` contract, like weights/vision_weights.py).

llama.cpp keeps a multimodal model's vision tower out of the text GGUF: its converter
(`convert_hf_to_gguf.py --mmproj`) writes it to a file of its own. What it changes is undone:
- names: `v.blk.N.{attn_qkv, attn_out, ln1, ln2, ffn_up, ffn_down}`, `v.post_ln` (the merger's
  norm), `mm.0` / `mm.2` (the merger's two linears), `v.patch_embd`, `v.position_embd`;
- the Conv3d patch kernel [out, C, 2, P, P] is stored as two Conv2d kernels, one per frame of a
  pair (`v.patch_embd.weight`, `.weight.1`): stacked back on the frame axis;
- config under `clip.vision.*`; `projection_dim` is the text model's width (the merger's output).
What the file does not carry keeps Qwen3.5's value: RoPE theta 1e4; LayerNorm epsilon 1e-6 (the
file's `attention.layer_norm_epsilon` is the text model's RMSNorm epsilon, which the converter
copies, while transformers' tower hard-codes 1e-6); the pixel budgets, frame rate and frame counts
of Qwen3.5's preprocessor config (the file keeps only mean and std).
"""

from __future__ import annotations

import re
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..config import MAX_WIDTH, ConfigFields
from ..errors import ModelLoadError
from ..media.config import MediaConfig
from ..models.vision import VisionConfig
from .gguf_reader import GGUFFile

if TYPE_CHECKING:
    import torch

PROJECTOR = "qwen3vl_merger"
_PATCH, _PATCH_NEXT_FRAME = "v.patch_embd.weight", "v.patch_embd.weight.1"
_BLOCK_PARTS = {
    "attn_qkv": "attn.qkv", "attn_out": "attn.proj", "ln1": "norm1", "ln2": "norm2",
    "ffn_up": "mlp.linear_fc1", "ffn_down": "mlp.linear_fc2",
}
_GLOBAL = {
    "v.patch_embd.bias": "patch_embed.proj.bias", "v.position_embd.weight": "pos_embed.weight",
    "v.post_ln.weight": "merger.norm.weight", "v.post_ln.bias": "merger.norm.bias",
    "mm.0.weight": "merger.linear_fc1.weight", "mm.0.bias": "merger.linear_fc1.bias",
    "mm.2.weight": "merger.linear_fc2.weight", "mm.2.bias": "merger.linear_fc2.bias",
}
_BLOCK_RE = re.compile(r"v\.blk\.(\d+)\.(\w+)\.(weight|bias)")


def tower_name(gguf_name: str) -> str | None:
    """`v.blk.3.ffn_up.weight` -> `blocks.3.mlp.linear_fc1.weight`; None for names we do not know
    (the two patch kernels are read together as `patch_embed.proj.weight`)."""
    if gguf_name in (_PATCH, _PATCH_NEXT_FRAME):
        return "patch_embed.proj.weight"
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m:
        part = _BLOCK_PARTS.get(m.group(2))
        return f"blocks.{m.group(1)}.{part}.{m.group(3)}" if part else None
    return _GLOBAL.get(gguf_name)


class MmprojFile(GGUFFile):
    """One opened vision projector file; `text_width`: the text model's hidden size it must feed."""

    def __init__(self, path: str | Path, text_width: int):
        super().__init__(path)
        arch, kind = self.metadata("general.architecture"), self.metadata("clip.projector_type")
        if arch != "clip" or not self.metadata("clip.has_vision_encoder", False):
            raise ModelLoadError(f"{self.path}: not a vision projector (mmproj) file (architecture '{arch}')")
        if kind != PROJECTOR:
            raise ModelLoadError(f"{self.path}: a '{kind}' vision projector; Qwen3.5 / 3.6 need '{PROJECTOR}'")
        if any(self.metadata("clip.vision.is_deepstack_layers") or []):
            raise ModelLoadError(f"{self.path}: vision towers with deepstack layers (Qwen3-VL) are not supported")
        self._tensors = {t.name: t for t in self.tensors}
        unknown = [name for name in self._tensors if tower_name(name) is None]
        if unknown:
            raise ModelLoadError(f"{self.path}: unknown vision tensors: {', '.join(unknown[:8])}")
        for name in (_PATCH, _PATCH_NEXT_FRAME, "v.position_embd.weight"):
            if name not in self._tensors:
                raise ModelLoadError(f"{self.path}: no tensor '{name}'")
        if len(self._shape(_PATCH)) != 4 or self._shape(_PATCH) != self._shape(_PATCH_NEXT_FRAME):
            raise ModelLoadError(f"{self.path}: the two patch kernels must be [out, channels, patch, patch] alike")
        self._sources = {tower_name(n): n for n in self._tensors if n not in (_PATCH, _PATCH_NEXT_FRAME)}
        if self.config.out_hidden_size != text_width:
            raise ModelLoadError(
                f"{self.path}: this projector feeds a text model {self.config.out_hidden_size} wide, the model "
                f"is {text_width} wide (a projector of another model?)"
            )

    @cached_property
    def config(self) -> VisionConfig:
        f = ConfigFields(lambda key: self.metadata(f"clip.vision.{key}"), str(self.path), "clip.vision.")
        if self.metadata("clip.use_gelu"):  # ggml_gelu is the tanh approximation, Qwen3.5's
            act = "gelu_pytorch_tanh"
        elif self.metadata("clip.use_silu"):
            act = "silu"
        else:
            raise ModelLoadError(f"{self.path}: the vision blocks' activation is neither GELU nor SiLU")
        return VisionConfig.from_hf_dict(dict(
            depth=f.integer("block_count"),
            hidden_size=f.integer("embedding_length", high=MAX_WIDTH),
            intermediate_size=f.integer("feed_forward_length", high=MAX_WIDTH),
            num_heads=f.integer("attention.head_count"),
            out_hidden_size=f.integer("projection_dim", high=MAX_WIDTH),
            num_position_embeddings=self._shape("v.position_embd.weight")[0],
            patch_size=f.integer("patch_size"),
            temporal_patch_size=2,  # one kernel per frame of a pair
            spatial_merge_size=f.integer("spatial_merge_size", 2),
            in_channels=self._shape(_PATCH)[1],  # [out, C, P, P]
            hidden_act=act,
        ), str(self.path))

    def media_config(self) -> MediaConfig:
        """Qwen3.5's preprocessing with the file's mean, std, patch and merge sizes."""
        mean, std = self.metadata("clip.vision.image_mean"), self.metadata("clip.vision.image_std")
        shared = dict(patch_size=self.config.patch_size, merge_size=self.config.spatial_merge_size,
                      **({"image_mean": mean, "image_std": std} if mean is not None and std is not None else {}))
        return MediaConfig.from_dicts(shared, shared, str(self.path))

    def _shape(self, gguf_name: str) -> tuple[int, ...]:
        return tuple(int(s) for s in reversed(self._tensors[gguf_name].shape.tolist()))

    # ---- the tower's tensors (names / get, as VisionTower.load_weights reads them) --------------

    def names(self) -> set[str]:
        return {"patch_embed.proj.weight", *self._sources}

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        import torch

        if name == "patch_embed.proj.weight":  # [out, C, 2, P, P]: the Conv3d's layout
            values = np.stack([self._values(self._tensors[n]) for n in (_PATCH, _PATCH_NEXT_FRAME)], axis=2)
        elif name in self._sources:
            values = self._values(self._tensors[self._sources[name]])
        else:
            raise ModelLoadError(f"{self.path}: vision tensor '{name}' not found")
        w = torch.from_numpy(values)
        return w if dtype is None else w.to(dtype)

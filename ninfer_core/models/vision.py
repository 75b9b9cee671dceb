"""The Qwen3.5 / Qwen3.6 vision tower (Qwen3-VL design without deepstack): patch rows -> LLM embeddings.

    x = patch_embed(rows) + position_table(grid)            Conv3d (2 x 16 x 16, stride = kernel) as
                                                            a Linear over the 1536-value rows
    for each block:                                         pre-LayerNorm ViT block
        x += proj(attention(rope2d(q), rope2d(k), v))      bidirectional, within one image / one
                                                            frame pair of a video
        x += fc2(gelu_tanh(fc1(norm2(x))))
    out = fc2(gelu(fc1(flatten_2x2(norm(x)))))              merger: 4 patches -> one LLM token

Position table: a learned side x side grid (48 x 48), bilinearly resampled (align_corners) to the
image's patch grid. 2-D rotary: head_dim / 4 frequencies (theta 1e4) rotated by the patch row,
as many by the column, laid out rotate-half over the whole head. Patch rows arrive with each 2x2
merge window contiguous (see media.image.patchify), so positions follow that order and the
merger only has to reshape.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelLoadError
from ..layers.rope import apply_rotary

Grid = tuple[int, int, int]
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "silu": F.silu,
}


@dataclass(frozen=True)
class VisionConfig:
    depth: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_heads: int = 16
    out_hidden_size: int = 2048
    num_position_embeddings: int = 2304
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    layer_norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_values(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def grid_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], where: str) -> "VisionConfig":
        """From a checkpoint's `vision_config` (sizes that are not given keep Qwen3.5's values)."""
        if raw.get("deepstack_visual_indexes"):
            raise ModelLoadError(f"{where}: vision towers with deepstack layers (Qwen3-VL) are not supported")
        rope = raw.get("rope_parameters") or {}
        fields = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        if "rope_theta" in rope:
            fields["rope_theta"] = rope["rope_theta"]
        try:
            config = cls(**fields)
        except TypeError as e:
            raise ModelLoadError(f"{where}: bad vision_config ({e})") from None
        if config.hidden_act not in ACTIVATIONS:
            raise ModelLoadError(
                f"{where}: unsupported vision hidden_act '{config.hidden_act}' (supported: {', '.join(ACTIVATIONS)})"
            )
        if config.grid_side**2 != config.num_position_embeddings:
            raise ModelLoadError(f"{where}: num_position_embeddings {config.num_position_embeddings} is not a square")
        if config.hidden_size % config.num_heads or config.head_dim % 4:
            raise ModelLoadError(
                f"{where}: vision head size {config.hidden_size}/{config.num_heads} must be a multiple of 4"
            )
        return config

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "VisionConfig":
        path = Path(model_dir) / "config.json"
        raw = read_config_json(path)
        if "vision_config" not in raw:
            raise ModelLoadError(f"{path}: the model has no vision tower (no vision_config)")
        return cls.from_hf_dict(raw["vision_config"], str(path))


def read_config_json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return raw


def merge_order(height: int, width: int, merge: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of each patch of an height x width grid in patch-row order (2x2 windows contiguous)."""
    rows = torch.arange(height, device=device).view(height // merge, merge, 1, 1).expand(-1, -1, width // merge, merge)
    cols = torch.arange(width, device=device).view(1, 1, width // merge, merge).expand(height // merge, merge, -1, -1)
    return rows.transpose(1, 2).reshape(-1), cols.transpose(1, 2).reshape(-1)


class PatchEmbed(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.proj = nn.Linear(config.patch_values, config.hidden_size)  # the Conv3d, flattened (C, T, P, P)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.proj(rows)


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)  # [N, heads, d] each
        q = apply_rotary(q[None].float(), cos[None], sin[None])[0].to(v.dtype)
        k = apply_rotary(k[None].float(), cos[None], sin[None])[0].to(v.dtype)
        out = torch.empty_like(q)
        start = 0
        for t, h, w in grids:  # attention stays inside one image / one frame pair: batch the frames
            end = start + t * h * w
            qs, ks, vs = (z[start:end].view(t, h * w, self.num_heads, -1).transpose(1, 2) for z in (q, k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs)  # [t, heads, hw, d]
            out[start:end] = o.transpose(1, 2).reshape(end - start, self.num_heads, -1)
            start = end
        return self.proj(out.reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attn = VisionAttention(config)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, grids)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        merged = config.hidden_size * config.spatial_merge_size**2
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.linear_fc1 = nn.Linear(merged, merged)
        self.linear_fc2 = nn.Linear(merged, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).view(-1, self.linear_fc1.in_features)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionTower(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)

    def forward(self, pixel_values: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        """pixel_values [sum t*h*w, patch_values] (items concatenated), one grid per item
        -> [sum t*h*w / 4, out_hidden_size]."""
        expected = sum(t * h * w for t, h, w in grids)
        if pixel_values.shape != (expected, self.config.patch_values):
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)} do not match grids {list(grids)}")
        weight = self.patch_embed.proj.weight
        x = self.patch_embed(pixel_values.to(weight.device, weight.dtype))
        x = x + self.position_table(grids).to(x.dtype)
        cos, sin = self.rotary(grids)
        for block in self.blocks:
            x = block(x, cos, sin, grids)
        return self.merger(x)

    def position_table(self, grids: Sequence[Grid]) -> torch.Tensor:
        """The learned side x side table resampled to each grid (float32), in patch-row order, per frame."""
        side, m = self.config.grid_side, self.config.spatial_merge_size
        table = self.pos_embed.weight.float().view(side, side, -1).permute(2, 0, 1)[None]
        parts = []
        for t, h, w in grids:
            resampled = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]  # [hidden, h, w]
            rows, cols = merge_order(h, w, m, table.device)
            parts.append(resampled[:, rows, cols].T.repeat(t, 1))
        return torch.cat(parts)

    def rotary(self, grids: Sequence[Grid]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, head_dim] (float32): angles of the patch row then column, rotate-half layout."""
        device = self.pos_embed.weight.device
        half = self.config.head_dim // 2  # each axis gets half / 2 frequencies
        inv_freq = 1.0 / self.config.rope_theta ** (torch.arange(0, half, 2, device=device).float() / half)
        angles = []
        for t, h, w in grids:
            rows, cols = merge_order(h, w, self.config.spatial_merge_size, device)
            per_frame = torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], dim=-1)
            angles.append(per_frame.repeat(t, 1))
        emb = torch.cat(angles).repeat(1, 2)
        return emb.cos(), emb.sin()

    @torch.no_grad()
    def load_weights(self, get: Callable[[str], torch.Tensor], names: set[str]) -> None:
        """Copy each parameter from the tensor of the same name (the patch-embed Conv3d kernel flattened)."""
        for name, param in self.named_parameters():
            if name not in names:
                raise ModelLoadError(
                    f"checkpoint is missing vision tensor '{name}' (expected shape {tuple(param.shape)})"
                )
            tensor = get(name)
            if name == "patch_embed.proj.weight" and tensor.numel() == param.numel():
                tensor = tensor.reshape(param.shape)
            if tuple(tensor.shape) != tuple(param.shape):
                raise ModelLoadError(
                    f"vision tensor '{name}' has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
                )
            param.copy_(tensor)


class TowerWeights(Protocol):
    """The tower's tensors by its own parameter names: a checkpoint's `model.visual.*`
    (weights/vision_weights.py) or llama.cpp's projector file (weights/gguf_mmproj.py)."""

    def names(self) -> set[str]: ...
    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor: ...


def load_vision_tower(
    config: VisionConfig, weights: TowerWeights, device: torch.device, dtype: torch.dtype
) -> VisionTower:
    """Build the tower on `device` in `dtype` and fill it from `weights`."""
    with torch.device("meta"):
        tower = VisionTower(config).to(dtype)
    tower = tower.to_empty(device=device)
    tower.load_weights(lambda name: weights.get(name, dtype), weights.names())
    return tower.eval()

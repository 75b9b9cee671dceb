"""The vision tower against transformers' Qwen3.5 vision model (fp32, tiny random configs).

Reference: `Qwen3_5MoeVisionModel` / `Qwen3_5VisionModel` (the merger output, `pooler_output`)
on packed inputs of several items: images of different grids (one not square, one larger than
the learned position grid, one smaller) and a video of several frame pairs, so the position-table
resampling, the 2-D rotary, the per-item / per-frame attention and the merge order all show.
"""

from __future__ import annotations

import pytest
import torch

from hf_reference import assert_close_rel
from ninfer_core.errors import ModelLoadError
from ninfer_core.models.vision import VisionConfig, VisionTower, load_vision_tower
from ninfer_core.weights.checkpoint import open_checkpoint
from ninfer_core.weights.vision_weights import VisionWeights
from tiny_checkpoints import write_tiny_qwen

TINY = dict(
    depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=40, num_position_embeddings=25,
    patch_size=4, temporal_patch_size=2, spatial_merge_size=2, in_channels=3,
)
GRIDS = [(1, 6, 10), (3, 4, 4), (1, 12, 8), (1, 2, 2)]


def hf_vision(moe: bool, seed: int = 0):
    if moe:
        from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeVisionConfig as Config
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel as Model
    else:
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig as Config
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel as Model
    config = Config(**TINY)
    config._attn_implementation = "sdpa"
    model = Model(config).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p[0].numel() ** 0.5)
    return model


def ours_from(hf_model) -> VisionTower:
    tower = VisionTower(VisionConfig.from_hf_dict(hf_model.config.to_dict(), "test")).float().eval()
    state = hf_model.state_dict()
    tower.load_weights(state.__getitem__, set(state))
    return tower


def pixels(grids, seed: int = 1) -> torch.Tensor:
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("moe", [True, False])
def test_tower_matches_transformers(moe):
    hf = hf_vision(moe)
    ours = ours_from(hf)
    x = pixels(GRIDS)
    with torch.no_grad():
        expected = hf(x, grid_thw=torch.tensor(GRIDS)).pooler_output
        actual = ours(x, GRIDS)
    assert actual.shape == (sum(t * h * w for t, h, w in GRIDS) // 4, TINY["out_hidden_size"])
    assert_close_rel(actual, expected, 1e-5)


def test_items_do_not_attend_to_each_other():
    """Each item's output depends only on its own patches (and a video's frame pairs only on themselves)."""
    ours = ours_from(hf_vision(True))
    x = pixels(GRIDS)
    with torch.no_grad():
        together = ours(x, GRIDS)
        first = ours(x[:60], GRIDS[:1])
        video_pair = ours(x[60:76], [(1, 4, 4)])
    assert_close_rel(together[:15], first, 1e-6)
    assert_close_rel(together[15:19], video_pair, 1e-6)


def test_load_vision_tower_from_checkpoint(tmp_path):
    hf = write_tiny_qwen(tmp_path, moe=True, multimodal=True, shard_size="40KB")
    weights = VisionWeights(open_checkpoint(tmp_path))
    tower = load_vision_tower(VisionConfig.from_model_dir(tmp_path), weights, torch.device("cpu"), torch.float32)
    grids = [(1, 4, 6), (2, 2, 2)]
    x = torch.randn(sum(t * h * w for t, h, w in grids), tower.config.patch_values)
    with torch.no_grad():
        expected = hf.model.visual(x, grid_thw=torch.tensor(grids)).pooler_output
        actual = tower(x, grids)
    assert_close_rel(actual, expected, 1e-5)


def test_bad_vision_configs():
    with pytest.raises(ModelLoadError, match="deepstack"):
        VisionConfig.from_hf_dict({"deepstack_visual_indexes": [8, 16, 24]}, "cfg")
    with pytest.raises(ModelLoadError, match="not a square"):
        VisionConfig.from_hf_dict({"num_position_embeddings": 20}, "cfg")
    with pytest.raises(ModelLoadError, match="hidden_act"):
        VisionConfig.from_hf_dict({"hidden_act": "relu6"}, "cfg")
    tower = VisionTower(VisionConfig(**TINY))
    with pytest.raises(ModelLoadError, match="missing vision tensor 'merger.norm.weight'"):
        state = {k: v for k, v in tower.state_dict().items() if k != "merger.norm.weight"}
        tower.load_weights(state.__getitem__, set(state))


def test_real_shape_defaults():
    """Qwen3.5's tower: 1536-value rows, 48 x 48 position grid, head 72, 4 x 1152 -> 2048 merger."""
    config = VisionConfig()
    assert (config.patch_values, config.grid_side, config.head_dim) == (1536, 48, 72)
    with torch.device("meta"):
        tower = VisionTower(config)
    assert tower.merger.linear_fc1.weight.shape == (4608, 4608)
    assert tower.merger.linear_fc2.weight.shape == (2048, 4608)


@pytest.mark.cuda
def test_tower_bf16_on_gpu_close_to_fp32():
    hf = hf_vision(True)
    ours = ours_from(hf)
    x = pixels(GRIDS)
    with torch.no_grad():
        expected = ours(x, GRIDS)
        actual = ours.to("cuda", torch.bfloat16)(x.cuda(), GRIDS).float().cpu()
    assert_close_rel(actual, expected, 3e-2)

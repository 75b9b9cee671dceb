"""Checkpoint loading: every HF layout gives the reference model's tensors under canonical names,
FP8 dequantization matches float64 math and transformers, bad directories fail with the file or
tensor named, and tensor data is read only on `get`."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tiny_checkpoints import (
    canonical_reference,
    dequantize_reference,
    write_tiny_qwen,
)

from ninfer_core.config import load_config
from ninfer_core.errors import ModelLoadError
from ninfer_core.weights.checkpoint import open_checkpoint
from ninfer_core.weights.expert_layout import fuse_experts
from ninfer_core.weights.fp8 import dequantize_fp8
from ninfer_core.weights.text_weights import TextWeights

LAYOUTS = {
    "moe-multimodal-fused": dict(moe=True, multimodal=True, experts="fused"),
    "moe-multimodal-per_expert-sharded-bf16": dict(
        moe=True, multimodal=True, experts="per_expert", shard_size="20KB", dtype=torch.bfloat16
    ),
    "moe-text-fused-sharded": dict(moe=True, multimodal=False, experts="fused", shard_size="30KB"),
    "moe-text-per_expert": dict(moe=True, multimodal=False, experts="per_expert"),
    "dense-multimodal": dict(moe=False, multimodal=True),
    "dense-text-sharded-bf16": dict(moe=False, multimodal=False, shard_size="10KB", dtype=torch.bfloat16),
    "moe-multimodal-fp8": dict(moe=True, multimodal=True, experts="per_expert", fp8=True, dtype=torch.bfloat16),
    "dense-text-fp8-sharded": dict(moe=False, multimodal=False, fp8=True, shard_size="20KB"),
}


def _open(directory: Path) -> TextWeights:
    return TextWeights(open_checkpoint(directory, load_config(directory).quantization))


def _stored_dtypes(directory: Path) -> dict[str, str]:
    out = {}
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            out.update({name: f.get_slice(name).get_dtype() for name in f.keys()})
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_gives_reference_tensors(tmp_path: Path, layout: str):
    kw = LAYOUTS[layout]
    model = write_tiny_qwen(tmp_path, seed=list(LAYOUTS).index(layout), **kw)
    stored = _stored_dtypes(tmp_path)
    # the checkpoint really has the layout under test
    assert any(".experts.0.gate_proj.weight" in n for n in stored) == (kw.get("experts") == "per_expert" and kw["moe"])
    assert any(n.endswith(".experts.gate_up_proj") for n in stored) == (kw.get("experts") == "fused" and kw["moe"])
    assert ("F8_E4M3" in stored.values()) == kw.get("fp8", False)
    assert any(n.startswith("model.visual.") for n in stored) == kw["multimodal"]
    assert (tmp_path / "model.safetensors.index.json").is_file() == (kw.get("shard_size") is not None)

    weights = _open(tmp_path)
    reference = canonical_reference(model)
    assert weights.names() == set(reference)
    assert any(n.startswith("mtp.layers.0.") for n in reference) and "lm_head.weight" in reference
    for name, expected in reference.items():
        got = weights.get(name, torch.float32)
        assert got.dtype == torch.float32 and got.shape == expected.shape, name
        assert torch.equal(got, expected), name


def test_default_dtype_is_stored_dtype_and_fp8_becomes_bf16(tmp_path: Path):
    model = write_tiny_qwen(tmp_path, moe=True, multimodal=False, experts="per_expert", fp8=True, dtype=torch.float16)
    weights = _open(tmp_path)
    reference = canonical_reference(model)
    assert weights.get("embed_tokens.weight").dtype == torch.float16
    fp8_names = (
        "layers.3.self_attn.q_proj.weight", "layers.0.mlp.experts.gate_up_proj", "mtp.layers.0.mlp.experts.down_proj"
    )
    for name in fp8_names:
        got = weights.get(name)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, reference[name].to(torch.bfloat16)), name


@pytest.mark.parametrize("multimodal", [True, False])
@pytest.mark.parametrize("experts", ["fused", "per_expert"])
def test_tiny_writer_layouts_load_in_transformers(tmp_path: Path, multimodal: bool, experts: str):
    """The writer's fused layout (Qwen's BF16 releases) and per-expert layout (transformers'
    save_pretrained) both load into transformers as exactly the reference weights."""
    import transformers as tf

    model = write_tiny_qwen(tmp_path, moe=True, multimodal=multimodal, experts=experts, mtp=False)
    cls = tf.Qwen3_5MoeForConditionalGeneration if multimodal else tf.Qwen3_5MoeForCausalLM
    loaded = cls.from_pretrained(tmp_path).state_dict()
    expected = model.state_dict()
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)


def _random_fp8(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    bits = torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)
    bits[(bits & 0x7F) == 0x7F] = 0x42  # 0x7F / 0xFF are NaN in e4m3fn
    return bits.view(torch.float8_e4m3fn)


@pytest.mark.parametrize(
    "shape,block,scale_dtype",
    [
        ((40, 50), (16, 24), torch.float32),  # partial blocks on both edges, rectangular block
        ((133, 263), (128, 128), torch.bfloat16),  # Qwen's block, partial edges
        ((256, 128), (128, 128), torch.float32),  # exact multiple
        ((3, 40, 50), (16, 24), torch.float32),  # stacked experts, one scale grid each
    ],
)
def test_fp8_dequant_matches_float64_and_transformers(shape, block, scale_dtype):
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    g = torch.Generator().manual_seed(sum(shape))
    q = _random_fp8(shape, g)
    grid = (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))
    scale = (torch.rand(grid, generator=g) * 4 + 1e-3).to(scale_dtype)
    got = dequantize_fp8(q, scale, block, torch.float32, "w.weight")
    expected = dequantize_reference(q, scale, block)
    torch.testing.assert_close(got.double(), expected, rtol=2e-7, atol=0)
    torch.testing.assert_close(got, _dequantize_fp8_weight(q, scale, list(block), torch.float32), rtol=2e-7, atol=0)
    assert torch.equal(dequantize_fp8(q, scale, block, torch.bfloat16, "w.weight"), got.to(torch.bfloat16))


def test_fp8_per_tensor_scale_and_bad_scale_shape():
    g = torch.Generator().manual_seed(1)
    q = _random_fp8((20, 30), g)
    got = dequantize_fp8(q, torch.tensor([0.5]), (16, 16), torch.float32, "w.weight")
    assert torch.equal(got, q.float() * 0.5)
    with pytest.raises(ModelLoadError, match=r"w\.weight_scale_inv.*\(2, 2\)"):
        dequantize_fp8(q, torch.ones(1, 2), (16, 16), torch.float32, "w.weight")


# ---- errors -------------------------------------------------------------------------------


def _sharded(tmp_path: Path) -> Path:
    write_tiny_qwen(tmp_path, moe=True, multimodal=True, experts="per_expert", shard_size="20KB", mtp=False)
    return tmp_path


def test_missing_directory(tmp_path: Path):
    with pytest.raises(ModelLoadError, match="nowhere.*not found"):
        open_checkpoint(tmp_path / "nowhere")


def test_missing_config_json(tmp_path: Path):
    write_tiny_qwen(tmp_path, moe=False, multimodal=False, mtp=False)
    (tmp_path / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_config(tmp_path)


def test_no_safetensors(tmp_path: Path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        open_checkpoint(tmp_path)


def test_index_references_missing_shard(tmp_path: Path):
    directory = _sharded(tmp_path)
    shard = sorted(directory.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=f"model.safetensors.index.json.*{shard.name}"):
        open_checkpoint(directory)


def test_index_lists_tensor_absent_from_shard(tmp_path: Path):
    directory = _sharded(tmp_path)
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = index["weight_map"]["lm_head.weight"]
    index["weight_map"]["model.language_model.layers.9.ghost.weight"] = shard
    index_path.write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=rf"layers\.9\.ghost\.weight.*{shard}"):
        open_checkpoint(directory)


def test_invalid_index_json(tmp_path: Path):
    directory = _sharded(tmp_path)
    (directory / "model.safetensors.index.json").write_text("{ not json")
    with pytest.raises(ModelLoadError, match="model.safetensors.index.json"):
        open_checkpoint(directory)


@pytest.mark.parametrize("damage", ["bad_header", "truncated", "empty"])
def test_corrupt_shard(tmp_path: Path, damage: str):
    directory = _sharded(tmp_path)
    shard = sorted(directory.glob("model-*.safetensors"))[2]
    data = shard.read_bytes()
    damaged = {"bad_header": data[:8] + b"#" * 16 + data[24:], "truncated": data[: len(data) - 100], "empty": b""}
    shard.write_bytes(damaged[damage])
    with pytest.raises(ModelLoadError, match=f"{shard.name}.*(corrupt|truncated)"):
        open_checkpoint(directory)


def test_same_tensor_in_two_files_without_index(tmp_path: Path):
    save_file({"a": torch.zeros(2), "b": torch.zeros(2)}, tmp_path / "one.safetensors")
    save_file({"a": torch.ones(2)}, tmp_path / "two.safetensors")
    with pytest.raises(ModelLoadError, match="'a'.*one.safetensors.*two.safetensors"):
        open_checkpoint(tmp_path)


def test_missing_tensor(tmp_path: Path):
    write_tiny_qwen(tmp_path, moe=True, multimodal=True, mtp=False)
    checkpoint = open_checkpoint(tmp_path)
    with pytest.raises(ModelLoadError, match="'model.nope.weight' not found"):
        checkpoint.get("model.nope.weight")
    with pytest.raises(ModelLoadError, match=r"'layers\.99\.mlp\.gate\.weight' not found"):
        TextWeights(checkpoint).get("layers.99.mlp.gate.weight")


def test_missing_expert_tensor(tmp_path: Path):
    write_tiny_qwen(tmp_path, moe=True, multimodal=True, experts="per_expert", mtp=False)
    path = tmp_path / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        tensors = {n: f.get_tensor(n).clone() for n in f.keys()}
    del tensors["model.language_model.layers.2.mlp.experts.1.up_proj.weight"]
    save_file(tensors, path)
    missing = r"'model\.language_model\.layers\.2\.mlp\.experts\.1\.up_proj\.weight' not found"
    with pytest.raises(ModelLoadError, match=missing):
        TextWeights(open_checkpoint(tmp_path))


def test_expert_shape_mismatch_and_mixed_layouts():
    names = {f"layers.0.mlp.experts.{e}.{p}.weight": f"model.layers.0.mlp.experts.{e}.{p}.weight"
             for e in range(2) for p in ("gate_proj", "up_proj", "down_proj")}
    shapes = {src: (5, 8) if "down" not in src else (8, 5) for src in names.values()}
    shapes["model.layers.0.mlp.experts.1.up_proj.weight"] = (6, 8)
    _, fused = fuse_experts(names)
    with pytest.raises(ModelLoadError, match=r"experts\.1\.up_proj\.weight.*\(6, 8\)"):
        fused["layers.0.mlp.experts.gate_up_proj"].load(lambda src: torch.zeros(shapes[src]))
    with pytest.raises(ModelLoadError, match="experts.gate_up_proj' is stored both fused and per expert"):
        fuse_experts({**names, "layers.0.mlp.experts.gate_up_proj": "model.layers.0.mlp.experts.gate_up_proj"})


def test_fp8_weight_without_scale(tmp_path: Path):
    write_tiny_qwen(tmp_path, moe=False, multimodal=False, fp8=True, mtp=False)
    path = tmp_path / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        tensors = {n: f.get_tensor(n).clone() for n in f.keys()}
    del tensors["model.layers.1.linear_attn.in_proj_qkv.weight_scale_inv"]
    save_file(tensors, path)
    expected = r"model\.safetensors.*'model\.layers\.1\.linear_attn\.in_proj_qkv\.weight'.*weight_scale_inv"
    with pytest.raises(ModelLoadError, match=expected):
        open_checkpoint(tmp_path, load_config(tmp_path).quantization)


def test_unsupported_quantization_method(tmp_path: Path):
    write_tiny_qwen(tmp_path, moe=False, multimodal=False, mtp=False)
    with pytest.raises(ModelLoadError, match="config.json.*'awq'"):
        open_checkpoint(tmp_path, {"quant_method": "awq", "bits": 4})


# ---- laziness -------------------------------------------------------------------------------


def _resident_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20


def test_open_and_names_do_not_read_tensor_data(tmp_path: Path):
    """Opening a 96 MB checkpoint maps it without reading it; resident memory grows only when
    a tensor is fetched and touched (the second half checks that the measurement can see it)."""
    save_file({"big": torch.ones(24 * 2**20), "small": torch.ones(4)}, tmp_path / "model.safetensors")
    gc.collect()
    before = _resident_mb()
    checkpoint = open_checkpoint(tmp_path)
    assert checkpoint.names() == {"big", "small"}
    assert checkpoint.get("small").sum() == 4
    opened = _resident_mb()
    assert opened - before < 16, f"opening read {opened - before:.0f} MB"
    assert checkpoint.get("big").sum() == 24 * 2**20
    assert _resident_mb() - opened > 64


def test_get_reads_the_file_at_call_time(tmp_path: Path):
    path = tmp_path / "model.safetensors"
    save_file({"t": torch.zeros(4)}, path)
    checkpoint = open_checkpoint(tmp_path)
    with path.open("r+b") as f:  # rewrite the tensor bytes in place after opening
        header_len = int.from_bytes(f.read(8), "little")
        f.seek(8 + header_len)
        f.write(torch.arange(4, dtype=torch.float32).numpy().tobytes())
    assert torch.equal(checkpoint.get("t"), torch.arange(4, dtype=torch.float32))

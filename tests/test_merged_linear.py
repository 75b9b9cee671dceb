"""Merged projections (`layers/linear.py`): one GEMM equals its separate parts, in fp32 and
quantized, and a checkpoint with separate tensors loads into the merged layout and round-trips
through `state_dict()` (the quantized artifact's format)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from ninfer_core.config import load_config
from ninfer_core.layers.linear import MergedLinear, load_parameters, merged_sources, source_names
from ninfer_core.models.loader import build_model, load_model
from ninfer_core.models.quantize import QuantRecipe
from ninfer_core.ops.quant import QuantLinear
from tiny_checkpoints import canonical_reference
from tiny_model_dir import WIDE, write_tiny_model_dir

PARTS = {"q_proj": 96, "k_proj": 32, "v_proj": 32}


def separate_and_merged(bias: bool) -> tuple[dict[str, nn.Linear], nn.Module]:
    """Three random Linears, and a holder whose `qkv_proj` was loaded from their tensors by name."""
    torch.manual_seed(0)
    separate = {name: nn.Linear(64, rows, bias=bias) for name, rows in PARTS.items()}
    weights = {f"{name}.{t}": getattr(lin, t).detach() for name, lin in separate.items()
               for t in ("weight", "bias") if getattr(lin, t) is not None}
    holder = nn.Module()
    holder.qkv_proj = MergedLinear(64, PARTS, bias=bias)
    load_parameters(holder, weights.__getitem__, set(weights))
    return separate, holder


@pytest.mark.parametrize("bias", [False, True])
def test_merged_linear_equals_its_parts(bias):
    separate, holder = separate_and_merged(bias)
    x = torch.randn(3, 5, 64)
    outputs = holder.qkv_proj(x)
    assert [o.shape[-1] for o in outputs] == list(PARTS.values())
    for got, lin in zip(outputs, separate.values()):
        torch.testing.assert_close(got, lin(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_merged_linear_equals_its_quantized_parts(kind):
    """Scales are per output row (per row group for int4), so quantizing the merged weight gives
    the parts' codes stacked, and each output slice equals that part's QuantLinear."""
    separate, holder = separate_and_merged(bias=True)
    holder.qkv_proj.linear = QuantLinear.from_linear(holder.qkv_proj.linear, kind, 32)
    parts = [QuantLinear.from_linear(lin, kind, 32) for lin in separate.values()]
    assert torch.equal(holder.qkv_proj.linear.qweight, torch.cat([p.qweight for p in parts]))
    x = torch.randn(2, 4, 64)
    for got, part in zip(holder.qkv_proj(x), parts):
        torch.testing.assert_close(got, part(x), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[bool, tuple[Path, dict[str, torch.Tensor]]]:
    """moe -> (model directory, its canonical checkpoint tensors)."""
    out = {}
    for moe in (True, False):
        directory = tmp_path_factory.mktemp(f"merged_{'moe' if moe else 'dense'}")
        hf, _ = write_tiny_model_dir(directory, moe=moe, overrides=WIDE)
        out[moe] = directory, canonical_reference(hf)
    return out


@pytest.mark.parametrize("moe", [True, False], ids=["moe", "dense"])
def test_checkpoint_round_trip(tiny_dirs, moe):
    """Separate checkpoint tensors -> merged parameters (their concatenation) -> state_dict() ->
    a fresh model's load_state_dict, exactly."""
    directory, reference = tiny_dirs[moe]
    loaded = load_model(str(directory), "cpu", "float32", weights="bf16")
    state = loaded.model.state_dict()
    sources = merged_sources(loaded.model)
    merged = [name for name in state if name in sources]
    layer = "layers.0.mlp.gates.linear.weight" if moe else "layers.0.mlp.gate_up_proj.linear.weight"
    assert {"layers.0.linear_attn.in_proj.linear.weight", "layers.3.self_attn.qkv_proj.linear.weight", layer} <= set(merged)
    assert not any(".in_proj_qkv." in n or ".q_proj." in n or ".up_proj." in n for n in state)
    for name in merged:
        parts = [reference[src].float() for src in source_names(sources, name)]
        assert torch.equal(state[name], torch.cat(parts)), name
    fresh = build_model(loaded.config, torch.device("cpu"), torch.float32)
    fresh.load_state_dict(state, strict=True)
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, state[name]), name


def test_recipe_quantizes_merged_projections(tiny_dirs):
    """int4: the dense MLP's gate_up int4, GDN / attention / shared-expert merges int8, the merged
    router + shared-expert gate unquantized."""
    model = build_model(load_config(tiny_dirs[True][0]), torch.device("cpu"), torch.float32, QuantRecipe("int4"))
    layer = model.layers[3]
    assert type(layer.mlp.gates.linear) is nn.Linear
    assert layer.mlp.shared_expert.gate_up_proj.linear.kind == "int8"
    assert layer.self_attn.qkv_proj.linear.kind == "int8"
    assert model.layers[0].linear_attn.in_proj.linear.kind == "int8"
    dense = load_model(str(tiny_dirs[False][0]), "cpu", "float32", weights="int4").model
    assert dense.layers[0].mlp.gate_up_proj.linear.kind == "int4"

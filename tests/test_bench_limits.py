"""The card's limits the benches set their figures against (ninfer_core/bench.py): a prompt's matmul
parameters counted from the model's own tensors, and a prefill's limit as the slower of its bytes at
the bandwidth and its FLOPs at the GEMM peak."""

from __future__ import annotations

import math

import pytest

from ninfer_core.bench import BenchSetup, _build, _Harness, decode_weight_bytes, prefill_limit_ms
from ninfer_core.hub.fit import matmul_params_per_token


@pytest.fixture(scope="module")
def tiny():
    setup = BenchSetup(model="tiny-qwen3.6-moe", device="cpu", weights="bf16", prefill_lengths=(),
                       decode_contexts=(64,), decode_batches=(1,), decode_steps=2, batch_context=64)
    model, config, dev, dtype, _ = _build(setup)
    return model, config, _Harness(model, config, dev, dtype, setup).manager


def test_matmul_params_are_the_layers_tensors_a_token_multiplies_with(tiny):
    """Every decoder-layer parameter but the two block norms, the routed experts' at k / E: what one
    prompt token multiplies with (the embedding row and lm_head are not a prompt token's matmuls)."""
    model, config, _ = tiny
    share = config.num_experts_per_tok / config.num_experts
    counted = 0.0
    for layer in model.layers:
        for name, p in layer.named_parameters():
            if name.startswith(("input_layernorm.", "post_attention_layernorm.")):
                continue
            counted += p.numel() * (share if name.startswith("mlp.experts.") else 1)
    assert config.is_moe and any(n.startswith("mlp.experts.") for n, _ in model.layers[0].named_parameters())
    assert matmul_params_per_token(config) == counted


def test_prefill_limit_is_the_slower_of_its_bytes_and_its_flops(tiny):
    model, config, manager = tiny
    length, kv, state = 48, manager.cache.kv.bytes_per_token, manager.cache.state.bytes_per_slot
    moved = decode_weight_bytes(model, config, length) + length * kv + 2 * state
    attention = sum(kind == "full_attention" for kind in config.layer_types)
    flops = (2 * length * matmul_params_per_token(config)
             + 2 * length**2 * config.num_heads * config.head_dim * attention)
    assert prefill_limit_ms(model, config, manager, length, 1e9, math.inf) == pytest.approx(moved / 1e6)
    assert prefill_limit_ms(model, config, manager, length, math.inf, 1e12) == pytest.approx(flops / 1e9)
    both = prefill_limit_ms(model, config, manager, length, 1e9, 1e12)
    assert both == pytest.approx(max(moved / 1e6, flops / 1e9))
    # the weights a prompt touches stop growing once every expert is hit; its attention FLOPs do not
    assert decode_weight_bytes(model, config, 4096) == decode_weight_bytes(model, config, 8192)

"""The drafters' lm_head (engine/speculative/draft_head.py): an int4 copy of an int8 lm_head.

Reference: int4 quantization written out here (group amax / 7 rounded to the bf16 scale, codes
rounded and clamped to -8..7) over the int8 weight's values; the engine's speculative greedy output
against its own plain decode of the same int8 model (the drafts may change, the tokens may not).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ninfer_core.engine.request import GenerationRequest
from ninfer_core.engine.speculative import draft_head
from ninfer_core.ops.quant import QuantLinear, dequantize_ref
from speculative_harness import PROMPTS, greedy, load, run, write_drafter, write_target
from tiny_model_dir import WIDE


def _int8_head(rows: int, width: int, seed: int = 0) -> QuantLinear:
    linear = nn.Linear(width, rows, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)))
    return QuantLinear.from_linear(linear, "int8")


def _int4_of(weight: torch.Tensor, group: int) -> torch.Tensor:
    """The dequantized int4 weight of `weight` [N, K] (float64 math, bf16 scales)."""
    groups = weight.double().unflatten(-1, (-1, group))
    scales = (groups.abs().amax(-1, keepdim=True) / 7).to(torch.bfloat16).double()
    return ((groups / scales).round().clamp(-8, 7) * scales).flatten(-2)


def test_int4_copy_is_the_int8_weights_int4_quantization(monkeypatch):
    """Rows quantized a few at a time (ROWS_PER_PASS 7 over 20 rows) give the whole weight's int4 values,
    group 128 where the width takes it; the head's logits are those of that weight."""
    monkeypatch.setattr(draft_head, "ROWS_PER_PASS", 7)
    source = _int8_head(20, 256)
    head = draft_head.draft_lm_head(source)
    assert isinstance(head, QuantLinear) and head.kind == "int4" and head.group_size == 128
    want = _int4_of(dequantize_ref(source.quantized, torch.float32), 128)
    assert torch.equal(dequantize_ref(head.quantized, torch.float64), want)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(head(x).double(), x.double() @ want.T, rtol=1e-5, atol=1e-4)


def test_heads_it_cannot_shrink_are_the_targets():
    """A full-precision head, an int4 one, and an int8 one whose width no int4 group divides (48) are
    kept as they are: the drafts read the target's lm_head."""
    full = nn.Linear(64, 20, bias=False)
    int4 = QuantLinear.from_linear(full, "int4", 32)
    narrow = _int8_head(20, 48)
    for head in (full, int4, narrow):
        assert draft_head.draft_lm_head(head) is head


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """At sizes the int8 CUDA kernels cover (the tiny default's experts take the grouped path, which
    the decode graphs cannot capture)."""
    return write_target(tmp_path_factory, overrides=WIDE)[0]


@pytest.mark.parametrize("spec", ["mtp", "dflash"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_drafts_of_an_int8_model_read_an_int4_head_and_decode_the_same_tokens(tmp_path_factory, target, device,
                                                                              spec):
    """int8 weights: the drafter's lm_head is the int4 copy, and speculative greedy decode gives the
    plain greedy tokens of the same model (the tiny model's random MTP layer / DFlash drafter gets its
    drafts rejected: rounds roll back)."""
    options = {"spec": spec, "draft_tokens": 3}
    if spec == "dflash":
        options["draft_model"] = write_drafter(tmp_path_factory, target)[0]
    requests = lambda: [GenerationRequest(p, greedy(60)) for p in PROMPTS]  # noqa: E731
    plain = list(run(load(target, weights="int8", device=device), requests()).values())
    llm = load(target, weights="int8", device=device, **options)
    drafter = llm.engine.speculator.drafter
    assert isinstance(drafter.target.lm_head, QuantLinear) and drafter.target.lm_head.kind == "int8"
    assert isinstance(drafter.lm_head, QuantLinear) and drafter.lm_head.kind == "int4"
    assert list(run(llm, requests()).values()) == plain
    assert llm.stats().spec.drafted > 3 * len(PROMPTS)

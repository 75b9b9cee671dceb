"""Reference helpers for parity tests: tiny random transformers models and a minimal driver for ours.

- `tiny_qwen3_5_config` / `build_hf_model`: a few-layer Qwen3.5 (MoE or dense) with odd sizes and
  weights re-randomised at a scale where every branch matters (norm weights, gates, decays).
- `ninfer_config`: our ModelConfig from the HF config dict (exercises `config_from_hf_dict`).
- `load_from_hf`: copy an HF model's weights into ours via `load_weights` (prefix stripped).
- `Runner`: drives our model over a CacheManager (prefill in chunks, decode, batched steps).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ninfer_core.cache import CacheManager, SequenceCache
from ninfer_core.config import ModelConfig, config_from_hf_dict
from ninfer_core.models.base import ForwardBatch, ForwardOutput

MOE_LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"]
DENSE_LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]


def tiny_qwen3_5_config(moe: bool, tie_word_embeddings: bool = False, **overrides):
    """A transformers text config small enough for CPU tests, with Qwen3.5's structure.

    MoE: head_dim 32, partial rotary 0.25 (8 dims, 4 frequencies, mRoPE [2, 1, 1]), 6 experts top-3.
    Dense: head_dim 48, partial rotary 0.5 (24 dims, 12 frequencies, mRoPE [5, 4, 3] which, like
    the real [11, 11, 10], leaves the last slot to the T axis).
    """
    common = dict(
        vocab_size=300,
        hidden_size=72,
        num_attention_heads=4,
        num_key_value_heads=2,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=24,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=4096,
        eos_token_id=None,
        pad_token_id=0,
    )
    if moe:
        from transformers import Qwen3_5MoeTextConfig

        kwargs = dict(
            common,
            num_hidden_layers=len(MOE_LAYER_TYPES),
            layer_types=MOE_LAYER_TYPES,
            head_dim=32,
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=40,
            shared_expert_intermediate_size=56,
            rope_parameters=_rope(0.25, [2, 1, 1]),
        )
        kwargs.update(overrides)
        return Qwen3_5MoeTextConfig(**kwargs)
    from transformers import Qwen3_5TextConfig

    kwargs = dict(
        common,
        num_hidden_layers=len(DENSE_LAYER_TYPES),
        layer_types=DENSE_LAYER_TYPES,
        head_dim=48,
        intermediate_size=100,
        rope_parameters=_rope(0.5, [5, 4, 3]),
    )
    kwargs.update(overrides)
    return Qwen3_5TextConfig(**kwargs)


def _rope(partial: float, section: list[int]) -> dict:
    return {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": partial,
        "mrope_section": section,
        "mrope_interleaved": True,
    }


def build_hf_model(hf_config, seed: int = 0) -> nn.Module:
    """The transformers CausalLM for `hf_config`, fp32, eval mode, weights re-randomised."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM

    cls = Qwen3_5MoeForCausalLM if getattr(hf_config, "num_experts", 0) else Qwen3_5ForCausalLM
    torch.manual_seed(seed)
    model = cls(hf_config).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                continue  # keep transformers' log(uniform(0.01, 16)): a spread of fast and slow decays
            if p.dim() == 1:  # norm weights and dt_bias: noticeably away from the identity
                identity = 1.0 if name.endswith("linear_attn.norm.weight") else 0.0  # plain vs zero-centred
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + identity)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * _weight_std(name, p.shape[-1]))
    return model


def _weight_std(name: str, fan_in: int) -> float:
    """Init std of a matrix, chosen so the random model is well conditioned.

    Unit-size embeddings and damped output projections keep each residual branch well below the
    stream, so rounding errors grow slowly through the layers (bf16 stays within a few percent).
    Routers get a wide spread so near-tied top-k choices, which make two evaluation orders pick
    different experts, are rare.
    """
    if name.endswith("embed_tokens.weight"):
        return 1.0
    if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight", "experts.down_proj")):
        return 0.3 / fan_in**0.5
    if name.endswith("mlp.gate.weight"):
        return 4.0 / fan_in**0.5
    return 1.0 / fan_in**0.5


def ninfer_config(hf_config) -> ModelConfig:
    return config_from_hf_dict(hf_config.to_dict(), Path("<tiny test config>"))


def hf_text_state_dict(hf_model: nn.Module) -> dict[str, torch.Tensor]:
    """The HF weights under canonical names: 'model.' stripped, lm_head dropped when tied."""
    tied = hf_model.config.tie_word_embeddings
    out = {}
    for name, tensor in hf_model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        out[name.removeprefix("model.")] = tensor
    return out


def load_from_hf(model: nn.Module, hf_model: nn.Module) -> None:
    weights = hf_text_state_dict(hf_model)
    model.load_weights(weights.__getitem__, set(weights))


def build_pair(moe: bool, tie_word_embeddings: bool = False, seed: int = 0):
    """(hf_model, our_model) with identical weights, both fp32 on CPU."""
    from ninfer_core.models.qwen3_5 import Qwen3_5ForCausalLM

    hf_config = tiny_qwen3_5_config(moe, tie_word_embeddings)
    hf = build_hf_model(hf_config, seed)
    ours = Qwen3_5ForCausalLM(ninfer_config(hf_config)).float().eval()
    load_from_hf(ours, hf)
    return hf, ours


@torch.no_grad()
def hf_logits(hf_model: nn.Module, ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Full-recompute logits [B, T, V] (no cache)."""
    return hf_model(input_ids=ids, position_ids=position_ids, use_cache=False).logits.float()


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-4) -> None:
    """max |actual - expected| <= tol * max |expected| (relative to the tensor's scale)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    err = (actual.double() - expected.double()).abs().max().item()
    scale = expected.double().abs().max().item()
    assert err <= tol * scale, f"max abs error {err:.3g} > {tol} * scale {scale:.3g}"


@dataclass
class Seq:
    cache: SequenceCache
    length: int = 0  # tokens already in the cache


class Runner:
    """Minimal engine stand-in: builds ForwardBatch for a list of sequences and steps the model."""

    def __init__(
        self,
        model: nn.Module,
        max_tokens: int = 1024,
        max_seqs: int = 4,
        page_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kv_dtype: torch.dtype | None = None,
    ):
        self.model = model
        self.device = torch.device(device)
        self.manager = CacheManager(model.config, max_tokens, max_seqs, page_size, dtype=dtype, device=device,
                                    kv_dtype=kv_dtype)

    def new_seq(self) -> Seq:
        return Seq(self.manager.allocate())

    @torch.no_grad()
    def step(
        self,
        seqs: list[Seq],
        ids: torch.Tensor,
        logits: str = "all",
        mrope_positions: torch.Tensor | None = None,
    ) -> ForwardOutput:
        """Append ids [B, T] (row b to seqs[b]) and return the model output."""
        num_new = ids.shape[1]
        for s in seqs:
            self.manager.reserve(s.cache, s.length + num_new)
        dev = self.device
        cache_lens = torch.tensor([s.length for s in seqs], dtype=torch.int64, device=dev)
        batch = ForwardBatch(
            input_ids=ids.to(dev),
            positions=cache_lens[:, None] + torch.arange(num_new, device=dev),
            cache_lens=cache_lens,
            slots=torch.tensor([s.cache.slot for s in seqs], dtype=torch.int64, device=dev),
            block_table=self.manager.block_table([s.cache for s in seqs]),
            mrope_positions=None if mrope_positions is None else mrope_positions.to(dev),
            logits=logits,
        )
        out = self.model(batch, self.manager.cache)
        for s in seqs:
            s.length += num_new
        return out

    def prefill(self, seq: Seq, ids: list[int] | torch.Tensor, chunk: int) -> torch.Tensor:
        """Feed a 1-D prompt in chunks of `chunk` tokens; returns logits [len, V] for every position."""
        ids = torch.as_tensor(ids).reshape(1, -1)
        parts = [self.step([seq], ids[:, i : i + chunk]).logits[0] for i in range(0, ids.shape[1], chunk)]
        return torch.cat(parts)

    def rollback(self, seq: Seq, length: int, snapshot) -> None:
        """Forget tokens after `length`: truncate KV pages, restore the GDN state snapshot taken there."""
        self.manager.truncate(seq.cache, length)
        self.manager.restore(seq.cache.slot, snapshot)
        seq.length = length

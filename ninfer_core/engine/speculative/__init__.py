"""Speculative decoding: drafters (n-gram, MTP, DFlash), lossless verification, exact rollback.

`--spec METHOD --draft-tokens K [--draft-model DIR] [--adaptive-draft]` becomes the Speculator the
engine runs its decode steps through in two steps, around the sizing of the cache (llm.py):
`load_draft_weights` before it (the MTP head or DFlash model resident, so the memory left for the KV
pages counts them, and the bytes a token of the drafter's own KV takes, whose pages mirror the
target's), `build_speculator` after it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ...cache import CacheManager
from ...config import ModelConfig
from ...errors import NinferError
from ...models.decoder import DecoderModel
from ...models.dflash import DFlashConfig, DFlashModel
from ...models.loader import LoadedModel, build_module, init_random_
from ...models.mtp import PREFIX, MTPHead
from ...models.quantize import QuantRecipe, apply_recipe_, fill_quantized_
from ...weights.checkpoint import open_checkpoint
from ..sampling import Sampler
from .adaptive import AdaptiveDraft, CostModel, RoundCosts
from .base import Draft, Drafter, Observation
from .dflash import DFlashDrafter
from .draft_head import draft_lm_head
from .mtp import MTPDrafter
from .ngram import NgramDrafter
from .speculator import Speculator

if TYPE_CHECKING:
    from ..cuda_graph import DecodeGraphs

METHODS = ("mtp", "dflash", "ngram")
DEFAULT_DRAFT_TOKENS = {"mtp": 3, "dflash": 15, "ngram": 4}

__all__ = ["DEFAULT_DRAFT_TOKENS", "METHODS", "AdaptiveDraft", "CostModel", "Draft", "DraftWeights", "Drafter",
           "Observation", "RoundCosts", "Speculator", "build_mtp_head", "build_speculator", "load_dflash",
           "load_draft_weights", "mtp_head"]


@dataclass
class DraftWeights:
    """A drafter's weights, resident before the cache is sized, and its own KV bytes a target token."""

    method: str
    module: MTPHead | DFlashModel | None  # None: n-gram drafts
    kv_bytes_per_token: int
    lm_head: torch.nn.Module | None = None  # the drafts' logits' (draft_head.py), None: the target's


def load_draft_weights(method: str, draft_model: str | Path | None, loaded: LoadedModel,
                       random_weights: bool = False) -> DraftWeights:
    """`--spec METHOD [--draft-model DIR]`'s weights on the model's device (options checked first)."""
    if method not in METHODS:
        raise NinferError(f"unknown speculative method '{method}' (use one of {', '.join(METHODS)})")
    if draft_model is not None and method != "dflash":
        raise NinferError(f"--draft-model is for --spec dflash, not {method}")
    if method == "ngram":
        return DraftWeights(method, None, 0)
    if method == "mtp":
        return DraftWeights(method, build_mtp_head(loaded, random_weights),
                            MTPDrafter.kv_bytes_per_token(loaded.config, loaded.dtype),
                            draft_lm_head(_require_decoder(loaded).lm_head))
    if draft_model is None:
        raise NinferError("--spec dflash needs --draft-model DIR (a z-lab DFlash checkpoint)")
    model = load_dflash(draft_model, loaded.device, loaded.dtype)
    return DraftWeights(method, model, DFlashDrafter.kv_bytes_per_token(model.config, loaded.dtype),
                        draft_lm_head(_require_decoder(loaded).lm_head))


def build_speculator(weights: DraftWeights, draft_tokens: int | None, loaded: LoadedModel, cache: CacheManager,
                     sampler: Sampler, graphs: DecodeGraphs | None = None, adaptive: bool = False) -> Speculator:
    """`graphs`: the engine's decode graphs (buckets, pool, scratch page) when drafts may use them;
    `adaptive`: K per request from its acceptance (adaptive.py), `draft_tokens` its maximum."""
    drafter: Drafter
    if isinstance(weights.module, MTPHead):
        drafter = MTPDrafter(_require_decoder(loaded), weights.module, cache, sampler, graphs, weights.lm_head)
    elif isinstance(weights.module, DFlashModel):
        drafter = DFlashDrafter(_require_decoder(loaded), weights.module, cache, sampler, weights.lm_head)
    else:
        drafter = NgramDrafter()
    k = min(DEFAULT_DRAFT_TOKENS[weights.method], drafter.max_draft_tokens) if draft_tokens is None else draft_tokens
    return Speculator(drafter, k, sampler, AdaptiveDraft() if adaptive else None)


def _require_decoder(loaded: LoadedModel) -> DecoderModel:
    if not isinstance(loaded.model, DecoderModel):
        raise NinferError(f"{loaded.name}: speculative drafts need a decoder model")
    return loaded.model


def build_mtp_head(loaded: LoadedModel, random_weights: bool = False) -> MTPHead:
    """The checkpoint's MTP block for the loaded model (`mtp_head`; random for weight-less benchmarks)."""
    target = _require_decoder(loaded)
    weights = getattr(target, "mtp_weights", {})
    if loaded.config.mtp_num_layers < 1 or not (weights or random_weights):
        raise NinferError(f"{loaded.name} has no MTP weights (mtp.* tensors): use --spec ngram or dflash")
    if loaded.config.mtp_num_layers > 1:
        raise NinferError(f"{loaded.name}: {loaded.config.mtp_num_layers} MTP layers; only 1 is supported")
    head = mtp_head(loaded.config, loaded.device, loaded.dtype, loaded.recipe, weights or None)
    target.mtp_weights = {}  # now on the head's device: drop the host copies (~1.7 GB for the 35B)
    return head


def mtp_head(config: ModelConfig, device: torch.device, dtype: torch.dtype, recipe: QuantRecipe,
             weights: Mapping[str, torch.Tensor] | None) -> MTPHead:
    """An MTP block on device in dtype, from `weights` (the checkpoint's `mtp.*` tensors) or random,
    quantized as the model is under int8 / int4: a draft step then reads its experts and projections
    through the target layers' kernels, not in bf16 (the 35B's block: 1.7 GB in bf16, of which a
    draft step reads its attention, 8 routed experts and the shared one)."""
    recipe = recipe if recipe.mode in ("int8", "int4") else QuantRecipe("bf16")
    if weights is None:  # drawn in the model dtype, then quantized
        head = build_module(lambda: MTPHead(config), device, dtype)
        init_random_(head)
        apply_recipe_(head, recipe)
        return head
    head = build_module(lambda: MTPHead(config), device, dtype, recipe)
    local = {name.removeprefix(PREFIX): tensor for name, tensor in weights.items()}
    fill_quantized_(head, local.__getitem__, set(local), device, recipe)
    head.load(weights)  # the rest (norms, the router, what stays in the model dtype)
    return head


def load_dflash(directory: str | Path, device: torch.device, dtype: torch.dtype) -> DFlashModel:
    config = DFlashConfig.from_dir(directory)
    model = build_module(lambda: DFlashModel(config), device, dtype)
    checkpoint = open_checkpoint(directory)
    model.load(lambda name: checkpoint.get(name, dtype), checkpoint.names())
    return model


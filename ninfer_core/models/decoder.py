"""The decoder shell every text model shares: embed, layers over a paged cache, final norm, lm_head.

A layer is `h += mixer(input_layernorm(h)); h += ffn(post_attention_layernorm(h))`; the mixer is
gated DeltaNet or (gated) attention per `config.layer_types`, the FFN a sparse MoE or a dense
SwiGLU MLP. Llama-family models are the all-attention, dense, plain-RMSNorm case of the same
shell. Parameter names equal the canonical checkpoint names, so loading is a name-for-name copy, except
merged projections (q|k|v, GDN in_proj, gate|up, router|shared gate), which load from their parts
(`layers/linear.py`): one GEMM instead of several per decode step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..cache import ModelCache
from ..config import ModelConfig
from ..errors import ModelLoadError
from ..layers.attention import Attention, AttentionMetadata
from ..layers.gdn import GatedDeltaNet, GDNRecord
from ..layers.linear import load_parameters, project_pending
from ..layers.mlp import MLP
from ..layers.moe import SparseMoE
from ..layers.norm import PendingNorm, RMSNorm
from ..layers.rope import RotaryEmbedding
from ..ops import cpu_layer
from ..ops.kquant import KQuantEmbedding
from ..ops.moe import padding_route_rows
from ..ops.quant import QuantEmbedding
from .base import ForwardBatch, ForwardOutput, StateFork

LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass
class StepContext:
    """What every layer of one forward shares: rotary tables, KV indexing, state slots, the cache."""

    cos: torch.Tensor
    sin: torch.Tensor
    attn: AttentionMetadata
    slots: torch.Tensor
    cache: ModelCache
    gdn_records: dict[int, GDNRecord] | None = None  # verify forwards: GDN layers record, pools untouched
    valid_tokens: torch.Tensor | None = None  # a padded prompt chunk (ForwardBatch.valid_tokens)
    fork: StateFork | None = None  # ForwardBatch.fork
    route_rows: torch.Tensor | None = None  # MoE models: a padded chunk's padding_route_rows
    live_tokens: torch.Tensor | None = None  # MoE models: ForwardBatch.live_tokens


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.is_linear = config.layer_types[layer_idx] == "linear_attention"
        eps, zc = config.rms_eps, config.norm_zero_centered
        self.input_layernorm = RMSNorm(config.hidden_size, eps, zc)
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config)
        else:
            self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, zc)
        self.mlp = SparseMoE(config) if config.is_moe else MLP(config.hidden_size, config.intermediate_size)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, step: StepContext | MixedStep
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(delta, residual) -> (delta, residual): the stream is residual + delta, kept apart so
        that every residual add runs inside the next RMSNorm kernel (two launches fewer per layer).
        The input norm is left to the mixer's first projection (`PendingNorm`), whose quantized
        GEMV runs it at decode sizes (one launch fewer again). The first layer gets the embeddings
        as `x` and no residual. With a MixedStep the rows of every part are flattened into x [N,
        hidden]: norms and the FFN run once over all of them (one read of the weights), the mixer
        per part."""
        if x.device.type == "cpu" and isinstance(step, StepContext):
            fused = cpu_layer.decode_layers([self], x, residual, step)  # the same, in one kernel call
            if fused is not None:
                return fused
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        elif isinstance(step, MixedStep):
            h, residual = self.input_layernorm.add_norm(x, residual)
        else:
            h = PendingNorm(x, residual, self.input_layernorm)
        mixed = step.per_part(h, self._mix) if isinstance(step, MixedStep) else self._mix(h, step)
        if isinstance(h, PendingNorm):
            assert h.summed is not None, "the mixer did not project its input"
            residual = h.summed
        route_rows, live = (step.route_rows, step.live_tokens) if isinstance(step, StepContext) else (None, None)
        return self.mlp.add_norm_forward(mixed, residual, self.post_attention_layernorm, route_rows, live)

    def _mix(self, h: torch.Tensor | PendingNorm, step: StepContext) -> torch.Tensor:
        """The token mixer (GDN or attention) of one part's rows [B, T, hidden] (or of those rows
        still to be normed)."""
        i = self.layer_idx
        if not self.is_linear:
            return self.self_attn(h, step.cos, step.sin, step.cache.kv.layer(i), step.attn)
        pools = (step.cache.state.conv[i], step.cache.state.recurrent[i], step.slots)
        if step.gdn_records is None:
            return self.linear_attn(h, *pools, step.valid_tokens, step.fork)
        h, step.gdn_records[i] = self.linear_attn.verify(h, *pools)
        return h


@dataclass
class MixedStep:
    """Several parts (ForwardBatches of their own shape: the decode rows, prompt chunks) in one
    forward; their rows lie one after another in the flattened activations."""

    parts: list[StepContext]
    shapes: list[tuple[int, int]]  # (B, T) per part

    def per_part(self, h: torch.Tensor, fn: Callable[[torch.Tensor, StepContext], torch.Tensor]) -> torch.Tensor:
        """fn over each part's rows of h [N, hidden] (viewed [B, T, hidden]), flattened back."""
        sizes = [b * t for b, t in self.shapes]
        outs = [fn(rows.view(b, t, -1), step).reshape(b * t, -1)
                for rows, (b, t), step in zip(h.split(sizes), self.shapes, self.parts)]
        return torch.cat(outs)


class DecoderModel(nn.Module):
    """Subclasses check the config's arch and decide which checkpoint tensors they accept."""

    archs: tuple[str, ...] = ()

    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.arch not in self.archs:
            raise ModelLoadError(f"{type(self).__name__} cannot run arch '{config.arch}' (expected one of {self.archs})")
        unknown = sorted(set(config.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ModelLoadError(f"unsupported layer types {unknown} (supported: {LAYER_TYPES})")
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_eps, config.norm_zero_centered)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.rotary_emb = RotaryEmbedding(config.rotary_dim, config.rope_theta, config.mrope_section)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the embedding table may be quantized: the final norm's)."""
        return self.norm.weight.dtype

    def tie_weights(self) -> None:
        """lm_head shares the embedding table: the same Parameter, or for a quantized table
        (`QuantEmbedding`, `KQuantEmbedding`) a linear over its buffers, unless a recipe gave lm_head its own
        quantized copy. Again after `to_empty()`, which unties them."""
        if not self.config.tie_word_embeddings:
            return
        if isinstance(self.embed_tokens, (QuantEmbedding, KQuantEmbedding)):
            self.lm_head = self.embed_tokens.tied_head()
        elif type(self.lm_head) is nn.Linear:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, batch: ForwardBatch, cache: ModelCache) -> ForwardOutput:
        step = self._step_context(batch, cache)
        delta, residual, captured = self._layers(self._embed(batch), step, batch.capture_layers)
        if _every_row_logits(batch):  # the final norm folded into lm_head's GEMV (a decode step: a launch fewer)
            pending = PendingNorm(delta, residual, self.norm)
            logits = project_pending(self.lm_head, pending).float()
            x = pending.summed
        else:
            normed, x = self.norm.add_norm(delta, residual)
            if batch.valid_tokens is not None and batch.logits == "last":  # the last real token of each row
                index = (batch.valid_tokens - 1)[:, None, None].expand(-1, 1, normed.shape[-1])
                logits = self._logits(normed.gather(1, index))
            else:
                logits = None if batch.logits == "none" else self._logits(_logit_rows(normed, batch.logits))
        features = torch.cat([captured[i] for i in batch.capture_layers], dim=-1) if batch.capture_layers else None
        return ForwardOutput(logits=logits, hidden_states=x, captured=features, gdn_records=step.gdn_records)

    def forward_parts(self, parts: list[ForwardBatch], cache: ModelCache) -> list[ForwardOutput]:
        """One forward over several batches (a varlen batch: decode rows plus prompt chunks of
        other sequences): the same outputs as a forward per part, but every weight is read once.
        lm_head runs once over the rows that ask for logits."""
        if len(parts) == 1:
            return [self.forward(parts[0], cache)]
        shapes = [(p.batch_size, p.num_new_tokens) for p in parts]
        steps = [self._step_context(p, cache) for p in parts]
        embeds = torch.cat([self._embed(p).flatten(0, 1) for p in parts])
        layers = tuple(sorted({i for p in parts for i in p.capture_layers}))
        delta, residual, captured = self._layers(embeds, MixedStep(steps, shapes), layers)
        normed, x = self.norm.add_norm(delta, residual)
        sizes = [b * t for b, t in shapes]
        xs = [rows.view(b, t, -1) for rows, (b, t) in zip(x.split(sizes), shapes)]
        wanted = [_logit_rows(rows.view(b, t, -1), p.logits)
                  for rows, (b, t), p in zip(normed.split(sizes), shapes, parts)]
        rows = torch.cat([w.flatten(0, 1) for w in wanted])
        logits = self._logits(rows) if rows.shape[0] else None
        outputs, start = [], 0
        for i, (p, xp, w) in enumerate(zip(parts, xs, wanted)):
            n = w.shape[0] * w.shape[1]
            part_logits = None if p.logits == "none" else logits[start : start + n].view(*w.shape[:2], -1)
            start += n
            feats = None
            if p.capture_layers:
                feats = torch.cat([captured[j].split(sizes)[i].view(*xp.shape) for j in p.capture_layers], dim=-1)
            outputs.append(ForwardOutput(logits=part_logits, hidden_states=xp, captured=feats,
                                         gdn_records=steps[i].gdn_records))
        return outputs

    def _embed(self, batch: ForwardBatch) -> torch.Tensor:
        if batch.inputs_embeds is not None:
            return batch.inputs_embeds.to(self.dtype)
        return self.embed_tokens(batch.input_ids)

    def _step_context(self, batch: ForwardBatch, cache: ModelCache) -> StepContext:
        positions = batch.mrope_positions if batch.mrope_positions is not None else batch.positions
        cos, sin = self.rotary_emb(positions, self.dtype)
        attn = AttentionMetadata.build(
            batch.block_table, batch.cache_lens, batch.num_new_tokens, cache.page_size, cache.kv.num_pages,
            batch.host_cache_lens, batch.valid_tokens, batch.pad_kv_row,
        )
        moe = self.config.is_moe
        route_rows = None
        if moe and batch.valid_tokens is not None:
            route_rows = padding_route_rows(batch.valid_tokens, batch.num_new_tokens)
        return StepContext(cos=cos, sin=sin, attn=attn, slots=batch.slots, cache=cache,
                           gdn_records={} if batch.verify else None, valid_tokens=batch.valid_tokens,
                           fork=batch.fork, route_rows=route_rows, live_tokens=batch.live_tokens if moe else None)

    def _layers(
        self, x: torch.Tensor, step: StepContext | MixedStep, capture_layers: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """The decoder stack: (delta, residual) of the last layer, whose sum is the output before
        the final norm (left to the caller, which may fold it into lm_head), and the residual stream
        after each layer in `capture_layers`."""
        captured: dict[int, torch.Tensor] = {}
        stack = None
        if x.device.type == "cpu" and isinstance(step, StepContext) and not capture_layers:
            stack = cpu_layer.decode_layers(self.layers, x, None, step)  # every layer in one kernel call
        if stack is not None:
            x, residual = stack
        else:
            residual = None
            for layer in self.layers:
                x, residual = layer(x, residual, step)
                if layer.layer_idx in capture_layers:
                    captured[layer.layer_idx] = x + residual
        return x, residual, captured

    def _logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.lm_head(normed).float()

    @torch.no_grad()
    def copy_parameters(self, get: Callable[[str], torch.Tensor], names: set[str]) -> None:
        """Copy every parameter from the tensor of the same canonical name (tie re-made first:
        `to_empty()` after a meta-device build unties lm_head from the embeddings)."""
        self.tie_weights()
        load_parameters(self, get, names)


def _every_row_logits(batch: ForwardBatch) -> bool:
    """Whether every row of the batch gets logits ("all", or "last" of one new token and no
    padding), so that lm_head can take the final norm's input whole."""
    if batch.logits == "all":
        return True
    return batch.logits == "last" and batch.num_new_tokens == 1 and batch.valid_tokens is None


def _logit_rows(x: torch.Tensor, which: str) -> torch.Tensor:
    """The rows of x [B, T, hidden] whose logits a batch asks for ("last", "all", "none")."""
    if which == "none":
        return x[:, :0]
    return x[:, -1:] if which == "last" else x

"""Sparse mixture of experts: softmax top-k router, fused 3-D expert weights, shared expert.

Expert weights stay in the checkpoint's fused layout and are indexed in place (never gathered
into per-token copies): `gate_up_proj` [E, 2I, H] with rows 0..I-1 the gate projection, and
`down_proj` [E, H, I]. Routing and the experts run through ops/moe.py (decode kernels, grouped
GEMM for prefill, the reference loop on CPU).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..ops.moe import (
    ExpertTensor,
    RouterNorm,
    SharedExpert,
    cpu_moe_layer,
    moe_experts,
    moe_add_norm_router,
    moe_experts_with_shared,
    moe_route,
    moe_router,
    sync_free_tokens,
)
from ..ops.kquant import KQuantExperts, KQuantFormat
from ..ops.quant import QuantFormat, QuantizedWeight, quantize
from .linear import MergedLinear
from .mlp import MLP
from .norm import RMSNorm

class Experts(nn.Module):
    """The fused expert tensors under the checkpoint's names (`gate_up_proj`, `down_proj`), or,
    after `quantize_`, each part in its quantized format as buffers (`{part}_qweight`,
    `{part}_scales`, and `{part}_offsets` for a GGUF's affine blocks; `{part}_blocks` for its
    K-quant ones), so that `state_dict()` is the quantized artifact. `gate_up` / `down` give
    either form."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size)
        )
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.inputs = {"gate_up": hidden_size, "down": intermediate_size}
        self.formats: dict[str, QuantFormat | KQuantFormat] = {}  # part -> its format once quantized

    @torch.no_grad()
    def quantize_(self, gate_up: QuantFormat | KQuantFormat, down: QuantFormat | KQuantFormat | None = None) -> None:
        """Replace both tensors by their quantized form (`down` defaults to gate_up's format): on
        the meta device empty buffers the loader fills, else the weights quantized now. A K-quant
        format (a GGUF's blocks, `{part}_blocks` [E, bytes]) only the loader fills."""
        if self.formats:
            raise ValueError(f"experts are already quantized ({self.formats['gate_up']})")
        for part, fmt in (("gate_up", gate_up), ("down", down or gate_up)):
            full = getattr(self, f"{part}_proj")
            if isinstance(fmt, KQuantFormat):
                if not full.is_meta:
                    raise ValueError("experts take K-quant blocks from a GGUF file only (the loader)")
                blocks = torch.empty(full.shape[0], fmt.nbytes(full.shape[-1]), dtype=torch.uint8, device=full.device)
                delattr(self, f"{part}_proj")
                self.register_buffer(f"{part}_blocks", blocks)
                self.formats[part] = fmt
                continue
            if full.is_meta:
                qw = QuantizedWeight.empty(fmt, full.shape[-2], full.shape[-1], full.device, batch=full.shape[:-2])
            else:
                qw = quantize(full, fmt.kind, fmt.group_size, fmt.scale_dtype)
                if qw.format != fmt:
                    raise ValueError(f"experts cannot be quantized to {fmt} here (only {qw.format})")
            delattr(self, f"{part}_proj")
            for name in ("qweight", "scales", "offsets"):
                if getattr(qw, name) is not None:
                    self.register_buffer(f"{part}_{name}", getattr(qw, name))
            self.formats[part] = fmt

    @property
    def gate_up(self) -> ExpertTensor:
        return self._tensor("gate_up")

    @property
    def down(self) -> ExpertTensor:
        return self._tensor("down")

    def graph_max_tokens(self, dtype: torch.dtype | None) -> int:
        """Tokens per forward of `dtype` activations up to which the experts run without a host sync
        (CUDA graphs)."""
        return sync_free_tokens(self.gate_up, self.down, dtype)

    def _tensor(self, part: str) -> ExpertTensor:
        """The part's tensor; quantized, one QuantizedWeight kept while its buffers stay the same objects
        (what it caches, the CPU kernels' per-expert plans, is made once, not every step)."""
        fmt = self.formats.get(part)
        if fmt is None:
            return getattr(self, f"{part}_proj")
        kept = self.__dict__.get(f"_{part}_quantized")
        own = self._buffers  # not getattr: nn.Module.__getattr__ is ~1 us a name (ops/quant.py _QuantizedBuffers)
        if isinstance(fmt, KQuantFormat):
            blocks = own[f"{part}_blocks"]
            if kept is None or kept.blocks is not blocks:
                kept = KQuantExperts(blocks, fmt.parts, self.inputs[part])
                self.__dict__[f"_{part}_quantized"] = kept
            return kept
        buffers = [own.get(f"{part}_{name}") for name in ("qweight", "scales", "offsets")]
        if kept is None or any(a is not b for a, b in zip((kept.qweight, kept.scales, kept.offsets), buffers)):
            kept = QuantizedWeight(fmt.kind, *buffers[:2], fmt.group_size, buffers[2])
            self.__dict__[f"_{part}_quantized"] = kept
        return kept


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        shared = config.shared_expert_intermediate_size
        # The router (checkpoint `gate`) and the shared expert's scalar gate as one GEMM: [router | shared gate].
        # Both stay in the model dtype under every quantization recipe (routing is sensitive to them).
        parts = {"gate": config.num_experts} | ({"shared_expert_gate": 1} if shared else {})
        self.gates = MergedLinear(config.hidden_size, parts)
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_expert = MLP(config.hidden_size, shared) if shared else None

    def forward(self, x: torch.Tensor, route_rows: torch.Tensor | None = None,
                live: torch.Tensor | None = None) -> torch.Tensor:
        """`route_rows` [N] (`padding_route_rows` of a padded prompt chunk): token n takes the experts
        of row route_rows[n], so the padding reads no expert the real tokens do not. `live` [1]
        (`ForwardBatch.live_tokens`, a decode graph's real tokens): the router kernel routes the spare
        rows dead (ops/moe.py `moe_router`), so they read no expert at all."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        return self._experts(x, *self._route(x, route_rows, live)).reshape(shape)

    def add_norm_forward(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm,
                         route_rows: torch.Tensor | None = None,
                         live: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(h), s) for (h, s) = norm.add_norm(x, residual): a decode step's add + norm run inside
        the router kernel (`moe_add_norm_router`, one launch fewer a layer) where it applies.
        `route_rows`, `live`: as `forward`'s; a padded chunk has 16 rows or more, past the router
        kernel's (and the CPU's one-call layer routes every row as its own), so those rows take the
        GEMM."""
        shape = x.shape
        router = self._kernel_router() if route_rows is None else None
        if x.device.type == "cpu" and router is not None:
            shared = None if self.shared_expert is None else self.shared_expert.quantized()
            if self.shared_expert is None or shared is not None:
                layer = cpu_moe_layer(x.reshape(-1, shape[-1]),
                                      RouterNorm(residual.reshape(-1, shape[-1]), norm.weight, norm.eps,
                                                 norm.zero_centered),
                                      router, self.top_k, self.renormalize, self.experts.gate_up, self.experts.down,
                                      shared)
                if layer is not None:
                    return layer[0].reshape(shape), layer[1].reshape(shape)
        fused = None
        if router is not None:
            fused = moe_add_norm_router(x.reshape(-1, shape[-1]),
                                        RouterNorm(residual.reshape(-1, shape[-1]), norm.weight, norm.eps,
                                                   norm.zero_centered),
                                        router, self.gates.parts["gate"], self.top_k, self.renormalize, live)
        if fused is None:
            h, residual = norm.add_norm(x, residual)
            return self(h, route_rows, live), residual
        h, summed, logits, weights, ids = fused
        _, *shared_gate = self.gates.split(logits)
        return self._experts(h, weights, ids, shared_gate).reshape(shape), summed.reshape(shape)

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 shared_gate: list[torch.Tensor]) -> torch.Tensor:
        """The routed experts (and the shared one, gated) of rows x [N, hidden]."""
        gate_up, down = self.experts.gate_up, self.experts.down
        if self.shared_expert is None:
            return moe_experts(x, gate_up, down, weights, ids)
        # A decode step's shared expert rides along in the routed experts' kernels where they
        # take it; else its own GEMVs, the gate and the sum in their epilogues.
        parts = self.shared_expert.quantized()
        out = None if parts is None else moe_experts_with_shared(x, gate_up, down, weights, ids,
                                                                 SharedExpert(*parts, shared_gate[0]))
        if out is None:
            out = self.shared_expert.gated(x, shared_gate[0], moe_experts(x, gate_up, down, weights, ids))
        return out

    def _kernel_router(self) -> torch.Tensor | None:
        """The [router | shared gate] rows the router kernels take (a plain linear without bias), or None."""
        linear = self.gates.linear
        return linear.weight if type(linear) is nn.Linear and linear.bias is None else None

    def _route(
        self, x: torch.Tensor, route_rows: torch.Tensor | None = None, live: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """(weights, ids, [the shared expert's gate logits] or []): a decode step's router GEMV and
        top-k in one kernel where it applies (no `route_rows`: see `add_norm_forward`), else the GEMM
        and `moe_route`."""
        router = self._kernel_router()
        fused = None if router is None or route_rows is not None else moe_router(
            x, router, self.gates.parts["gate"], self.top_k, self.renormalize, live)
        if fused is not None:
            logits, weights, ids = fused
            _, *shared_gate = self.gates.split(logits)
            return weights, ids, shared_gate
        router_logits, *shared_gate = self.gates(x)  # shared_gate: [] without a shared expert
        weights, ids = moe_route(router_logits, self.top_k, self.renormalize, route_rows)
        return weights, ids, shared_gate

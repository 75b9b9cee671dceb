"""Gated DeltaNet (linear attention) as in Qwen3.5: short causal conv + gated delta rule.

Per value head the recurrent state S [dk, dv] (fp32) evolves, for each token, as
    S = exp(g) * S;   u = beta * (v - S^T k);   S = S + k u^T;   o = S^T q
with q, k l2-normalised (q also scaled by dk^-1/2); value head j reads key head j // (Hv / Hk).

Two equivalent evaluations:
- `gated_delta_rule_recurrent`: the token loop above (decode, T = 1);
- `gated_delta_rule_chunked`: the WY / UT-transform form over chunks of 64 tokens (prefill).
Both start from a given state and return the final state, so a prompt can be processed in any
split and continued by decode.

Conv state: the last K-1 pre-conv inputs of the qkv channels, [C, K-1] per sequence (K-1 is
all the next output needs). A new sequence starts from zeros for both states.

Speculative verification (`GatedDeltaNet.verify`) reads the state but leaves the pools as they
are and returns the per-token projections (`GDNRecord`); `GatedDeltaNet.commit` then advances
the pooled state through the accepted prefix only (`engine/speculative/rollback.py`), so
rejected draft tokens never touch it.

The functions here are the torch references of the hot ops; `GatedDeltaNet` runs them through
`ops.gdn`, which picks the fused CUDA steps (decode, verify, commit) and flash-linear-attention's
chunked kernel (prefill) where they apply.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..models.base import StateFork
from ..ops import gdn as gdn_ops
from ..ops.kquant import KQuantLinear
from ..ops.quant import QuantLinear
from .linear import MergedLinear
from .norm import GatedRMSNorm, PendingNorm

CHUNK_SIZE = 64


def causal_conv1d_silu(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU continuing from a state.

    x [B, T, C] new inputs, conv_state [B, C, K-1] previous inputs, weight [C, K].
    Returns (y [B, T, C] in x's dtype, new conv state [B, C, K-1] in conv_state's dtype).
    """
    kernel = weight.shape[-1]
    window = torch.cat((conv_state.to(x.dtype), x.transpose(1, 2)), dim=-1)  # [B, C, K-1+T]
    compute = torch.promote_types(x.dtype, torch.float32)
    y = F.conv1d(window.to(compute), weight.to(compute).unsqueeze(1), groups=weight.shape[0])  # [B, C, T]
    new_state = window[:, :, window.shape[-1] - (kernel - 1) :].to(conv_state.dtype)
    return F.silu(y).transpose(1, 2).to(x.dtype), new_state


def conv_qkv_heads(
    qkv: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    compute: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The conv, then per-head q, k (l2-normalised in `compute`, q scaled by dk^-1/2) and v.

    qkv [B, T, C] -> q, k [B, T, Hk, dk], v [B, T, Hv, dv] (qkv's dtype), new conv state.
    """
    mixed, conv_state = causal_conv1d_silu(qkv, conv_state, weight)
    parts = qkv_parts(mixed, num_k_heads * head_k_dim)
    return (*qkv_heads(parts, num_k_heads, head_k_dim, head_v_dim, compute), conv_state)


# A conv output's q, k, v parts [B, T, width]: column slices of [B, T, C] (`qkv_parts`), or the
# prefill conv kernel's dense parts (ops/gdn.py `conv_prefill`)
QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def qkv_parts(mixed: torch.Tensor, key_dim: int) -> QKV:
    """The conv output [B, T, C] as its q, k, v column slices (views)."""
    q, k, v = mixed.split([key_dim, key_dim, mixed.shape[-1] - 2 * key_dim], dim=-1)
    return q, k, v


def split_heads(parts: QKV, num_k_heads: int, head_k_dim: int, head_v_dim: int) -> QKV:
    """A conv output's parts as per-head q, k [B, T, Hk, dk] and v [B, T, Hv, dv] (views)."""
    q, k, v = parts
    batch, num_new, _ = q.shape
    return (q.reshape(batch, num_new, num_k_heads, head_k_dim), k.reshape(batch, num_new, num_k_heads, head_k_dim),
            v.reshape(batch, num_new, -1, head_v_dim))


def qkv_heads(parts: QKV, num_k_heads: int, head_k_dim: int, head_v_dim: int, compute: torch.dtype) -> QKV:
    """A conv output's parts as per-head q, k (l2-normalised in `compute`, q scaled by dk^-1/2), v."""
    q, k, v = split_heads(parts, num_k_heads, head_k_dim, head_v_dim)
    return l2norm(q.to(compute)) * head_k_dim**-0.5, l2norm(k.to(compute)), v


def real_tokens(valid_tokens: torch.Tensor, num_new: int) -> torch.Tensor:
    """[B, T, 1]: whether token t of row b is one of its first valid_tokens[b] (the rest: padding)."""
    return (torch.arange(num_new, device=valid_tokens.device)[None, :] < valid_tokens[:, None])[..., None]


def heads_and_gates(
    parts: QKV, a: torch.Tensor, b: torch.Tensor, w: gdn_ops.GDNWeights, valid_tokens: torch.Tensor | None,
    compute: torch.dtype,
) -> tuple[torch.Tensor, ...]:
    """q, k, v of the conv output's parts (q, k in `compute`) and g, beta of a, b; padding tokens
    (past valid_tokens) get g = beta = 0, which leaves the recurrent state as it is."""
    q, k, v = qkv_heads(parts, w.num_k_heads, w.head_k_dim, w.head_v_dim, compute)
    g, beta = gdn_gates(a, b, w.A_log, w.dt_bias)
    if valid_tokens is not None:
        real = real_tokens(valid_tokens, a.shape[1])
        g, beta = g * real, beta * real
    return q, k, v, g, beta


def conv_state_after(conv_state: torch.Tensor, qkv: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The conv state [B, C, K-1] after row b's first counts[b] new inputs of qkv [B, T, C]: the
    K-1 inputs ending with input counts[b] - 1 of [old state | new inputs] (device counts: no sync;
    gathered, not concatenated: a prompt chunk's qkv is megabytes)."""
    taps = conv_state.shape[-1]
    at = counts[:, None] - taps + torch.arange(taps, device=counts.device)  # [B, K-1]: < 0 is the old state
    new = qkv.gather(1, at.clamp(min=0)[..., None].expand(-1, -1, qkv.shape[-1])).transpose(1, 2)
    old = conv_state.gather(2, (at + taps).clamp(max=taps - 1)[:, None, :].expand(conv_state.shape))
    return torch.where((at >= 0)[:, None, :], new.to(conv_state.dtype), old)


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-decay g = -exp(A_log) * softplus(a + dt_bias) and write strength beta = sigmoid(b), fp32."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _expand_key_heads(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    """[B, T, Hk, dk] -> [B, T, Hv, dk]: value head j reads key head j // (Hv / Hk)."""
    return x.repeat_interleave(num_v_heads // x.shape[2], dim=2)


def gated_delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    every_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token delta rule.

    q, k [B, T, Hk, dk] (normalised, q scaled), v [B, T, Hv, dv], g, beta [B, T, Hv],
    state [B, Hv, dk, dv]. Computes in the state's dtype; returns (o [B, T, Hv, dv], final state),
    or with `every_state` the states before and after each token, [B, T+1, Hv, dk, dv].
    """
    dtype = state.dtype
    num_v_heads = v.shape[2]
    q, k = (_expand_key_heads(t, num_v_heads).to(dtype) for t in (q, k))
    v, g, beta = v.to(dtype), g.to(dtype), beta.to(dtype)
    outputs, states = [], [state]
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        predicted = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        u = beta[:, t, :, None] * (v[:, t] - predicted)
        state = state + k[:, t, :, :, None] * u[:, :, None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
        states.append(state)
    return torch.stack(outputs, dim=1), torch.stack(states, dim=1) if every_state else state


def gated_delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `gated_delta_rule_recurrent`, evaluated chunk by chunk.

    Inside a chunk with cumulative decay gamma_t = prod_{s<=t} exp(g_s) and entry state S0:
        (I + A) U = beta V - diag(beta gamma) K S0,   A[t, s] = beta_t (gamma_t / gamma_s) k_t.k_s  (s < t)
        O = diag(gamma) Q S0 + ((Q K^T) * Gamma * causal) U,    Gamma[t, s] = gamma_t / gamma_s
        S_end = gamma_C S0 + (K * gamma_C / gamma)^T U
    With T = (I + A)^-1 this is U = T(beta V) - T(beta gamma K) S0, so everything except the S0
    terms is computed for all chunks at once and only a short scan over chunks remains.
    """
    dtype = state.dtype
    batch, seq_len, _, _ = q.shape
    num_v_heads = v.shape[2]
    q, k = (_expand_key_heads(t, num_v_heads) for t in (q, k))
    # -> [B, H, T, ...] in the compute dtype, T padded to whole chunks (padding: k = v = beta = 0,
    # g = 0, which leaves the state untouched).
    pad = (-seq_len) % chunk_size
    q, k, v = (F.pad(t.to(dtype).transpose(1, 2), (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t.to(dtype).transpose(1, 2), (0, pad)) for t in (g, beta))
    num_chunks = (seq_len + pad) // chunk_size
    q, k, v = (t.reshape(batch, num_v_heads, num_chunks, chunk_size, -1) for t in (q, k, v))
    g, beta = (t.reshape(batch, num_v_heads, num_chunks, chunk_size) for t in (g, beta))

    log_gamma = g.cumsum(dim=-1)  # [B, H, N, C]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # Gamma[t, s] = gamma_t / gamma_s on and below the diagonal, 0 above (masked before exp).
    gamma_ratio = (log_gamma[..., :, None] - log_gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()

    k_beta = k * beta[..., None]
    # solve_triangular with unitriangular=True reads only the strictly lower part of A: it solves (I + A) X = rhs.
    a_matrix = (k_beta @ k.transpose(-1, -2)) * gamma_ratio
    u_free = torch.linalg.solve_triangular(a_matrix, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        a_matrix, k_beta * log_gamma.exp()[..., None], upper=False, unitriangular=True
    )
    intra = (q @ k.transpose(-1, -2)) * gamma_ratio
    q_decayed = q * log_gamma.exp()[..., None]
    k_to_end = k * (log_gamma[..., -1:] - log_gamma).exp()[..., None]
    chunk_decay = log_gamma[..., -1].exp()[..., None, None]  # [B, H, N, 1, 1]

    outputs = []
    for n in range(num_chunks):
        u = u_free[:, :, n] - w[:, :, n] @ state
        outputs.append(q_decayed[:, :, n] @ state + intra[:, :, n] @ u)
        state = state * chunk_decay[:, :, n] + k_to_end[:, :, n].transpose(-1, -2) @ u
    out = torch.cat(outputs, dim=2)[:, :, :seq_len]  # [B, H, T, dv]
    return out.transpose(1, 2), state


@dataclass
class GDNRecord:
    """One GDN layer's input projections of a verify forward: enough to advance its state through
    any prefix of the tokens (`GatedDeltaNet.commit`)."""

    qkv: torch.Tensor  # [B, T, C] pre-conv
    a: torch.Tensor  # [B, T, Hv]
    b: torch.Tensor  # [B, T, Hv]
    act: torch.Tensor | None = None  # the verify's activations on the CUDA kernel (ops.gdn.gdn_verify_recorded)


def _host_cuts(fork: StateFork | None, batch: int) -> list[tuple[int, torch.Tensor]] | None:
    """A fork's checkpoints as (tokens, slots) with the tokens on the host (one row's), [] without a
    fork; None where they are on the device only or the batch has several rows."""
    cuts: list[tuple[int, torch.Tensor]] = []
    while fork is not None:
        if fork.host_tokens is None or batch != 1:
            return None
        cuts.append((fork.host_tokens, fork.slots))
        fork = fork.then
    return cuts


class GatedDeltaNet(nn.Module):
    """One GDN mixer layer; reads and updates its conv / recurrent state pools in place."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        hidden = config.hidden_size
        # The checkpoint's in_proj_qkv / _z / _b / _a all read x: one GEMM, output [qkv | z | b | a].
        self.in_proj = MergedLinear(hidden, {"in_proj_qkv": self.conv_dim, "in_proj_z": self.value_dim,
                                             "in_proj_b": self.num_v_heads, "in_proj_a": self.num_v_heads})
        # Only a holder for the checkpoint's `conv1d.weight` [C, 1, K]; the math is causal_conv1d_silu.
        k = config.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, k, groups=self.conv_dim, bias=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)
        # None, or out_proj's inputs in the order its weight's columns are stored (a GGUF keeps them
        # with the value heads tiled: the 4K activations move instead of its blocks)
        self.register_buffer("out_input_order", None, persistent=False)

    def set_input_order(self, linear: str, order: torch.Tensor) -> None:
        """Take `linear`'s (out_proj's) inputs in `order` (index_select over the last dim)."""
        if linear != "out_proj" or order.shape != (self.value_dim,):
            raise ValueError(f"GDN layers take an input order for out_proj [{self.value_dim}], not {linear} "
                             f"{tuple(order.shape)}")
        self.out_input_order = order.to(next(self.parameters()).device)

    def _out(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(x if self.out_input_order is None else x.index_select(-1, self.out_input_order))

    @property
    def weights(self) -> gdn_ops.GDNWeights:
        """The parameters the GDN ops take, made again only when one moved (`to`: the conv weight's view
        would be stale). Read from the modules' dicts: nn.Module.__getattr__ is ~1 us a name, and a CPU
        decode step asks for every layer's."""
        params = (self._modules["conv1d"]._parameters["weight"], self._parameters["A_log"],
                  self._parameters["dt_bias"], self._modules["norm"]._parameters["weight"])
        key = tuple(p.data_ptr() for p in params)
        cached = self.__dict__.get("_weights")
        if cached is None or cached[0] != key:
            conv, a_log, dt_bias, norm = params
            cached = self.__dict__["_weights"] = (key, gdn_ops.GDNWeights(
                conv[:, 0], a_log, dt_bias, norm, self.norm.eps, self.num_k_heads, self.head_k_dim, self.head_v_dim))
        return cached[1]

    def forward(
        self, x: torch.Tensor | PendingNorm, conv_pool: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor,
        valid_tokens: torch.Tensor | None = None, fork: StateFork | None = None,
    ) -> torch.Tensor:
        """x [B, T, hidden] (or those rows still to be normed: in_proj norms them); conv_pool [S, C,
        K-1], state_pool [S, Hv, dk, dv]; slots [B]; valid_tokens [B]: only row b's first
        valid_tokens[b] tokens advance its state (padding); fork: the state after fork.tokens[b]
        tokens is also written to slot fork.slots[b]."""
        if x.shape[1] == 1:
            mixed = self._cpu_mixer(x, conv_pool, state_pool, slots)
            if mixed is not None:
                return mixed
            return self._out(self._decode(x, conv_pool, state_pool, slots))[:, None]
        cuts, w = _host_cuts(fork, x.shape[0]), self.weights
        if valid_tokens is None and cuts is not None and gdn_ops.cpu_steps_apply(conv_pool, state_pool, w):
            # the CPU: the fused steps beat the chunked rule's torch ops at every length (gdn_prefill_stepped)
            qkv, z, b, a = self.in_proj(x)
            return self._out(gdn_ops.gdn_prefill_stepped(qkv, a, b, z, conv_pool, state_pool, slots, w, cuts))
        if fork is not None:
            valid = valid_tokens if valid_tokens is not None else torch.full_like(fork.tokens, x.shape[1])
            if fork.tail:
                return self._forked(x, conv_pool, state_pool, slots, valid, fork)
            sliced = x.shape[0] == 1 and valid_tokens is None and fork.host_tokens is not None
            return self._forked_chunked(x, conv_pool, state_pool, slots, valid, fork, sliced)
        out, state = self._mix(x, conv_pool, slots, state_pool[slots], valid_tokens)
        state_pool[slots] = state
        return out

    def _cpu_mixer(
        self, x: torch.Tensor | PendingNorm, conv_pool: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor | None:
        """A decode step's whole mixer in one CPU call where the input norm is pending and both
        projections are compact weights without a bias (ops/gdn.py `cpu_gdn_mixer`); sets x.summed."""
        in_proj, out_proj = self.in_proj.linear, self.out_proj
        if not (isinstance(x, PendingNorm) and x.x.device.type == "cpu"
                and all(isinstance(m, (QuantLinear, KQuantLinear)) and m.bias is None for m in (in_proj, out_proj))):
            return None
        fused = gdn_ops.cpu_gdn_mixer(x, in_proj.quantized, out_proj.quantized, self.out_input_order, conv_pool,
                                      state_pool, slots, self.weights)
        if fused is None:
            return None
        out, x.summed = fused
        return out

    def _decode(
        self, x: torch.Tensor | PendingNorm, conv_pool: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        """One new token of each sequence, up to out_proj: [B, value_dim]. With the input norm pending
        and a quantized in_proj, its GEMV runs the conv where the kernels take it (one launch fewer),
        else the projection and the fused steps."""
        linear = self.in_proj.linear
        if isinstance(x, PendingNorm) and isinstance(linear, QuantLinear):
            # in_proj's rows are [qkv | z | b | a] (__init__), as gdn_decode_step_folded reads them
            out = gdn_ops.gdn_decode_step_folded(x, linear.quantized, linear.bias, conv_pool, state_pool, slots,
                                                 self.weights)
            if out is not None:
                return out
        qkv, z, b, a = (p[:, 0] for p in self.in_proj(x))
        return gdn_ops.gdn_decode_step(qkv, a, b, z, conv_pool, state_pool, slots, self.weights)

    def _forked(
        self, x: torch.Tensor | PendingNorm, conv_pool: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor,
        valid: torch.Tensor, fork: StateFork,
    ) -> torch.Tensor:
        """The prefill with a checkpoint inside: the chunked rule runs through the fork (the tokens
        after it are padding to it); the fused steps then copy the state there to the fork's slots
        and run the tokens from the fork to the end (at most MAX_STEP_TOKENS) from it, reading
        their projections and writing their outputs in place; or, with `fork.steps`, run its
        windows in turn (checkpoints at their starts). One in_proj and out_proj over the whole
        chunk, so the weights are read once (a second forward for the tail read them all again: a
        decode step's time)."""
        qkv, z, b, a = self.in_proj(x)
        normed, state = self._rule(qkv, z, b, a, conv_pool, slots, state_pool[slots], fork.tokens)
        state_pool[slots] = state
        if fork.steps is None:
            self._tail(qkv, z, b, a, conv_pool, state_pool, slots, valid, fork, normed)
        else:
            steps = fork.steps
            for offsets, counts, fork_slots in zip(steps.offsets, steps.counts, steps.fork_slots):
                self._steps(qkv, z, b, a, conv_pool, state_pool, slots, offsets, counts, fork_slots, normed)
        return self._out(normed)

    def _tail(
        self, qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_pool: torch.Tensor,
        state_pool: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor, fork: StateFork, normed: torch.Tensor,
    ) -> None:
        """The fused steps over row b's tokens fork.tokens[b] .. valid[b] - 1 from the pooled state
        (first copied to fork.slots[b]); their outputs overwrite those rows of normed."""
        self._steps(qkv, z, b, a, conv_pool, state_pool, slots, fork.tokens, valid - fork.tokens, fork.slots, normed)

    def _steps(
        self, qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_pool: torch.Tensor,
        state_pool: torch.Tensor, slots: torch.Tensor, offsets: torch.Tensor, counts: torch.Tensor,
        fork_slots: torch.Tensor, normed: torch.Tensor,
    ) -> None:
        """Row b's tokens offsets[b] .. + counts[b] - 1 (at most MAX_STEP_TOKENS) through the fused steps
        from the pooled state, first copied to fork_slots[b]; their outputs overwrite those rows of normed."""
        gdn_ops.gdn_prefill_tail(qkv, a, b, z, conv_pool, state_pool, slots, self.weights, offsets=offsets,
                                 counts=counts, fork_slots=fork_slots,
                                 width=min(gdn_ops.MAX_STEP_TOKENS, qkv.shape[1]), out=normed)

    def _forked_chunked(
        self, x: torch.Tensor | PendingNorm, conv_pool: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor,
        valid: torch.Tensor, fork: StateFork, sliced: bool = False,
    ) -> torch.Tensor:
        """The prefill with a checkpoint anywhere inside: the chunked rule runs twice over the
        chunk, first with the tokens from the fork on as padding (its final state is the state at
        the fork: copied to the fork's slots), then from that state with the tokens before the fork
        as padding; each token's output comes from the run it was real in. The conv runs once (it
        does not depend on where the state is kept); the fork slot's conv state is gathered. With a
        second fork (`fork.then`, near the end) the second run stops there and the fused steps run
        the rest, as in `_forked`. sliced: each run reads its side's tokens only (an eager forward of
        one unpadded row): at 8K tokens the masked second run costs as much as a second forward."""
        num_new = x.shape[1]
        qkv, z, b, a = self.in_proj(x)
        end = fork.then.tokens if fork.then is not None else valid  # where the chunked rule stops
        conv_pool[fork.slots] = conv_state_after(conv_pool[slots], qkv, fork.tokens)
        parts = gdn_ops.conv_prefill(qkv, conv_pool, slots, self.conv1d.weight[:, 0], self.key_dim, end)
        q, k, v, g, beta = heads_and_gates(parts, a, b, self.weights, end, state_pool.dtype)
        rule = gdn_ops.gated_delta_rule_prefill
        if sliced:  # one unpadded row, positions on the host: each run over its side's tokens only
            cut, stop = fork.host_tokens, fork.then.host_tokens if fork.then is not None else num_new
            assert cut is not None and stop is not None
            out_before, state = rule(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut], state_pool[slots])
            state_pool[fork.slots] = state
            out_after, state = rule(q[:, cut:stop], k[:, cut:stop], v[:, cut:stop], g[:, cut:stop],
                                    beta[:, cut:stop], state)
            out = torch.cat([out_before, out_after, out_after.new_zeros(1, num_new - stop, *out_after.shape[2:])], 1)
        else:
            position = torch.arange(num_new, device=qkv.device)[None, :]
            before = position < fork.tokens[:, None]  # [B, T]
            after = ~before & (position < end[:, None])
            out_before, state = rule(q, k, v, g * before[..., None], beta * before[..., None], state_pool[slots])
            state_pool[fork.slots] = state
            out_after, state = rule(q, k, v, g * after[..., None], beta * after[..., None], state)
            out = torch.where(before[..., None, None], out_before, out_after)
        state_pool[slots] = state
        normed = self._normed(out, z)
        if fork.then is not None:
            self._tail(qkv, z, b, a, conv_pool, state_pool, slots, valid, fork.then, normed)
        return self._out(normed)

    def verify(
        self, x: torch.Tensor | PendingNorm, conv_pool: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, GDNRecord]:
        """`forward`'s outputs for T <= 16 tokens, but the pools stay as they are: the returned
        record lets `commit` keep just the accepted prefix of the tokens."""
        qkv, z, b, a = self.in_proj(x)
        out, act = gdn_ops.gdn_verify_recorded(qkv, a, b, z, conv_pool, state_pool, slots, self.weights)
        return self._out(out), GDNRecord(qkv=qkv, a=a, b=b, act=act)

    def commit(
        self, record: GDNRecord, conv_pool: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor,
        counts: torch.Tensor,
    ) -> None:
        """Advance slots[b] through the first counts[b] tokens of a verify's record (device tensor)."""
        gdn_ops.gdn_commit(record.qkv, record.a, record.b, conv_pool, state_pool, slots, counts, self.weights,
                           record.act)

    def _mix(
        self, x: torch.Tensor | PendingNorm, conv_pool: torch.Tensor, slots: torch.Tensor, state: torch.Tensor,
        valid_tokens: torch.Tensor | None = None,
        delta_rule: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's prefill: (output, new recurrent state); the conv states of `slots` advance
        in the pool. `delta_rule`: the chunked prefill unless given (a test passes the recurrent form)."""
        qkv, z, b, a = self.in_proj(x)
        normed, state = self._rule(qkv, z, b, a, conv_pool, slots, state, valid_tokens, delta_rule)
        return self._out(normed), state

    def _rule(
        self, qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_pool: torch.Tensor,
        slots: torch.Tensor, state: torch.Tensor, valid_tokens: torch.Tensor | None,
        delta_rule: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """conv, delta rule and gated norm of the projections: (normed [B, T, value_dim], new state).
        The conv states of `slots` advance in the pool, ending at each row's last real token."""
        parts = gdn_ops.conv_prefill(qkv, conv_pool, slots, self.conv1d.weight[:, 0], self.key_dim, valid_tokens)
        out, state = gdn_ops.gated_delta_rule_from_conv(parts, a, b, self.weights, valid_tokens, state, delta_rule)
        return self._normed(out, z), state

    def _normed(self, out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The gated RMSNorm of the rule's output [B, T, Hv, dv] (gate z), as [B, T, value_dim]."""
        batch, num_new = z.shape[:2]
        z = z.reshape(batch, num_new, self.num_v_heads, self.head_v_dim)
        return self.norm(out.to(z.dtype), z).reshape(batch, num_new, self.value_dim)

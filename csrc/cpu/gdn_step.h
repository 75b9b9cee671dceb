// The fused Gated DeltaNet steps on the CPU: ops/gdn.py `_steps`' contract for fp32 models (decode,
// speculative verify and commit; T <= 16 new tokens a sequence). The layer between in_proj and
// out_proj in one call: the torch reference is ~60 small ops a layer, 1.5 ms for one token at the
// 35B's shape where the state's 4 MB of traffic take ~0.2 ms.
#pragma once

#include <cstdint>

#include "decode_layer.h"

namespace ninfer::cpu {

inline constexpr std::int64_t kMaxTaps = 8, kMaxTokens = 16;  // ops/gdn.py checks both

// Token t of sequence b is row b * tokens + t of each input, its rows `*_stride` floats apart.
struct GdnStepArgs {
  float* out;                 // [B, T, Hv * dv] contiguous, or null: no outputs (a commit)
  const float* qkv;           // [B, T, C] pre-conv projections, C = 2 * Hk * dk + Hv * dv
  const float* a;             // [B, T, Hv] in_proj_a
  const float* b;             // [B, T, Hv] in_proj_b
  const float* z;             // [B, T, Hv * dv] the norm's gate (with out)
  float* conv_pool;           // [S, C, K - 1]
  float* state_pool;          // [S, Hv, dk, dv]
  const std::int64_t* slots;  // [B], distinct
  const std::int64_t* counts; // [B] tokens row b's pools advance through (clamped to [0, T]), or null: all
  const float* conv_weight;   // [C, K]
  const float* A_log;         // [Hv]
  const float* dt_bias;       // [Hv]
  const float* norm_weight;   // [dv]
  std::int64_t batch, tokens, num_k_heads, num_v_heads, head_k_dim, head_v_dim, taps;
  std::int64_t qkv_stride, ab_stride, z_stride;
  float q_scale, eps;
  bool write_state;           // false: the pools stay as they are (a verify)
  int threads;
};

// The conv + SiLU of every channel, then per (sequence, value head): q / k l2-normalised (q scaled),
// g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), the delta rule token by token on the fp32
// state, out = norm_weight * rmsnorm(o) * silu(z).
void gdn_steps(const GdnStepArgs& args);

// A GDN layer's token mixer of a decode step in one call (layers/gdn.py GatedDeltaNet with its input norm
// pending): h = norm(x + residual) (add_rmsnorm; the sum to residual_out), in_proj's rows [qkv | z | b |
// a] of h, gdn_steps on them, its outputs taken in out_order where given (a GGUF's tiled value heads),
// out_proj. The Python path is the same calls with ~40 small torch ops and wrappers between them (~0.25 ms
// of a 35B layer's ~1.7 ms on two cores).
struct GdnMixerArgs {
  GdnStepArgs step;  // the layer's weights and shapes, the call's pools, slots, batch, tokens, threads
  LayerLinear in_proj, out_proj;
  const float* x;            // [B T, H]: the residual stream's delta
  const float* residual;     // [B T, H]
  float* residual_out;       // [B T, H]: x + residual
  const float* norm_weight;  // [H]: the layer's input norm
  float norm_eps;
  bool zero_centered;
  const std::int64_t* out_order;  // [Hv dv] or null
  float* out;                     // [B T, H]
  bool int8_activations;
};

void gdn_mixer(const GdnMixerArgs& args);

}  // namespace ninfer::cpu

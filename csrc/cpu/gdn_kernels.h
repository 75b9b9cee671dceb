// The fused GDN steps' work items (gdn_step.h): a block of channels' conv + SiLU, then one (sequence,
// value head)'s delta rule and norm; written once for every instruction set V (included by
// isa_kernels.h). Why here and not in gdn_step.cpp: that file is compiled for any x86-64, and the
// state's passes and the SiLU's exponentials are the step's time.
#pragma once

#include <cstdint>
#include <type_traits>

#include "gdn_step.h"
#include "vector_math.h"

namespace ninfer::cpu {
namespace {

template <class V>
struct GdnKernels {
  using F = typename V::F;
  static constexpr int kAccs = 4;  // vectors of a pass's columns held in registers over the state's rows

  // Channels [c0, c1) of sequence b into mixed [B, T, C]: silu(sum_j w[j] window[t + j]) over window = [the
  // conv state | the T new inputs] (layers/gdn.py causal_conv1d_silu); the state then takes the K - 1
  // inputs ending with new input keep - 1 (keep 0: unchanged).
  static void conv(const GdnStepArgs& a, std::int64_t b, std::int64_t c0, std::int64_t c1, std::int64_t keep,
                   float* mixed) {
    const std::int64_t taps = a.taps, held = taps - 1, channels = mixed_channels(a);
    float window[kMaxTaps + kMaxTokens];
    for (std::int64_t c = c0; c < c1; ++c) {
      float* state = a.conv_pool + (a.slots[b] * channels + c) * held;
      for (std::int64_t j = 0; j < held; ++j) window[j] = state[j];
      for (std::int64_t t = 0; t < a.tokens; ++t) window[held + t] = a.qkv[(b * a.tokens + t) * a.qkv_stride + c];
      const float* w = a.conv_weight + c * taps;
      for (std::int64_t t = 0; t < a.tokens; ++t) {
        float y = 0;
        for (std::int64_t j = 0; j < taps; ++j) y += w[j] * window[t + j];
        mixed[(b * a.tokens + t) * channels + c] = y;
      }
      if (keep > 0)
        for (std::int64_t j = 0; j < held; ++j) state[j] = window[keep + j];
    }
    for (std::int64_t t = 0; t < a.tokens; ++t) {
      float* y = mixed + (b * a.tokens + t) * channels;
      std::int64_t c = c0;
      for (; c + V::W <= c1; c += V::W) V::store(y + c, VectorMath<V>::silu(V::load(y + c)));
      for (; c < c1; ++c) y[c] = y[c] / (1.0f + __builtin_expf(-y[c]));
    }
  }

  // Value head h of sequence b from the conv outputs `mixed` [B, T, C]; the pool takes the state after
  // `keep` tokens (0: unchanged). `work`: 2 dk + 2 dv floats, dk dv more where the state is stepped in a
  // copy (a verify, or a commit of fewer than T tokens).
  static void head(const GdnStepArgs& a, const float* mixed, std::int64_t b, std::int64_t h, std::int64_t keep,
                   float* work) {
    const std::int64_t dk = a.head_k_dim, dv = a.head_v_dim, key_dim = a.num_k_heads * dk;
    const std::int64_t channels = mixed_channels(a), key_head = h / (a.num_v_heads / a.num_k_heads);
    const std::int64_t run = a.out ? a.tokens : keep;
    float* pooled = a.state_pool + (a.slots[b] * a.num_v_heads + h) * dk * dv;
    float *q = work, *k = q + dk, *delta = k + dk, *o = delta + dv;
    const bool in_place = keep == a.tokens;
    float* s = in_place ? pooled : o + dv;
    if (!in_place && run > 0) copy(pooled, s, dk * dv);
    const float rate = -__builtin_expf(a.A_log[h]);
    for (std::int64_t t = 0; t < run; ++t) {
      const std::int64_t row = b * a.tokens + t;
      const float* x = mixed + row * channels;
      l2norm(x + key_head * dk, q, dk, a.q_scale);
      l2norm(x + key_dim + key_head * dk, k, dk, 1.0f);
      const float gate = a.a[row * a.ab_stride + h] + a.dt_bias[h];
      const float softplus = gate > 20.0f ? gate : __builtin_log1pf(__builtin_expf(gate));  // torch's threshold
      const float decay = __builtin_expf(rate * softplus);
      const float beta = 1.0f / (1.0f + __builtin_expf(-a.b[row * a.ab_stride + h]));
      step(s, q, k, x + 2 * key_dim + h * dv, decay, beta, delta, o, dk, dv);
      if (!in_place && t + 1 == keep) copy(s, pooled, dk * dv);
      if (a.out) gated_norm(a, o, a.z + row * a.z_stride + h * dv, a.out + (row * a.num_v_heads + h) * dv);
    }
  }

  // S = decay S; delta = beta (v - S^T k); S += k delta^T; o = S^T q. Two passes over S's rows, each
  // column block's sums in registers.
  static void step(float* s, const float* q, const float* k, const float* v, float decay, float beta, float* delta,
                   float* o, std::int64_t dk, std::int64_t dv) {
    for_columns(dv, [&](auto width, std::int64_t j) {
      constexpr int U = decltype(width)::value;
      if constexpr (U == 0) {
        float acc = 0;
        for (std::int64_t i = 0; i < dk; ++i) acc += k[i] * (s[i * dv + j] *= decay);
        delta[j] = beta * (v[j] - acc);
      } else {
        F acc[U];
        for (int u = 0; u < U; ++u) acc[u] = V::zero();
        const F d = V::splat(decay);
        for (std::int64_t i = 0; i < dk; ++i) {
          float* r = s + i * dv + j;
          const F ki = V::splat(k[i]);
          for (int u = 0; u < U; ++u) {
            const F x = V::mul(V::load(r + u * V::W), d);
            V::store(r + u * V::W, x);
            acc[u] = V::fma(ki, x, acc[u]);
          }
        }
        const F bv = V::splat(beta);
        for (int u = 0; u < U; ++u) {
          const F vv = V::load(v + j + u * V::W);
          V::store(delta + j + u * V::W, V::mul(bv, V::sub(vv, acc[u])));
        }
      }
    });
    for_columns(dv, [&](auto width, std::int64_t j) {
      constexpr int U = decltype(width)::value;
      if constexpr (U == 0) {
        float acc = 0;
        for (std::int64_t i = 0; i < dk; ++i) acc += q[i] * (s[i * dv + j] += k[i] * delta[j]);
        o[j] = acc;
      } else {
        F acc[U], du[U];
        for (int u = 0; u < U; ++u) acc[u] = V::zero(), du[u] = V::load(delta + j + u * V::W);
        for (std::int64_t i = 0; i < dk; ++i) {
          float* r = s + i * dv + j;
          const F ki = V::splat(k[i]), qi = V::splat(q[i]);
          for (int u = 0; u < U; ++u) {
            const F x = V::fma(ki, du[u], V::load(r + u * V::W));
            V::store(r + u * V::W, x);
            acc[u] = V::fma(qi, x, acc[u]);
          }
        }
        for (int u = 0; u < U; ++u) V::store(o + j + u * V::W, acc[u]);
      }
    });
  }

  // pass(width, j) over dv columns: blocks of kAccs vectors, then single vectors, then single columns (width 0).
  template <class Pass>
  static void for_columns(std::int64_t dv, Pass&& pass) {
    std::int64_t j = 0;
    for (; j + kAccs * V::W <= dv; j += kAccs * V::W) pass(std::integral_constant<int, kAccs>{}, j);
    for (; j + V::W <= dv; j += V::W) pass(std::integral_constant<int, 1>{}, j);
    for (; j < dv; ++j) pass(std::integral_constant<int, 0>{}, j);
  }

  // to = x / sqrt(sum x^2 + 1e-6) * scale (layers/gdn.py l2norm, in its order)
  static void l2norm(const float* x, float* to, std::int64_t n, float scale) {
    float squares = 0;
    for (std::int64_t i = 0; i < n; ++i) squares += x[i] * x[i];
    const float r = 1.0f / __builtin_sqrtf(squares + 1e-6f);
    for (std::int64_t i = 0; i < n; ++i) to[i] = x[i] * r * scale;
  }

  // out = w * (o / sqrt(mean o^2 + eps)) * silu(z) (layers/norm.py gated_rms_norm in fp32)
  static void gated_norm(const GdnStepArgs& a, const float* o, const float* z, float* out) {
    const std::int64_t dv = a.head_v_dim;
    float squares = 0;
    for (std::int64_t i = 0; i < dv; ++i) squares += o[i] * o[i];
    const float r = 1.0f / __builtin_sqrtf(squares / static_cast<float>(dv) + a.eps);
    for (std::int64_t i = 0; i < dv; ++i) {
      const float silu = z[i] / (1.0f + __builtin_expf(-z[i]));
      out[i] = a.norm_weight[i] * (o[i] * r) * silu;
    }
  }

  static std::int64_t mixed_channels(const GdnStepArgs& a) {
    return 2 * a.num_k_heads * a.head_k_dim + a.num_v_heads * a.head_v_dim;
  }

  static void copy(const float* from, float* to, std::int64_t n) {
    std::int64_t i = 0;
    for (; i + V::W <= n; i += V::W) V::store(to + i, V::load(from + i));
    for (; i < n; ++i) to[i] = from[i];
  }
};

}  // namespace
}  // namespace ninfer::cpu

// Host entry point of the Gated DeltaNet prefill conv (gdn_conv.cu). Plain C++ like ops.h.
#pragma once

#include <cstdint>

#include "ops.h"

namespace ninfer {

inline constexpr int kGdnConvMaxTaps = 8;  // gdn_conv.cu's unrolled taps, checked at the binding

// The causal depthwise conv + SiLU of a GDN layer's prefill, continuing each sequence's conv state
// in the pool (ninfer_core/layers/gdn.py, causal_conv1d_silu and conv_state_after):
//   window_b = [conv_pool[slots[b]] (K-1 inputs) | qkv[b, 0..T-1]]    per channel c
//   y[b, t, c] = round(silu(sum_j weight[c, j] * window_b[c, t + j]))   (fp32 math)
//   conv_pool[slots[b]] = window_b[:, n_b .. n_b + K-2],  n_b = valid[b] (or T when valid is 0)
// qkv [B, T, C] with a contiguous last axis, token t of row b at b * qkv_stride_b + t *
// qkv_stride_t; out: B * T * C elements holding y's three parts one after another, each a
// contiguous [B, T, width]: channels [0, split) (q), [split, 2 split) (k), [2 split, C) (v), so
// that each is the dense tensor fla's prefill takes (a [B, T, C] out made it copy each); conv_pool
// [S, C, K-1] contiguous; weight [C, K]; all in `dtype`. slots [B] int64 (distinct), valid [B]
// int64 in 0..T or 0. 2 <= K <= 8, 0 < 2 split < C.
struct GdnConvArgs {
  std::uintptr_t out;
  std::uintptr_t qkv;
  std::uintptr_t conv_pool;
  std::uintptr_t slots;
  std::uintptr_t valid;
  std::uintptr_t weight;
  std::int64_t qkv_stride_b;
  std::int64_t qkv_stride_t;
  std::int64_t batch;
  std::int64_t tokens;
  std::int64_t channels;
  std::int64_t split;
  int taps;
  DType dtype;
  int device;
  std::uintptr_t stream;
};

void gdn_conv_prefill(const GdnConvArgs& args);

}  // namespace ninfer

// Host entry point of the fused head RMSNorm + rotary embedding (rope.cu). Plain C++ like ops.h.
#pragma once

#include <cstdint>

#include "ops.h"

namespace ninfer {

// For each head vector x of x [B, T, H, D] (last axis contiguous; token t of row b at
// b * stride_b + t * stride_t, head h h * stride_h further):
//   n = rmsnorm(x) when weight != 0: round(x * rstd * (1 + w)) zero-centred, else
//       round(round(x * rstd) * w), rstd = rsqrt(mean(x^2) + eps) in fp32 (ninfer_core/ops/rmsnorm.py);
//       n = x without a weight;
//   out[b, t, h, i] = round(round(n_i * cos_i) + round(-n_{i+R/2} * sin_i))   i <  R/2
//                   = round(round(n_i * cos_i) + round( n_{i-R/2} * sin_i))   R/2 <= i < R
//                   = n_i                                                     i >= R
// with cos / sin [B, T, R] (last axis contiguous, token t of row b at b * cs_stride_b + t *
// cs_stride_t): rotate-half RoPE on the first R dims (ninfer_core/ops/rope.py). out is contiguous
// [B, T, H, D]; everything is in `dtype` (weight too). D in {64, 128, 256}; R even, 0 < R <= D, and
// (R / 2) a multiple of D / 32.
struct NormRotaryArgs {
  std::uintptr_t out;
  std::uintptr_t x;
  std::uintptr_t weight;  // [D] or 0: no norm
  std::uintptr_t cos;
  std::uintptr_t sin;
  std::int64_t batch;
  std::int64_t tokens;
  std::int64_t heads;
  std::int64_t stride_b;
  std::int64_t stride_t;
  std::int64_t stride_h;
  std::int64_t cs_stride_b;
  std::int64_t cs_stride_t;
  int head_dim;
  int rotary_dim;
  float eps;
  bool zero_centered;
  DType dtype;
  int device;
  std::uintptr_t stream;
};

void norm_rotary(const NormRotaryArgs& args);

}  // namespace ninfer

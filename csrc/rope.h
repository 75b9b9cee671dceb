// Host entry points of the fused head RMSNorm + rotary embedding (rope.cu), alone and as the
// attention layer's decode prologue with the KV append. Plain C++ like ops.h.
#pragma once

#include <cstdint>

#include "decode_attention.h"
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

// A [B, T, H, D] operand read in place, last axis contiguous: head h of token t of row b starts
// `b * stride_b + t * stride_t + h * stride_h` elements after `data`.
struct HeadsIn {
  std::uintptr_t data;
  std::int64_t stride_b;
  std::int64_t stride_t;
  std::int64_t stride_h;
};

// The decode prologue of an attention layer in one launch, bit for bit the three it replaces:
//   q_out = norm_rotary(q with q_weight): contiguous [B, T, heads, D];
//   write_kv(norm_rotary(k with k_weight), v, slot_mapping): k, v [B, T, kv_heads, D] into cache
//   rows slot_mapping[b * T + t] as WriteKVArgs (decode_attention.h) says, fp8 / int8 quantized
//   per (token, kv head), slots outside [0, num_slots) skipped.
// norm_rotary is NormRotaryArgs' above: the two norms (a weight of 0: none) share eps and
// zero_centered, q and k the cos / sin tables. dtype F16 or BF16, weights included.
struct NormRotaryKVArgs {
  std::uintptr_t q_out;
  HeadsIn q;
  HeadsIn k;
  HeadsIn v;
  std::uintptr_t q_weight;  // [D] or 0
  std::uintptr_t k_weight;  // [D] or 0
  std::uintptr_t cos;
  std::uintptr_t sin;
  std::int64_t cs_stride_b;
  std::int64_t cs_stride_t;
  std::uintptr_t k_cache;  // [num_slots, kv_heads, D]: the pages [num_pages, page_size, ...] flat
  std::uintptr_t v_cache;
  std::uintptr_t k_scale;  // [num_slots, kv_heads] fp32; 0 for Native
  std::uintptr_t v_scale;
  std::uintptr_t slot_mapping;  // [B * T] int64
  std::int64_t num_slots;
  std::int64_t batch;
  std::int64_t tokens;
  int heads;
  int kv_heads;
  int head_dim;
  int rotary_dim;
  float eps;
  bool zero_centered;
  DType dtype;
  KVDType kv_dtype;
  int device;
  std::uintptr_t stream;
};

void norm_rotary_write_kv(const NormRotaryKVArgs& args);

}  // namespace ninfer

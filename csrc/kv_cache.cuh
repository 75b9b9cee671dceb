// Device code of the paged KV cache shared by its writers and readers: the stored element type of
// each KVDType, and the store of one head vector into a cache row (write_kv in
// decode_attention.cu, and the decode prologue norm_rotary_write_kv in rope.cu, which appends k
// straight from its rotary: one definition, so both quantize bit for bit alike).
#pragma once

#include <cuda_fp8.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "common.cuh"
#include "decode_attention.h"

namespace ninfer {

template <typename T, KVDType KV>
struct CacheElem {
  using type = T;
};
template <typename T>
struct CacheElem<T, KVDType::FP8> {
  using type = std::uint8_t;
};
template <typename T>
struct CacheElem<T, KVDType::Int8> {
  using type = std::int8_t;
};

// Cache row `row` (slot * kv_heads + kv head) of `cache` [rows, 32 * kEpl] <- the head vector x
// that the warp holds, lane `lane` elements lane * kEpl .. + kEpl: a copy for Native, else
// quantized with the vector's absmax (warp-reduced) and its scale stored in scales[row] (scale =
// absmax / qmax, 1 for an all-zero vector: ops/attention.py quantize_kv, bit for bit). Every lane
// of the warp calls it (the absmax is a warp shuffle).
template <typename T, KVDType KV, int kEpl>
__device__ __forceinline__ void store_kv_vector(const Vec<T, kEpl>& x, unsigned char* cache, float* scales,
                                                std::int64_t row, int lane) {
  using C = typename CacheElem<T, KV>::type;
  C* dst = reinterpret_cast<C*>(cache) + row * (32 * kEpl) + lane * kEpl;
  if constexpr (KV == KVDType::Native) {
    *reinterpret_cast<Vec<T, kEpl>*>(dst) = x;
  } else {
    constexpr float kQMax = KV == KVDType::FP8 ? 448.0f : 127.0f;
    float f[kEpl];
    float amax = 0.0f;
#pragma unroll
    for (int e = 0; e < kEpl; ++e) {
      f[e] = to_float(x.v[e]);
      amax = fmaxf(amax, fabsf(f[e]));
    }
    amax = warp_max(amax);
    float scale = amax * (1.0f / kQMax);  // = ops/attention.py quantize_kv, bit for bit
    if (scale == 0.0f) scale = 1.0f;
    Vec<C, kEpl> out;
#pragma unroll
    for (int e = 0; e < kEpl; ++e) {
      const float y = f[e] / scale;
      if constexpr (KV == KVDType::FP8) {
        out.v[e] = __nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3);
      } else {
        out.v[e] = static_cast<std::int8_t>(fminf(fmaxf(rintf(y), -127.0f), 127.0f));
      }
    }
    *reinterpret_cast<Vec<C, kEpl>*>(dst) = out;
    if (lane == 0) scales[row] = scale;
  }
}

// launch(std::integral_constant<KVDType, KV>{}) for the cache's element type; `op` names the caller.
template <typename Launch>
void by_kv_dtype(KVDType kv, const char* op, Launch&& launch) {
  switch (kv) {
    case KVDType::Native: launch(std::integral_constant<KVDType, KVDType::Native>{}); break;
    case KVDType::FP8: launch(std::integral_constant<KVDType, KVDType::FP8>{}); break;
    case KVDType::Int8: launch(std::integral_constant<KVDType, KVDType::Int8>{}); break;
    default: throw std::invalid_argument(std::string(op) + ": unknown kv dtype");
  }
}

}  // namespace ninfer

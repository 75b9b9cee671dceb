// GQA decode attention over one chunk of keys, written once for every instruction set V (included
// by isa_kernels.h): decode_ops.cpp's decode_attention splits each (sequence, token, kv head)'s keys
// into fixed chunks, runs them on the pool's threads and merges their softmax sums. Why here and
// not in decode_ops.cpp: that file is compiled for any x86-64, where its loops ran at SSE2 width;
// at a few thousand keys attention took more time than the layer's matmuls.
#pragma once

#include <cmath>
#include <cstdint>

#include "decode_ops.h"
#include "quant_kernels.h"

namespace ninfer::cpu {
namespace {

// A 16-bit cache element, by what it holds (the same bits, two widenings).
struct Bf16 {
  std::uint16_t bits;
};
struct Half {
  std::uint16_t bits;
};

template <class V>
struct AttentionKernels {
  using F = typename V::F;

  // A cache row's values: fp32, or bf16 / fp16 widened (exactly) to fp32.
  static F load(const float* p) { return V::load(p); }
  static F load(const Bf16* p) { return V::bf16s(reinterpret_cast<const std::uint16_t*>(p)); }
  static F load(const Half* p) { return V::halves(reinterpret_cast<const std::uint16_t*>(p)); }
  static float value(float x) { return x; }
  static float value(Bf16 x) {
    const std::uint32_t bits = static_cast<std::uint32_t>(x.bits) << 16;
    float f;
    __builtin_memcpy(&f, &bits, 4);
    return f;
  }
  static float value(Half x) { return half_to_float(x.bits); }

  template <class T>
  static float dot(const float* a, const T* b, std::int64_t n) {
    F acc = V::zero();
    std::int64_t i = 0;
    for (; i + V::W <= n; i += V::W) acc = V::fma(V::load(a + i), load(b + i), acc);
    float total = V::sum(acc);
    for (; i < n; ++i) total += a[i] * value(b[i]);
    return total;
  }

  // out[i] += p * v[i]
  template <class T>
  static void axpy(float* out, float p, const T* v, std::int64_t n) {
    const F s = V::splat(p);
    std::int64_t i = 0;
    for (; i + V::W <= n; i += V::W) V::store(out + i, V::fma(s, load(v + i), V::load(out + i)));
    for (; i < n; ++i) out[i] += p * value(v[i]);
  }

  // Keys [j0, j1) of sequence b's token t for the query heads of kv_head: per head g, m[g] = the
  // largest scaled score, l[g] = sum exp(score - m[g]), acc[g] = sum exp(score - m[g]) v [dim].
  // `scores`: group * (j1 - j0) floats. Each K / V row is read once for the group.
  static void chunk(const AttentionArgs& a, std::int64_t b, std::int64_t t, std::int64_t kv_head, std::int64_t j0,
                    std::int64_t j1, float* scores, float* m, float* l, float* acc) {
    switch (a.cache) {
      case CacheType::F32: chunk_of(a.k_cache, a.v_cache, a, b, t, kv_head, j0, j1, scores, m, l, acc); break;
      case CacheType::BF16:
        chunk_of(reinterpret_cast<const Bf16*>(a.k_cache), reinterpret_cast<const Bf16*>(a.v_cache), a, b, t, kv_head,
                 j0, j1, scores, m, l, acc);
        break;
      case CacheType::F16:
        chunk_of(reinterpret_cast<const Half*>(a.k_cache), reinterpret_cast<const Half*>(a.v_cache), a, b, t, kv_head,
                 j0, j1, scores, m, l, acc);
        break;
    }
  }

  template <class T>
  static void chunk_of(const T* k_cache, const T* v_cache, const AttentionArgs& a, std::int64_t b, std::int64_t t,
                       std::int64_t kv_head, std::int64_t j0, std::int64_t j1, float* scores, float* m, float* l,
                       float* acc) {
    const std::int64_t dim = a.dim, group = a.heads / a.kv_heads, n = j1 - j0;
    const float* q = a.q + ((b * a.num_new + t) * a.heads + kv_head * group) * dim;
    const auto row = [&](std::int64_t j) {
      const std::int64_t page = a.block_table[b * a.table_width + j / a.page_size];
      return ((page * a.page_size + j % a.page_size) * a.kv_heads + kv_head) * dim;
    };
    for (std::int64_t j = j0; j < j1; ++j) {
      const T* k = k_cache + row(j);
      for (std::int64_t g = 0; g < group; ++g) scores[g * n + (j - j0)] = dot(q + g * dim, k, dim) * a.scale;
    }
    for (std::int64_t g = 0; g < group; ++g) {
      float* p = scores + g * n;
      float max = -INFINITY, total = 0;
      for (std::int64_t j = 0; j < n; ++j) max = p[j] > max ? p[j] : max;
      // __builtin_expf, not std::exp: an inline library function would be a COMDAT copy that the
      // linker may take from the AVX-512 file (see quant_kernels.h)
      for (std::int64_t j = 0; j < n; ++j) total += (p[j] = __builtin_expf(p[j] - max));
      m[g] = max, l[g] = total;
    }
    for (std::int64_t i = 0; i < group * dim; ++i) acc[i] = 0;
    for (std::int64_t j = j0; j < j1; ++j) {
      const T* v = v_cache + row(j);
      for (std::int64_t g = 0; g < group; ++g) axpy(acc + g * dim, scores[g * n + (j - j0)], v, dim);
    }
  }
};

}  // namespace
}  // namespace ninfer::cpu

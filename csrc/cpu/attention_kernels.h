// GQA decode attention over one chunk of keys, written once for every instruction set V (included
// by isa_kernels.h): decode_ops.cpp's decode_attention splits each (sequence, token, kv head)'s keys
// into fixed chunks, runs them on the pool's threads and merges their softmax sums. Why here and
// not in decode_ops.cpp: that file is compiled for any x86-64, where its loops ran at SSE2 width;
// at a few thousand keys attention took more time than the layer's matmuls.
#pragma once

#include <cmath>
#include <cstdint>

#include "decode_ops.h"

namespace ninfer::cpu {
namespace {

template <class V>
struct AttentionKernels {
  using F = typename V::F;

  static float dot(const float* a, const float* b, std::int64_t n) {
    F acc = V::zero();
    std::int64_t i = 0;
    for (; i + V::W <= n; i += V::W) acc = V::fma(V::load(a + i), V::load(b + i), acc);
    float total = V::sum(acc);
    for (; i < n; ++i) total += a[i] * b[i];
    return total;
  }

  // out[i] += p * v[i]
  static void axpy(float* out, float p, const float* v, std::int64_t n) {
    const F s = V::splat(p);
    std::int64_t i = 0;
    for (; i + V::W <= n; i += V::W) V::store(out + i, V::fma(s, V::load(v + i), V::load(out + i)));
    for (; i < n; ++i) out[i] += p * v[i];
  }

  // Keys [j0, j1) of sequence b's token t for the query heads of kv_head: per head g, m[g] = the
  // largest scaled score, l[g] = sum exp(score - m[g]), acc[g] = sum exp(score - m[g]) v [dim].
  // `scores`: group * (j1 - j0) floats. Each K / V row is read once for the group.
  static void chunk(const AttentionArgs& a, std::int64_t b, std::int64_t t, std::int64_t kv_head, std::int64_t j0,
                    std::int64_t j1, float* scores, float* m, float* l, float* acc) {
    const std::int64_t dim = a.dim, group = a.heads / a.kv_heads, n = j1 - j0;
    const float* q = a.q + ((b * a.num_new + t) * a.heads + kv_head * group) * dim;
    const auto row = [&](std::int64_t j) {
      const std::int64_t page = a.block_table[b * a.table_width + j / a.page_size];
      return ((page * a.page_size + j % a.page_size) * a.kv_heads + kv_head) * dim;
    };
    for (std::int64_t j = j0; j < j1; ++j) {
      const float* k = a.k_cache + row(j);
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
      const float* v = a.v_cache + row(j);
      for (std::int64_t g = 0; g < group; ++g) axpy(acc + g * dim, scores[g * n + (j - j0)], v, dim);
    }
  }
};

}  // namespace
}  // namespace ninfer::cpu

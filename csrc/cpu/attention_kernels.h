// GQA decode attention over one chunk of keys, written once for every instruction set V (included
// by isa_kernels.h): decode_ops.cpp's decode_attention splits each (sequence, kv head)'s keys
// into fixed chunks, runs them on the pool's threads and merges their softmax sums. Why here and
// not in decode_ops.cpp: that file is compiled for any x86-64, where its loops ran at SSE2 width;
// at a few thousand keys attention took more time than the layer's matmuls.
#pragma once

#include <cmath>
#include <cstdint>

#include "decode_ops.h"
#include "quant_kernels.h"
#include "vector_math.h"

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
  static float value(Bf16 x) { return bf16_to_float(x.bits); }
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

  // Keys [j0, j0 + kAttentionChunk) of sequence b for the query heads of kv_head, for each of its new
  // tokens up to the token's causal limit: per token t and head g (at [t * group + g]),
  // m = the largest scaled score, l = sum exp(score - m), acc = sum exp(score - m) v [dim]; a token
  // that sees none of the chunk's keys is skipped (its l stays 0). `scores`: group * kAttentionChunk
  // floats; `widened`: 2 * kAttentionChunk * dim floats for a 16-bit cache's chunk.
  static void chunk(const AttentionArgs& a, std::int64_t b, std::int64_t kv_head, std::int64_t j0,
                    float* scores, float* widened, float* m, float* l, float* acc) {
    switch (a.cache) {
      case CacheType::F32: tokens_of(a.k_cache, a.v_cache, a, b, kv_head, j0, scores, widened, m, l, acc); break;
      case CacheType::BF16:
        tokens_of(reinterpret_cast<const Bf16*>(a.k_cache), reinterpret_cast<const Bf16*>(a.v_cache), a, b, kv_head, j0,
                  scores, widened, m, l, acc);
        break;
      case CacheType::F16:
        tokens_of(reinterpret_cast<const Half*>(a.k_cache), reinterpret_cast<const Half*>(a.v_cache), a, b, kv_head, j0,
                  scores, widened, m, l, acc);
        break;
    }
  }

  // The chunk's K / V rows are read from memory once for all the tokens (a speculative verify, a short
  // follow-up message): each token's pass finds them in L2. A 16-bit cache's rows are widened once into
  // `widened` when more than one token reads them (widening is exact: the same sums to the bit), not
  // once per token and head.
  template <class T>
  static void tokens_of(const T* k_cache, const T* v_cache, const AttentionArgs& a, std::int64_t b,
                        std::int64_t kv_head, std::int64_t j0, float* scores, float* widened, float* m, float* l,
                        float* acc) {
    const std::int64_t dim = a.dim, group = a.heads / a.kv_heads;
    const std::int64_t end = lesser(j0 + kAttentionChunk, a.cache_lens[b] + a.num_new);  // the last token's keys
    std::int64_t rows[kAttentionChunk];  // the chunk's cache rows
    for (std::int64_t j = j0; j < end; ++j) {
      const std::int64_t page = a.block_table[b * a.table_width + j / a.page_size];
      rows[j - j0] = ((page * a.page_size + j % a.page_size) * a.kv_heads + kv_head) * dim;
    }
    const std::int64_t n = end - j0;
    const bool widen = sizeof(T) == 2 && a.num_new > 1;
    if (widen) {
      for (std::int64_t j = 0; j < n; ++j) {
        if (j + kAhead < n) prefetch_rows(k_cache, v_cache, rows[j + kAhead], dim);
        widen_row(k_cache + rows[j], widened + j * dim, dim);
        widen_row(v_cache + rows[j], widened + (n + j) * dim, dim);
        rows[j] = j * dim;
      }
    }
    for (std::int64_t t = 0; t < a.num_new; ++t) {
      const std::int64_t keys = lesser(end, a.cache_lens[b] + t + 1) - j0;
      if (keys <= 0) continue;
      const float* q = a.q + ((b * a.num_new + t) * a.heads + kv_head * group) * dim;
      const std::int64_t at = t * group;
      if (widen) {
        attend(widened, widened + n * dim, rows, keys, q, a, scores, m + at, l + at, acc + at * dim);
      } else {
        attend(k_cache, v_cache, rows, keys, q, a, scores, m + at, l + at, acc + at * dim);
      }
    }
  }

  // Rows ahead of the one in use are asked for from memory: a decode step's cache is past the L3 (the
  // weights stream through it every step), and the hardware prefetchers did not follow rows a kv head
  // apart (2,048 keys from DRAM, one thread: 471 -> 301 us a layer; 8, 16 or 32 rows ahead alike).
  static constexpr std::int64_t kAhead = 8;
  template <class T>
  static void prefetch_rows(const T* k_cache, const T* v_cache, std::int64_t row, std::int64_t dim) {
    const auto* k = reinterpret_cast<const char*>(k_cache + row);
    const auto* v = reinterpret_cast<const char*>(v_cache + row);
    for (std::int64_t byte = 0; byte < dim * static_cast<std::int64_t>(sizeof(T)); byte += 64) {
      __builtin_prefetch(k + byte);
      __builtin_prefetch(v + byte);
    }
  }

  template <class T>
  static void widen_row(const T* from, float* to, std::int64_t dim) {
    std::int64_t i = 0;
    for (; i + V::W <= dim; i += V::W) V::store(to + i, load(from + i));
    for (; i < dim; ++i) to[i] = value(from[i]);
  }

  // One token's query heads of a kv head over n keys at rows[0, n) of k_cache / v_cache.
  template <class T>
  static void attend(const T* k_cache, const T* v_cache, const std::int64_t* rows, std::int64_t n, const float* q,
                     const AttentionArgs& a, float* scores, float* m, float* l, float* acc) {
    const std::int64_t dim = a.dim, group = a.heads / a.kv_heads;
    for (std::int64_t j = 0; j < n; ++j) {
      if (j + kAhead < n) prefetch_rows(k_cache, v_cache, rows[j + kAhead], dim);
      const T* k = k_cache + rows[j];
      for (std::int64_t g = 0; g < group; ++g) scores[g * n + j] = dot(q + g * dim, k, dim) * a.scale;
    }
    for (std::int64_t g = 0; g < group; ++g) {
      float* p = scores + g * n;
      float max = -INFINITY;
      for (std::int64_t j = 0; j < n; ++j) max = p[j] > max ? p[j] : max;
      F sums = V::zero();
      std::int64_t j = 0;
      for (; j + V::W <= n; j += V::W) {
        const F e = VectorMath<V>::exp(V::add(V::load(p + j), V::splat(-max)));  // vector_math.h
        V::store(p + j, e);
        sums = V::add(sums, e);
      }
      float total = V::sum(sums);
      // __builtin_expf, not std::exp: an inline library function would be a COMDAT copy that the
      // linker may take from the AVX-512 file (see quant_kernels.h)
      for (; j < n; ++j) total += (p[j] = __builtin_expf(p[j] - max));
      m[g] = max, l[g] = total;
    }
    // acc[g] = sum_j p[g][j] v_j: kAccs vectors of a head's output in registers over all the chunk's keys
    // (the V rows come from L1 / L2 again for each head of the group), not loaded and stored a key.
    constexpr std::int64_t kAccs = 4;
    for (std::int64_t g = 0; g < group; ++g) {
      const float* p = scores + g * n;
      float* out = acc + g * dim;
      std::int64_t i = 0;
      for (; i + kAccs * V::W <= dim; i += kAccs * V::W) {
        F s[kAccs] = {V::zero(), V::zero(), V::zero(), V::zero()};
        for (std::int64_t j = 0; j < n; ++j) {
          const F w = V::splat(p[j]);
          const T* v = v_cache + rows[j] + i;
          for (std::int64_t u = 0; u < kAccs; ++u) s[u] = V::fma(w, load(v + u * V::W), s[u]);
        }
        for (std::int64_t u = 0; u < kAccs; ++u) V::store(out + i + u * V::W, s[u]);
      }
      for (; i + V::W <= dim; i += V::W) {
        F s = V::zero();
        for (std::int64_t j = 0; j < n; ++j) s = V::fma(V::splat(p[j]), load(v_cache + rows[j] + i), s);
        V::store(out + i, s);
      }
      for (; i < dim; ++i) {
        float s = 0;
        for (std::int64_t j = 0; j < n; ++j) s += p[j] * value(v_cache[rows[j] + i]);
        out[i] = s;
      }
    }
  }
};

}  // namespace
}  // namespace ninfer::cpu

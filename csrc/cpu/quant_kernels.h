// The CPU quant kernels, written once over a vector type V. Each isa_*.cpp defines its V (the two
// AVX-512 ones share isa_avx512.h's) and compiles this header with its instruction set;
// quant_matmul.cpp picks one at run time.
//
// V provides: F (W floats), zero, load, store, interleave (two F's lanes in turn), store_bf16, splat,
// add, sub, mul, div, fma, max, round, times_pow2, sum (horizontal), halves (W fp16 -> F), bytes (W
// signed bytes -> F) and nibbles (W bytes -> their low and their high nibbles as two F).
// The int4 loop reads 2W inputs per W code bytes: the W low nibbles are inputs 0, 2, .., 2W - 2
// and the high ones 1, 3, .., 2W - 1, so x is first arranged to that order (`arrange`) and the
// codes are never shuffled.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "decode_ops.h"
#include "gdn_step.h"
#include "quant_matmul.h"

namespace ninfer::cpu {

// One call's inputs once prepared by quant_matmul.cpp.
struct Prepared {
  const QuantWeight* w;
  float* out;          // [m, n]
  const float* x;      // [m, k], int4: arranged
  const float* xsum;   // [m, k / group] sums of x per group (for the offsets)
  const float* bias;   // [n] or null
  std::int64_t m;
};

// One call's inputs for the int8-activation kernels (quant_kernels_a8.h), prepared by quant_matmul.cpp.
struct PreparedA8 {
  const QuantWeight* w;
  float* out;                      // [m, n]
  const std::int8_t* xq;           // [m, kpad] x quantized per block of 32 (int4: arranged per chunk)
  std::int64_t kpad;               // k rounded up to whole chunks (zeros past k)
  const float* xlane;              // [m, kpad / span] each lane's activation block scale
  const std::int32_t* corr;        // [m, kpad / span] -128 * each lane's activation sum (biased int8 dots)
  const std::int32_t* lane_group;  // [lanes] the group of lane i, counted from its chunk's first
  const float* xsum;               // [m, k / group] exact sums of x per group (for the offsets)
  const float* bias;               // [n] or null
  std::int64_t m;
};

struct PreparedKQ;  // kquant_kernels.h
struct KQuantSpan;

// The entry points of one instruction set (isa_kernels.h fills them in).
struct IsaKernels {
  const char* name;
  int lanes;  // W: int32 lanes of the int8-activation dot products
  void (*arrange)(const float* x, std::int64_t m, std::int64_t k, float* dst);
  void (*rows)(const Prepared& p, std::int64_t n0, std::int64_t n1);
  void (*rows_a8)(const PreparedA8& p, std::int64_t n0, std::int64_t n1);
  void (*dequantize_rows)(const QuantWeight& w, void* out, bool bf16, std::int64_t n0, std::int64_t n1);
  // K-quant blocks (kquant.h): packs [g0, g1) of a matmul, one activation row quantized per
  // super-block, rows [r0, r1) of a part dequantized
  void (*kquant_rows)(const PreparedKQ& p, std::int64_t g0, std::int64_t g1);
  void (*kquant_quantize)(const float* x, std::int64_t k, std::int8_t* q, float* d, std::int32_t* sums16,
                          float* sums32);
  void (*kquant_dequantize_rows)(const KQuantSpan& s, std::int64_t k, std::int64_t r0, std::int64_t r1, void* out,
                                 bool bf16);
  // decode attention of a sequence's new tokens over a chunk of keys from j0 (attention_kernels.h)
  void (*attend_chunk)(const AttentionArgs& a, std::int64_t b, std::int64_t kv_head, std::int64_t j0, float* scores,
                       float* widened, float* m, float* l, float* acc);
  // the fused GDN steps (gdn_kernels.h): a block of channels' conv, one (sequence, value head)'s rule
  void (*gdn_conv)(const GdnStepArgs& a, std::int64_t b, std::int64_t c0, std::int64_t c1, std::int64_t keep,
                   float* mixed);
  void (*gdn_head)(const GdnStepArgs& a, const float* mixed, std::int64_t b, std::int64_t h, std::int64_t keep,
                   float* work);
  // out[r] = x . w[r] for the fp32 rows r in [r0, r1) of w [rows, k] (a MoE router's logits: moe_step.h)
  void (*dot_rows)(const float* x, const float* w, std::int64_t k, std::int64_t r0, std::int64_t r1, float* out);
};

// Everything below has internal linkage on purpose: each isa_*.cpp compiles its own copy with its
// own instruction set. A shared inline copy (a std:: container's, say) could be the one the linker
// kept from the AVX-512 file and fault on an older CPU, so this code uses no library templates.
namespace {

constexpr std::int64_t kMaxGroups = 4096;  // scale groups per weight row (quant_matmul.cpp checks)

inline std::int64_t lesser(std::int64_t a, std::int64_t b) { return a < b ? a : b; }

// x as bf16 bits: round to nearest even as torch does; NaN -> 0x7fc0 (a quiet NaN, torch's).
inline std::uint16_t bf16_bits(float x) {
  std::uint32_t bits;
  std::memcpy(&bits, &x, 4);
  return x != x ? 0x7fc0 : static_cast<std::uint16_t>((bits + ((bits >> 16) & 1) + 0x7fff) >> 16);
}

// bf16 bits -> float: the bits shifted up (exact).
inline float bf16_to_float(std::uint16_t h) {
  const std::uint32_t bits = static_cast<std::uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// x as IEEE half bits, rounded to nearest even as torch's .to(float16): |x| >= 65520 -> inf, NaN -> a
// quiet NaN with x's sign, below 2^-14 the subnormals (round(|x| 2^24) units of 2^-24).
inline std::uint16_t half_bits(float x) {
  std::uint32_t f;
  std::memcpy(&f, &x, 4);
  const auto sign = static_cast<std::uint16_t>((f >> 16) & 0x8000);
  const std::uint32_t a = f & 0x7fffffff;
  if (a > 0x7f800000) return sign | 0x7e00;
  if (a >= 0x477ff000) return sign | 0x7c00;
  if (a >= 0x38800000) {  // a normal half: the exponent rebiased (127 -> 15), 23 mantissa bits rounded to 10
    const std::uint32_t r = a - 0x38000000;
    return sign | static_cast<std::uint16_t>((r + 0xfff + ((r >> 13) & 1)) >> 13);
  }
  if (a < 0x33000000) return sign;  // below 2^-25 (and 2^-25, a tie, to the even 0)
  const std::uint32_t exponent = a >> 23, mantissa = (a & 0x7fffff) | 0x800000;
  const std::uint32_t shift = 126 - exponent;  // |x| 2^24 = mantissa >> shift
  return sign | static_cast<std::uint16_t>((mantissa + (1u << (shift - 1)) - 1 + ((mantissa >> shift) & 1)) >> shift);
}

// IEEE half -> float, exact (subnormals included): the tails the vector conversion leaves.
inline float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000) << 16;
  const std::uint32_t rest = h & 0x7fff;
  float f;
  if (rest >= 0x7c00) {  // inf / nan
    const std::uint32_t bits = sign | 0x7f800000 | (rest & 0x3ff) << 13;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  const std::uint32_t bits = rest << 13;  // as a float, 2^-112 times the half's magnitude
  std::memcpy(&f, &bits, 4);
  f *= 0x1p112f;
  return sign ? -f : f;
}

// Whether V converts two interleaved vectors to bf16 at once (`store_bf16_pairs`, AVX512-BF16's).
template <class V, class = void>
struct HasBf16Pairs {
  static constexpr bool value = false;
};
template <class V>
struct HasBf16Pairs<V, decltype(void(&V::store_bf16_pairs))> {
  static constexpr bool value = true;
};

template <class V>
struct Kernels {
  using F = typename V::F;
  static constexpr int W = V::W;

  static void arrange(const float* x, std::int64_t m, std::int64_t k, float* dst) {
    for (std::int64_t i = 0; i < m * k; i += 2 * W) {
      for (int j = 0; j < W; ++j) {
        dst[i + j] = x[i + 2 * j];
        dst[i + W + j] = x[i + 2 * j + 1];
      }
    }
  }

  static float dot(const float* a, const float* b, std::int64_t count) {
    F acc = V::zero();
    std::int64_t i = 0;
    for (; i + W <= count; i += W) acc = V::fma(V::load(a + i), V::load(b + i), acc);
    float total = V::sum(acc);
    for (; i < count; ++i) total += a[i] * b[i];
    return total;
  }

  // count values of type `type` -> fp32.
  static void to_float(std::uintptr_t src, ScaleType type, std::int64_t first, std::int64_t count, float* dst) {
    if (type == ScaleType::F32) {
      std::memcpy(dst, reinterpret_cast<const float*>(src) + first, count * sizeof(float));
      return;
    }
    const auto* h = reinterpret_cast<const std::uint16_t*>(src) + first;
    if (type == ScaleType::BF16) {
      for (std::int64_t i = 0; i < count; ++i) {
        const std::uint32_t bits = static_cast<std::uint32_t>(h[i]) << 16;
        std::memcpy(dst + i, &bits, 4);
      }
      return;
    }
    std::int64_t i = 0;
    for (; i + W <= count; i += W) V::store(dst + i, V::halves(h + i));
    for (; i < count; ++i) dst[i] = half_to_float(h[i]);
  }

  // Whether w's rows have offsets (given, or int4's default); an int8 weight without them adds none.
  static bool has_offsets(const QuantWeight& w) { return w.offsets || w.int4; }

  // The scales and offsets (defaults filled in; untouched without any) of `rows` weight rows from
  // n0, fp32 [rows][groups].
  static void block_params(const QuantWeight& w, std::int64_t n0, std::int64_t rows, float* scale, float* offset) {
    const std::int64_t count = rows * (w.k / w.group);
    to_float(w.scales, w.scale_type, n0 * (w.k / w.group), count, scale);
    if (w.offsets) {
      to_float(w.offsets, w.scale_type, n0 * (w.k / w.group), count, offset);
    } else if (w.int4) {
      for (std::int64_t i = 0; i < count; ++i) offset[i] = -8.0f * scale[i];
    }
  }

  // acc[t] += group g of a weight row (its codes at `row`) . x[t], codes unscaled.
  template <int T, bool Int4, int G>
  static void group_dot(const QuantWeight& w, const std::uint8_t* row, std::int64_t g, const float* x, F* acc) {
    const std::int64_t group = G ? G : w.group;
    const float* xg = x + g * group;
    for (std::int64_t c = 0; c < group; c += Int4 ? 2 * W : W) {
      if constexpr (Int4) {
        F lo, hi;
        V::nibbles(row + (g * group + c) / 2, lo, hi);
        for (int t = 0; t < T; ++t) {
          acc[t] = V::fma(lo, V::load(xg + t * w.k + c), acc[t]);
          acc[t] = V::fma(hi, V::load(xg + t * w.k + c + W), acc[t]);
        }
      } else {
        const F q = V::bytes(reinterpret_cast<const std::int8_t*>(row) + g * group + c);
        for (int t = 0; t < T; ++t) acc[t] = V::fma(q, V::load(xg + t * w.k + c), acc[t]);
      }
    }
  }

  // dots[t] = sum_k code[n][k] * scale[k / group] * x[t][k] for T rows of x: each code is decoded
  // once for the T rows. One weight row at a time, in memory order: the hardware prefetcher
  // follows one stream (rows side by side would be many short ones, half the bandwidth). G: the
  // group size when it is a common one (the inner loop unrolls), 0 to read it from w.
  template <int T, bool Int4, int G>
  static void tile(const QuantWeight& w, const float* scale, std::int64_t n, const float* x, float* dots) {
    const std::int64_t groups = w.k / (G ? G : w.group);
    const auto* row = reinterpret_cast<const std::uint8_t*>(w.codes) + n * (Int4 ? w.k / 2 : w.k);
    // Groups alternate between two sums per row, so that the scale FMA of a group does not wait
    // for the previous group's.
    F even[T], odd[T], acc[T];
    for (int t = 0; t < T; ++t) even[t] = odd[t] = V::zero();
    std::int64_t g = 0;
    if constexpr (!Int4 && G == W) {  // one vector per group (Q6_K's 16): scale the codes instead
      for (; g + 1 < groups; g += 2) {
        const auto* codes = reinterpret_cast<const std::int8_t*>(row) + g * G;
        const F q0 = V::mul(V::bytes(codes), V::splat(scale[g]));
        const F q1 = V::mul(V::bytes(codes + G), V::splat(scale[g + 1]));
        for (int t = 0; t < T; ++t) {
          even[t] = V::fma(q0, V::load(x + t * w.k + g * G), even[t]);
          odd[t] = V::fma(q1, V::load(x + t * w.k + g * G + G), odd[t]);
        }
      }
    }
    for (; g + 1 < groups; g += 2) {
      for (int t = 0; t < T; ++t) acc[t] = V::zero();
      group_dot<T, Int4, G>(w, row, g, x, acc);
      const F s = V::splat(scale[g]);
      for (int t = 0; t < T; ++t) even[t] = V::fma(acc[t], s, even[t]);
      for (int t = 0; t < T; ++t) acc[t] = V::zero();
      group_dot<T, Int4, G>(w, row, g + 1, x, acc);
      const F s1 = V::splat(scale[g + 1]);
      for (int t = 0; t < T; ++t) odd[t] = V::fma(acc[t], s1, odd[t]);
    }
    if (g < groups) {
      for (int t = 0; t < T; ++t) acc[t] = V::zero();
      group_dot<T, Int4, G>(w, row, g, x, acc);
      const F s = V::splat(scale[g]);
      for (int t = 0; t < T; ++t) even[t] = V::fma(acc[t], s, even[t]);
    }
    for (int t = 0; t < T; ++t) dots[t] = V::sum(V::add(even[t], odd[t]));
  }

  // Weight row n against x rows [m0, m0 + T): the dot products, the offsets and the bias.
  template <int T, bool Int4, int G>
  static void block(const Prepared& p, const float* scale, const float* offset, std::int64_t n, std::int64_t m0) {
    const QuantWeight& w = *p.w;
    const std::int64_t groups = w.k / w.group;
    float dots[T];
    tile<T, Int4, G>(w, scale, n, p.x + m0 * w.k, dots);
    for (int t = 0; t < T; ++t) {
      const float value = has_offsets(w) ? dots[t] + dot(offset, p.xsum + (m0 + t) * groups, groups) : dots[t];
      p.out[(m0 + t) * w.n + n] = p.bias ? value + p.bias[n] : value;
    }
  }

  template <bool Int4, int G>
  static void rows_of(const Prepared& p, std::int64_t n0, std::int64_t n1) {
    constexpr std::int64_t kChunk = 16;  // rows whose scales and offsets are converted at once
    const std::int64_t groups = p.w->k / p.w->group;
    // plain C allocation: no library template in this file (see above)
    auto* scale = static_cast<float*>(std::malloc(2 * kChunk * groups * sizeof(float)));
    float* offset = scale + kChunk * groups;
    for (std::int64_t c0 = n0; c0 < n1; c0 += kChunk) {
      const std::int64_t c1 = lesser(n1, c0 + kChunk);
      block_params(*p.w, c0, c1 - c0, scale, offset);  // vectorised over the chunk
      for (std::int64_t n = c0; n < c1; ++n) {
        const float *s = scale + (n - c0) * groups, *o = offset + (n - c0) * groups;
        for (std::int64_t m0 = 0; m0 < p.m; m0 += 4) {
          switch (lesser(4, p.m - m0)) {
            case 1: block<1, Int4, G>(p, s, o, n, m0); break;
            case 2: block<2, Int4, G>(p, s, o, n, m0); break;
            case 3: block<3, Int4, G>(p, s, o, n, m0); break;
            default: block<4, Int4, G>(p, s, o, n, m0); break;
          }
        }
      }
    }
    std::free(scale);
  }

  static void rows(const Prepared& p, std::int64_t n0, std::int64_t n1) {
    const std::int64_t group = p.w->group;
    if (p.w->int4) return group == 32 ? rows_of<true, 32>(p, n0, n1) : rows_of<true, 0>(p, n0, n1);
    if (group == 16) return rows_of<false, 16>(p, n0, n1);
    if (group == 32) return rows_of<false, 32>(p, n0, n1);
    return rows_of<false, 0>(p, n0, n1);
  }

  // Rows [n0, n1) of the dense weight into out (row n0 first): code * scale + offset, a product
  // then a sum (the reference's two roundings).
  // In bf16 (round to nearest even, torch's conversion) straight from the registers: a bf16 GEMM
  // takes the tile without a second pass over it.
  static void dequantize_rows(const QuantWeight& w, void* out, bool bf16, std::int64_t n0, std::int64_t n1) {
    const std::int64_t groups = w.k / w.group;
    float scale[kMaxGroups], offset[kMaxGroups];
    for (std::int64_t n = n0; n < n1; ++n) {
      block_params(w, n, 1, scale, offset);
      float* wide = static_cast<float*>(out) + (n - n0) * w.k;
      auto* narrow = static_cast<std::uint16_t*>(out) + (n - n0) * w.k;
      for (std::int64_t g = 0; g < groups; ++g) {
        const F s = V::splat(scale[g]), o = has_offsets(w) ? V::splat(offset[g]) : V::zero();
        const std::int64_t begin = g * w.group, end = begin + w.group;
        if (w.int4) {
          const auto* codes = reinterpret_cast<const std::uint8_t*>(w.codes) + n * w.k / 2;
          for (std::int64_t c = begin; c < end; c += 2 * W) {
            F lo, hi;
            V::nibbles(codes + c / 2, lo, hi);
            lo = V::add(V::mul(lo, s), o), hi = V::add(V::mul(hi, s), o);
            if constexpr (HasBf16Pairs<V>::value) {
              if (bf16) {
                V::store_bf16_pairs(narrow + c, lo, hi);
                continue;
              }
            }
            F first, second;
            V::interleave(lo, hi, first, second);
            bf16 ? V::store_bf16(narrow + c, first) : V::store(wide + c, first);
            bf16 ? V::store_bf16(narrow + c + W, second) : V::store(wide + c + W, second);
          }
        } else {
          const auto* codes = reinterpret_cast<const std::int8_t*>(w.codes) + n * w.k;
          for (std::int64_t c = begin; c < end; c += W) {
            const F v = V::add(V::mul(V::bytes(codes + c), s), o);
            bf16 ? V::store_bf16(narrow + c, v) : V::store(wide + c, v);
          }
        }
      }
    }
  }
};

}  // namespace

// Defined by isa_*.cpp (the x86 ones only where the compiler targets x86).
extern const IsaKernels kGenericKernels;
extern const IsaKernels kAvx2Kernels;
extern const IsaKernels kAvx512Kernels;
// The AVX512-BF16 dequantizations (isa_avx512bf16.cpp, where the compiler takes -mavx512bf16).
using DequantizeRows = decltype(IsaKernels::dequantize_rows);
using KQuantDequantizeRows = decltype(IsaKernels::kquant_dequantize_rows);
extern const DequantizeRows kAvx512Bf16Dequantize;
extern const KQuantDequantizeRows kAvx512Bf16KQuantDequantize;

// The instruction set the kernels run with, picked once per process (quant_matmul.cpp).
const IsaKernels& active_kernels();

}  // namespace ninfer::cpu

// The int8-activation ("a8") quant kernels: the weight codes times activations quantized to int8
// per block of 32 inputs, summed as integers four products at a time (AVX-512 VNNI vpdpbusd, AVX2
// maddubs + madd, or plain C), then scaled per lane. Why: the exact kernels (quant_kernels.h)
// convert every code to fp32 and spend ~8 vector operations per 32 weights, so decode on one core
// is arithmetic-bound; integer dot products take ~3x fewer (llama.cpp's way). Measured on Zen 4:
// 1.3-1.8x the exact kernel with the weights in cache, little of it left when they stream from
// DRAM (docs/performance.md, issue 18), so NINFER_CPU_MATH=int8 opts in.
//
// Layout. A chunk is W lanes of `span` inputs (int4: span 8, int8: span 4):
//   int8: lane i sums inputs k0 + 4i .. k0 + 4i + 3, the codes as they are;
//   int4: the chunk's 4W code bytes split into their low and high nibbles; lane i of the low half
//         holds inputs k0 + 8i + {0, 2, 4, 6}, of the high half + {1, 3, 5, 7}, so the activations
//         are arranged per chunk as [even inputs | odd inputs] (quant_matmul.cpp) and one lane sums
//         the 8 inputs k0 + 8i .. k0 + 8i + 7, the codes never shuffled.
// A lane lies in one weight group and one activation block, so its integer sum is scaled by
// scale[group] * xscale[block] (both expanded per lane) into an fp32 accumulator. The offsets
// (Q4_1, K-quant minimums, the int4 -8) multiply the exact fp32 group sums of x, as in the exact
// kernel. A row whose length is not whole chunks runs its last chunk from a zero-padded copy.
//
// V provides, beyond quant_kernels.h: B (4W bytes), I (W int32), Idx (W lane indices), bytes4
// (load 4W bytes), nibble_halves (4W code bytes -> low / high nibbles), izero, iload, to_float,
// make_idx, expand (W floats p[idx[i]]), dot_u8 (acc[i] += sum of 4 unsigned x signed products of
// lane i), and for signed codes either kBiasedS8 = true with flip (xor 0x80, the unsigned form
// dot_u8 multiplies; the accumulator then starts at -128 times the lane's activation sum) or
// dot_s8 (acc[i] += sum of 4 signed x signed products).
#pragma once

#include "quant_kernels.h"

namespace ninfer::cpu {
namespace {

template <class V>
struct A8Kernels {
  using F = typename V::F;
  using B = typename V::B;
  using I = typename V::I;
  using Idx = typename V::Idx;
  static constexpr int W = V::W;

  // acc[t] += this chunk of a weight row (its codes at `codes`, lane scales ws) . x rows m0 + t.
  template <int T, bool Int4>
  static void chunk(const PreparedA8& p, const std::uint8_t* codes, F ws, std::int64_t c, std::int64_t m0, F* acc) {
    constexpr std::int64_t kChunk = (Int4 ? 8 : 4) * W;
    const std::int64_t lanes = p.kpad / (Int4 ? 8 : 4);  // per activation row
    if constexpr (Int4) {
      B lo, hi;
      V::nibble_halves(codes, lo, hi);
      for (int t = 0; t < T; ++t) {
        const std::int8_t* xq = p.xq + (m0 + t) * p.kpad + c * kChunk;
        const I s = V::dot_u8(V::dot_u8(V::izero(), lo, xq), hi, xq + 4 * W);
        acc[t] = V::fma(V::to_float(s), V::mul(ws, V::load(p.xlane + (m0 + t) * lanes + c * W)), acc[t]);
      }
    } else {
      const B b = V::bytes4(codes);
      for (int t = 0; t < T; ++t) {
        const std::int8_t* xq = p.xq + (m0 + t) * p.kpad + c * kChunk;
        I s;
        if constexpr (V::kBiasedS8) {
          s = V::dot_u8(V::iload(p.corr + (m0 + t) * lanes + c * W), V::flip(b), xq);
        } else {
          s = V::dot_s8(V::izero(), b, xq);
        }
        acc[t] = V::fma(V::to_float(s), V::mul(ws, V::load(p.xlane + (m0 + t) * lanes + c * W)), acc[t]);
      }
    }
  }

  // Weight row n (fp32 scales / offsets s, o) against x rows [m0, m0 + T).
  template <int T, bool Int4>
  static void block(const PreparedA8& p, const float* s, const float* o, Idx idx, std::int64_t n, std::int64_t m0) {
    const QuantWeight& w = *p.w;
    constexpr std::int64_t kSpan = Int4 ? 8 : 4, kChunk = kSpan * W, kChunkBytes = 4 * W;
    const std::int64_t full = w.k / kChunk, groups = w.k / w.group;
    const auto* row = reinterpret_cast<const std::uint8_t*>(w.codes) + n * (Int4 ? w.k / 2 : w.k);
    F acc[T];
    for (int t = 0; t < T; ++t) acc[t] = V::zero();
    // the chunk's first group: `step` groups on every `per` chunks (no division in the loop)
    const std::int64_t per = w.group > kChunk ? w.group / kChunk : 1, step = w.group > kChunk ? 1 : kChunk / w.group;
    const float* first = s;
    for (std::int64_t c = 0, in_group = 0; c < full; ++c) {
      chunk<T, Int4>(p, row + c * kChunkBytes, V::expand(first, idx), c, m0, acc);
      if (++in_group == per) in_group = 0, first += step;
    }
    if (full * kChunk < w.k) {  // the last, partial chunk (groups < a chunk): zeros past the row
      std::uint8_t codes[kChunkBytes] = {};
      std::memcpy(codes, row + full * kChunkBytes, (w.k - full * kChunk) / (Int4 ? 2 : 1));
      float ws[W];
      const std::int64_t lanes = (w.k - full * kChunk) / kSpan;
      for (int i = 0; i < W; ++i) ws[i] = i < lanes ? first[p.lane_group[i]] : 0.0f;
      chunk<T, Int4>(p, codes, V::load(ws), full, m0, acc);
    }
    for (int t = 0; t < T; ++t) {
      const float dots = V::sum(acc[t]);
      const float value = Kernels<V>::has_offsets(w) ? dots + Kernels<V>::dot(o, p.xsum + (m0 + t) * groups, groups) : dots;
      p.out[(m0 + t) * w.n + n] = p.bias ? value + p.bias[n] : value;
    }
  }

  template <bool Int4>
  static void rows_of(const PreparedA8& p, std::int64_t n0, std::int64_t n1) {
    constexpr std::int64_t kRows = 16;  // rows whose scales and offsets are converted at once
    const std::int64_t groups = p.w->k / p.w->group;
    // W floats of slack: `expand` loads W scales from a lane's first group on
    auto* scale = static_cast<float*>(std::calloc(2 * kRows * groups + W, sizeof(float)));
    float* offset = scale + kRows * groups;
    const Idx idx = V::make_idx(p.lane_group);
    for (std::int64_t c0 = n0; c0 < n1; c0 += kRows) {
      const std::int64_t c1 = lesser(n1, c0 + kRows);
      Kernels<V>::block_params(*p.w, c0, c1 - c0, scale, offset);
      for (std::int64_t n = c0; n < c1; ++n) {
        const float *s = scale + (n - c0) * groups, *o = offset + (n - c0) * groups;
        for (std::int64_t m0 = 0; m0 < p.m; m0 += 4) {
          switch (lesser(4, p.m - m0)) {
            case 1: block<1, Int4>(p, s, o, idx, n, m0); break;
            case 2: block<2, Int4>(p, s, o, idx, n, m0); break;
            case 3: block<3, Int4>(p, s, o, idx, n, m0); break;
            default: block<4, Int4>(p, s, o, idx, n, m0); break;
          }
        }
      }
    }
    std::free(scale);
  }

  static void rows(const PreparedA8& p, std::int64_t n0, std::int64_t n1) {
    return p.w->int4 ? rows_of<true>(p, n0, n1) : rows_of<false>(p, n0, n1);
  }
};

}  // namespace
}  // namespace ninfer::cpu

// The K-quant kernels (kquant.h), written once over a vector type V like quant_kernels.h; each
// isa_*.cpp compiles them with its instruction set.
//
// Decode: a pack's 16 rows at once against T activation rows quantized to int8 per 32 inputs
// (Q4_K, Q5_K, Q6_K; Q8_0, Q4_0 and Q4_1 the same way: kquant.h).
// Four code bytes of a row sit in one int32 lane, and the four activations they multiply are the
// same for every row, so one vector of codes meets one broadcast activation word: integer dot
// products of 4 (AVX-512 VNNI vpdpbusd; AVX2 maddubs + madd; plain C) summed per sub-block, times
// the rows' integer sub-block scales (one vector multiply per sub-block and 16 rows), then per
// 32 inputs converted to fp32 and times d and the activation scale. Q6_K's -32 multiplies the
// activation codes' sums per 16 (in integers, before the scale), Q4_K's minimums the quantized
// activations' sums per 32; both are computed once per call.
// Why this shape, measured on Zen 4 (docs/performance.md, issue 18, third pass): the codes are
// read as one sequential stream at ~0.1 vector operation per weight byte (~30 GB/s from the L2,
// DRAM gives ~20), so the memory stream, not the arithmetic, sets the pace. One activation scale
// per 32 inputs rather than llama.cpp's per 256: Qwen2.5's few huge activation channels then
// coarsen 1/48 of the values instead of a third (decode KL 1e-3 instead of 2e-2), for ~10% more
// arithmetic and no measurable speed.
//
// V provides, beyond quant_kernels.h / quant_kernels_a8.h: with_high<S> (lo | (qh shifted left by
// S, right by -S, in 16-bit lanes) & 0x30: a six-bit code from its low nibble and two high bits),
// store_bytes, dot_u8_word (acc[i] += the 4 unsigned bytes of lane i times the 4 signed bytes at
// x, the same for every lane), iadd, isub, imul, isplat, widen_u8 / widen_s8 (W bytes -> W int32),
// and for the activations vabs, vmax, hmax, round_to_int (round half to even) and store_i8.
#pragma once

#include "kquant.h"
#include "quant_kernels.h"

namespace ninfer::cpu {

// A part of a K-quant weight resolved for the kernels (kquant_matmul.cpp makes them).
struct KQuantSpan {
  BlockType type;
  std::int64_t rows;   // output rows
  std::int64_t row0;   // its first output row in the weight
  std::int64_t pack0;  // its first pack, counted over the weight's parts
  const std::uint8_t* data;
};

constexpr std::int64_t kActivationBlock = 32;  // inputs per activation scale

// x quantized per group of 32 inputs: codes, scales (absmax / 127), the codes' sums per 16 (Q6_K's
// -32) and the quantized values' sums per 32 (Q4_K's minimums).
struct ActivationsQ8K {
  const std::int8_t* q;        // [m, k]
  const float* d;              // [m, k / 32]
  const std::int32_t* sums16;  // [m, k / 16]
  const float* sums32;         // [m, k / 32]
};

struct PreparedKQ {
  const KQuantSpan* spans;
  int parts;
  std::int64_t k, n;  // n: output rows of the weight
  ActivationsQ8K x;
  float* out;         // [m, n]
  const float* bias;  // [n] or null
  std::int64_t m;
};

namespace {

template <class V>
struct KQuantKernels {
  using F = typename V::F;
  using B = typename V::B;
  using I = typename V::I;
  static constexpr int W = V::W;
  static constexpr int kHalves = kPackRows / W;  // vectors per 16 rows
  static constexpr int kMaxT = 4;                // activation rows per pass over a pack
  static constexpr std::int64_t kQ4Bytes = kPackRows * block_bytes(BlockType::Q4_K),
                                kQ5Bytes = kPackRows * block_bytes(BlockType::Q5_K),
                                kQ6Bytes = kPackRows * block_bytes(BlockType::Q6_K);

  // The four six-bit byte vectors of a packing (kquant.h): from the low-nibble bytes `a` (values
  // v and v + 128 of a), `b` (of b) and the high-bit bytes `h` (4W bytes each).
  static void six_bits(const std::uint8_t* a, const std::uint8_t* b, const std::uint8_t* h, B v[4]) {
    B a_lo, a_hi, b_lo, b_hi;
    V::nibble_halves(a, a_lo, a_hi);
    V::nibble_halves(b, b_lo, b_hi);
    const B high = V::bytes4(h);
    v[0] = V::template with_high<4>(a_lo, high);
    v[1] = V::template with_high<2>(b_lo, high);
    v[2] = V::template with_high<0>(a_hi, high);
    v[3] = V::template with_high<-2>(b_hi, high);
  }

  // A Q4_K block's scales and minimums as bytes: sm[16j + r] = sc[j][r], sm[128 + 16j + r] = m[j][r].
  static void q4k_scales(const std::uint8_t* block, std::uint8_t* sm) {
    for (int i = 0; i < 64; i += 4 * W) {
      B v[4];
      six_bits(block + 64 + i, block + 128 + i, block + 192 + i, v);
      for (int q = 0; q < 4; ++q) V::store_bytes(sm + 64 * q + i, v[q]);
    }
  }

  template <int T>
  static void zero_all(F (&acc)[kHalves][T]) {
    for (auto& row : acc)
      for (auto& a : row) a = V::zero();
  }

  // out[t][r] = acc's lane of row r (the pack's rows W to a vector).
  template <int T>
  static void store_all(const F (&acc)[kHalves][T], float (*out)[kPackRows]) {
    for (int h = 0; h < kHalves; ++h)
      for (int t = 0; t < T; ++t) V::store(out[t] + W * h, acc[h][t]);
  }

  // out[t][r] = row r of the pack at `pack` . x rows m0 + t (T of them), without bias. Q4_K, or
  // Q5_K (Five: a fifth bit of every code from qh, sub-block s's in bit s of its byte).
  template <int T, bool Five>
  static void q45k_pack(const PreparedKQ& p, const std::uint8_t* pack, std::int64_t m0, float (*out)[kPackRows]) {
    const std::int64_t blocks = p.k / kSuperBlock, groups = p.k / kActivationBlock;
    F acc[kHalves][T];
    zero_all(acc);
    alignas(64) std::uint8_t sm[256];
    for (std::int64_t b = 0; b < blocks; ++b, pack += Five ? kQ5Bytes : kQ4Bytes) {
      q4k_scales(pack, sm);
      const std::uint8_t *qh = pack + 256, *qs = pack + (Five ? 768 : 256);
      for (int h = 0; h < kHalves; ++h) {
        const auto* d16 = reinterpret_cast<const std::uint16_t*>(pack) + W * h;
        const F d = V::halves(d16), dmin = V::halves(d16 + kPackRows);
        F mins[T];
        for (int t = 0; t < T; ++t) mins[t] = V::zero();
        for (int sub = 0; sub < 4; ++sub) {  // inputs 64 sub .. 64 sub + 63: sub-blocks 2 sub, 2 sub + 1
          I lo_dot[T], hi_dot[T];
          for (int t = 0; t < T; ++t) lo_dot[t] = hi_dot[t] = V::izero();
          for (int c = 0; c < 8; ++c) {
            B lo, hi;
            V::nibble_halves(qs + (8 * sub + c) * 64 + 4 * W * h, lo, hi);
            if constexpr (Five) {  // codes < 32: maddubs' int16 pairs stay exact
              const B high = V::bytes4(qh + c * 64 + 4 * W * h);
              lo = V::with_bit(lo, high, 2 * sub);
              hi = V::with_bit(hi, high, 2 * sub + 1);
            }
            for (int t = 0; t < T; ++t) {
              const std::int8_t* x = p.x.q + (m0 + t) * p.k + b * kSuperBlock + 64 * sub + 4 * c;
              lo_dot[t] = V::dot_u8_word(lo_dot[t], lo, x);
              hi_dot[t] = V::dot_u8_word(hi_dot[t], hi, x + 32);
            }
          }
          const I sc_lo = V::widen_u8(sm + 32 * sub + W * h), sc_hi = V::widen_u8(sm + 32 * sub + 16 + W * h);
          for (int t = 0; t < T; ++t) {  // below 2^24: exact in fp32
            const float* xd = p.x.d + (m0 + t) * groups + b * 8 + 2 * sub;
            acc[h][t] = V::fma(V::to_float(V::imul(lo_dot[t], sc_lo)), V::mul(d, V::splat(xd[0])), acc[h][t]);
            acc[h][t] = V::fma(V::to_float(V::imul(hi_dot[t], sc_hi)), V::mul(d, V::splat(xd[1])), acc[h][t]);
          }
        }
        for (int j = 0; j < 8; ++j) {
          const F m = V::to_float(V::widen_u8(sm + 128 + 16 * j + W * h));
          for (int t = 0; t < T; ++t) mins[t] = V::fma(m, V::splat(p.x.sums32[(m0 + t) * groups + b * 8 + j]), mins[t]);
        }
        for (int t = 0; t < T; ++t) acc[h][t] = V::fma(V::mul(dmin, V::splat(-1.0f)), mins[t], acc[h][t]);
      }
    }
    store_all(acc, out);
  }

  template <int T>
  static void q6k_pack(const PreparedKQ& p, const std::uint8_t* pack, std::int64_t m0, float (*out)[kPackRows]) {
    const std::int64_t blocks = p.k / kSuperBlock, groups = p.k / kActivationBlock;
    F acc[kHalves][T];
    zero_all(acc);
    for (std::int64_t b = 0; b < blocks; ++b, pack += kQ6Bytes) {
      const auto* sc = reinterpret_cast<const std::int8_t*>(pack + 32);
      const std::uint8_t* steps = pack + 288;
      for (int h = 0; h < kHalves; ++h) {
        const F d = V::halves(reinterpret_cast<const std::uint16_t*>(pack) + W * h);
        for (int half = 0; half < 2; ++half) {
          I isum[4][T];  // [q]: sub-blocks 8 half + 2 q and + 1, activation group 4 half + q
          for (auto& row : isum)
            for (auto& a : row) a = V::izero();
          for (int cg = 0; cg < 2; ++cg) {  // steps 4 cg .. 4 cg + 3: sub-blocks 8 half + 2 q + cg
            I dot[4][T];
            for (auto& row : dot)
              for (auto& a : row) a = V::izero();
            for (int c = 4 * cg; c < 4 * cg + 4; ++c) {
              const std::uint8_t* step = steps + (8 * half + c) * 192 + 4 * W * h;
              B v[4];
              six_bits(step, step + 64, step + 128, v);
              for (int t = 0; t < T; ++t) {
                const std::int8_t* x = p.x.q + (m0 + t) * p.k + b * kSuperBlock + 128 * half + 4 * c;
                for (int q = 0; q < 4; ++q) dot[q][t] = V::dot_u8_word(dot[q][t], v[q], x + 32 * q);
              }
            }
            for (int q = 0; q < 4; ++q) {
              const int s = 8 * half + 2 * q + cg;
              const I scale = V::widen_s8(sc + 16 * s + W * h);
              for (int t = 0; t < T; ++t) {
                const std::int32_t bias = 32 * p.x.sums16[(m0 + t) * (p.k / 16) + b * 16 + s];  // the codes' -32
                isum[q][t] = V::iadd(isum[q][t], V::imul(V::isub(dot[q][t], V::isplat(bias)), scale));
              }
            }
          }
          for (int q = 0; q < 4; ++q) {
            for (int t = 0; t < T; ++t) {  // |isum| <= 2 * 16 * 64 * 127 * 128: exact in fp32
              const float xd = p.x.d[(m0 + t) * groups + b * 8 + 4 * half + q];
              acc[h][t] = V::fma(V::to_float(isum[q][t]), V::mul(d, V::splat(xd)), acc[h][t]);
            }
          }
        }
      }
    }
    store_all(acc, out);
  }

  // Q8_0, Q4_0, Q4_1 (eight blocks of 32 inputs to a span, kquant.h): per block the codes' integer
  // dots (|.| <= 32 * 128 * 127: exact in fp32), times d and the activation scale, then the type's
  // offset. Q8_0: where the products take unsigned codes (kBiasedS8: VNNI), the stored q + 128 less
  // 128 times the activation codes' sum; else (AVX2's saturating pairs, plain C) the signed codes.
  // Q4_0: the nibbles less 8 times the activation codes' sum; Q4_1: plus m times the quantized
  // activations' sum (sums32).
  template <int T, BlockType kType>
  static void blocks32_pack(const PreparedKQ& p, const std::uint8_t* pack, std::int64_t m0, float (*out)[kPackRows]) {
    constexpr bool kNibbles = kType != BlockType::Q8_0;
    constexpr int kTables = kType == BlockType::Q4_1 ? 2 : 1;  // fp16 [8][16] tables before the codes: d (, m)
    constexpr std::int32_t kBias = kType == BlockType::Q4_0 ? 8 : kType == BlockType::Q8_0 && V::kBiasedS8 ? 128 : 0;
    const std::int64_t blocks = p.k / kSuperBlock, groups = p.k / kActivationBlock;
    F acc[kHalves][T];
    zero_all(acc);
    for (std::int64_t b = 0; b < blocks; ++b, pack += kPackRows * block_bytes(kType)) {
      const std::uint8_t* qs = pack + 256 * kTables;
      for (int h = 0; h < kHalves; ++h) {
        for (int j = 0; j < 8; ++j) {
          const auto* d16 = reinterpret_cast<const std::uint16_t*>(pack) + kPackRows * j + W * h;
          const F d = V::halves(d16);
          I dot[T];
          for (auto& a : dot) a = V::izero();
          for (int c = 0; c < (kNibbles ? 4 : 8); ++c) {
            const std::uint8_t* at = qs + ((kNibbles ? 4 : 8) * j + c) * 64 + 4 * W * h;
            B lo{}, hi{};  // the low and high nibbles' codes, or Q8_0's (signed where the products want them)
            if constexpr (kNibbles) {
              V::nibble_halves(at, lo, hi);
            } else {
              lo = V::kBiasedS8 ? V::bytes4(at) : V::flip(V::bytes4(at));
            }
            for (int t = 0; t < T; ++t) {
              const std::int8_t* x = p.x.q + (m0 + t) * p.k + b * kSuperBlock + 32 * j + 4 * c;
              if constexpr (kNibbles) {
                dot[t] = V::dot_u8_word(V::dot_u8_word(dot[t], lo, x), hi, x + 16);
              } else if constexpr (V::kBiasedS8) {
                dot[t] = V::dot_u8_word(dot[t], lo, x);
              } else {
                dot[t] = V::dot_s8_word(dot[t], lo, x);
              }
            }
          }
          const std::int64_t g = b * 8 + j;
          for (int t = 0; t < T; ++t) {
            const std::int32_t* sums = p.x.sums16 + (m0 + t) * (p.k / 16) + 2 * g;
            const I centred = kBias ? V::isub(dot[t], V::isplat(kBias * (sums[0] + sums[1]))) : dot[t];
            acc[h][t] = V::fma(V::to_float(centred), V::mul(d, V::splat(p.x.d[(m0 + t) * groups + g])), acc[h][t]);
            if constexpr (kType == BlockType::Q4_1) {
              acc[h][t] = V::fma(V::halves(d16 + 8 * kPackRows), V::splat(p.x.sums32[(m0 + t) * groups + g]), acc[h][t]);
            }
          }
        }
      }
    }
    store_all(acc, out);
  }

  template <int T>
  static void pack_dots(const PreparedKQ& p, const KQuantSpan& s, const std::uint8_t* pack, std::int64_t m0,
                        float (*out)[kPackRows]) {
    if (s.type == BlockType::Q4_0) {
      blocks32_pack<T, BlockType::Q4_0>(p, pack, m0, out);
    } else if (s.type == BlockType::Q4_1) {
      blocks32_pack<T, BlockType::Q4_1>(p, pack, m0, out);
    } else if (s.type == BlockType::Q4_K) {
      q45k_pack<T, false>(p, pack, m0, out);
    } else if (s.type == BlockType::Q5_K) {
      q45k_pack<T, true>(p, pack, m0, out);
    } else if (s.type == BlockType::Q6_K) {
      q6k_pack<T>(p, pack, m0, out);
    } else {
      blocks32_pack<T, BlockType::Q8_0>(p, pack, m0, out);
    }
  }

  // Packs [g0, g1) of the weight (counted over its parts): every activation row, bias added.
  static void rows(const PreparedKQ& p, std::int64_t g0, std::int64_t g1) {
    alignas(64) float dots[kMaxT][kPackRows];
    for (int i = 0; i < p.parts; ++i) {
      const KQuantSpan& s = p.spans[i];
      const std::int64_t packs = (s.rows + kPackRows - 1) / kPackRows;
      const std::int64_t bytes = kPackRows * block_bytes(s.type) * (p.k / kSuperBlock);
      for (std::int64_t g = g0 > s.pack0 ? g0 : s.pack0; g < g1 && g < s.pack0 + packs; ++g) {
        const std::int64_t local = g - s.pack0, valid = lesser(kPackRows, s.rows - local * kPackRows);
        const std::uint8_t* pack = s.data + local * bytes;
        for (std::int64_t m0 = 0; m0 < p.m; m0 += kMaxT) {
          const std::int64_t count = lesser(kMaxT, p.m - m0);
          switch (count) {
            case 1: pack_dots<1>(p, s, pack, m0, dots); break;
            case 2: pack_dots<2>(p, s, pack, m0, dots); break;
            case 3: pack_dots<3>(p, s, pack, m0, dots); break;
            default: pack_dots<4>(p, s, pack, m0, dots); break;
          }
          const std::int64_t n0 = s.row0 + local * kPackRows;
          for (std::int64_t t = 0; t < count; ++t) {
            float* dst = p.out + (m0 + t) * p.n + n0;
            for (std::int64_t r = 0; r < valid; ++r) dst[r] = p.bias ? dots[t][r] + p.bias[n0 + r] : dots[t][r];
          }
        }
      }
    }
  }

  // One row of x (k values) quantized per group of 32 (kquant.h): codes, scales, the codes' sums
  // per 16 and the quantized values' sums per 32 (scale times the codes' sum).
  static void quantize(const float* x, std::int64_t k, std::int8_t* q, float* d, std::int32_t* sums16, float* sums32) {
    for (std::int64_t g = 0; g < k / kActivationBlock; ++g) {
      const float* xg = x + g * kActivationBlock;
      F amax = V::zero();
      for (int i = 0; i < kActivationBlock; i += W) amax = V::vmax(amax, V::vabs(V::load(xg + i)));
      const float top = V::hmax(amax);
      d[g] = top / 127.0f;
      const F inv = V::splat(top > 0 ? 127.0f / top : 0.0f);  // ops/quant.py quantize_activations_ref: the same
      std::int8_t* qg = q + g * kActivationBlock;
      for (int i = 0; i < kActivationBlock; i += W) V::store_i8(qg + i, V::round_to_int(V::mul(V::load(xg + i), inv)));
      for (int s = 0; s < 2; ++s) {
        std::int32_t sum = 0;
        for (int i = 0; i < 16; ++i) sum += qg[16 * s + i];
        sums16[2 * g + s] = sum;
      }
      sums32[g] = d[g] * static_cast<float>(sums16[2 * g] + sums16[2 * g + 1]);
    }
  }

  // Rows [r0, r1) of part s (rows counted in the part) as floats, gguf-py's values (kquant.h), into
  // out (row r0 first, k values a row; bf16: round to nearest even).
  static void dequantize_rows(const KQuantSpan& s, std::int64_t k, std::int64_t r0, std::int64_t r1, void* out,
                              bool bf16) {
    const std::int64_t blocks = k / kSuperBlock, bytes = kPackRows * block_bytes(s.type);
    alignas(64) float values[kSuperBlock];
    alignas(64) std::uint8_t sm[256];
    alignas(64) std::uint8_t codes[kPackRows][kSuperBlock];
    for (std::int64_t r = r0; r < r1;) {
      const std::int64_t pack = r / kPackRows, end = lesser(r1, (pack + 1) * kPackRows);
      for (std::int64_t b = 0; b < blocks; ++b) {
        const std::uint8_t* block = s.data + (pack * blocks + b) * bytes;
        if (s.type == BlockType::Q4_K || s.type == BlockType::Q5_K) {
          q4k_scales(block, sm);
        } else if (s.type == BlockType::Q6_K) {
          q6k_codes(block, codes);
        }
        for (std::int64_t row = r; row < end; ++row) {
          const int lane = static_cast<int>(row % kPackRows);
          if (s.type == BlockType::Q4_K) {
            q45k_row<false>(block, sm, lane, values);
          } else if (s.type == BlockType::Q5_K) {
            q45k_row<true>(block, sm, lane, values);
          } else if (s.type == BlockType::Q6_K) {
            q6k_row(block, codes[lane], lane, values);
          } else if (s.type == BlockType::Q8_0) {
            q80_row(block, lane, values);
          } else {
            q4x_row(block, s.type == BlockType::Q4_1, lane, values);
          }
          const std::int64_t at = (row - r0) * k + b * kSuperBlock;
          if (bf16) {
            auto* dst = static_cast<std::uint16_t*>(out) + at;
            for (int i = 0; i < kSuperBlock; i += W) V::store_bf16(dst + i, V::load(values + i));
          } else {
            std::memcpy(static_cast<float*>(out) + at, values, sizeof values);
          }
        }
      }
      r = end;
    }
  }

  // Row `lane` of a Q8_0 super-block: d * q, as gguf-py.
  static void q80_row(const std::uint8_t* block, int lane, float* values) {
    const auto* d16 = reinterpret_cast<const std::uint16_t*>(block);
    alignas(64) std::uint8_t raw[kSuperBlock];
    for (int c = 0; c < 64; ++c) std::memcpy(raw + 4 * c, block + 256 + 64 * c + 4 * lane, 4);
    alignas(64) std::int8_t q[kSuperBlock];
    for (int i = 0; i < kSuperBlock; ++i) q[i] = static_cast<std::int8_t>(raw[i] ^ 0x80);
    for (int j = 0; j < 8; ++j) {
      const F d = V::splat(half_to_float(d16[kPackRows * j + lane]));
      for (int i = 0; i < 32; i += W) V::store(values + 32 * j + i, V::mul(d, V::bytes(q + 32 * j + i)));
    }
  }

  // Row `lane` of a Q4_0 / Q4_1 (one) super-block: d * (q - 8), d * q + m, as gguf-py.
  static void q4x_row(const std::uint8_t* block, bool one, int lane, float* values) {
    const auto* d16 = reinterpret_cast<const std::uint16_t*>(block);
    const std::uint8_t* qs = block + (one ? 512 : 256);
    for (int j = 0; j < 8; ++j) {
      alignas(64) std::uint8_t raw[16];  // the block's qs bytes of this row, in the file's order
      for (int c = 0; c < 4; ++c) std::memcpy(raw + 4 * c, qs + (4 * j + c) * 64 + 4 * lane, 4);
      const F d = V::splat(half_to_float(d16[kPackRows * j + lane]));
      const F m = V::splat(one ? half_to_float(d16[kPackRows * (8 + j) + lane]) : -8.0f);
      for (int i = 0; i < 16; i += W) {
        F lo, hi;
        V::nibbles(raw + i, lo, hi);
        V::store(values + 32 * j + i, one ? V::add(V::mul(d, lo), m) : V::mul(d, V::add(lo, m)));
        V::store(values + 32 * j + 16 + i, one ? V::add(V::mul(d, hi), m) : V::mul(d, V::add(hi, m)));
      }
    }
  }

  // Row `lane` of a Q4_K / Q5_K block (scales unpacked in sm): (d * sc) * q - dmin * m, as gguf-py.
  template <bool Five>
  static void q45k_row(const std::uint8_t* block, const std::uint8_t* sm, int lane, float* values) {
    const auto* d16 = reinterpret_cast<const std::uint16_t*>(block);
    const float d = half_to_float(d16[lane]), dmin = half_to_float(d16[kPackRows + lane]);
    std::uint8_t qs[128], qh[32];  // the row's bytes in the file's order
    for (int i = 0; i < 32; ++i) std::memcpy(qs + 4 * i, block + (Five ? 768 : 256) + 64 * i + 4 * lane, 4);
    if constexpr (Five) {
      for (int i = 0; i < 8; ++i) std::memcpy(qh + 4 * i, block + 256 + 64 * i + 4 * lane, 4);
    }
    for (int sub = 0; sub < 4; ++sub) {
      const F s_lo = V::splat(d * sm[32 * sub + lane]), s_hi = V::splat(d * sm[32 * sub + 16 + lane]);
      const F o_lo = V::splat(-(dmin * sm[128 + 32 * sub + lane])), o_hi = V::splat(-(dmin * sm[128 + 32 * sub + 16 + lane]));
      alignas(64) std::int8_t fifth[64];  // Q5_K: 16 times the fifth bit of the sub-blocks' inputs
      if constexpr (Five) {
        for (int l = 0; l < 32; ++l) {
          fifth[l] = static_cast<std::int8_t>(((qh[l] >> (2 * sub)) & 1) << 4);
          fifth[32 + l] = static_cast<std::int8_t>(((qh[l] >> (2 * sub + 1)) & 1) << 4);
        }
      }
      for (int i = 0; i < 32; i += W) {
        F lo, hi;
        V::nibbles(qs + 32 * sub + i, lo, hi);
        if constexpr (Five) {
          lo = V::add(lo, V::bytes(fifth + i));
          hi = V::add(hi, V::bytes(fifth + 32 + i));
        }
        V::store(values + 64 * sub + i, V::add(V::mul(s_lo, lo), o_lo));
        V::store(values + 64 * sub + 32 + i, V::add(V::mul(s_hi, hi), o_hi));
      }
    }
  }

  // The six-bit codes (0..63) of a Q6_K block's 16 rows, row-major: decoded as the matmul decodes
  // them, four codes of a row to a word.
  static void q6k_codes(const std::uint8_t* block, std::uint8_t (*codes)[kSuperBlock]) {
    alignas(64) std::uint8_t v[4][4 * W];
    for (int half = 0; half < 2; ++half) {
      for (int c = 0; c < 8; ++c) {
        for (int h = 0; h < kHalves; ++h) {
          const std::uint8_t* step = block + 288 + (8 * half + c) * 192 + 4 * W * h;
          B words[4];
          six_bits(step, step + 64, step + 128, words);
          for (int q = 0; q < 4; ++q) V::store_bytes(v[q], words[q]);
          for (int q = 0; q < 4; ++q)
            for (int r = 0; r < W; ++r) std::memcpy(codes[W * h + r] + 128 * half + 32 * q + 4 * c, v[q] + 4 * r, 4);
        }
      }
    }
  }

  // Row `lane` of a Q6_K block (its codes decoded): (d * sc) * (q - 32), as gguf-py.
  static void q6k_row(const std::uint8_t* block, const std::uint8_t* codes, int lane, float* values) {
    const float d = half_to_float(reinterpret_cast<const std::uint16_t*>(block)[lane]);
    const auto* sc = reinterpret_cast<const std::int8_t*>(block + 32);
    const auto* q = reinterpret_cast<const std::int8_t*>(codes);  // codes < 64: the same as signed bytes
    for (int i = 0; i < kSuperBlock; i += W) {
      const F centred = V::add(V::bytes(q + i), V::splat(-32.0f));  // exact
      V::store(values + i, V::mul(V::splat(d * static_cast<float>(sc[16 * (i / 16) + lane])), centred));
    }
  }
};

}  // namespace
}  // namespace ninfer::cpu

// The quant kernels in portable C++ (8-float arrays the compiler vectorizes as it can): every CPU
// without AVX2, and the reference the x86 paths are tested beside.
#include "isa_kernels.h"

namespace ninfer::cpu {
namespace {

struct Generic {
  static constexpr int W = 8;
  struct F {
    float v[W];
  };
  static F zero() { return F{}; }
  static F load(const float* p) {
    F r;
    for (int i = 0; i < W; ++i) r.v[i] = p[i];
    return r;
  }
  static void store(float* p, F a) {
    for (int i = 0; i < W; ++i) p[i] = a.v[i];
  }
  static void interleave(F lo, F hi, F& first, F& second) {
    for (int i = 0; i < W; ++i) {
      F& half = i < W / 2 ? first : second;
      half.v[2 * (i % (W / 2))] = lo.v[i];
      half.v[2 * (i % (W / 2)) + 1] = hi.v[i];
    }
  }
  static void store_bf16(std::uint16_t* p, F a) {
    for (int i = 0; i < W; ++i) p[i] = bf16_bits(a.v[i]);
  }
  static F splat(float s) {
    F r;
    for (int i = 0; i < W; ++i) r.v[i] = s;
    return r;
  }
  static F add(F a, F b) {
    for (int i = 0; i < W; ++i) a.v[i] += b.v[i];
    return a;
  }
  static F mul(F a, F b) {
    for (int i = 0; i < W; ++i) a.v[i] *= b.v[i];
    return a;
  }
  static F sub(F a, F b) {
    for (int i = 0; i < W; ++i) a.v[i] -= b.v[i];
    return a;
  }
  static F div(F a, F b) {
    for (int i = 0; i < W; ++i) a.v[i] /= b.v[i];
    return a;
  }
  static F fma(F a, F b, F c) {
    for (int i = 0; i < W; ++i) c.v[i] += a.v[i] * b.v[i];
    return c;
  }
  static F max(F a, F b) {
    for (int i = 0; i < W; ++i) a.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i];
    return a;
  }
  static F round(F a) {
    for (int i = 0; i < W; ++i) a.v[i] = __builtin_rintf(a.v[i]);
    return a;
  }
  static F times_pow2(F x, F n) {
    for (int i = 0; i < W; ++i) x.v[i] = __builtin_ldexpf(x.v[i], static_cast<int>(n.v[i]));
    return x;
  }
  static float sum(F a) {
    float s = 0;
    for (int i = 0; i < W; ++i) s += a.v[i];
    return s;
  }
  static F halves(const std::uint16_t* p) {
    F r;
    for (int i = 0; i < W; ++i) r.v[i] = half_to_float(p[i]);
    return r;
  }
  static F bf16s(const std::uint16_t* p) {
    F r;
    for (int i = 0; i < W; ++i) r.v[i] = bf16_to_float(p[i]);
    return r;
  }
  static F bytes(const std::int8_t* p) {
    F r;
    for (int i = 0; i < W; ++i) r.v[i] = p[i];
    return r;
  }
  static void nibbles(const std::uint8_t* p, F& lo, F& hi) {
    for (int i = 0; i < W; ++i) {
      lo.v[i] = static_cast<float>(p[i] & 15);
      hi.v[i] = static_cast<float>(p[i] >> 4);
    }
  }

  // int8-activation dot products (quant_kernels_a8.h)
  struct B {
    std::uint8_t b[4 * W];
  };
  struct I {
    std::int32_t v[W];
  };
  using Idx = I;
  static constexpr bool kBiasedS8 = false;
  static B bytes4(const std::uint8_t* p) {
    B r;
    std::memcpy(r.b, p, sizeof r.b);
    return r;
  }
  static void nibble_halves(const std::uint8_t* p, B& lo, B& hi) {
    for (int i = 0; i < 4 * W; ++i) {
      lo.b[i] = p[i] & 15;
      hi.b[i] = p[i] >> 4;
    }
  }
  static I izero() { return I{}; }
  static I dot_u8(I acc, B u, const std::int8_t* x) {
    for (int i = 0; i < 4 * W; ++i) acc.v[i / 4] += u.b[i] * x[i];
    return acc;
  }
  static I dot_s8(I acc, B w, const std::int8_t* x) {
    for (int i = 0; i < 4 * W; ++i) acc.v[i / 4] += static_cast<std::int8_t>(w.b[i]) * x[i];
    return acc;
  }
  static F to_float(I a) {
    F r;
    for (int i = 0; i < W; ++i) r.v[i] = static_cast<float>(a.v[i]);
    return r;
  }
  static Idx make_idx(const std::int32_t* lane_group) {
    Idx r;
    for (int i = 0; i < W; ++i) r.v[i] = lane_group[i];
    return r;
  }
  static F expand(const float* p, Idx idx) {
    F r;
    for (int i = 0; i < W; ++i) r.v[i] = p[idx.v[i]];
    return r;
  }

  // K-quant kernels (kquant_kernels.h)
  template <int S>
  static B with_high(B lo, B qh) {
    for (int i = 0; i < 4 * W; ++i) {
      const int shifted = S > 0 ? qh.b[i] << S : S < 0 ? qh.b[i] >> -S : qh.b[i];
      lo.b[i] = static_cast<std::uint8_t>(lo.b[i] | (shifted & 0x30));
    }
    return lo;
  }
  static B with_bit(B lo, B qh, int bit) {
    for (int i = 0; i < 4 * W; ++i) lo.b[i] = static_cast<std::uint8_t>(lo.b[i] | ((qh.b[i] >> bit) & 1) << 4);
    return lo;
  }
  static void store_bytes(std::uint8_t* p, B b) { std::memcpy(p, b.b, sizeof b.b); }
  static I dot_u8_word(I acc, B u, const std::int8_t* x) {
    for (int i = 0; i < 4 * W; ++i) acc.v[i / 4] += u.b[i] * x[i % 4];
    return acc;
  }
  static B flip(B b) {
    for (auto& v : b.b) v ^= 0x80;
    return b;
  }
  static I dot_s8_word(I acc, B w, const std::int8_t* x) {
    for (int i = 0; i < 4 * W; ++i) acc.v[i / 4] += static_cast<std::int8_t>(w.b[i]) * x[i % 4];
    return acc;
  }
  static I iadd(I a, I b) {
    for (int i = 0; i < W; ++i) a.v[i] += b.v[i];
    return a;
  }
  static I isub(I a, I b) {
    for (int i = 0; i < W; ++i) a.v[i] -= b.v[i];
    return a;
  }
  static I imul(I a, I b) {
    for (int i = 0; i < W; ++i) a.v[i] *= b.v[i];
    return a;
  }
  static I isplat(std::int32_t v) {
    I r;
    for (int i = 0; i < W; ++i) r.v[i] = v;
    return r;
  }
  static I widen_u8(const std::uint8_t* p) {
    I r;
    for (int i = 0; i < W; ++i) r.v[i] = p[i];
    return r;
  }
  static I widen_s8(const std::int8_t* p) {
    I r;
    for (int i = 0; i < W; ++i) r.v[i] = p[i];
    return r;
  }
  static F vabs(F a) {
    for (int i = 0; i < W; ++i) a.v[i] = a.v[i] < 0 ? -a.v[i] : a.v[i];
    return a;
  }
  static F vmax(F a, F b) {
    for (int i = 0; i < W; ++i) a.v[i] = a.v[i] < b.v[i] ? b.v[i] : a.v[i];
    return a;
  }
  static float hmax(F a) {
    float m = a.v[0];
    for (int i = 1; i < W; ++i) m = m < a.v[i] ? a.v[i] : m;
    return m;
  }
  static I round_to_int(F a) {  // half to even: adding 1.5 * 2^23 rounds |v| < 2^22 in the float sum
    I r;
    for (int i = 0; i < W; ++i) r.v[i] = static_cast<std::int32_t>((a.v[i] + 12582912.0f) - 12582912.0f);
    return r;
  }
  static void store_i8(std::int8_t* p, I a) {
    for (int i = 0; i < W; ++i) p[i] = static_cast<std::int8_t>(a.v[i]);
  }
};

}  // namespace

const IsaKernels kGenericKernels = make_kernels<Generic>("generic");

}  // namespace ninfer::cpu

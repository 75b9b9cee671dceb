// The quant kernels in portable C++ (8-float arrays the compiler vectorizes as it can): every CPU
// without AVX2, and the reference the x86 paths are tested beside.
#include "quant_kernels_a8.h"

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
  static void store_pairs(float* dst, F lo, F hi) {
    for (int i = 0; i < W; ++i) {
      dst[2 * i] = lo.v[i];
      dst[2 * i + 1] = hi.v[i];
    }
  }
  static void store_bf16(std::uint16_t* p, F a) {  // round to nearest even; NaN -> 0x7fc0, as torch
    for (int i = 0; i < W; ++i) {
      std::uint32_t bits;
      std::memcpy(&bits, &a.v[i], 4);
      p[i] = a.v[i] != a.v[i] ? 0x7fc0 : static_cast<std::uint16_t>((bits + ((bits >> 16) & 1) + 0x7fff) >> 16);
    }
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
  static F fma(F a, F b, F c) {
    for (int i = 0; i < W; ++i) c.v[i] += a.v[i] * b.v[i];
    return c;
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
};

}  // namespace

const IsaKernels kGenericKernels = make_kernels<Generic>("generic");

}  // namespace ninfer::cpu

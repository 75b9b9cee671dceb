// The quant kernels in portable C++ (8-float arrays the compiler vectorizes as it can): every CPU
// without AVX2, and the reference the x86 paths are tested beside.
#include "quant_kernels.h"

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
};

}  // namespace

const IsaKernels kGenericKernels = Kernels<Generic>::make("generic");

}  // namespace ninfer::cpu

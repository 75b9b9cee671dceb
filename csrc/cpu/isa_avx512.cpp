// The quant kernels with AVX-512F (16 floats per vector). Compiled with -mavx512f -mfma -mf16c.
#include <immintrin.h>

#include "quant_kernels.h"

namespace ninfer::cpu {
namespace {

struct Avx512 {
  using F = __m512;
  static constexpr int W = 16;
  static F zero() { return _mm512_setzero_ps(); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  // dst[2i] = lo[i], dst[2i + 1] = hi[i]
  static void store_pairs(float* dst, F lo, F hi) {
    const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i second = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    _mm512_storeu_ps(dst, _mm512_permutex2var_ps(lo, first, hi));
    _mm512_storeu_ps(dst + 16, _mm512_permutex2var_ps(lo, second, hi));
  }
  static F splat(float v) { return _mm512_set1_ps(v); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(F v) { return _mm512_reduce_add_ps(v); }
  static F halves(const std::uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static F bytes(const std::int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static void nibbles(const std::uint8_t* p, F& lo, F& hi) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
  }
};

}  // namespace

const IsaKernels kAvx512Kernels = Kernels<Avx512>::make("avx512");

}  // namespace ninfer::cpu

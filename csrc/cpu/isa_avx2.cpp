// The quant kernels with AVX2 + FMA + F16C (8 floats per vector). Compiled with -mavx2 -mfma -mf16c.
#include <immintrin.h>

#include "quant_kernels.h"

namespace ninfer::cpu {
namespace {

struct Avx2 {
  using F = __m256;
  static constexpr int W = 8;
  static F zero() { return _mm256_setzero_ps(); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  // dst[2i] = lo[i], dst[2i + 1] = hi[i]
  static void store_pairs(float* dst, F lo, F hi) {
    const __m256 a = _mm256_unpacklo_ps(lo, hi), b = _mm256_unpackhi_ps(lo, hi);  // per 128-bit lane
    _mm256_storeu_ps(dst, _mm256_permute2f128_ps(a, b, 0x20));
    _mm256_storeu_ps(dst + 8, _mm256_permute2f128_ps(a, b, 0x31));
  }
  static F splat(float v) { return _mm256_set1_ps(v); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static F halves(const std::uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static F bytes(const std::int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static void nibbles(const std::uint8_t* p, F& lo, F& hi) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
    hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
  }
};

}  // namespace

const IsaKernels kAvx2Kernels = Kernels<Avx2>::make("avx2");

}  // namespace ninfer::cpu

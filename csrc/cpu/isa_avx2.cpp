// The quant kernels with AVX2 + FMA + F16C (8 floats per vector). Compiled with -mavx2 -mfma -mf16c.
#include <immintrin.h>

#include "isa_kernels.h"

namespace ninfer::cpu {
namespace {

struct Avx2 {
  using F = __m256;
  static constexpr int W = 8;
  static F zero() { return _mm256_setzero_ps(); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  // (first, second) = lo and hi interleaved: lo[0], hi[0], lo[1], hi[1], ..
  static void interleave(F lo, F hi, F& first, F& second) {
    const __m256 a = _mm256_unpacklo_ps(lo, hi), b = _mm256_unpackhi_ps(lo, hi);  // per 128-bit lane
    first = _mm256_permute2f128_ps(a, b, 0x20);
    second = _mm256_permute2f128_ps(a, b, 0x31);
  }
  static void store_bf16(std::uint16_t* p, F v) {  // round to nearest even; NaN -> 0x7fc0, as torch
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  static F splat(float v) { return _mm256_set1_ps(v); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F round(F a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F times_pow2(F x, F n) {  // x 2^n, n integral and x 2^n normal: n added to the exponent field
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(x), _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23)));
  }
  static float sum(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static F halves(const std::uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static F bf16s(const std::uint16_t* p) {  // bf16 -> fp32: the bits shifted up (exact)
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static F bytes(const std::int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static void nibbles(const std::uint8_t* p, F& lo, F& hi) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
    hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
  }

  // int8-activation dot products (quant_kernels_a8.h): maddubs multiplies unsigned by signed
  // bytes into saturating int16 pairs, which stay exact for |code| <= 128 and |x| <= 127.
  using B = __m256i;
  using I = __m256i;
  using Idx = __m256i;
  static constexpr bool kBiasedS8 = false;
  static B bytes4(const std::uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static void nibble_halves(const std::uint8_t* p, B& lo, B& hi) {
    const __m256i b = bytes4(p), mask = _mm256_set1_epi8(15);
    lo = _mm256_and_si256(b, mask);
    hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), mask);
  }
  static I izero() { return _mm256_setzero_si256(); }
  static I pairs(__m256i products16) { return _mm256_madd_epi16(products16, _mm256_set1_epi16(1)); }
  static I dot_u8(I acc, B u, const std::int8_t* x) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    return _mm256_add_epi32(acc, pairs(_mm256_maddubs_epi16(u, xv)));
  }
  static I dot_s8(I acc, B w, const std::int8_t* x) {  // |w| . (x with w's sign)
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    return _mm256_add_epi32(acc, pairs(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(xv, w))));
  }
  static F to_float(I v) { return _mm256_cvtepi32_ps(v); }
  static Idx make_idx(const std::int32_t* lane_group) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lane_group));
  }
  static F expand(const float* p, Idx idx) { return _mm256_permutevar8x32_ps(_mm256_loadu_ps(p), idx); }

  // K-quant kernels (kquant_kernels.h)
  template <int S>
  static B with_high(B lo, B qh) {
    const __m256i shifted = S > 0 ? _mm256_slli_epi16(qh, S) : S < 0 ? _mm256_srli_epi16(qh, -S) : qh;
    return _mm256_or_si256(lo, _mm256_and_si256(shifted, _mm256_set1_epi8(0x30)));
  }
  static B with_bit(B lo, B qh, int bit) {  // lo | ((qh >> bit) & 1) << 4 (bit < 8: no byte crosses)
    const __m256i moved = _mm256_slli_epi16(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(bit)), 4);
    return _mm256_or_si256(lo, _mm256_and_si256(moved, _mm256_set1_epi8(0x10)));
  }
  static void store_bytes(std::uint8_t* p, B b) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), b); }
  static I dot_u8_word(I acc, B u, const std::int8_t* x) {  // codes <= 63: the int16 pairs cannot saturate
    std::int32_t word;
    std::memcpy(&word, x, 4);
    return _mm256_add_epi32(acc, pairs(_mm256_maddubs_epi16(u, _mm256_set1_epi32(word))));
  }
  static B flip(B b) { return _mm256_xor_si256(b, _mm256_set1_epi8(static_cast<char>(0x80))); }
  static I dot_s8_word(I acc, B w, const std::int8_t* x) {  // Q8_0's full-range codes: |w| . (x with w's sign)
    std::int32_t word;
    std::memcpy(&word, x, 4);
    const __m256i xv = _mm256_set1_epi32(word);
    return _mm256_add_epi32(acc, pairs(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(xv, w))));
  }
  static I iadd(I a, I b) { return _mm256_add_epi32(a, b); }
  static I isub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I imul(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I isplat(std::int32_t v) { return _mm256_set1_epi32(v); }
  static I widen_u8(const std::uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static I widen_s8(const std::int8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static F vabs(F v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }
  static F vmax(F a, F b) { return _mm256_max_ps(a, b); }
  static float hmax(F v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }
  static I round_to_int(F v) { return _mm256_cvtps_epi32(v); }  // the default rounding: half to even
  static void store_i8(std::int8_t* p, I v) {
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(words, words));
  }
};

}  // namespace

const IsaKernels kAvx2Kernels = make_kernels<Avx2>("avx2");

}  // namespace ninfer::cpu

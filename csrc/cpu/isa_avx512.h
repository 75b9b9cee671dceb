// The AVX-512 vector type of the CPU kernels (F / BW / VNNI, 16 floats per vector): included by
// isa_avx512.cpp and isa_avx512bf16.cpp only, each compiled with these instruction sets.
#pragma once

#include <immintrin.h>

#include "isa_kernels.h"

namespace ninfer::cpu {
namespace {

struct Avx512 {
  using F = __m512;
  static constexpr int W = 16;
  static F zero() { return _mm512_setzero_ps(); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  // (first, second) = lo and hi interleaved: lo[0], hi[0], lo[1], hi[1], ..
  static void interleave(F lo, F hi, F& first, F& second) {
    first = _mm512_permutex2var_ps(lo, _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0), hi);
    second = _mm512_permutex2var_ps(lo, _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8),
                                    hi);
  }
  static void store_bf16(std::uint16_t* p, F v) {  // round to nearest even; NaN -> 0x7fc0, as torch
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  static F splat(float v) { return _mm512_set1_ps(v); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F round(F a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F times_pow2(F x, F n) { return _mm512_scalef_ps(x, n); }  // x 2^n, n integral
  static float sum(F v) { return _mm512_reduce_add_ps(v); }
  static F halves(const std::uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static F bf16s(const std::uint16_t* p) {  // bf16 -> fp32: the bits shifted up (exact)
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static F bytes(const std::int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static void nibbles(const std::uint8_t* p, F& lo, F& hi) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
  }

  // int8-activation dot products (quant_kernels_a8.h)
  using B = __m512i;
  using I = __m512i;
  using Idx = __m512i;
  static constexpr bool kBiasedS8 = true;  // vpdpbusd multiplies unsigned by signed bytes
  static B bytes4(const std::uint8_t* p) { return _mm512_loadu_si512(p); }
  static void nibble_halves(const std::uint8_t* p, B& lo, B& hi) {
    const __m512i b = _mm512_loadu_si512(p), mask = _mm512_set1_epi8(15);
    lo = _mm512_and_si512(b, mask);
    hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), mask);
  }
  static B flip(B b) { return _mm512_xor_si512(b, _mm512_set1_epi8(static_cast<char>(0x80))); }
  static I izero() { return _mm512_setzero_si512(); }
  static I iload(const std::int32_t* p) { return _mm512_loadu_si512(p); }
  static I dot_u8(I acc, B u, const std::int8_t* x) { return _mm512_dpbusd_epi32(acc, u, _mm512_loadu_si512(x)); }
  static F to_float(I v) { return _mm512_cvtepi32_ps(v); }
  static Idx make_idx(const std::int32_t* lane_group) { return _mm512_loadu_si512(lane_group); }
  static F expand(const float* p, Idx idx) { return _mm512_permutexvar_ps(idx, _mm512_loadu_ps(p)); }

  // K-quant kernels (kquant_kernels.h)
  template <int S>
  static B with_high(B lo, B qh) {  // lo | (qh << S) & 0x30 in one ternary-logic op
    const __m512i shifted = S > 0 ? _mm512_slli_epi16(qh, S) : S < 0 ? _mm512_srli_epi16(qh, -S) : qh;
    return _mm512_ternarylogic_epi32(lo, shifted, _mm512_set1_epi8(0x30), 0xF8);
  }
  static B with_bit(B lo, B qh, int bit) {  // lo | ((qh >> bit) & 1) << 4 (bit < 8: no byte crosses)
    const __m512i moved = _mm512_slli_epi16(_mm512_srl_epi16(qh, _mm_cvtsi32_si128(bit)), 4);
    return _mm512_ternarylogic_epi32(lo, moved, _mm512_set1_epi8(0x10), 0xF8);
  }
  static void store_bytes(std::uint8_t* p, B b) { _mm512_storeu_si512(p, b); }
  static I dot_u8_word(I acc, B u, const std::int8_t* x) {
    std::int32_t word;
    std::memcpy(&word, x, 4);
    return _mm512_dpbusd_epi32(acc, u, _mm512_set1_epi32(word));
  }
  static I iadd(I a, I b) { return _mm512_add_epi32(a, b); }
  static I isub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I imul(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I isplat(std::int32_t v) { return _mm512_set1_epi32(v); }
  static I widen_u8(const std::uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I widen_s8(const std::int8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static F vabs(F v) { return _mm512_abs_ps(v); }
  static F vmax(F a, F b) { return _mm512_max_ps(a, b); }
  static float hmax(F v) { return _mm512_reduce_max_ps(v); }
  static I round_to_int(F v) { return _mm512_cvtps_epi32(v); }  // the default rounding: half to even
  static void store_i8(std::int8_t* p, I v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(v)); }
};

}  // namespace
}  // namespace ninfer::cpu

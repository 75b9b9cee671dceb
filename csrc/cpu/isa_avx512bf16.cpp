// AVX-512 with AVX512-BF16: the dequantization of weights to bf16 (a prefill's GEMM tiles) rounds
// with the instruction, where the plain AVX-512 kernels spell the rounding out (SmolLM2's 106 M
// weights, one thread: 21.4 -> 12.8 ms, paid by every prefill forward). Every other kernel is the
// AVX-512 one (quant_matmul.cpp builds the entry points). Compiled with the AVX-512 flags and
// -mavx512dq -mavx512bf16, where the compiler takes them (CMakeLists.txt).
#include "isa_avx512.h"

namespace ninfer::cpu {
namespace {

struct Avx512Bf16 : Avx512 {
  // Bit for bit Avx512::store_bf16 (torch's rounding): the instruction rounds to nearest even as
  // torch does, but keeps a NaN's sign and payload (torch: 0x7fc0) and flushes subnormals to zero;
  // a vector holding either (a weight's code * scale + offset from 16-bit scales is neither) takes
  // the spelled-out path. One classification of the lanes decides.
  static void store_bf16(std::uint16_t* p, F v) {
    if (_mm512_fpclass_ps_mask(v, 0x01 | 0x20 | 0x80)) return Avx512::store_bf16(p, v);  // NaNs, subnormals
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
  }
  // lo and hi interleaved (lo[0], hi[0], lo[1], ..) as bf16: one conversion of both, one permutation
  static void store_bf16_pairs(std::uint16_t* p, F lo, F hi) {
    if (_mm512_fpclass_ps_mask(lo, 0x01 | 0x20 | 0x80) | _mm512_fpclass_ps_mask(hi, 0x01 | 0x20 | 0x80)) {
      F first, second;
      interleave(lo, hi, first, second);
      return Avx512::store_bf16(p, first), Avx512::store_bf16(p + W, second);
    }
    const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));  // lo in the low half
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                           6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    _mm512_storeu_si512(p, _mm512_permutexvar_epi16(order, both));
  }
};

}  // namespace

extern const DequantizeRows kAvx512Bf16Dequantize = &Kernels<Avx512Bf16>::dequantize_rows;
extern const KQuantDequantizeRows kAvx512Bf16KQuantDequantize = &KQuantKernels<Avx512Bf16>::dequantize_rows;

}  // namespace ninfer::cpu

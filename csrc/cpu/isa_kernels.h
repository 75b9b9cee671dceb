// The entry points of instruction set V: every kernel family compiled with it. Included by the
// isa_*.cpp files only, each after defining its V.
#pragma once

#include "attention_kernels.h"
#include "gdn_kernels.h"
#include "kquant_kernels.h"
#include "quant_kernels_a8.h"

namespace ninfer::cpu {
namespace {

template <class V>
void dot_rows(const float* x, const float* w, std::int64_t k, std::int64_t r0, std::int64_t r1, float* out) {
  for (std::int64_t r = r0; r < r1; ++r) out[r] = AttentionKernels<V>::dot(x, w + r * k, k);
}

template <class V>
IsaKernels make_kernels(const char* name) {
  return {name,
          V::W,
          &Kernels<V>::arrange,
          &Kernels<V>::rows,
          &A8Kernels<V>::rows,
          &Kernels<V>::dequantize_rows,
          &KQuantKernels<V>::rows,
          &KQuantKernels<V>::quantize,
          &KQuantKernels<V>::dequantize_rows,
          &AttentionKernels<V>::chunk,
          &GdnKernels<V>::conv,
          &GdnKernels<V>::head,
          &dot_rows<V>};
}

}  // namespace
}  // namespace ninfer::cpu

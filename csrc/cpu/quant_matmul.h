// CPU weight-only matmul over int8 / int4 codes with group scales: the decode GEMV of the
// compact CPU formats (ninfer_core/ops/quant.py documents them; ops/quant.py holds the torch
// reference). Plain C++ over raw pointers, like the CUDA launchers in ../ops.h.
#pragma once

#include <cstdint>

namespace ninfer::cpu {

// w[n][k] = code * scale[n][k / group] + offset[n][k / group], computed in fp32:
// Scales and offsets are fp32, fp16 or bf16 (the GPU formats' int8 / int4 scales run as they are;
// GGUF blocks map to fp16).
//   int4: code = a nibble, 0..15 (byte k / 2 of row n: the low nibble for even k, the high one for
//         odd k); offset defaults to -8 * scale (the symmetric grid of the GPU format);
//   int8: code = the signed byte; offset defaults to 0.
enum class ScaleType : int { F32 = 0, F16 = 1, BF16 = 2 };  // the values of ../ops.h DType

struct QuantWeight {
  std::uintptr_t codes;    // int8 [n, k] or uint8 [n, k / 2]
  std::uintptr_t scales;   // [n, k / group]
  std::uintptr_t offsets;  // [n, k / group] in the scales' type, or 0 for the default
  std::int64_t n;
  std::int64_t k;
  std::int64_t group;  // divides k; a multiple of 32 for int4, of 16 for int8
  bool int4;
  ScaleType scale_type;
};

// out[m][n] = sum_k x[m][k] * w[n][k] (+ bias[n]), fp32 activations and accumulation; or, with
// int8_activations, x quantized to int8 per block of 32 inputs (scale absmax / 127, round half to
// even) and the codes multiplied by it in integers (quant_kernels_a8.h): ~3x less arithmetic, the
// error of llama.cpp's Q8 activations. Shapes those kernels do not cover (k not whole blocks of
// 32, groups that straddle their chunks) run exactly.
struct MatmulArgs {
  QuantWeight w;
  std::uintptr_t out;   // fp32 [m, n]
  std::uintptr_t x;     // fp32 [m, k]
  std::uintptr_t bias;  // fp32 [n], or 0
  std::int64_t m;
  int threads;  // the caller counts as one
  bool int8_activations;
};

void quant_matmul(const MatmulArgs& args);

// out fp32 (or bf16) [count, k] = rows [first, first + count) of w, the dense weight (prefill
// multiplies by it with a GEMM, a tile of rows at a time).
void dequantize(const QuantWeight& w, std::int64_t first, std::int64_t count, std::uintptr_t out, bool bf16,
                int threads);

// The instruction set the kernels run with on this CPU: "avx512bf16", "avx512", "avx2" or "generic".
// NINFER_CPU_ISA=avx512|avx2|generic picks a lower one.
const char* isa();

// Switch to the best instruction set up to `name` that this CPU has, and return it: tests run
// every path on one machine. Not while a kernel runs.
const char* use_isa(const char* name);

}  // namespace ninfer::cpu

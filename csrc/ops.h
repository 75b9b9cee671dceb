// Host-side entry points of the CUDA kernels. Plain C++ (no CUDA or torch types) so that
// bindings.cpp compiles with the host compiler alone; tensors travel as raw device pointers.
#pragma once

#include <cstdint>

namespace ninfer {

// Element types the kernels accept; values mirror ninfer_core/ops/dispatch.py.
enum class DType : int { F32 = 0, F16 = 1, BF16 = 2 };

// Fused (residual add +) RMSNorm over rows of `hidden` contiguous elements.
//   residual == 0:  out = norm(x)
//   residual != 0:  s = round(x + residual); residual_out = s; out = norm(s)
// norm(v) = round(v * rstd * (1 + w))          when zero_centered (Qwen3.5)
//         = round(round(v * rstd) * w)         otherwise (Llama)
// with rstd = rsqrt(mean(v^2) + eps) in fp32. out may alias x; residual_out may alias residual.
struct RmsNormArgs {
  std::uintptr_t out;
  std::uintptr_t residual_out;
  std::uintptr_t x;
  std::uintptr_t residual;
  std::uintptr_t weight;
  std::int64_t rows;
  std::int64_t hidden;
  float eps;
  bool zero_centered;
  DType dtype;         // x, residual, out, residual_out
  DType weight_dtype;  // dtype or F32
  int device;
  std::uintptr_t stream;  // cudaStream_t as an integer (torch's Stream.cuda_stream)
};

void rmsnorm(const RmsNormArgs& args);

}  // namespace ninfer

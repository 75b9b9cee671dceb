// int8 / int4 weights -> a dense 16-bit (or fp32) copy, for the compute-bound prefill GEMMs
// (MoE grouped GEMM, QuantLinear with many rows). One pass: read the codes once, write the
// values once; the torch reference (ops/quant.py dequantize) makes several fp32 passes.
#include "common.cuh"
#include "launch.cuh"
#include "quant_gemv.h"

namespace ninfer {
namespace {

// Each thread turns 8 codes into 8 values: w = (q [- 8]) * scale, computed in fp32 and rounded
// once to T (= dequantize(qw, dtype) bit for bit).
template <typename T, bool kInt4>
__global__ void dequant_kernel(T* __restrict__ out, const std::uint8_t* __restrict__ qweight,
                               const void* __restrict__ scales, std::int64_t rows, std::int64_t k,
                               int group_size) {
  enter_kernel();
  const std::int64_t total = rows * k / 8;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t first = i * 8;  // element index of the first of the 8 values
    const std::int64_t row = first / k;
    const std::int64_t col = first - row * k;
    float q[8];
    float scale;
    if constexpr (kInt4) {
      const std::uint32_t packed = reinterpret_cast<const std::uint32_t*>(qweight)[i];
#pragma unroll
      for (int e = 0; e < 8; ++e) q[e] = static_cast<float>((packed >> (4 * e)) & 15u) - 8.0f;
      const auto* s = static_cast<const __nv_bfloat16*>(scales);
      scale = __bfloat162float(s[row * (k / group_size) + col / group_size]);
    } else {
      const uint2 packed = reinterpret_cast<const uint2*>(qweight)[i];
      const std::int8_t* c = reinterpret_cast<const std::int8_t*>(&packed);
#pragma unroll
      for (int e = 0; e < 8; ++e) q[e] = static_cast<float>(c[e]);
      scale = static_cast<const float*>(scales)[row];
    }
    Vec<T, 8> v;
#pragma unroll
    for (int e = 0; e < 8; ++e) v.v[e] = from_float<T>(q[e] * scale);
    *reinterpret_cast<Vec<T, 8>*>(out + first) = v;
  }
}

template <typename T>
void launch(const DequantArgs& a, cudaStream_t stream) {
  const std::int64_t work = a.rows * a.k / 8;
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<std::int64_t>((work + threads - 1) / threads, 65535 * 8));
  auto* out = reinterpret_cast<T*>(a.out);
  const auto* q = reinterpret_cast<const std::uint8_t*>(a.qweight);
  const auto* s = reinterpret_cast<const void*>(a.scales);
  launch_kernel("dequant kernel launch", a.int4 ? dequant_kernel<T, true> : dequant_kernel<T, false>, blocks,
                threads, 0, stream, out, q, s, a.rows, a.k, a.group_size);
}

}  // namespace

// Trusts its arguments: the binding (bind_quant.cpp) checks them against quant_gemv.h.
void dequant(const DequantArgs& a) {
  DeviceGuard guard(a.device);
  const cudaStream_t stream = as_stream(a.stream);
  by_dtype(a.dtype, "dequant", [&](auto t) { launch<decltype(t)>(a, stream); });
}

}  // namespace ninfer

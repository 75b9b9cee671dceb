// Fused elementwise epilogues (csrc/activation.h); torch references in ninfer_core/ops/activation.py.
#include "activation.h"
#include "common.cuh"
#include "launch.cuh"

namespace ninfer {
namespace {

template <typename T>
__global__ void silu_mul_kernel(T* __restrict__ out, const T* __restrict__ x, std::int64_t rows, std::int64_t cols) {
  enter_kernel();
  const std::int64_t total = rows * cols;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = i / cols, c = i - r * cols;
    out[i] = from_float<T>(silu_times<T>(to_float(x[r * 2 * cols + c]), to_float(x[r * 2 * cols + cols + c])));
  }
}

template <typename T>
__global__ void sigmoid_mul_kernel(T* out, const T* x, const T* __restrict__ gate, const T* add, std::int64_t rows,
                                   std::int64_t cols, std::int64_t gate_stride, int gate_cols) {
  enter_kernel();
  const std::int64_t total = rows * cols;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = i / cols, c = i - r * cols;
    const float g = to_float(gate[r * gate_stride + (gate_cols == 1 ? 0 : c)]);
    float v = sigmoid_times<T>(to_float(x[i]), g);
    if (add != nullptr) v = to_float(add[i]) + v;
    out[i] = from_float<T>(v);
  }
}

int blocks_for(std::int64_t total) {
  return static_cast<int>(std::min<std::int64_t>((total + 255) / 256, 4096));
}

}  // namespace

// The launchers trust their arguments: the binding (bind_activation.cpp) checks them against activation.h.
void silu_mul(const SiluMulArgs& a) {
  DeviceGuard guard(a.device);
  const cudaStream_t stream = as_stream(a.stream);
  const int blocks = blocks_for(a.rows * a.cols);
  const auto go = [&](auto type) {
    using T = decltype(type);
    launch_kernel("silu_mul kernel launch", silu_mul_kernel<T>, blocks, 256, 0, stream,
                  reinterpret_cast<T*>(a.out), reinterpret_cast<const T*>(a.x), a.rows, a.cols);
  };
  by_dtype(a.dtype, "silu_mul", go);
}

template <typename T>
void launch_sigmoid_mul(const SigmoidMulArgs& a, cudaStream_t stream) {
  launch_kernel("sigmoid_mul kernel launch", sigmoid_mul_kernel<T>, blocks_for(a.rows * a.cols), 256, 0, stream,
                reinterpret_cast<T*>(a.out), reinterpret_cast<const T*>(a.x), reinterpret_cast<const T*>(a.gate),
                reinterpret_cast<const T*>(a.add), a.rows, a.cols, a.gate_stride, a.gate_cols);
}

void sigmoid_mul(const SigmoidMulArgs& a) {
  DeviceGuard guard(a.device);
  const cudaStream_t stream = as_stream(a.stream);
  by_dtype(a.dtype, "sigmoid_mul", [&](auto t) { launch_sigmoid_mul<decltype(t)>(a, stream); });
}

}  // namespace ninfer

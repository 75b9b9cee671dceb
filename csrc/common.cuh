// Shared device helpers: error checks, device guard, dtype conversion, vector loads, reductions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "ops.h"

namespace ninfer {

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
  }
}

inline cudaStream_t as_stream(std::uintptr_t handle) {
  return reinterpret_cast<cudaStream_t>(handle);
}

__host__ __device__ inline bool is_aligned(std::uintptr_t ptr, std::size_t bytes) {
  return ptr % bytes == 0;
}

// Makes `device` current for a launch and restores the caller's device (torch's notion of the
// current device is the CUDA runtime's, so it must be left as it was).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
    switched_ = device != previous_;
    if (switched_) check_cuda(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() {
    if (switched_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

// launch(T{}) with the element type T of `dtype`; `op` names the caller in the error.
template <typename Launch>
void by_dtype(DType dtype, const char* op, Launch&& launch) {
  switch (dtype) {
    case DType::F32: launch(float{}); break;
    case DType::F16: launch(__half{}); break;
    case DType::BF16: launch(__nv_bfloat16{}); break;
    default: throw std::invalid_argument(std::string(op) + ": unsupported dtype");
  }
}

// launch(std::integral_constant<int, D>{}) for an attention head dim D of 64, 128 or 256, the dims
// the head kernels are built for; `op` names the caller in the error.
template <typename Launch>
void by_head_dim(int head_dim, const char* op, Launch&& launch) {
  switch (head_dim) {
    case 64: launch(std::integral_constant<int, 64>{}); break;
    case 128: launch(std::integral_constant<int, 128>{}); break;
    case 256: launch(std::integral_constant<int, 256>{}); break;
    default: throw std::invalid_argument(std::string(op) + ": head_dim must be 64, 128 or 256");
  }
}

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Loads for before the PDL wait (launch.cuh), issued where they stand. nvcc sinks ordinary
// read-only loads (__ldg, loads of const data) and non-volatile asm past the wait's asm: in the
// SASS the router's weight rows, the rotary constants and the shared expert's rows in gate_up
// all loaded after the wait, their DRAM round trip then one the kernel waits out. Volatile asm
// stays in order with the wait (the loads are read-only: ld.global.nc).
__device__ __forceinline__ uint4 load_early16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ std::int64_t load_early(const std::int64_t* p) {
  long long v;
  asm volatile("ld.global.nc.s64 %0, [%1];" : "=l"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ int load_early(const int* p) {
  int v;
  asm volatile("ld.global.nc.s32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

// An element of T as a float (load_early16's rule).
template <typename T>
__device__ __forceinline__ float load_early_float(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    float v;
    asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
  } else {
    unsigned short bits;
    asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(bits) : "l"(p));
    if constexpr (std::is_same_v<T, __half>) return __half2float(__ushort_as_half(bits));
    return __uint_as_float(static_cast<std::uint32_t>(bits) << 16);
  }
}

// v rounded to T and back: where a torch reference rounds an intermediate to the model dtype.
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return to_float(from_float<T>(v));
}

// SiLU in fp32: the GDN conv and gated norm (gdn_decode.cu) and the GEMV's conv epilogue
// (quant_gemv.cu) share it, so a conv folded into the GEMV stays bit-equal to the conv kernel.
__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }

// The gates of the elementwise kernels (activation.cu) and of the GEMV epilogues that fold them
// (quant_gemv.cu, moe.cu): one definition, so fused and composed results stay bit-equal. Inputs
// are values of T (rounded as the reference's tensors are); the caller rounds the result.
// silu(gate) * up, the silu rounded to T:
template <typename T>
__device__ __forceinline__ float silu_times(float gate, float up) {
  return round_to<T>(gate / (1.0f + expf(-gate))) * up;
}
// v * sigmoid(g), the sigmoid and the product rounded to T; __fmul_rn: never contracted into an
// FMA with an add that follows (a float32 fused epilogue once differed from the kernel by an ulp).
template <typename T>
__device__ __forceinline__ float sigmoid_times(float v, float g) {
  return round_to<T>(__fmul_rn(v, round_to<T>(1.0f / (1.0f + expf(-g)))));
}

// RMSNorm's element steps (csrc/rmsnorm.cu; the MoE router folds the norm in and must match it):
// the residual add rounded to T, and a normed element scaled by its weight, zero-centred
// round(x * rstd * (1 + w)) or plain round(round(x * rstd) * w).
template <typename T>
__device__ __forceinline__ T add_rounded(T a, T b) {
  return from_float<T>(to_float(a) + to_float(b));
}
template <typename T, typename W>
__device__ __forceinline__ T norm_scale(T a, float rstd, W w, bool zero_centered) {
  const float n = to_float(a) * rstd;
  return zero_centered ? from_float<T>(n * (to_float(w) + 1.0f)) : from_float<T>(to_float(from_float<T>(n)) * to_float(w));
}

// N consecutive elements moved as one aligned access (16 bytes for N = 16 / sizeof(T)).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// Pulls the line holding p into L2, neither taking a register nor waiting.
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Sum over the threads of one row group (threadIdx.x); every thread gets the total. A group is
// either one warp (blockDim.x == 32, several groups per block) or the whole block (blockDim.y ==
// 1, blockDim.x a multiple of 32).
__device__ __forceinline__ float group_sum(float v) {
  v = warp_sum(v);
  if (blockDim.x == 32) return v;
  __shared__ float partial[32];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x >> 5) ? partial[lane] : 0.0f;
  return warp_sum(v);
}

// Thread block clusters (sm_90+; launch.cuh launch_kernel_in_clusters): a barrier over every thread
// of the cluster's blocks (writes to shared memory before it are seen by all after it), and a load of
// another block's shared variable (`local`: this block's copy of it) by the block's rank.
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
  __trap();  // callers take the cluster path only where clusters_supported()
#endif
}

__device__ __forceinline__ float load_from_cluster_block(const float* local, unsigned rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const auto address = static_cast<std::uint32_t>(__cvta_generic_to_shared(local));
  std::uint32_t remote;
  float v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(address), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
#else
  __trap();
  return 0.0f;
#endif
}

// RMSNorm's sum of squares in rmsnorm_kernel's order, which the kernels that fold the norm in
// repeat: a row of nvec vectors gets rms_row_threads(nvec) threads, thread i adding the squares of
// vectors i, i + threads, ... in element order (add_squares); the threads of each warp add up with
// warp_sum, then the warp totals (zero-padded to 32) with another; rms_rstd makes 1 / rms of it.
constexpr int kRmsMaxThreads = 1024;
__host__ __device__ constexpr int rms_row_threads(int nvec) {
  return nvec > kRmsMaxThreads ? kRmsMaxThreads : (nvec + 31) / 32 * 32;
}
template <typename T, int V>
__device__ __forceinline__ float add_squares(float sumsq, const Vec<T, V>& a) {
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const float f = to_float(a.v[j]);
    sumsq += f * f;
  }
  return sumsq;
}
__device__ __forceinline__ float rms_rstd(float sumsq, int hidden, float eps) {
  return rsqrtf(sumsq / static_cast<float>(hidden) + eps);
}

}  // namespace ninfer

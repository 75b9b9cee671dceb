// Fused (residual add +) RMSNorm: one pass to add and reduce, one to scale; fp32 math.
#include "common.cuh"
#include "launch.cuh"

namespace ninfer {
namespace {

constexpr int kRowsPerWarpBlock = 4;  // rows of <= 32 vectors: one warp each, 4 warps a block

// The sum of squares in the order of common.cuh's rms_row_threads (the MoE router and the quant
// GEMV fold the norm in and repeat it). Each thread owns the same vector indices in both passes, so out == x and
// residual_out == residual are safe (a thread only rereads what it wrote itself).
template <typename T, typename W, int V, bool kResidual>
__global__ void rmsnorm_kernel(T* out, T* residual_out, const T* x, const T* residual,
                               const W* __restrict__ weight, std::int64_t rows, int hidden,
                               float eps, bool zero_centered) {
  using TV = Vec<T, V>;
  using WV = Vec<W, V>;
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (row >= rows) {  // only in warp-per-row blocks, where a whole warp leaves together
    enter_kernel();
    return;
  }
  const int nvec = hidden / V;
  // The weights of this thread's first vector (the model's) load before the wait, and the row's
  // first vector stays in registers for the scaling pass: read after the reduction, both were one
  // more round trip there (the weights from DRAM, read once a step). Other vectors as before.
  constexpr bool kEarlyWeights = sizeof(WV) % 16 == 0;  // whole 16-byte loads
  const WV* wv = reinterpret_cast<const WV*>(weight);
  WV w_first{};
  if constexpr (kEarlyWeights) {
    if (threadIdx.x < nvec) {
#pragma unroll
      for (int c = 0; c < static_cast<int>(sizeof(WV) / 16); ++c) {
        reinterpret_cast<uint4*>(&w_first)[c] = load_early16(reinterpret_cast<const uint4*>(wv + threadIdx.x) + c);
      }
    }
  }
  enter_kernel_after_loads();
  const std::int64_t base = row * hidden;
  const TV* xv = reinterpret_cast<const TV*>(x + base);
  TV* ov = reinterpret_cast<TV*>(out + base);
  TV* rov = kResidual ? reinterpret_cast<TV*>(residual_out + base) : nullptr;
  const TV* rv = kResidual ? reinterpret_cast<const TV*>(residual + base) : nullptr;

  float sumsq = 0.0f;
  TV first{};
  for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
    TV a = xv[i];
    if constexpr (kResidual) {
      const TV r = rv[i];
#pragma unroll
      for (int j = 0; j < V; ++j) a.v[j] = add_rounded(a.v[j], r.v[j]);
      rov[i] = a;
    }
    if (i == threadIdx.x) first = a;
    sumsq = add_squares(sumsq, a);
  }
  const float rstd = rms_rstd(group_sum(sumsq), hidden, eps);

  const TV* src = kResidual ? rov : xv;
  for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
    const bool own = i == threadIdx.x;
    const TV a = own ? first : src[i];
    const WV w = kEarlyWeights && own ? w_first : wv[i];
    TV o;
#pragma unroll
    for (int j = 0; j < V; ++j) o.v[j] = norm_scale(a.v[j], rstd, w.v[j], zero_centered);
    ov[i] = o;
  }
}

template <typename T, typename W, int V>
void launch(const RmsNormArgs& a) {
  const int hidden = static_cast<int>(a.hidden);
  const int nvec = hidden / V;
  dim3 block;
  dim3 grid;
  if (nvec <= 32) {
    block = dim3(32, kRowsPerWarpBlock);
    grid = dim3(static_cast<unsigned>((a.rows + kRowsPerWarpBlock - 1) / kRowsPerWarpBlock));
  } else {
    block = dim3(rms_row_threads(nvec));
    grid = dim3(static_cast<unsigned>(a.rows));
  }
  auto* out = reinterpret_cast<T*>(a.out);
  const auto* x = reinterpret_cast<const T*>(a.x);
  const auto* weight = reinterpret_cast<const W*>(a.weight);
  const cudaStream_t stream = as_stream(a.stream);
  if (a.residual != 0) {
    launch_kernel("rmsnorm kernel launch", rmsnorm_kernel<T, W, V, true>, grid, block, 0, stream, out,
                  reinterpret_cast<T*>(a.residual_out), x, reinterpret_cast<const T*>(a.residual), weight,
                  a.rows, hidden, a.eps, a.zero_centered);
  } else {
    launch_kernel("rmsnorm kernel launch", rmsnorm_kernel<T, W, V, false>, grid, block, 0, stream, out,
                  static_cast<T*>(nullptr), x, static_cast<const T*>(nullptr), weight, a.rows, hidden, a.eps,
                  a.zero_centered);
  }
}

// 16-byte accesses when every row start is 16-byte aligned, else one element at a time.
template <typename T, typename W>
void launch_typed(const RmsNormArgs& a) {
  constexpr int kVec = 16 / sizeof(T);
  const bool residual_ok =
      a.residual == 0 || (is_aligned(a.residual, 16) && is_aligned(a.residual_out, 16));
  if (a.hidden % kVec == 0 && is_aligned(a.x, 16) && is_aligned(a.out, 16) &&
      is_aligned(a.weight, sizeof(W) * kVec) && residual_ok) {
    launch<T, W, kVec>(a);
  } else {
    launch<T, W, 1>(a);
  }
}

template <typename T>
void launch_weight(const RmsNormArgs& a) {
  if (a.weight_dtype == a.dtype) {
    launch_typed<T, T>(a);
  } else if (a.weight_dtype == DType::F32) {
    launch_typed<T, float>(a);
  } else {
    throw std::invalid_argument("rmsnorm: weight dtype must be the input dtype or float32");
  }
}

}  // namespace

// Trusts its arguments: the binding (bindings.cpp) checks them against ops.h.
void rmsnorm(const RmsNormArgs& a) {
  if (a.rows == 0) return;
  DeviceGuard guard(a.device);
  by_dtype(a.dtype, "rmsnorm", [&](auto t) { launch_weight<decltype(t)>(a); });
}

}  // namespace ninfer

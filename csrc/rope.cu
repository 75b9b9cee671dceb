// Head RMSNorm + rotate-half rotary embedding in one pass (see rope.h): one warp per head vector,
// D / 32 consecutive elements per lane, the rotation partner D / 32-aligned R / 2 elements away
// read from the partner lane by a shuffle. The attention layer's torch path is ~14 kernels a layer
// for q and k (two norms, then per tensor: slices, a negation, two concatenations, two products
// and a sum); this is two. The roundings are the torch expressions', op for op.
#include <string>

#include "common.cuh"
#include "launch.cuh"
#include "rope.h"

namespace ninfer {
namespace {

constexpr int kWarpsPerBlock = 4;

template <typename T, int kPer>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
    norm_rotary_kernel(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ weight,
                       const T* __restrict__ cos, const T* __restrict__ sin, int tokens, int heads,
                       std::int64_t stride_b, std::int64_t stride_t, std::int64_t stride_h,
                       std::int64_t cs_stride_b, std::int64_t cs_stride_t, int rotary_dim, float eps,
                       bool zero_centered, std::int64_t vectors) {
  enter_kernel();
  constexpr int kDim = 32 * kPer;
  const std::int64_t vec = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.y;
  if (vec >= vectors) return;  // a whole warp leaves together
  const int lane = threadIdx.x;
  const int h = static_cast<int>(vec % heads);
  const std::int64_t bt = vec / heads;
  const int t = static_cast<int>(bt % tokens);
  const std::int64_t b = bt / tokens;
  const T* src = x + b * stride_b + t * stride_t + h * stride_h + lane * kPer;
  float v[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) v[j] = to_float(src[j]);

  if (weight != nullptr) {
    float sumsq = 0.0f;
#pragma unroll
    for (int j = 0; j < kPer; ++j) sumsq += v[j] * v[j];
    const float rstd = rsqrtf(warp_sum(sumsq) / static_cast<float>(kDim) + eps);
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const float w = to_float(weight[lane * kPer + j]);
      const float n = v[j] * rstd;
      v[j] = zero_centered ? to_float(from_float<T>(n * (w + 1.0f)))
                           : to_float(from_float<T>(to_float(from_float<T>(n)) * w));
    }
  }

  const int half_lanes = rotary_dim / 2 / kPer;  // lanes holding the first rotated half
  const bool first = lane < half_lanes;
  const bool rotated = lane < 2 * half_lanes;
  const int partner = first ? lane + half_lanes : (rotated ? lane - half_lanes : lane);
  const T* cs = cos + b * cs_stride_b + t * cs_stride_t + lane * kPer;
  const T* sn = sin + b * cs_stride_b + t * cs_stride_t + lane * kPer;
  T* dst = out + vec * kDim + lane * kPer;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const float other = __shfl_sync(0xffffffffu, v[j], partner);
    if (rotated) {
      const float c = to_float(from_float<T>(v[j] * to_float(cs[j])));
      const float s = to_float(from_float<T>((first ? -other : other) * to_float(sn[j])));
      dst[j] = from_float<T>(c + s);
    } else {
      dst[j] = from_float<T>(v[j]);
    }
  }
}

template <typename T, int kPer>
void launch(const NormRotaryArgs& a) {
  const std::int64_t vectors = a.batch * a.tokens * a.heads;
  const dim3 block(32, kWarpsPerBlock);
  const dim3 grid(static_cast<unsigned>((vectors + kWarpsPerBlock - 1) / kWarpsPerBlock));
  launch_kernel("norm_rotary kernel launch", norm_rotary_kernel<T, kPer>, grid, block, 0, as_stream(a.stream),
                reinterpret_cast<T*>(a.out), reinterpret_cast<const T*>(a.x), reinterpret_cast<const T*>(a.weight),
                reinterpret_cast<const T*>(a.cos), reinterpret_cast<const T*>(a.sin), static_cast<int>(a.tokens),
                static_cast<int>(a.heads), a.stride_b, a.stride_t, a.stride_h, a.cs_stride_b, a.cs_stride_t,
                a.rotary_dim, a.eps, a.zero_centered, vectors);
}

template <typename T>
void launch_dim(const NormRotaryArgs& a) {
  switch (a.head_dim) {
    case 64: launch<T, 2>(a); break;
    case 128: launch<T, 4>(a); break;
    case 256: launch<T, 8>(a); break;
    default: throw std::invalid_argument("norm_rotary: head_dim must be 64, 128 or 256");
  }
}

}  // namespace

void norm_rotary(const NormRotaryArgs& a) {
  const int per_lane = a.head_dim / 32;
  if ((a.head_dim != 64 && a.head_dim != 128 && a.head_dim != 256) || a.rotary_dim < 2 ||
      a.rotary_dim > a.head_dim || a.rotary_dim % 2 || (a.rotary_dim / 2) % per_lane) {
    throw std::invalid_argument("norm_rotary: head_dim " + std::to_string(a.head_dim) +
                                " / rotary_dim " + std::to_string(a.rotary_dim) + " not supported");
  }
  if (a.batch < 0 || a.tokens < 1 || a.heads < 1 || a.tokens > (1 << 30) || a.heads > (1 << 20) ||
      a.batch * a.tokens * a.heads / kWarpsPerBlock >= (1LL << 31)) {
    throw std::invalid_argument("norm_rotary: shape out of range");
  }
  if (a.out == 0 || a.x == 0 || a.cos == 0 || a.sin == 0) {
    throw std::invalid_argument("norm_rotary: null pointer");
  }
  if (a.batch == 0) return;
  DeviceGuard guard(a.device);
  by_dtype(a.dtype, "norm_rotary", [&](auto t) { launch_dim<decltype(t)>(a); });
}

}  // namespace ninfer

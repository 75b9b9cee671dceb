// Head RMSNorm + rotate-half rotary embedding in one pass (see rope.h): one warp per head vector,
// D / 32 consecutive elements per lane, the rotation partner D / 32-aligned R / 2 elements away
// read from the partner lane by a shuffle. The attention layer's torch path is ~14 kernels a layer
// for q and k (two norms, then per tensor: slices, a negation, two concatenations, two products
// and a sum); this is two. The roundings are the torch expressions', op for op.
// norm_rotary_write_kv is a decode step's attention prologue in one launch instead of three
// (norm_rotary for q, for k, write_kv): q's and k's head vectors in one grid, each k warp then
// storing its result and the token's v into the paged cache with write_kv's own device code.
#include <type_traits>

#include "common.cuh"
#include "kv_cache.cuh"
#include "launch.cuh"
#include "rope.h"

namespace ninfer {
namespace {

constexpr int kWarpsPerBlock = 4;

// A lane's constants for its elements of a head vector: the norm's weights and the token's cos /
// sin (rotated lanes only: the rows are rotary_dim long). The kernels load them before the PDL
// wait (the weights are the model's; cos / sin were computed launches back; load_early_float and
// enter_kernel_after_loads keep all of them there: of norm_rotary_write_kv's 24, ptxas had placed 8
// below the wait), and the token's v with its k, so that after the wait a lane's loads go out
// together: one L2 round trip, not three in a row.
template <int kPer>
struct RotaryLane {
  float w[kPer], c[kPer], s[kPer];
};

// Lanes holding the first rotated half of a head vector (kPer elements a lane); the rotated lanes
// are the first twice as many.
template <int kPer>
__device__ __forceinline__ int half_rotated_lanes(int rotary_dim) {
  return rotary_dim / 2 / kPer;
}

template <typename T, int kPer>
__device__ __forceinline__ RotaryLane<kPer> load_rotary_lane(const T* weight, const T* cs, const T* sn, int rotary_dim,
                                                             int lane) {
  RotaryLane<kPer> r{};
  const bool rotated = lane < 2 * half_rotated_lanes<kPer>(rotary_dim);
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    if (weight != nullptr) r.w[j] = load_early_float(weight + lane * kPer + j);
    if (rotated) {
      r.c[j] = load_early_float(cs + lane * kPer + j);
      r.s[j] = load_early_float(sn + lane * kPer + j);
    }
  }
  return r;
}

// One head vector normed (with_norm: by r.w) and rotated. Lane `lane` holds elements lane * kPer
// .. + kPer of it in v (values of T; the norm overwrites them) and gets the same elements of the
// result in y. Every lane of the warp calls it (the norm's sum and the rotation partner are shuffles).
template <typename T, int kPer>
__device__ __forceinline__ void norm_rotary_vector(float (&v)[kPer], const RotaryLane<kPer>& r, bool with_norm,
                                                   int rotary_dim, float eps, bool zero_centered, int lane,
                                                   Vec<T, kPer>& y) {
  constexpr int kDim = 32 * kPer;
  if (with_norm) {
    float sumsq = 0.0f;
#pragma unroll
    for (int j = 0; j < kPer; ++j) sumsq += v[j] * v[j];
    const float rstd = rsqrtf(warp_sum(sumsq) / static_cast<float>(kDim) + eps);
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const float w = r.w[j];
      const float n = v[j] * rstd;
      v[j] = zero_centered ? to_float(from_float<T>(n * (w + 1.0f)))
                           : to_float(from_float<T>(to_float(from_float<T>(n)) * w));
    }
  }

  const int half_lanes = half_rotated_lanes<kPer>(rotary_dim);
  const bool first = lane < half_lanes;
  const bool rotated = lane < 2 * half_lanes;
  const int partner = first ? lane + half_lanes : (rotated ? lane - half_lanes : lane);
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const float other = __shfl_sync(0xffffffffu, v[j], partner);
    if (rotated) {
      const float c = to_float(from_float<T>(v[j] * r.c[j]));
      const float s = to_float(from_float<T>((first ? -other : other) * r.s[j]));
      y.v[j] = from_float<T>(c + s);
    } else {
      y.v[j] = from_float<T>(v[j]);
    }
  }
}

template <typename T, int kPer>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
    norm_rotary_kernel(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ weight,
                       const T* __restrict__ cos, const T* __restrict__ sin, int tokens, int heads,
                       std::int64_t stride_b, std::int64_t stride_t, std::int64_t stride_h,
                       std::int64_t cs_stride_b, std::int64_t cs_stride_t, int rotary_dim, float eps,
                       bool zero_centered, std::int64_t vectors) {
  constexpr int kDim = 32 * kPer;
  const std::int64_t vec = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.y;
  const int lane = threadIdx.x;
  const int h = static_cast<int>(vec % heads);
  const std::int64_t bt = vec / heads;
  const int t = static_cast<int>(bt % tokens);
  const std::int64_t b = bt / tokens;
  const std::int64_t cs_row = b * cs_stride_b + t * cs_stride_t;
  RotaryLane<kPer> r{};
  if (vec < vectors) r = load_rotary_lane<T, kPer>(weight, cos + cs_row, sin + cs_row, rotary_dim, lane);
  enter_kernel_after_loads();
  if (vec >= vectors) return;  // a whole warp leaves together
  const T* src = x + b * stride_b + t * stride_t + h * stride_h + lane * kPer;
  float v[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) v[j] = to_float(src[j]);
  Vec<T, kPer> y;
  norm_rotary_vector<T, kPer>(v, r, weight != nullptr, rotary_dim, eps, zero_centered, lane, y);
  T* dst = out + vec * kDim + lane * kPer;
#pragma unroll
  for (int j = 0; j < kPer; ++j) dst[j] = y.v[j];
}

// Head h of token t of row b of a [B, T, H, D] operand, advanced to lane's elements.
template <typename T, int kPer>
__device__ __forceinline__ const T* head_lane(const HeadsIn& in, std::int64_t b, std::int64_t t, int h, int lane) {
  return reinterpret_cast<const T*>(in.data) + b * in.stride_b + t * in.stride_t + h * in.stride_h + lane * kPer;
}

// One warp per head vector of a token's [q heads | k heads]; a k warp then appends its k and the
// token's v of the same kv head to the cache, as write_kv_kernel does (decode_attention.cu).
template <typename T, KVDType KV, int kPer>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
    norm_rotary_kv_kernel(const NormRotaryKVArgs a, std::int64_t vectors) {
  constexpr int kDim = 32 * kPer;
  const std::int64_t vec = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.y;
  if (vec >= vectors) {  // a whole warp leaves together
    enter_kernel();
    return;
  }
  const int lane = threadIdx.x;
  const int all_heads = a.heads + a.kv_heads;
  const int h = static_cast<int>(vec % all_heads);
  const std::int64_t bt = vec / all_heads;  // b * T + t
  const std::int64_t t = bt % a.tokens;
  const std::int64_t b = bt / a.tokens;
  const bool is_q = h < a.heads;
  const int head = is_q ? h : h - a.heads;  // q head, or kv head
  const std::int64_t cs_row = b * a.cs_stride_b + t * a.cs_stride_t;
  const auto* weight = reinterpret_cast<const T*>(is_q ? a.q_weight : a.k_weight);
  const RotaryLane<kPer> r = load_rotary_lane<T, kPer>(weight, reinterpret_cast<const T*>(a.cos) + cs_row,
                                                       reinterpret_cast<const T*>(a.sin) + cs_row, a.rotary_dim, lane);
  const std::int64_t slot = is_q ? -1 : load_early(reinterpret_cast<const std::int64_t*>(a.slot_mapping) + bt);
  // q, k and v are the projection's, the kernel before; decode attention, next, reads no output of
  // it before its wait (launch.cuh)
  start_dependents_then_wait_after_loads();
  const T* src = is_q ? head_lane<T, kPer>(a.q, b, t, head, lane) : head_lane<T, kPer>(a.k, b, t, head, lane);
  float v[kPer];
  Vec<T, kPer> value;  // a k warp's token v, loaded with its k
#pragma unroll
  for (int j = 0; j < kPer; ++j) v[j] = to_float(src[j]);
  const bool stored = !is_q && slot >= 0 && slot < a.num_slots;
  if (stored) {
    const T* value_src = head_lane<T, kPer>(a.v, b, t, head, lane);
#pragma unroll
    for (int j = 0; j < kPer; ++j) value.v[j] = value_src[j];
  }
  Vec<T, kPer> y;
  norm_rotary_vector<T, kPer>(v, r, weight != nullptr, a.rotary_dim, a.eps, a.zero_centered, lane, y);
  if (is_q) {
    T* dst = reinterpret_cast<T*>(a.q_out) + (bt * a.heads + head) * kDim + lane * kPer;
#pragma unroll
    for (int j = 0; j < kPer; ++j) dst[j] = y.v[j];
    return;
  }

  if (!stored) return;
  const std::int64_t row = slot * a.kv_heads + head;
  store_kv_vector<T, KV, kPer>(y, reinterpret_cast<unsigned char*>(a.k_cache), reinterpret_cast<float*>(a.k_scale),
                               row, lane);
  store_kv_vector<T, KV, kPer>(value, reinterpret_cast<unsigned char*>(a.v_cache), reinterpret_cast<float*>(a.v_scale),
                               row, lane);
}

// Grid of one warp per head vector, kWarpsPerBlock a block.
dim3 vector_grid(std::int64_t vectors) {
  return dim3(static_cast<unsigned>((vectors + kWarpsPerBlock - 1) / kWarpsPerBlock));
}

template <typename T, int kPer>
void launch(const NormRotaryArgs& a) {
  const std::int64_t vectors = a.batch * a.tokens * a.heads;
  const dim3 block(32, kWarpsPerBlock);
  launch_kernel("norm_rotary kernel launch", norm_rotary_kernel<T, kPer>, vector_grid(vectors), block, 0,
                as_stream(a.stream), reinterpret_cast<T*>(a.out), reinterpret_cast<const T*>(a.x),
                reinterpret_cast<const T*>(a.weight), reinterpret_cast<const T*>(a.cos),
                reinterpret_cast<const T*>(a.sin), static_cast<int>(a.tokens), static_cast<int>(a.heads), a.stride_b,
                a.stride_t, a.stride_h, a.cs_stride_b, a.cs_stride_t, a.rotary_dim, a.eps, a.zero_centered, vectors);
}

template <typename T>
void launch_kv(const NormRotaryKVArgs& a) {
  const std::int64_t vectors = a.batch * a.tokens * (a.heads + a.kv_heads);
  const dim3 block(32, kWarpsPerBlock);
  by_kv_dtype(a.kv_dtype, "norm_rotary_write_kv", [&](auto kv) {
    by_head_dim(a.head_dim, "norm_rotary_write_kv", [&](auto dim) {
      launch_kernel("norm_rotary_write_kv kernel launch",
                    norm_rotary_kv_kernel<T, decltype(kv)::value, decltype(dim)::value / 32>, vector_grid(vectors),
                    block, 0, as_stream(a.stream), a, vectors);
    });
  });
}

}  // namespace

// The launchers trust their arguments: the binding (bind_attention.cpp) checks them against rope.h.
// Left here: the grid's limit, which follows from its blocks of kWarpsPerBlock head vectors.
void norm_rotary(const NormRotaryArgs& a) {
  if (a.batch * a.tokens * a.heads / kWarpsPerBlock >= (1LL << 31)) {
    throw std::invalid_argument("norm_rotary: too many head vectors for the grid");
  }
  if (a.batch == 0) return;
  DeviceGuard guard(a.device);
  by_dtype(a.dtype, "norm_rotary", [&](auto t) {
    by_head_dim(a.head_dim, "norm_rotary", [&](auto dim) { launch<decltype(t), decltype(dim)::value / 32>(a); });
  });
}

void norm_rotary_write_kv(const NormRotaryKVArgs& a) {
  if (a.batch * a.tokens * (a.heads + a.kv_heads) / kWarpsPerBlock >= (1LL << 31)) {
    throw std::invalid_argument("norm_rotary_write_kv: too many head vectors for the grid");
  }
  if (a.batch == 0) return;
  DeviceGuard guard(a.device);
  switch (a.dtype) {
    case DType::F16: launch_kv<__half>(a); break;
    case DType::BF16: launch_kv<__nv_bfloat16>(a); break;
    default: throw std::invalid_argument("norm_rotary_write_kv: dtype must be float16 or bfloat16");
  }
}

}  // namespace ninfer

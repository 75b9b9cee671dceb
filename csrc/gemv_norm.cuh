// The add + RMSNorm a decode GEMV folds in front of itself (quant_gemv.h GemvAddNormArgs), shared
// by quant_gemv.cu's MMA kernel and stream_gemv.cu's streamed one: the rows are added and normed
// in a shared-memory stage, bit-equal to csrc/rmsnorm.cu's add_rmsnorm.
#pragma once

#include "common.cuh"
#include "quant_gemv.h"

namespace ninfer {

// 16 bytes through the read-only path (weights: not kept in L1), zeros when !pred. Predicated
// rather than branched: the MMAs that follow need the whole warp converged.
template <bool kWeights>
__device__ __forceinline__ uint4 load16(const void* ptr, bool pred) {
  uint4 v = make_uint4(0, 0, 0, 0);
  if constexpr (kWeights) {
    asm("{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n"
        " @p ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n}"
        : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w)
        : "l"(ptr), "r"(static_cast<int>(pred)));
  } else {
    asm("{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n"
        " @p ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n}"
        : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w)
        : "l"(ptr), "r"(static_cast<int>(pred)));
  }
  return v;
}

// 16 bytes from global to shared memory without registers (cp.async, sm_80+): the issuing thread
// sees them after cp_async_wait_all, the others after a barrier that follows it.
__device__ __forceinline__ void cp_async16(void* shared, const void* global) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(static_cast<std::uint32_t>(__cvta_generic_to_shared(shared))),
               "l"(global)
               : "memory");
}

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// The add + RMSNorm in front of a plain GEMV (quant_gemv.h GemvAddNormArgs): all null without it.
struct AddNorm {
  const void* residual;  // [m, k]
  const void* weight;    // [k]
  void* residual_out;    // [m, k]
  float eps;
  bool zero_centered;
};

// The norm's stage in dynamic shared memory: the m rows, then the norm's weight, each k + kStagePad
// elements (the pad: the rows of a quarter warp's x loads start in different banks).
constexpr int kStagePad = 8;

// Bytes of the stage for m rows of k 16-bit elements; at most kStageMaxBytes within the limits
// (quant_gemv.h): 80.3 KB, which with a norm kernel's static shared memory (at most 18 KB) fits
// the 99 KB a block may have on sm_86 / sm_89 / sm_120.
constexpr std::size_t stage_bytes(std::int64_t m, std::int64_t k) {
  return static_cast<std::size_t>((m + 1) * (k + kStagePad)) * 2;
}
constexpr std::size_t kStageMaxBytes =
    kQuantGemvNormStageBytes + kQuantGemvNormMaxK * 2 + (kQuantGemvNormMaxRows + 1) * kStagePad * 2;

// The norm's weight into the stage's last row: constant, so copied before the wait for x.
template <typename T, int kBlockWarps>
__device__ __forceinline__ void stage_norm_weight(T* stage, const AddNorm& norm, int m, int k) {
  const T* weight = static_cast<const T*>(norm.weight);
  T* row = stage + m * (k + kStagePad);
  for (int i = 8 * threadIdx.x; i < k; i += 8 * kBlockWarps * 32) cp_async16(row + i, weight + i);
}

// The norm prologue: norm(x + residual) of the m rows into the stage, bit-equal to add_rmsnorm's
// (csrc/rmsnorm.cu), and x + residual into residual_out by block 0. In rmsnorm_kernel thread c of a
// row adds the squares of vector c (8 elements; k <= 8 * 1024: one vector a thread) and its warps
// add up their lanes, then the warp totals: so here a warp takes such a 32-vector group whole (group
// p: row p / groups, vectors 32 (p % groups) + lane), adds it up as that warp does, and the group
// totals of a row add up as the warp totals do. Every block reads x and residual, none writes them.
template <typename T, int kBlockWarps>
__device__ void add_norm_rows(T* stage, const T* __restrict__ x, const AddNorm& norm, int m, int k) {
  constexpr int kPer = 8;       // elements of a 16-byte vector
  constexpr int kInFlight = 2;  // groups whose x loads a warp has in flight together (3: the
                                // weights loaded before it spill a register for kTiles = 1)
  using TV = Vec<T, kPer>;
  __shared__ float group_totals[kQuantGemvNormMaxRows][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nvec = k / kPer, stride = k + kStagePad;
  const int groups = rms_row_threads(nvec) / 32, all_groups = m * groups;  // groups: of a row
  // The residual vectors of this lane's groups go to the stage first, all at once (no registers);
  // the x vectors follow kInFlight groups at a time and are added there.
  const auto* residual = static_cast<const T*>(norm.residual);
  for (int p = warp; p < all_groups; p += kBlockWarps) {
    const int row = p / groups, c = p % groups * 32 + lane;
    if (c < nvec) cp_async16(stage + row * stride + c * kPer, residual + static_cast<std::int64_t>(row) * k + c * kPer);
  }
  auto* residual_out = static_cast<T*>(norm.residual_out);
  for (int first = warp; first < all_groups; first += kBlockWarps * kInFlight) {
    uint4 xv[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {  // group first + u kBlockWarps; lanes past a row load zeros
      const int p = first + u * kBlockWarps, c = p % groups * 32 + lane;
      const bool live = p < all_groups && c < nvec;
      xv[u] = load16<false>(x + (live ? static_cast<std::int64_t>(p / groups) * k + c * kPer : 0), live);
    }
    cp_async_wait_all();  // this lane's residual vectors are in the stage
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int p = first + u * kBlockWarps, row = p / groups, c = p % groups * 32 + lane;
      if (p >= all_groups) break;  // warp-uniform
      const bool live = c < nvec;
      uint4* staged = reinterpret_cast<uint4*>(stage + row * stride) + c;
      const uint4 rv = live ? *staged : make_uint4(0, 0, 0, 0);
      TV& a = *reinterpret_cast<TV*>(&xv[u]);
      const TV& r = *reinterpret_cast<const TV*>(&rv);
#pragma unroll
      for (int j = 0; j < kPer; ++j) a.v[j] = add_rounded(a.v[j], r.v[j]);
      if (live) {
        *staged = xv[u];
        if (blockIdx.x == 0) reinterpret_cast<uint4*>(residual_out + static_cast<std::int64_t>(row) * k)[c] = xv[u];
      }
      const float total = warp_sum(add_squares(0.0f, a));  // dead lanes add zeros, as idle threads do
      if (lane == 0) group_totals[row][p % groups] = total;
    }
  }
  cp_async_wait_all();  // the weight row too (also in warps without a group)
  __syncthreads();
  const uint4* weight = reinterpret_cast<const uint4*>(stage + m * stride);
  for (int row = 0; row < m; ++row) {
    const float rstd = rms_rstd(warp_sum(lane < groups ? group_totals[row][lane] : 0.0f), k, norm.eps);
    uint4* staged = reinterpret_cast<uint4*>(stage + row * stride);
    for (int c = threadIdx.x; c < nvec; c += kBlockWarps * 32) {
      uint4 v = staged[c];
      const uint4 wv = weight[c];
      TV& a = *reinterpret_cast<TV*>(&v);
      const TV& w = *reinterpret_cast<const TV*>(&wv);
#pragma unroll
      for (int j = 0; j < kPer; ++j) a.v[j] = norm_scale(a.v[j], rstd, w.v[j], norm.zero_centered);
      staged[c] = v;
    }
  }
  __syncthreads();
}

}  // namespace ninfer

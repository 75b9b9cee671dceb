// Decode GEMVs of 1-4 activation rows that stream their weights through shared memory with the
// copy engine (sm_90+). At batch 1 a projection is a few MB read once: quant_gemv.cu's warps each
// keep two or four 16-byte loads in flight and wait for several DRAM round trips one after
// another, so an 8 MB GEMV ran at ~1 TB/s whether its weights came from DRAM or from L2. Here one
// block an SM asks for its rows in a few large bulk copies (cp.async.bulk, completing on an
// mbarrier per ring slot) before it even waits for the kernel before it (programmatic dependent
// launch: weights are never written), so nearly all of a block's bytes are in flight at once and
// their latency hides behind the previous kernel's tail. Then the activations are staged (with the
// folded add + RMSNorm in front where asked: gemv_norm.cuh, bit-equal to add_rmsnorm), each warp
// dots one staged weight row with them (weight_dot.cuh, fp32) as its slot lands, and the slot is
// refilled.
//
// Stage s is weight rows 16 s .. 16 s + 15 (+ their int4 group scales); block b takes stages b,
// b + grid, ... through a ring of slots. Sums are fp32: int8 as quant_gemv's (exact up to the
// order of the sum), int4 with each group's scale applied to its fp32 partial sum.
#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "gemv_norm.cuh"
#include "launch.cuh"
#include "quant_gemv.h"
#include "weight_dot.cuh"

namespace ninfer {
namespace {

constexpr int kStageRows = 16;  // one weight row a warp and stage
constexpr int kThreads = 32 * kStageRows;
constexpr int kMaxRing = 8;
constexpr int kBarrierBytes = 128;  // the ring's mbarriers, padded so the stages stay 128-byte aligned
constexpr int kMinRing = 2;
constexpr bool kStreamByDefault = false;  // until measured on a GPU: NINFER_STREAM_GEMV=1 turns it on
constexpr int kStaticReserve = 4096;  // add_norm_rows' static shared memory, and a margin

struct StreamArgs {
  void* out;
  const void* x;
  const std::uint8_t* qweight;
  const std::uint8_t* scales;  // int8: fp32 [n]; int4: bf16 [n, groups]
  const void* bias;
  int m, n, k;
  int row_bytes;
  int groups;
  int group_shift;  // log2(group_size / 32): int4 vector c lies in group c >> group_shift
  int stages;
  int ring;
  int slot_bytes;
  int x_bytes;     // the staged activations, rounded up to 128
  int norm_bytes;  // the norm's stage (gemv_norm.cuh), rounded up to 128; 0 without one
  AddNorm norm;
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ std::uint32_t smem_address(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void barrier_init(std::uint32_t bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void barrier_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void barrier_expect(std::uint32_t bar, std::uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_load(std::uint32_t dst, const void* src, std::uint32_t bytes, std::uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}
__device__ __forceinline__ void barrier_wait(std::uint32_t bar, std::uint32_t parity) {
  std::uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}
#endif

template <typename T, typename C, bool kNorm>
__global__ void __launch_bounds__(kThreads, 1) stream_gemv_kernel(StreamArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr bool kInt4 = C::kNibbleScaled;
  extern __shared__ __align__(128) unsigned char smem[];
  std::uint64_t* bars = reinterpret_cast<std::uint64_t*>(smem);
  float* xs = reinterpret_cast<float*>(smem + kBarrierBytes);
  T* norm_stage = reinterpret_cast<T*>(smem + kBarrierBytes + a.x_bytes);
  unsigned char* ring = smem + kBarrierBytes + a.x_bytes + a.norm_bytes;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int grid = gridDim.x;
  const int scale_bytes = kInt4 ? a.groups * 2 : 0;  // a row's scales in its slot
  const auto issue = [&](int i) {  // thread 0: stage blockIdx.x + i grid into slot i % ring
    const int s = blockIdx.x + i * grid;
    if (s >= a.stages) return;
    const int rows = min(kStageRows, a.n - s * kStageRows);
    unsigned char* slot = ring + (i % a.ring) * a.slot_bytes;
    const std::uint32_t bar = smem_address(&bars[i % a.ring]);
    const std::int64_t row0 = static_cast<std::int64_t>(s) * kStageRows;
    barrier_expect(bar, rows * (a.row_bytes + scale_bytes));
    bulk_load(smem_address(slot), a.qweight + row0 * a.row_bytes, rows * a.row_bytes, bar);
    if constexpr (kInt4) {
      bulk_load(smem_address(slot + kStageRows * a.row_bytes), a.scales + row0 * scale_bytes, rows * scale_bytes, bar);
    }
  };
  if (threadIdx.x == 0) {
    for (int r = 0; r < a.ring; ++r) barrier_init(smem_address(&bars[r]));
    barrier_init_fence();
    for (int i = 0; i < a.ring; ++i) issue(i);  // before the wait: weights are never written
  }
  if constexpr (kNorm) stage_norm_weight<T, kStageRows>(norm_stage, a.norm, a.m, a.k);
  wait_for_inputs();
  start_dependents();
  const T* x = static_cast<const T*>(a.x);
  if constexpr (kNorm) {
    add_norm_rows<T, kStageRows>(norm_stage, x, a.norm, a.m, a.k);  // ends with a barrier
    x = norm_stage;
  }
  const int x_stride = kNorm ? a.k + kStagePad : a.k;
  for (int j = 0; j < a.m; ++j) stage<C>(xs + j * a.k, x + static_cast<std::int64_t>(j) * x_stride, a.k);
  __syncthreads();  // the staged rows, and the barriers' init, seen by every thread

  const int row_vecs = a.row_bytes / 16;  // = a.k / C::kVec, the staged rows' chunks
  T* out = static_cast<T*>(a.out);
  const T* bias = static_cast<const T*>(a.bias);
  for (int i = 0; blockIdx.x + i * grid < a.stages; ++i) {
    const int row = (blockIdx.x + i * grid) * kStageRows + warp;
    const unsigned char* slot = ring + (i % a.ring) * a.slot_bytes;
    barrier_wait(smem_address(&bars[i % a.ring]), (i / a.ring) & 1);
    if (row < a.n) {
      const uint4* w = reinterpret_cast<const uint4*>(slot + warp * a.row_bytes);
      const __nv_bfloat16* group_scales =
          reinterpret_cast<const __nv_bfloat16*>(slot + kStageRows * a.row_bytes + warp * scale_bytes);
      float acc[kStreamGemvMaxRows] = {};
      for (int c = lane; c < row_vecs; c += 32) {
        float f[C::kVec];
        C::floats(w[c], f);
        const float scale = kInt4 ? __bfloat162float(group_scales[c >> a.group_shift]) : 1.0f;
#pragma unroll
        for (int j = 0; j < kStreamGemvMaxRows; ++j) {
          if (j < a.m) {
            const float d = dot_floats<C>(f, reinterpret_cast<const float4*>(xs + j * a.k) + c, row_vecs);
            acc[j] = kInt4 ? fmaf(scale, d, acc[j]) : acc[j] + d;
          }
        }
      }
#pragma unroll
      for (int j = 0; j < kStreamGemvMaxRows; ++j) {
        if (j >= a.m) break;
        float v = warp_sum(acc[j]);
        if (lane == 0) {
          if constexpr (!kInt4) v *= __ldg(reinterpret_cast<const float*>(a.scales) + row);
          if (bias != nullptr) v += to_float(bias[row]);
          out[static_cast<std::int64_t>(j) * a.n + row] = from_float<T>(v);
        }
      }
    }
    __syncthreads();  // the slot is read: refill it
    if (threadIdx.x == 0) issue(i + a.ring);
  }
#endif
}

constexpr int round_up(int v, int to) { return (v + to - 1) / to * to; }

// The launch of a call: grid, ring slots and their bytes; ring < kMinRing where it does not fit.
struct Plan {
  int grid = 0;
  StreamArgs args{};
  std::size_t smem = 0;
};

Plan plan(const QuantGemvArgs& a) {
  Plan p;
  StreamArgs& s = p.args;
  s.m = static_cast<int>(a.m);
  s.n = static_cast<int>(a.n);
  s.k = static_cast<int>(a.k);
  s.row_bytes = static_cast<int>(a.int4 ? a.k / 2 : a.k);
  s.groups = a.int4 ? static_cast<int>(a.k / a.group_size) : 0;
  for (s.group_shift = 0; a.int4 && (32 << s.group_shift) < a.group_size;) ++s.group_shift;
  s.stages = (s.n + kStageRows - 1) / kStageRows;
  s.slot_bytes = round_up(kStageRows * (s.row_bytes + 2 * s.groups), 128);
  s.x_bytes = round_up(s.m * s.k * 4, 128);
  s.norm_bytes = a.norm.residual != 0 ? round_up(static_cast<int>(stage_bytes(a.m, a.k)), 128) : 0;
  p.grid = std::min(s.stages, device_attribute<cudaDevAttrMultiProcessorCount>(a.device));
  const int per_block = (s.stages + p.grid - 1) / std::max(p.grid, 1);
  const long long room = device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(a.device) - kStaticReserve -
                         kBarrierBytes - s.x_bytes - s.norm_bytes;
  const long long slots = room > 0 ? room / s.slot_bytes : 0;
  s.ring = static_cast<int>(std::min<long long>(std::min<long long>(kMaxRing, per_block), slots));
  p.smem = kBarrierBytes + s.x_bytes + s.norm_bytes + static_cast<std::size_t>(s.ring) * s.slot_bytes;
  return p;
}

template <typename T, typename C, bool kNorm>
void launch(const QuantGemvArgs& a, Plan p) {
  constexpr auto kernel = stream_gemv_kernel<T, C, kNorm>;
  static std::array<std::atomic<bool>, 64> allowed{};
  if (!allowed.at(a.device).load(std::memory_order_relaxed)) {
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(a.device) - kStaticReserve),
               "cudaFuncSetAttribute");
    allowed[a.device].store(true, std::memory_order_relaxed);
  }
  StreamArgs& s = p.args;
  s.out = reinterpret_cast<void*>(a.out);
  s.x = reinterpret_cast<const void*>(a.x);
  s.qweight = reinterpret_cast<const std::uint8_t*>(a.qweight);
  s.scales = reinterpret_cast<const std::uint8_t*>(a.scales);
  s.bias = reinterpret_cast<const void*>(a.bias);
  s.norm = {reinterpret_cast<const void*>(a.norm.residual), reinterpret_cast<const void*>(a.norm.weight),
            reinterpret_cast<void*>(a.norm.residual_out), a.norm.eps, a.norm.zero_centered};
  launch_kernel("stream_gemv kernel launch", kernel, dim3(p.grid), dim3(kThreads), p.smem, as_stream(a.stream), s);
}

}  // namespace

bool stream_gemv_fits(const QuantGemvArgs& a) {
  const char* env = std::getenv("NINFER_STREAM_GEMV");  // read at each call: benchmarks switch it
  if (!(env == nullptr ? kStreamByDefault : std::strcmp(env, "0") != 0) || (a.dtype != DType::F16 && a.dtype != DType::BF16) || a.gate_up || a.gate != 0 || a.add != 0 ||
      a.m > kStreamGemvMaxRows || a.n < kStreamGemvMinRows || a.n > (1LL << 30)) {
    return false;
  }
  if (a.int4 && ((a.k / a.group_size) % 8 != 0 || !is_aligned(a.scales, 16))) return false;  // 16-byte scale copies
  if (compute_major(a.device) < 9) return false;
  return plan(a).args.ring >= kMinRing;
}

void stream_gemv(const QuantGemvArgs& a) {
  const Plan p = plan(a);
  const auto by_codes = [&](auto type, auto norm) {
    using T = decltype(type);
    constexpr bool kNorm = decltype(norm)::value;
    a.int4 ? launch<T, Int4Codes, kNorm>(a, p) : launch<T, Int8Codes, kNorm>(a, p);
  };
  const auto by_norm = [&](auto type) {
    a.norm.residual != 0 ? by_codes(type, std::true_type{}) : by_codes(type, std::false_type{});
  };
  a.dtype == DType::F16 ? by_norm(__half{}) : by_norm(__nv_bfloat16{});
}

}  // namespace ninfer

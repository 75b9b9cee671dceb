// MoE routing (one warp per token) and the routed experts' decode step as two bandwidth-bound
// GEMV kernels: gate_up rows of each (token, expert) pair with SwiGLU fused into the epilogue,
// then the down rows of all of a token's experts with the weighted sum over experts inside the
// kernel (fixed order: deterministic, no atomics). Expert ids are read on the device, so the step
// never syncs with the host and is captured by CUDA graphs. Weights stream through 16-byte loads,
// each selected expert's bytes read once per token; activations are staged as fp32 in shared
// memory and every product is accumulated in fp32.
#include <algorithm>
#include <type_traits>

#include "common.cuh"
#include "launch.cuh"
#include "moe.h"

namespace ninfer {
namespace {

constexpr int kWarps = 8;  // one output row per warp, 8 rows per block
constexpr int kThreads = 32 * kWarps;
constexpr int kUnroll = 4;  // 16-byte loads in flight per lane and weight row
constexpr int kMaxTopK = kMoeMaxTopK;
constexpr int kMaxRouteExperts = kMoeMaxRouteExperts;  // routing holds a token's probabilities in a warp's registers

// ---------------------------------------------------------------- activations in shared memory

// An activation vector is staged as fp32 float4 quads, quad-major: quad q (elements 4q..4q+3) of
// the chunk c of kVec elements that one 16-byte weight vector covers lives at x4[q * chunks + c].
// The lanes of a warp read consecutive chunks, so their loads of quad q are consecutive 16-byte
// words (no bank conflicts), and quad q of a chunk is one immediate-offset step from quad 0: the
// dot products spend no instructions on shared-memory addresses.
// W::kNibbleScaled (int4): element 4q + m is staged times 16^-m, exactly (a power of two), because
// the int4 dot takes nibble m of a 16-bit half word in place, as n * 16^m (see Int4Weights).
template <typename W, typename T>
__device__ __forceinline__ void stage(float* dst, const T* __restrict__ src, int n) {
  constexpr int kVec = W::kVec;
  const int chunks = n / kVec;
  const auto put = [&](int p, float v) {
    const int m = p % 4;
    if constexpr (W::kNibbleScaled) v *= __uint_as_float((127u - 4u * m) << 23);  // 2^(-4m)
    dst[((p % kVec / 4) * chunks + p / kVec) * 4 + m] = v;
  };
  constexpr int kPer = 16 / sizeof(T);
  if (n % kPer == 0 && is_aligned(reinterpret_cast<std::uintptr_t>(src), 16)) {
    for (int v = threadIdx.x; v < n / kPer; v += blockDim.x) {
      const Vec<T, kPer> packed = reinterpret_cast<const Vec<T, kPer>*>(src)[v];
#pragma unroll
      for (int j = 0; j < kPer; ++j) put(v * kPer + j, to_float(packed.v[j]));
    }
    return;
  }
#pragma unroll 4
  for (int p = threadIdx.x; p < n; p += blockDim.x) put(p, to_float(src[p]));
}

__device__ __forceinline__ float dot4(float a, float b, float c, float d, float4 x, float acc) {
  return fmaf(d, x.w, fmaf(c, x.z, fmaf(b, x.y, fmaf(a, x.x, acc))));
}

// ---------------------------------------------------------------- weight formats
// Each reads one 16-byte vector (chunk c of a row), gives the chunk's scale, and dots the raw
// vector with the staged activations of that chunk: x points at its quad 0, quad q is x[q * chunks].

template <typename T>
struct DenseWeights {
  static constexpr int kVec = 16 / sizeof(T);
  static constexpr bool kNibbleScaled = false;
  const uint4* w;
  int row_vecs;

  __device__ __forceinline__ uint4 load(std::int64_t row, int c) const {
    return __ldg(w + row * row_vecs + c);
  }
  __device__ __forceinline__ float scale(std::int64_t, int) const { return 1.0f; }
  __device__ __forceinline__ float dot(const uint4& v, const float4* x, int chunks) const;
};

__device__ __forceinline__ float2 pair_to_float2(std::uint32_t w, __nv_bfloat16*) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}
__device__ __forceinline__ float2 pair_to_float2(std::uint32_t w, __half*) {
  return __half22float2(*reinterpret_cast<const __half2*>(&w));
}

template <typename T>
__device__ __forceinline__ float DenseWeights<T>::dot(const uint4& v, const float4* x, int chunks) const {
  const std::uint32_t words[4] = {v.x, v.y, v.z, v.w};
  float acc = 0.0f;
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const float2 a = pair_to_float2(words[2 * q], static_cast<T*>(nullptr));
    const float2 b = pair_to_float2(words[2 * q + 1], static_cast<T*>(nullptr));
    acc = dot4(a.x, a.y, b.x, b.y, x[q * chunks], acc);
  }
  return acc;
}

template <>
__device__ __forceinline__ float DenseWeights<float>::dot(const uint4& v, const float4* x, int) const {
  return dot4(__uint_as_float(v.x), __uint_as_float(v.y), __uint_as_float(v.z), __uint_as_float(v.w), x[0], 0.0f);
}

struct Int8Weights {
  static constexpr int kVec = 16;
  static constexpr bool kNibbleScaled = false;
  const uint4* q;
  const float* scales;  // [rows]
  int row_vecs;

  __device__ __forceinline__ uint4 load(std::int64_t row, int c) const {
    return __ldg(q + row * row_vecs + c);
  }
  __device__ __forceinline__ float scale(std::int64_t row, int) const {
    return __ldg(scales + row);
  }
  // Byte b of word q is element 4q + b. 0x4B0000xx is the float 2^23 + xx exactly; with the sign
  // bit flipped, xx = value + 128: two instructions per element instead of a slow I2F.
  __device__ __forceinline__ float dot(const uint4& v, const float4* x, int chunks) const {
    const std::uint32_t words[4] = {v.x, v.y, v.z, v.w};
    float acc = 0.0f;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const std::uint32_t u = words[q] ^ 0x80808080u;
      float f[4];
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        f[b] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7440u + b)) - 8388736.0f;
      }
      acc = dot4(f[0], f[1], f[2], f[3], x[q * chunks], acc);
    }
    return acc;
  }
};

struct Int4Weights {
  static constexpr int kVec = 32;
  static constexpr bool kNibbleScaled = true;
  const uint4* q;
  const __nv_bfloat16* scales;  // [rows, groups]
  int row_vecs;
  int groups;
  int group_shift;  // log2(group_size / 32): chunk c lies in group c >> group_shift

  __device__ __forceinline__ uint4 load(std::int64_t row, int c) const {
    return __ldg(q + row * row_vecs + c);
  }
  __device__ __forceinline__ float scale(std::int64_t row, int c) const {
    return __bfloat162float(scales[row * groups + (c >> group_shift)]);
  }
  // Nibble m of word w is element 8w + m, stored as value + 8. Quad q = 2w + h is the 16-bit half
  // h of word w; its nibble m (bits 4m..4m+3 of the half) is read in place: 0x4B000000 | (bits)
  // is the float 2^23 + n 16^m exactly, minus 2^23 + 8 16^m gives (n - 8) 16^m, one LOP3 and one
  // FADD an element. The staged x carries the 16^-m (stage), so each product, and so every fp32
  // sum, is the one (n - 8) * x would give.
  __device__ __forceinline__ float dot(const uint4& v, const float4* x, int chunks) const {
    const std::uint32_t words[4] = {v.x, v.y, v.z, v.w};
    float acc = 0.0f;
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      const std::uint32_t u = q % 2 ? words[q / 2] >> 16 : words[q / 2];
      float f[4];
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        f[m] = __uint_as_float((u & (0xFu << (4 * m))) | 0x4B000000u) - (8388608.0f + 8.0f * (1 << (4 * m)));
      }
      acc = dot4(f[0], f[1], f[2], f[3], x[q * chunks], acc);
    }
    return acc;
  }
};

// ---------------------------------------------------------------- kernels

__device__ __forceinline__ float load_float(const void* p, int i, DType dtype) {
  switch (dtype) {
    case DType::F32: return static_cast<const float*>(p)[i];
    case DType::F16: return __half2float(static_cast<const __half*>(p)[i]);
    default: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  }
}

// No shared expert in a decode step (the kernels' WS type); never loaded from.
struct NoShared {
  static constexpr int kVec = 16;
};

template <typename WS>
inline constexpr bool kHasShared = !std::is_same_v<WS, NoShared>;

// One block's gate_up rows of one expert: warp w computes outputs i = kGateUpOutputs w + o (gate
// row gate_row + i, up row gate_row + rows + i) and writes h_row[i] with the reference's roundings
// (linear, silu and product each in T); a dead expert writes 0. Two outputs a warp halve the
// blocks: one token's 8 + 1 experts at the 35B shape are 288 blocks, all resident at once (at one
// output a warp, 576 blocks took 1.3 waves at 3 blocks an SM, ncu). A lane keeps kUnroll vectors
// of the warp's rows in flight; the first are requested before x is staged, so the staging runs
// under their DRAM latency (at the 35B shape they are all of the rows).
constexpr int kGateUpOutputs = 2;

template <typename T, typename W>
__device__ __forceinline__ void gate_up_rows(T* h_row, const T* x_row, const W& w, std::int64_t gate_row,
                                             int rows, bool expert_live, int hidden, float* xs) {
  constexpr int kOut = kGateUpOutputs;
  constexpr int kPer = kUnroll / kOut;  // vectors of each row a lane loads per step
  const int lane = threadIdx.x & 31;
  const int i0 = (blockIdx.x * kWarps + (threadIdx.x >> 5)) * kOut;
  bool live[kOut];  // uniform over the warp
  std::int64_t g_row[kOut];
#pragma unroll
  for (int o = 0; o < kOut; ++o) {
    live[o] = expert_live && i0 + o < rows;
    g_row[o] = live[o] ? gate_row + i0 + o : 0;
  }
  const int nvec = hidden / W::kVec;
  uint4 wg[kOut][kPer];
  uint4 wu[kOut][kPer];
  float sg[kOut][kPer];
  float su[kOut][kPer];
  const auto load = [&](int c0) {
#pragma unroll
    for (int o = 0; o < kOut; ++o) {
#pragma unroll
      for (int k = 0; k < kPer; ++k) {
        const int c = c0 + 32 * k;
        if (live[o] && c < nvec) {
          wg[o][k] = w.load(g_row[o], c);
          wu[o][k] = w.load(g_row[o] + rows, c);
          sg[o][k] = w.scale(g_row[o], c);
          su[o][k] = w.scale(g_row[o] + rows, c);
        }
      }
    }
  };
  load(lane);
  stage<W>(xs, x_row, hidden);
  __syncthreads();
  if (i0 >= rows) return;
  const float4* x4 = reinterpret_cast<const float4*>(xs);
  float g[kOut] = {};
  float u[kOut] = {};
  for (int c0 = lane;;) {
#pragma unroll
    for (int o = 0; o < kOut; ++o) {
#pragma unroll
      for (int k = 0; k < kPer; ++k) {
        const int c = c0 + 32 * k;
        if (live[o] && c < nvec) {
          g[o] = fmaf(sg[o][k], w.dot(wg[o][k], x4 + c, nvec), g[o]);
          u[o] = fmaf(su[o][k], w.dot(wu[o][k], x4 + c, nvec), u[o]);
        }
      }
    }
    c0 += 32 * kPer;
    if (c0 >= nvec) break;
    load(c0);
  }
#pragma unroll
  for (int o = 0; o < kOut; ++o) {
    g[o] = warp_sum(g[o]);
    u[o] = warp_sum(u[o]);
    if (lane == 0 && i0 + o < rows) {
      h_row[i0 + o] = from_float<T>(silu_times<T>(round_to<T>(g[o]), round_to<T>(u[o])));
    }
  }
}

// Block (row tile, y): y < routed_pairs is the (token, slot) pair y's expert, into h[token, slot];
// past it, the shared expert of token y - routed_pairs (WS weights [2 shared_inter, hidden]),
// into h[token, top_k] (h rows are h_stride = top_k * inter + shared_inter long).
template <typename T, typename W, typename WS>
__global__ void __launch_bounds__(kThreads, 3)  // 3 blocks an SM: the 288 blocks of one token in one wave
    gate_up_kernel(T* __restrict__ h, const T* __restrict__ x, const int* __restrict__ ids, W w, WS ws,
                   int routed_pairs, int top_k, int hidden, int inter, int experts, int shared_inter,
                   int h_stride) {
  enter_kernel();
  extern __shared__ float4 smem[];
  float* xs = reinterpret_cast<float*>(smem);
  const int y = blockIdx.y;
  if (kHasShared<WS> && y >= routed_pairs) {
    if constexpr (kHasShared<WS>) {
      const int n = y - routed_pairs;
      gate_up_rows<T>(h + static_cast<std::int64_t>(n) * h_stride + top_k * inter,
                      x + static_cast<std::int64_t>(n) * hidden, ws, 0, shared_inter, true, hidden, xs);
    }
    return;
  }
  const int n = y / top_k;
  const int e = ids[y];
  gate_up_rows<T>(h + static_cast<std::int64_t>(n) * h_stride + (y % top_k) * inter,
                  x + static_cast<std::int64_t>(n) * hidden, w, static_cast<std::int64_t>(e) * 2 * inter, inter,
                  e >= 0 && e < experts, hidden, xs);
}

// Block (row tile, token): warp r computes out[token, r] over the token's k experts at once, the
// k down rows laid end to end as one row of k * inter elements against h[token] (k * inter). The
// first loads (their expert ids read from global memory) go out before the kernel waits for
// gate_up, the kernel launched just before it (programmatic dependent launch): the ids and
// weights come from the routing before that, already complete. With a shared expert the warp
// also takes its down row r (WS [hidden, shared_inter]) against h[token, top_k] and ends as the
// composition would: round(round(routed) + round(round(shared) * round(sigmoid(gate[token])))).
template <typename T, typename W, typename WS>
__global__ void __launch_bounds__(kThreads)
    down_kernel(T* __restrict__ out, const T* __restrict__ h, const void* __restrict__ weights,
                DType weights_dtype, const int* __restrict__ ids, W w, WS ws, int top_k, int hidden,
                int inter, int experts, int shared_inter, int h_stride, const T* __restrict__ shared_gate,
                std::int64_t gate_stride) {
  extern __shared__ float4 smem[];
  const int n = blockIdx.y;
  const int span = top_k * inter;
  float* hs = reinterpret_cast<float*>(smem);
  float* hs_shared = hs + span;
  float* slot_weight = hs_shared + (kHasShared<WS> ? shared_inter : 0);
  const int lane = threadIdx.x & 31;
  const int r = blockIdx.x * kWarps + (threadIdx.x >> 5);
  const int row_vecs = inter / W::kVec;
  const int nvec = top_k * row_vecs;
  int j = lane / row_vecs;  // slot and chunk of the flattened vector index t, advanced with t
  int c = lane % row_vecs;
  uint4 v[kUnroll];
  float s[kUnroll];
  int slot[kUnroll];
  bool live[kUnroll];
  const auto load = [&](int t0) {
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      int e = -1;
      if (r < hidden && t0 + 32 * k < nvec) e = __ldg(ids + n * top_k + j);
      live[k] = e >= 0 && e < experts;  // an id outside [0, experts) contributes nothing
      slot[k] = j;
      if (live[k]) {
        const std::int64_t row = static_cast<std::int64_t>(e) * hidden + r;
        v[k] = w.load(row, c);
        s[k] = w.scale(row, c);
      }
      for (c += 32; c >= row_vecs; c -= row_vecs) ++j;
    }
  };
  const int shared_vecs = kHasShared<WS> ? shared_inter / WS::kVec : 0;
  uint4 sv[kUnroll];
  float ss[kUnroll];
  const auto load_shared = [&](int c0) {
    if constexpr (kHasShared<WS>) {
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        if (r < hidden && c0 + 32 * k < shared_vecs) {
          sv[k] = ws.load(r, c0 + 32 * k);
          ss[k] = ws.scale(r, c0 + 32 * k);
        }
      }
    }
  };
  load(lane);
  load_shared(lane);
  enter_kernel();  // h is gate_up's output
  const T* h_row = h + static_cast<std::int64_t>(n) * h_stride;
  stage<W>(hs, h_row, span);
  if constexpr (kHasShared<WS>) stage<WS>(hs_shared, h_row + span, shared_inter);
  for (int jj = threadIdx.x; jj < top_k; jj += blockDim.x) {
    slot_weight[jj] = load_float(weights, n * top_k + jj, weights_dtype);
  }
  __syncthreads();
  if (r >= hidden) return;
  float acc = 0.0f;
  for (int t0 = lane;;) {
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if (live[k]) {
        acc = fmaf(slot_weight[slot[k]] * s[k], w.dot(v[k], reinterpret_cast<const float4*>(hs) + t0 + 32 * k, nvec), acc);
      }
    }
    t0 += 32 * kUnroll;
    if (t0 >= nvec) break;
    load(t0);
  }
  acc = warp_sum(acc);
  if constexpr (kHasShared<WS>) {
    float shared = 0.0f;
    for (int c0 = lane;;) {
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        if (c0 + 32 * k < shared_vecs) {
          shared = fmaf(ss[k], ws.dot(sv[k], reinterpret_cast<const float4*>(hs_shared) + c0 + 32 * k, shared_vecs),
                        shared);
        }
      }
      c0 += 32 * kUnroll;
      if (c0 >= shared_vecs) break;
      load_shared(c0);
    }
    shared = warp_sum(shared);
    acc = round_to<T>(acc) + sigmoid_times<T>(round_to<T>(shared), to_float(shared_gate[n * gate_stride]));
  }
  if (lane == 0) out[static_cast<std::int64_t>(n) * hidden + r] = from_float<T>(acc);
}

// One warp routes one token: softmax of its logits row in fp32, then top_k rounds of a warp
// argmax (ties to the lower id); each winner is knocked out with -1 (probabilities are >= 0).
// Expert i lives in register i / 32 of lane i % 32, so a round is a few register compares and two
// warp reductions (__reduce_*_sync, sm_80+): one warp walking the row in shared memory took
// ~5 us a token, latency-bound. Non-negative floats order as their bits, so the max of the bits
// is the max probability; the min over the lanes holding it gives the lowest id. The row is read
// through L2 (__ldcg): the router kernel's last block reads rows other blocks wrote.
// kPerLane: registers a lane holds (experts <= 32 kPerLane; 8 for the 256 experts of Qwen3.5 / 3.6,
// half the compares of the 512-expert bound).
template <int kPerLane, typename T>
__device__ __forceinline__ void route_token(T* __restrict__ weights, int* __restrict__ ids, const T* row,
                                            std::int64_t token, int experts, int top_k, bool renormalize) {
  const int lane = threadIdx.x & 31;
  float p[kPerLane];
  float top = -INFINITY;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int i = lane + 32 * j;
    p[j] = i < experts ? to_float(__ldcg(row + i)) : -INFINITY;
    top = fmaxf(top, p[j]);
  }
  top = warp_max(top);
  float sum = 0.0f;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    if (lane + 32 * j < experts) {
      p[j] = expf(p[j] - top);
      sum += p[j];
    }
  }
  sum = warp_sum(sum);
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) p[j] = lane + 32 * j < experts ? p[j] / sum : -1.0f;
  float mine[kMaxTopK / 32] = {};  // lane l keeps the winners of rounds l, l + 32
  float total = 0.0f;
  for (int k = 0; k < top_k; ++k) {
    float best = -1.0f;
    int arg = experts;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      if (p[j] > best) {
        best = p[j];
        arg = lane + 32 * j;
      }
    }
    const unsigned top_bits = __reduce_max_sync(0xffffffffu, __float_as_uint(fmaxf(best, 0.0f)));
    const int win = static_cast<int>(
        __reduce_min_sync(0xffffffffu, __float_as_uint(fmaxf(best, 0.0f)) == top_bits ? arg : experts));
    const float won = __uint_as_float(top_bits);
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      if (lane + 32 * j == win) p[j] = -1.0f;
    }
#pragma unroll
    for (int m = 0; m < kMaxTopK / 32; ++m) {
      if (k == lane + 32 * m) mine[m] = won;
    }
    if (lane == 0) ids[token * top_k + k] = win;
    total += won;
  }
#pragma unroll
  for (int m = 0; m < kMaxTopK / 32; ++m) {
    const int k = lane + 32 * m;
    if (k < top_k) weights[token * top_k + k] = from_float<T>(renormalize ? mine[m] / total : mine[m]);
  }
}

// One warp per token (route_token).
template <typename T, int kPerLane>
__global__ void __launch_bounds__(32)
    route_kernel(T* __restrict__ weights, int* __restrict__ ids, const T* __restrict__ logits,
                 const std::int64_t* __restrict__ rows, int experts, int top_k, bool renormalize) {
  enter_kernel();
  const std::int64_t token = blockIdx.x;
  const std::int64_t row = rows == nullptr ? token : rows[token];
  route_token<kPerLane>(weights, ids, logits + row * experts, token, experts, top_k, renormalize);
}

// The router of a decode step in one launch: block (b, y) computes logits rows kRouterRows b ..
// (the router's rows, then extra ones such as the shared expert's gate) for its tokens (y: a group
// of router_tokens_per_block of them), rounded to T as the GEMM's output is; the block that finishes
// last routes each token over the first `experts` rows (route_token) and resets the `done` counter
// for the next launch / replay. A block walks its tokens in turn, each a chain of barriers and warp
// sums (ncu, 8 tokens in one block: 2,600 instructions a warp at 0.32 issued a cycle, 13.8 us on the
// H100), so past two tokens the tokens are spread over blocks, two to a block.
// Thread i holds the 16-byte vectors i, i + kRouterThreads of x and of its block's rows, so a
// thread's chain is a few loads, 16 FMAs a token and the reductions. A warp a row (64 elements a
// lane, and each warp norming all of x) made ~500-1,000 dependent instructions a warp at one warp
// a scheduler (ncu: 6.8 us a call for 1 MB, 0.16 TB/s); as blocks the 35B's batch-1 step went
// 2.260 -> 2.086 ms (router 9.6 -> 6.2 us a call). The other way round, a warp per token for 2-8
// tokens (each warp norming and dotting its token whole, the rows staged in shared memory) made
// batch 8 8% slower on the H100 (thirty-second session): the same long per-warp chain.
constexpr int kRouterThreads = 256;
constexpr int kRouterWarps = kRouterThreads / 32;
constexpr int kRouterRows = 2;  // 129 blocks for the 35B's 257 rows: about one an SM
// Rows and tokens a router block takes. Two rows: one or two tokens alone, else two (H100 replays,
// thirty-second session: two a block b4 / b8 -1.2% / -1.1% against all in one block; one a block
// +2.4% / +3.1% against two, in two waves). Where a thread holds one vector of x (kVecs, past 4
// tokens) a block takes 4 rows of one token: 65 x 8 blocks, one wave, each a single token's chain.
template <int kVecs>
__host__ __device__ constexpr int router_rows() { return kVecs == 1 ? 4 : kRouterRows; }
__host__ __device__ constexpr int router_tokens_per_block(int tokens, int rows) {
  return rows > kRouterRows ? 1 : tokens <= 2 ? tokens : 2;
}
// 16-byte vectors of x a thread holds (router_kernel's kVecs): 1 past 4 tokens up to a hidden of 2,048
// (the 35B), else 2 (kMoeRouterMaxHidden). At one, the 35B's kernel (256 experts, the norm folded) fits
// 64 registers without spills, 4 blocks an SM: batch 8's 516 blocks (129 x 4 token pairs) in one wave,
// where the two-vector kernel's 116 registers held 2 an SM and took two. H100 replays: one vector at
// every token count (thirty-fourth session) b8 -2.5% but b1 / b4 +0.9% / +0.7%, whose blocks fit one
// wave already; past 4 tokens only (thirty-sixth session) b8 4.189 -> 4.076 ms (-2.7%), b1 / b4 level.
constexpr int kRouterMaxVecs = static_cast<int>(kMoeRouterMaxHidden / 8 / kRouterThreads);
constexpr int kRouterMaxTokens = kMoeRouterMaxTokens;  // batch-8 decode
static_assert(kRouterMaxTokens <= kRouterWarps, "the last block routes token n with warp n");

// The RMSNorm folded into the router (moe.h RouterNormArgs); residual == nullptr: none.
template <typename T>
struct RouterNorm {
  const T* residual;
  const T* weight;
  T* normed;
  T* residual_out;
  float eps;
  bool zero_centered;
};

// Token n's x vectors of this thread (c = threadIdx.x + kRouterThreads j) replaced by
// norm(x + residual) (rv: the residual's vectors), bit-equal to rmsnorm_kernel (rms_row_threads):
// there thread c sums the squares of vector c, each warp adds its lanes (a group of 32 vectors),
// then the group totals, zero-padded to 32, are added with one more warp_sum; here vector c's
// group is c / 32 = warp + kRouterWarps j. Block 0 writes the rows out. group_totals: shared,
// kVecs * kRouterWarps floats.
template <typename T, int kVecs>
__device__ __forceinline__ void fold_norm(uint4 (&xv)[kVecs], const uint4 (&rv)[kVecs], const uint4 (&nw)[kVecs],
                                          const RouterNorm<T>& norm, std::int64_t n,
                                          int hidden, float* group_totals) {
  constexpr int kPer = 8;
  using TV = Vec<T, kPer>;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nvec = hidden / kPer;
  const std::int64_t base = n * hidden;
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int c = threadIdx.x + kRouterThreads * j;
    if (kRouterThreads * j >= nvec) break;  // block-uniform
    if (c < nvec) {
      TV& a = *reinterpret_cast<TV*>(&xv[j]);
      const TV& r = *reinterpret_cast<const TV*>(&rv[j]);
#pragma unroll
      for (int i = 0; i < kPer; ++i) a.v[i] = add_rounded(a.v[i], r.v[i]);
    }
    const float total = warp_sum(c < nvec ? add_squares(0.0f, *reinterpret_cast<const TV*>(&xv[j])) : 0.0f);
    if (lane == 0) group_totals[warp + kRouterWarps * j] = total;
  }
  __syncthreads();
  const int groups = rms_row_threads(nvec) / 32;
  const float rstd = rms_rstd(warp_sum(lane < groups ? group_totals[lane] : 0.0f), hidden, norm.eps);
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int c = threadIdx.x + kRouterThreads * j;
    if (c >= nvec) break;
    if (blockIdx.x == 0) reinterpret_cast<uint4*>(norm.residual_out + base)[c] = xv[j];
    TV& a = *reinterpret_cast<TV*>(&xv[j]);
    const TV& w = *reinterpret_cast<const TV*>(&nw[j]);
#pragma unroll
    for (int i = 0; i < kPer; ++i) a.v[i] = norm_scale(a.v[i], rstd, w.v[i], norm.zero_centered);
    if (blockIdx.x == 0) reinterpret_cast<uint4*>(norm.normed + base)[c] = xv[j];
  }
  __syncthreads();  // group_totals is free for the next token
}

template <typename T, int kPerLane, bool kNorm, int kVecs>
__global__ void __launch_bounds__(kRouterThreads, kVecs == 1 && kPerLane <= 8 ? 4 : 1)
    router_kernel(T* logits, T* __restrict__ weights, int* __restrict__ ids, unsigned* done,
                  const T* __restrict__ x, const T* __restrict__ w, int tokens, int hidden, int rows,
                  int experts, int top_k, bool renormalize, RouterNorm<T> norm, const int* __restrict__ live) {
  constexpr int kRows = router_rows<kVecs>();
  __shared__ float partial[kRouterMaxTokens][kRows][kRouterWarps];
  __shared__ float group_totals[kVecs * kRouterWarps];
  __shared__ bool last;
  constexpr int kPer = 8;  // elements of a 16-byte vector
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nvec = hidden / kPer;
  const int row0 = blockIdx.x * kRows;
  const int per_block = router_tokens_per_block(tokens, kRows);
  const int first = blockIdx.y * per_block, count = min(per_block, tokens - first);  // this block's tokens
  // The router's rows (and the norm's weight) are constant: they load before the wait for x
  // (load_early16 and enter_kernel_after_loads: else ptxas places the wait above them).
  uint4 wv[kRows][kVecs] = {};
  uint4 nw[kVecs] = {};
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int c = threadIdx.x + kRouterThreads * j;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (row0 + r < rows && c < nvec) {
        wv[r][j] = load_early16(reinterpret_cast<const uint4*>(w + static_cast<std::int64_t>(row0 + r) * hidden) + c);
      }
    }
    if (kNorm && c < nvec) nw[j] = load_early16(reinterpret_cast<const uint4*>(norm.weight) + c);
  }
  // set before the graph's replay, not by a kernel: read before the wait (volatile), off the routing's path
  const int live_tokens = live != nullptr ? load_early(live) : tokens;
  // Token n + 1's x (and residual) vectors are requested before token n is normed and dotted: one
  // L2 round trip for all the tokens, not one a token.
  uint4 next_x[kVecs], next_r[kVecs];
  const auto load_token = [&](int n) {
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const int c = threadIdx.x + kRouterThreads * j;
      if (c >= nvec) continue;
      const std::int64_t at = static_cast<std::int64_t>(n) * nvec + c;
      // coherent loads (.cg, not .nc): ptxas may hoist read-only (.nc) loads above the wait
      next_x[j] = __ldcg(reinterpret_cast<const uint4*>(x) + at);
      if constexpr (kNorm) next_r[j] = __ldcg(reinterpret_cast<const uint4*>(norm.residual) + at);
    }
  };
  enter_kernel_after_loads();
  load_token(first);
  constexpr bool kOneToken = kRows > kRouterRows;  // router_tokens_per_block: nothing to load ahead
  for (int n = first; n < first + (kOneToken ? 1 : count); ++n) {
    uint4 xv[kVecs], rv[kVecs];
#pragma unroll
    for (int j = 0; j < kVecs; ++j) xv[j] = next_x[j], rv[j] = next_r[j];
    if (!kOneToken && n + 1 < first + count) load_token(n + 1);
    if constexpr (kNorm) fold_norm(xv, rv, nw, norm, n, hidden, group_totals);
    float acc[kRows] = {};
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      if (threadIdx.x + kRouterThreads * j >= nvec) continue;
      const Vec<T, kPer> xt = *reinterpret_cast<const Vec<T, kPer>*>(&xv[j]);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const Vec<T, kPer> wt = *reinterpret_cast<const Vec<T, kPer>*>(&wv[r][j]);
#pragma unroll
        for (int i = 0; i < kPer; ++i) acc[r] = fmaf(to_float(wt.v[i]), to_float(xt.v[i]), acc[r]);
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float v = warp_sum(acc[r]);
      if (lane == 0) partial[n - first][r][warp] = v;
    }
  }
  __syncthreads();
  // Thread n kRows + r adds the warps' sums of (token n, row row0 + r) in warp order.
  if (threadIdx.x < count * kRows) {
    const int n = threadIdx.x / kRows, r = threadIdx.x % kRows;
    if (row0 + r < rows) {
      float v = 0.0f;
#pragma unroll
      for (int i = 0; i < kRouterWarps; ++i) v += partial[n][r][i];
      logits[static_cast<std::int64_t>(first + n) * rows + row0 + r] = from_float<T>(v);
    }
  }
  __threadfence();  // this block's logits are visible before it counts itself done
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(done, 1u) == gridDim.x * gridDim.y - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  if (warp < min(tokens, live_tokens)) {
    route_token<kPerLane>(weights, ids, logits + static_cast<std::int64_t>(warp) * rows, warp, experts, top_k,
                          renormalize);
  } else if (warp < tokens) {  // a spare row: dead, so the experts' kernels read nothing for it
    for (int k = lane; k < top_k; k += 32) {
      ids[warp * top_k + k] = -1;
      weights[warp * top_k + k] = from_float<T>(0.0f);
    }
  }
  if (threadIdx.x == 0) *done = 0;
}

// One block: the slots of ids [slots] grouped by expert in blocks of block_m positions (see
// moe.h). Counts and cursors live in shared memory; a slot's place inside its expert's rows is
// the order of the atomics (any order gives the same results: each slot's output is its own).
__global__ void __launch_bounds__(1024)
    align_kernel(int* __restrict__ sorted_slots, int* __restrict__ block_experts,
                 int* __restrict__ used, const int* __restrict__ ids, int slots, int experts,
                 int block_m, int capacity) {
  enter_kernel();
  extern __shared__ int counts[];  // [experts], then the cursors [experts]
  int* cursor = counts + experts;
  for (int e = threadIdx.x; e < experts; e += blockDim.x) counts[e] = 0;
  for (int p = threadIdx.x; p < capacity; p += blockDim.x) sorted_slots[p] = slots;
  __syncthreads();
  for (int s = threadIdx.x; s < slots; s += blockDim.x) {
    const int e = ids[s];
    if (e >= 0 && e < experts) atomicAdd(&counts[e], 1);
  }
  __syncthreads();
  if (threadIdx.x < 32) {  // exclusive scan of the padded counts: lane i owns a run of experts
    const int lane = threadIdx.x;
    const int per_lane = (experts + 31) / 32;
    const int first = lane * per_lane, last = min(first + per_lane, experts);
    int own = 0;
    for (int e = first; e < last; ++e) own += (counts[e] + block_m - 1) / block_m * block_m;
    int inclusive = own;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const int before = __shfl_up_sync(0xffffffffu, inclusive, offset);
      if (lane >= offset) inclusive += before;
    }
    int run = inclusive - own;
    for (int e = first; e < last; ++e) {
      cursor[e] = run;
      run += (counts[e] + block_m - 1) / block_m * block_m;
    }
    if (lane == 31) *used = inclusive;
  }
  __syncthreads();
  for (int b = threadIdx.x; b < capacity / block_m; b += blockDim.x) {
    // the last expert whose rows start at or before block b (blocks past *used: the last expert)
    int lo = 0, hi = experts - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (cursor[mid] <= b * block_m) lo = mid; else hi = mid - 1;
    }
    block_experts[b] = lo;
  }
  __syncthreads();
  for (int s = threadIdx.x; s < slots; s += blockDim.x) {
    const int e = ids[s];
    if (e >= 0 && e < experts) sorted_slots[atomicAdd(&cursor[e], 1)] = s;
  }
}

// A thread owns 8 elements of a token's row: it reads them from each of the token's top_k slot rows
// of y (16 bytes each, 8 rows' loads in flight together) and writes their weighted sum.
// Replaces combine_slots_ref's cuBLAS bmm, which took 6.4 us for 64 tokens at the 35B shape (2.3 MB;
// docs/performance.md, twenty-second session) and, being no PDL kernel, waited for the down GEMV's
// last block before it started.
constexpr int kCombineThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kCombineThreads)
    combine_kernel(T* __restrict__ out, const T* __restrict__ y, const void* __restrict__ weights,
                   DType weights_dtype, int tokens, int top_k, int hidden) {
  enter_kernel();  // y is the kernel before's output
  constexpr int kPer = 8;
  using TV = Vec<T, kPer>;
  const int vecs = hidden / kPer;
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * kCombineThreads + threadIdx.x;
  if (i >= static_cast<std::int64_t>(tokens) * vecs) return;
  const int n = static_cast<int>(i / vecs);
  const uint4* rows = reinterpret_cast<const uint4*>(y) + static_cast<std::int64_t>(n) * top_k * vecs + i % vecs;
  constexpr int kBatch = 8;  // slot rows whose loads go out together (predicated), then added in slot order
  float acc[kPer] = {};
  for (int j0 = 0; j0 < top_k; j0 += kBatch) {
    uint4 raw[kBatch];
    float w[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const bool live = j0 + u < top_k;
      w[u] = live ? load_float(weights, n * top_k + j0 + u, weights_dtype) : 0.0f;
      raw[u] = live ? rows[static_cast<std::int64_t>(j0 + u) * vecs] : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (j0 + u >= top_k) break;
      const float wu = round_to<T>(w[u]);
      if (wu == 0.0f) continue;  // a dead slot (a spare row's: moe.h MoeRouterArgs.live) has no row written
      const TV& v = *reinterpret_cast<const TV*>(&raw[u]);
#pragma unroll
      for (int e = 0; e < kPer; ++e) acc[e] = fmaf(wu, to_float(v.v[e]), acc[e]);
    }
  }
  TV sum;
#pragma unroll
  for (int e = 0; e < kPer; ++e) sum.v[e] = from_float<T>(acc[e]);
  reinterpret_cast<TV*>(out)[i] = sum;
}

// ---------------------------------------------------------------- launchers

template <typename T, typename Launch>
void with_weights(const ExpertWeights& ew, int cols, Launch&& launch) {
  switch (ew.kind) {
    case ExpertKind::Dense:
      launch(DenseWeights<T>{reinterpret_cast<const uint4*>(ew.weight),
                             cols / DenseWeights<T>::kVec});
      break;
    case ExpertKind::Int8:
      launch(Int8Weights{reinterpret_cast<const uint4*>(ew.weight),
                         reinterpret_cast<const float*>(ew.scales), cols / Int8Weights::kVec});
      break;
    case ExpertKind::Int4: {
      int shift = 0;
      while ((32 << shift) < ew.group_size) ++shift;
      launch(Int4Weights{reinterpret_cast<const uint4*>(ew.weight),
                         reinterpret_cast<const __nv_bfloat16*>(ew.scales),
                         cols / Int4Weights::kVec, cols / ew.group_size, shift});
      break;
    }
  }
}

// The shared expert's weights as a kernel type (int8 / int4; the binding checked it), or NoShared.
template <typename Launch>
void with_shared(const ExpertWeights& ew, int cols, Launch&& launch) {
  if (ew.weight == 0) {
    launch(NoShared{});
  } else if (ew.kind == ExpertKind::Int8) {
    launch(Int8Weights{reinterpret_cast<const uint4*>(ew.weight), reinterpret_cast<const float*>(ew.scales),
                       cols / Int8Weights::kVec});
  } else {
    int shift = 0;
    while ((32 << shift) < ew.group_size) ++shift;
    launch(Int4Weights{reinterpret_cast<const uint4*>(ew.weight), reinterpret_cast<const __nv_bfloat16*>(ew.scales),
                       cols / Int4Weights::kVec, cols / ew.group_size, shift});
  }
}

// Shared experts ride along with 16-bit activations and quantized routed experts only (every
// quantized recipe); other combinations instantiate the kernels without one.
template <typename T, typename W, typename Launch>
void with_shared_for(const ExpertWeights& ew, int cols, Launch&& launch) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<W, DenseWeights<T>>) {
    launch(NoShared{});
  } else {
    with_shared(ew, cols, launch);
  }
}

template <typename T>
void launch_decode(const MoeDecodeArgs& a) {
  const int top_k = static_cast<int>(a.top_k);
  const int hidden = static_cast<int>(a.hidden);
  const int inter = static_cast<int>(a.inter);
  const int experts = static_cast<int>(a.experts);
  const int shared_inter = static_cast<int>(a.shared_inter);
  const int h_stride = top_k * inter + shared_inter;
  const int routed_pairs = static_cast<int>(a.tokens) * top_k;
  const cudaStream_t stream = as_stream(a.stream);
  auto* h = reinterpret_cast<T*>(a.h);
  const auto* ids = reinterpret_cast<const int*>(a.ids);
  const auto* gate = reinterpret_cast<const T*>(a.shared_gate);

  constexpr int kBlockOutputs = kWarps * kGateUpOutputs;
  const dim3 gate_up_grid((std::max(inter, shared_inter) + kBlockOutputs - 1) / kBlockOutputs,
                          static_cast<unsigned>(routed_pairs + (shared_inter > 0 ? a.tokens : 0)));
  const std::size_t gate_up_smem = sizeof(float) * hidden;
  with_weights<T>(a.gate_up, hidden, [&](auto w) {
    with_shared_for<T, decltype(w)>(a.shared_gate_up, hidden, [&](auto ws) {
      launch_kernel("moe gate_up kernel launch", gate_up_kernel<T, decltype(w), decltype(ws)>, gate_up_grid,
                    kThreads, gate_up_smem, stream, h, reinterpret_cast<const T*>(a.x), ids, w, ws, routed_pairs,
                    top_k, hidden, inter, experts, shared_inter, h_stride);
    });
  });

  const dim3 down_grid((hidden + kWarps - 1) / kWarps, static_cast<unsigned>(a.tokens));
  const std::size_t down_smem = sizeof(float) * (top_k * (inter + 2) + shared_inter);
  with_weights<T>(a.down, inter, [&](auto w) {
    with_shared_for<T, decltype(w)>(a.shared_down, shared_inter, [&](auto ws) {
      launch_kernel("moe down kernel launch", down_kernel<T, decltype(w), decltype(ws)>, down_grid, kThreads,
                    down_smem, stream, reinterpret_cast<T*>(a.out), static_cast<const T*>(h),
                    reinterpret_cast<const void*>(a.weights), a.weights_dtype, ids, w, ws, top_k, hidden, inter,
                    experts, shared_inter, h_stride, gate, a.shared_gate_stride);
    });
  });
}

// launch(std::integral_constant<int, kPerLane>) with the fewest registers per lane that hold the experts.
template <typename Launch>
void by_route_width(std::int64_t experts, Launch&& launch) {
  if (experts <= 256) {
    launch(std::integral_constant<int, 8>{});
  } else {
    launch(std::integral_constant<int, kMaxRouteExperts / 32>{});
  }
}

template <typename T>
void launch_route(const MoeRouteArgs& a) {
  by_route_width(a.experts, [&](auto per_lane) {
    launch_kernel("moe route kernel launch", route_kernel<T, decltype(per_lane)::value>, static_cast<unsigned>(a.tokens),
                  32, 0, as_stream(a.stream), reinterpret_cast<T*>(a.weights), reinterpret_cast<int*>(a.ids),
                  reinterpret_cast<const T*>(a.logits), reinterpret_cast<const std::int64_t*>(a.rows),
                  static_cast<int>(a.experts), static_cast<int>(a.top_k), a.renormalize);
  });
}

template <typename T>
void launch_router(const MoeRouterArgs& a) {
  const MoeRouteArgs& r = a.route;
  const RouterNorm<T> norm{reinterpret_cast<const T*>(a.norm.residual), reinterpret_cast<const T*>(a.norm.weight),
                           reinterpret_cast<T*>(a.norm.normed), reinterpret_cast<T*>(a.norm.residual_out), a.norm.eps,
                           a.norm.zero_centered};
  const auto go = [&](auto per_lane, auto with_norm, auto vecs) {
    constexpr int kRows = router_rows<decltype(vecs)::value>();
    const int per_block = router_tokens_per_block(static_cast<int>(r.tokens), kRows);
    const dim3 blocks(static_cast<unsigned>((a.rows + kRows - 1) / kRows),
                      static_cast<unsigned>((r.tokens + per_block - 1) / per_block));
    launch_kernel("moe router kernel launch",
                  router_kernel<T, decltype(per_lane)::value, decltype(with_norm)::value, decltype(vecs)::value>,
                  blocks, kRouterThreads, 0, as_stream(r.stream), reinterpret_cast<T*>(r.logits),
                  reinterpret_cast<T*>(r.weights), reinterpret_cast<int*>(r.ids), reinterpret_cast<unsigned*>(a.done),
                  reinterpret_cast<const T*>(a.x), reinterpret_cast<const T*>(a.w), static_cast<int>(r.tokens),
                  static_cast<int>(a.hidden), static_cast<int>(a.rows), static_cast<int>(r.experts),
                  static_cast<int>(r.top_k), r.renormalize, norm, reinterpret_cast<const int*>(a.live));
  };
  const auto with_vecs = [&](auto per_lane, auto with_norm) {
    if (r.tokens > 4 && a.hidden <= 8 * kRouterThreads) {
      return go(per_lane, with_norm, std::integral_constant<int, 1>{});
    }
    go(per_lane, with_norm, std::integral_constant<int, kRouterMaxVecs>{});
  };
  by_route_width(r.experts, [&](auto per_lane) {
    a.norm.residual != 0 ? with_vecs(per_lane, std::true_type{}) : with_vecs(per_lane, std::false_type{});
  });
}

}  // namespace

// The launchers trust their arguments: the binding (bind_moe.cpp) checks them against moe.h.
void moe_router(const MoeRouterArgs& a) {
  const MoeRouteArgs& r = a.route;
  DeviceGuard guard(r.device);
  by_dtype(r.dtype, "moe_router", [&](auto t) {
    if constexpr (!std::is_same_v<decltype(t), float>) launch_router<decltype(t)>(a);
  });
}

void moe_route(const MoeRouteArgs& a) {
  if (a.tokens == 0) return;
  DeviceGuard guard(a.device);
  by_dtype(a.dtype, "moe_route", [&](auto t) { launch_route<decltype(t)>(a); });
}

void moe_align(const MoeAlignArgs& a) {
  DeviceGuard guard(a.device);
  launch_kernel("moe align kernel launch", align_kernel, 1, 1024, 2 * sizeof(int) * a.experts,
                as_stream(a.stream), reinterpret_cast<int*>(a.sorted_slots), reinterpret_cast<int*>(a.block_experts),
                reinterpret_cast<int*>(a.used), reinterpret_cast<const int*>(a.ids), static_cast<int>(a.slots),
                static_cast<int>(a.experts), a.block_m, static_cast<int>(a.capacity));
}

void moe_combine(const MoeCombineArgs& a) {
  if (a.tokens == 0) return;
  DeviceGuard guard(a.device);
  const std::int64_t threads = a.tokens * (a.hidden / 8);
  const auto blocks = static_cast<unsigned>((threads + kCombineThreads - 1) / kCombineThreads);
  const auto go = [&](auto type) {
    using T = decltype(type);
    launch_kernel("moe combine kernel launch", combine_kernel<T>, blocks, kCombineThreads, 0, as_stream(a.stream),
                  reinterpret_cast<T*>(a.out), reinterpret_cast<const T*>(a.y),
                  reinterpret_cast<const void*>(a.weights), a.weights_dtype, static_cast<int>(a.tokens),
                  static_cast<int>(a.top_k), static_cast<int>(a.hidden));
  };
  a.dtype == DType::F16 ? go(__half{}) : go(__nv_bfloat16{});
}

void moe_decode(const MoeDecodeArgs& a) {
  if (a.tokens == 0 || moe_decode_mma(a)) return;
  DeviceGuard guard(a.device);
  by_dtype(a.dtype, "moe_decode", [&](auto t) { launch_decode<decltype(t)>(a); });
}

}  // namespace ninfer

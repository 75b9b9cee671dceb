// The MoE decode step's two expert kernels (csrc/moe.cu's gate_up and down) on tensor cores, for
// the default recipe's shapes: fp16 / bf16 activations, int4 routed experts in groups of 128, an
// int8 shared expert or none. As in moe.cu, every (token, expert) pair's weights are read once and
// each warp asks for all of its weights at once (one DRAM round trip); here the warps dequantize
// into mma.m16n8k16 operands (csrc/mma.cuh: ~2 instructions a weight against moe.cu's ~3 fp32
// ones), x comes straight from global memory (every lane loads the token's x; column 0 of C is
// the one read), and a 16-row tile's K is split over warps whose sums meet in shared memory, in a
// fixed order.
//
// gate_up: 1-D grid. Routed blocks: (pair, 8 tiles_per_block outputs) with hidden / 512 warps a
// tile (4 chunks of 128 codes a warp); each tile is 8 gate rows and their 8 up rows, so a lane's
// C entries 0 and 2 are the gate and up sums of output g. Shared-expert blocks (int8: 64 codes a
// chunk) follow: one tile a block, its K over all 8 warps, every token (up to 8) a column of its MMAs.
// down: grid (hidden / 16, tokens); warp j takes slot j's 16 rows (inter / 128 chunks) and chunk j
// of the shared expert's rows; each routed chunk's sums are scaled by its group scale times the
// slot's routing weight, in fp32 (moe.cu's order of roundings otherwise). Past 2 tokens, down's
// weights go through shared memory in a grid of one wave (down_staged_kernel).
#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "common.cuh"
#include "launch.cuh"
#include "mma.cuh"
#include "moe.h"

namespace ninfer {
namespace {

constexpr int kWarps = 8;
constexpr int kChunkBytes = 64;   // of a row, per warp step: 16 bytes a lane, 4 lanes a row
constexpr int kInt4Chunk = 128;   // codes in an int4 chunk: one group of 128
constexpr int kInt8Chunk = 64;    // codes in an int8 chunk
constexpr int kPartChunks = 4;    // int4 chunks a warp holds (8 x 16 bytes a lane in flight)
constexpr int kPartK = kPartChunks * kInt4Chunk;  // 512: gate_up's K a warp
constexpr int kMaxDecodeTokens = 8;  // the shared expert's tokens: the N of one m16n8k16 MMA

struct GateUpParams {
  const std::uint8_t* q;        // [E, 2 inter, hidden / 2] int4
  const std::uint16_t* scales;  // [E, 2 inter, hidden / 128] bf16
  const std::uint8_t* sq;       // [2 shared_inter, hidden] int8, or null
  const float* sscales;         // [2 shared_inter]
  int routed_pairs, top_k, hidden, inter, experts, shared_inter, h_stride;
  int parts;            // warps a routed tile: hidden / 512
  int pair_blocks;      // routed blocks a pair: inter / (8 * kWarps / parts)
  int shared_blocks;    // shared-expert blocks: shared_inter / 8, each for every token
  int tokens;           // <= kMaxDecodeTokens
};

struct DownParams {
  const std::uint8_t* q;        // [E, hidden, inter / 2] int4
  const std::uint16_t* scales;  // [E, hidden, inter / 128] bf16
  const std::uint8_t* sq;       // [hidden, shared_inter] int8, or null
  const float* sscales;         // [hidden]
  const void* weights;          // [tokens, top_k] routing weights
  DType weights_dtype;
  const void* shared_gate;      // [tokens] logits (gate_stride apart)
  std::int64_t gate_stride;
  int top_k, hidden, inter, experts, shared_inter, h_stride;
};

__device__ __forceinline__ float load_weight(const void* p, std::int64_t i, DType dtype) {
  switch (dtype) {
    case DType::F32: return static_cast<const float*>(p)[i];
    case DType::F16: return __half2float(static_cast<const __half*>(p)[i]);
    default: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  }
}

// Adds the 8 outputs' (gate, up) sums of `parts` warps in warp order and writes h with the
// reference's roundings (linear, silu and product each in T). red: [kWarps][8][2] in shared memory,
// warp w's entries written by its lanes t = 0 (C entries 0, 2 of output g); gate_scale /
// up_scale: thread i's per-row fp32 scales of the int8 shared expert (gate row, up row), else 1.
template <typename T>
__device__ __forceinline__ void gate_up_epilogue(T* h_out, float (*red)[8][2], int tiles, int parts, float gate_scale = 1.0f,
                                                 float up_scale = 1.0f) {
  const int i = threadIdx.x;
  if (i >= 8 * tiles) return;
  const int tile = i / 8, o = i % 8;
  float gate = 0.0f, up = 0.0f;
  for (int p = 0; p < parts; ++p) {
    gate += red[tile * parts + p][o][0];
    up += red[tile * parts + p][o][1];
  }
  gate *= gate_scale;  // exact for the routed experts' 1
  up *= up_scale;
  h_out[i] = from_float<T>(silu_times<T>(round_to<T>(gate), round_to<T>(up)));
}

template <typename T, bool kShared>
__global__ void __launch_bounds__(kWarps * 32, 3)  // 3 blocks an SM: one token's 256 + 64 blocks in one wave
    gate_up_mma_kernel(T* __restrict__ h, const T* __restrict__ x, const int* __restrict__ ids, GateUpParams p) {
  __shared__ float red[kWarps][8][2];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int routed_blocks = p.routed_pairs * p.pair_blocks;
  const int bid = blockIdx.x;
  if (kShared && bid >= routed_blocks) {
    // The shared expert: one 8-output tile, K over the 8 warps, every token at once (token n is
    // the MMA's B column n: lane g loads token g's x, a lane past the tokens token 0's, whose C
    // column nobody reads), so its weights are read once a step, not once a token.
    __shared__ float shared_red[kMaxDecodeTokens][kWarps][8][2];
    const int i0 = (bid - routed_blocks) * 8;
    const int row_bytes = p.hidden;
    const int chunks = p.hidden / kInt8Chunk / kWarps;  // <= kPartChunks (moe_decode_mma)
    const std::uint8_t* rows[2] = {p.sq + static_cast<std::int64_t>(i0 + g) * row_bytes,
                                   p.sq + static_cast<std::int64_t>(i0 + g + p.shared_inter) * row_bytes};
    // the epilogue's row scales (thread i: output i0 + i), with the weights: after the barrier they
    // were one more round trip at the block's tail
    float gate_scale = 1.0f, up_scale = 1.0f;
    if (threadIdx.x < 8) {
      gate_scale = __ldg(p.sscales + i0 + threadIdx.x);
      up_scale = __ldg(p.sscales + i0 + threadIdx.x + p.shared_inter);
    }
    uint4 q[kPartChunks][2];
#pragma unroll
    for (int u = 0; u < kPartChunks; ++u) {
      const int off = (warp * chunks + u) * kChunkBytes + 16 * t;
#pragma unroll
      for (int r = 0; r < 2; ++r) q[u][r] = load16_early(rows[r] + (u < chunks ? off : 0), u < chunks);
    }
    enter_kernel_after_loads();  // x is the router's normed output
    const T* xr[1] = {x + static_cast<std::int64_t>(g < p.tokens ? g : 0) * p.hidden};
    float acc[1][4] = {};
    const std::uint16_t no_scale[2] = {};
#pragma unroll
    for (int u = 0; u < kPartChunks; ++u) {
      if (u < chunks) chunk_mma<T, false, false, 1>(acc, q[u], no_scale, xr, (warp * chunks + u) * kInt8Chunk + 16 * t);
    }
    // C entries 0, 1: the gate sums of output g for tokens 2t, 2t + 1; entries 2, 3 their up sums
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      if (2 * t + c < p.tokens) {
        shared_red[2 * t + c][warp][g][0] = acc[0][c];
        shared_red[2 * t + c][warp][g][1] = acc[0][2 + c];
      }
    }
    __syncthreads();
    for (int n = 0; n < p.tokens; ++n) {
      gate_up_epilogue<T>(h + static_cast<std::int64_t>(n) * p.h_stride + p.top_k * p.inter + i0, shared_red[n], 1,
                          kWarps, gate_scale, up_scale);
    }
    return;
  }
  enter_kernel();  // ids come from the router, the kernel before
  const int y = bid / p.pair_blocks;
  const int tiles = kWarps / p.parts;
  const int tile = warp / p.parts, part = warp % p.parts;
  const int i0 = (bid % p.pair_blocks * tiles + tile) * 8;  // this warp's first output
  const int n = y / p.top_k;
  const int e = __ldg(ids + y);
  const bool live = e >= 0 && e < p.experts;
  const int row_bytes = p.hidden / 2, groups = p.hidden / kInt4Chunk;
  const std::int64_t gate_row = static_cast<std::int64_t>(live ? e : 0) * 2 * p.inter + i0 + g;
  const std::int64_t rows[2] = {gate_row, gate_row + p.inter};
  uint4 q[kPartChunks][2];
  std::uint16_t sc[kPartChunks][2];
#pragma unroll
  for (int u = 0; u < kPartChunks; ++u) {
    const int c = part * kPartChunks + u;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      q[u][r] = load16<true>(p.q + rows[r] * row_bytes + c * kChunkBytes + 16 * t, live);
      sc[u][r] = load2(p.scales + rows[r] * groups + c, live);
    }
  }
  const T* xr[1] = {x + static_cast<std::int64_t>(n) * p.hidden};
  float gate = 0.0f, up = 0.0f;  // column 0 (the token) of rows g, g + 8
#pragma unroll
  for (int u = 0; u < kPartChunks; ++u) {
    float c[1][4] = {};
    int4_chunk_sums<T, 1>(c, q[u], xr, (part * kPartChunks + u) * kInt4Chunk + 32 * t);
    gate = fmaf(bf16_bits_to_float(sc[u][0]), c[0][0], gate);
    up = fmaf(bf16_bits_to_float(sc[u][1]), c[0][2], up);
  }
  if (t == 0) red[warp][g][0] = gate, red[warp][g][1] = up;
  __syncthreads();
  // a dead expert's rows read as zeros: its h is silu(0) * 0 = 0, as in moe.cu
  gate_up_epilogue<T>(h + static_cast<std::int64_t>(n) * p.h_stride + (y % p.top_k) * p.inter +
                          (bid % p.pair_blocks) * tiles * 8,
                      red, tiles, p.parts);
}

// Blocks an SM of a staged kernel with its shared memory (0: it does not fit), set up once per
// kernel and device (more than 48 KB of dynamic shared memory is opt-in). A template parameter, not an
// argument: kernels of one signature (with and without the shared expert) each need their own opt-in.
template <auto kKernel>
int staged_blocks_per_sm(int device, int smem) {
  static std::array<std::atomic<int>, 64> fits{};  // blocks + 1; 0: not asked
  if (device < 0 || device >= static_cast<int>(fits.size())) return 0;
  int blocks = fits[device].load(std::memory_order_relaxed) - 1;
  if (blocks < 0) {
    blocks = 0;
    if (cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kKernel, kWarps * 32, smem) != cudaSuccess) {
      blocks = 0;
      (void)cudaGetLastError();  // the refusal's error, not left for the next launch check to find
    }
    fits[device].store(blocks + 1, std::memory_order_relaxed);
  }
  return blocks;
}

// kBlocksPerSm: 2 (92 registers) where the grid fits one wave of them (up to 2 tokens); 3 (80
// registers, no spills) for more tokens, whose 3-4 waves then overlap more loads (sixteenth
// session: batch 8 -2.9%, batch 4 -0.9%, but batch 1 +1.2% at 3).
template <typename T, bool kShared, int kBlocksPerSm>
__global__ void __launch_bounds__(kWarps * 32, kBlocksPerSm)
    down_mma_kernel(T* __restrict__ out, const T* __restrict__ h, const int* __restrict__ ids, DownParams p) {
  __shared__ float red[kWarps][16][2];
  const int lane = threadIdx.x & 31, j = threadIdx.x >> 5;  // warp j: slot j
  const int g = lane >> 2, t = lane & 3;
  const int n = blockIdx.y;
  const int r0 = blockIdx.x * 16;
  // The router's ids and weights are two launches back, so they and the weights load before the
  // wait for gate_up's h.
  const int e = j < p.top_k ? __ldg(ids + n * p.top_k + j) : -1;
  const bool live = e >= 0 && e < p.experts;
  const int chunks = p.inter / kInt4Chunk;  // <= kPartChunks (moe_decode_mma)
  const int row_bytes = p.inter / 2;
  const std::int64_t rows[2] = {static_cast<std::int64_t>(live ? e : 0) * p.hidden + r0 + g,
                                static_cast<std::int64_t>(live ? e : 0) * p.hidden + r0 + g + 8};
  uint4 q[kPartChunks][2];
  std::uint16_t sc[kPartChunks][2];
#pragma unroll
  for (int u = 0; u < kPartChunks; ++u) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      q[u][r] = load16<true>(p.q + rows[r] * row_bytes + u * kChunkBytes + 16 * t, live && u < chunks);
      sc[u][r] = load2(p.scales + rows[r] * chunks + u, live && u < chunks);
    }
  }
  const float wj = live ? load_weight(p.weights, static_cast<std::int64_t>(n) * p.top_k + j, p.weights_dtype) : 0.0f;
  uint4 qs[2] = {};
  const bool shared_live = kShared && j * kInt8Chunk < p.shared_inter;
  if constexpr (kShared) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      qs[r] = load16<true>(p.sq + static_cast<std::int64_t>(r0 + g + 8 * r) * p.shared_inter + j * kChunkBytes + 16 * t,
                           shared_live);
    }
  }
  // The epilogue's shared-expert row scale (constant) and gate logit (the router's, two launches
  // back) load here too: after the barrier they were one more round trip at the block's tail.
  float shared_scale = 0.0f, gate_logit = 0.0f;
  if (kShared && threadIdx.x < 16 && r0 + threadIdx.x < p.hidden) {
    shared_scale = __ldg(p.sscales + r0 + threadIdx.x);
    gate_logit = to_float(static_cast<const T*>(p.shared_gate)[n * p.gate_stride]);
  }
  enter_kernel();  // h is gate_up's output
  const T* h_row = h + static_cast<std::int64_t>(n) * p.h_stride;
  float routed[2] = {};  // column 0 of rows g, g + 8
  if (live) {  // warp-uniform
    const T* xr[1] = {h_row + j * p.inter};
#pragma unroll
    for (int u = 0; u < kPartChunks; ++u) {
      if (u >= chunks) break;
      float c[1][4] = {};
      int4_chunk_sums<T, 1>(c, q[u], xr, u * kInt4Chunk + 32 * t);
      routed[0] = fmaf(bf16_bits_to_float(sc[u][0]) * wj, c[0][0], routed[0]);
      routed[1] = fmaf(bf16_bits_to_float(sc[u][1]) * wj, c[0][2], routed[1]);
    }
  }
  float shared[1][4] = {};
  if (shared_live) {  // warp-uniform
    const T* xr[1] = {h_row + p.top_k * p.inter};
    const std::uint16_t no_scale[2] = {};
    chunk_mma<T, false, false, 1>(shared, qs, no_scale, xr, j * kInt8Chunk + 16 * t);
  }
  if (t == 0) {
    red[j][g][0] = routed[0], red[j][g + 8][0] = routed[1];
    red[j][g][1] = shared[0][0], red[j][g + 8][1] = shared[0][2];
  }
  __syncthreads();
  const int i = threadIdx.x;
  if (i >= 16 || r0 + i >= p.hidden) return;
  float acc = 0.0f, shared_sum = 0.0f;
  for (int w = 0; w < kWarps; ++w) {
    acc += red[w][i][0];
    shared_sum += red[w][i][1];
  }
  if constexpr (kShared) {
    shared_sum *= shared_scale;
    acc = round_to<T>(acc) + sigmoid_times<T>(round_to<T>(shared_sum), gate_logit);
  }
  out[static_cast<std::int64_t>(n) * p.hidden + r0 + i] = from_float<T>(acc);
}

// down_mma_kernel with its weights staged through shared memory (cp.async, two stages): a grid of one
// wave whose blocks take items (row tile r0 = item % (hidden / 16), token item / (hidden / 16))
// blockIdx.x, + gridDim.x, ...; the next item's codes (warp j: slot j's 16 rows, then the shared
// expert's chunk j) and scales are copied while this one computes, so weights stay in flight across
// each item's compute and epilogue, and no block ends and another starts (at batch 8 the register
// kernel's grid is 1,024 blocks, about 4 waves). Each lane reads back the 16-byte pieces it copied; a
// row's 8-byte scale run is copied by lane t = 0 / 1 and read by its 4 lanes after a __syncwarp. The
// ids and routing weights are two launches back, so the first item's copies go out before the wait
// for gate_up's h. For the 35B's inter of 512 (4 groups a row: a row's scales are one 8-byte run).
constexpr int kDownStageCodes = kWarps * (2 * kPartChunks + 2) * 32;  // uint4 a stage: [warp][slot][lane]
constexpr int kDownStageRuns = kWarps * 8 * 2;                        // 8-byte scale runs a stage: [warp][g][row]
constexpr int kDownStagedSmem = 2 * (kDownStageCodes * 16 + kDownStageRuns * 8);  // 82 KB: 2 blocks an SM

template <typename T, bool kShared>
__global__ void __launch_bounds__(kWarps * 32, 2)
    down_staged_kernel(T* __restrict__ out, const T* __restrict__ h, const int* __restrict__ ids, DownParams p,
                       int tokens) {
  extern __shared__ uint4 staged[];  // [2][kDownStageCodes] codes, then [2][kDownStageRuns] scale runs
  auto* scale_runs = reinterpret_cast<uint2*>(staged + 2 * kDownStageCodes);
  __shared__ float red[2][kWarps][16][2];
  const int lane = threadIdx.x & 31, j = threadIdx.x >> 5;  // warp j: slot j
  const int g = lane >> 2, t = lane & 3;
  const int row_tiles = p.hidden / 16, items = row_tiles * tokens;
  constexpr int kSlots = 2 * kPartChunks + 2;
  uint4* codes = staged + j * (kSlots * 32) + lane;  // + s kDownStageCodes + slot 32
  uint2* runs = scale_runs + j * 16 + g * 2;          // + s kDownStageRuns + r
  const int row_bytes = p.inter / 2;
  const bool shared_live = kShared && j * kInt8Chunk < p.shared_inter;
  const auto expert = [&](int item) { return j < p.top_k ? __ldg(ids + item / row_tiles * p.top_k + j) : -1; };
  const auto issue = [&](int item, int e, int s) {
    const int r0 = item % row_tiles * 16;
    const bool live = e >= 0 && e < p.experts;
    const std::int64_t row = static_cast<std::int64_t>(live ? e : 0) * p.hidden + r0 + g;
    const std::uint8_t* qr = p.q + row * row_bytes + 16 * t;
#pragma unroll
    for (int u = 0; u < kPartChunks; ++u) {
      cp_async_zfill<16>(codes + s * kDownStageCodes + (2 * u) * 32, qr + u * kChunkBytes, live);
      cp_async_zfill<16>(codes + s * kDownStageCodes + (2 * u + 1) * 32, qr + 8 * row_bytes + u * kChunkBytes, live);
    }
    if (t < 2) cp_async_zfill<8>(runs + s * kDownStageRuns + t, p.scales + (row + 8 * t) * kPartChunks, live);
    if constexpr (kShared) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        cp_async_zfill<16>(codes + s * kDownStageCodes + (2 * kPartChunks + r) * 32,
                           p.sq + static_cast<std::int64_t>(r0 + g + 8 * r) * p.shared_inter + (shared_live ? j * kChunkBytes : 0) + 16 * t,
                           shared_live);
      }
    }
  };
  int item = blockIdx.x;
  int e_next = -1;
  if (item < items) {
    issue(item, expert(item), 0);
    if (item + gridDim.x < items) e_next = expert(item + gridDim.x);
  }
  cp_async_commit();
  enter_kernel_after_loads();  // h is gate_up's output
  for (int s = 0; item < items; item += gridDim.x, s ^= 1) {
    const int next = item + gridDim.x;
    if (next < items) {
      issue(next, e_next, s ^ 1);
      if (next + gridDim.x < items) e_next = expert(next + gridDim.x);
    }
    cp_async_commit();
    const int n = item / row_tiles, r0 = item % row_tiles * 16;
    const int e = expert(item);
    const bool live = e >= 0 && e < p.experts;
    const float wj = live ? load_weight(p.weights, static_cast<std::int64_t>(n) * p.top_k + j, p.weights_dtype) : 0.0f;
    float shared_scale = 0.0f, gate_logit = 0.0f;
    if (kShared && threadIdx.x < 16) {
      shared_scale = __ldg(p.sscales + r0 + threadIdx.x);
      gate_logit = to_float(static_cast<const T*>(p.shared_gate)[n * p.gate_stride]);
    }
    cp_async_wait_one();  // this item's copies are in
    __syncwarp();         // and the scale runs lanes 0 / 1 of each row copied
    const T* h_row = h + static_cast<std::int64_t>(n) * p.h_stride;
    float routed[2] = {};  // column 0 of rows g, g + 8
    if (live) {  // warp-uniform
      const uint2 run[2] = {runs[s * kDownStageRuns], runs[s * kDownStageRuns + 1]};
      const T* xr[1] = {h_row + j * p.inter};
#pragma unroll
      for (int u = 0; u < kPartChunks; ++u) {
        const uint4 q[2] = {codes[s * kDownStageCodes + (2 * u) * 32], codes[s * kDownStageCodes + (2 * u + 1) * 32]};
        float c[1][4] = {};
        int4_chunk_sums<T, 1>(c, q, xr, u * kInt4Chunk + 32 * t);
        const std::uint32_t w0 = u < 2 ? run[0].x : run[0].y, w1 = u < 2 ? run[1].x : run[1].y;
        const auto bits = [u](std::uint32_t w) { return static_cast<std::uint16_t>(u % 2 ? w >> 16 : w & 0xffffu); };
        routed[0] = fmaf(bf16_bits_to_float(bits(w0)) * wj, c[0][0], routed[0]);
        routed[1] = fmaf(bf16_bits_to_float(bits(w1)) * wj, c[0][2], routed[1]);
      }
    }
    float shared[1][4] = {};
    if (shared_live) {  // warp-uniform
      const uint4 qs[2] = {codes[s * kDownStageCodes + (2 * kPartChunks) * 32],
                           codes[s * kDownStageCodes + (2 * kPartChunks + 1) * 32]};
      const T* xr[1] = {h_row + p.top_k * p.inter};
      const std::uint16_t no_scale[2] = {};
      chunk_mma<T, false, false, 1>(shared, qs, no_scale, xr, j * kInt8Chunk + 16 * t);
    }
    if (t == 0) {
      red[s][j][g][0] = routed[0], red[s][j][g + 8][0] = routed[1];
      red[s][j][g][1] = shared[0][0], red[s][j][g + 8][1] = shared[0][2];
    }
    __syncthreads();
    const int i = threadIdx.x;
    if (i < 16 && r0 + i < p.hidden) {
      float acc = 0.0f, shared_sum = 0.0f;
      for (int w = 0; w < kWarps; ++w) {
        acc += red[s][w][i][0];
        shared_sum += red[s][w][i][1];
      }
      if constexpr (kShared) {
        shared_sum *= shared_scale;
        acc = round_to<T>(acc) + sigmoid_times<T>(round_to<T>(shared_sum), gate_logit);
      }
      out[static_cast<std::int64_t>(n) * p.hidden + r0 + i] = from_float<T>(acc);
    }
  }
}

bool is_pow2(std::int64_t v) { return v > 0 && (v & (v - 1)) == 0; }

template <typename T>
void launch(const MoeDecodeArgs& a, bool shared) {
  const cudaStream_t stream = as_stream(a.stream);
  const int top_k = static_cast<int>(a.top_k), hidden = static_cast<int>(a.hidden), inter = static_cast<int>(a.inter);
  const int shared_inter = static_cast<int>(a.shared_inter);
  const int h_stride = top_k * inter + shared_inter;
  const int parts = hidden / kPartK;
  GateUpParams gu{reinterpret_cast<const std::uint8_t*>(a.gate_up.weight),
                  reinterpret_cast<const std::uint16_t*>(a.gate_up.scales),
                  reinterpret_cast<const std::uint8_t*>(a.shared_gate_up.weight),
                  reinterpret_cast<const float*>(a.shared_gate_up.scales),
                  static_cast<int>(a.tokens) * top_k, top_k, hidden, inter, static_cast<int>(a.experts), shared_inter,
                  h_stride, parts, inter / (8 * kWarps / parts), shared_inter / 8, static_cast<int>(a.tokens)};
  const unsigned gate_up_blocks = static_cast<unsigned>(gu.routed_pairs * gu.pair_blocks + (shared ? gu.shared_blocks : 0));
  DownParams dp{reinterpret_cast<const std::uint8_t*>(a.down.weight), reinterpret_cast<const std::uint16_t*>(a.down.scales),
                reinterpret_cast<const std::uint8_t*>(a.shared_down.weight),
                reinterpret_cast<const float*>(a.shared_down.scales), reinterpret_cast<const void*>(a.weights),
                a.weights_dtype, reinterpret_cast<const void*>(a.shared_gate), a.shared_gate_stride, top_k, hidden, inter,
                static_cast<int>(a.experts), shared_inter, h_stride};
  auto* h = reinterpret_cast<T*>(a.h);
  const auto* ids = reinterpret_cast<const int*>(a.ids);
  const dim3 down_grid(static_cast<unsigned>(hidden / 16), static_cast<unsigned>(a.tokens));
  const auto go = [&](auto with_shared) {
    constexpr bool kShared = decltype(with_shared)::value;
    launch_kernel("moe gate_up (tensor cores) launch", gate_up_mma_kernel<T, kShared>, gate_up_blocks, kWarps * 32, 0,
                  stream, h, reinterpret_cast<const T*>(a.x), ids, gu);
    // down staged past 2 tokens, where the register kernel's grid is more than a wave (at 1-2 it is
    // one); H100 replays (thirty-seventh session) against the register down: b4 -2.1%, b8 -0.5%, b1
    // level. NINFER_MOE_DOWN_STAGED=0 takes the register kernel past 2 tokens too: the path of GPUs
    // where two staged blocks do not fit an SM (sm_80, 86, 89, 120), for the tests on those that fit.
    const char* down_policy = std::getenv("NINFER_MOE_DOWN_STAGED");
    const int down_staged = (down_policy != nullptr && std::strcmp(down_policy, "0") == 0) || inter != kPartK ||
                                    a.tokens <= 2
                                ? 0
                                : staged_blocks_per_sm<down_staged_kernel<T, kShared>>(static_cast<int>(a.device),
                                                                                      kDownStagedSmem);
    if (down_staged >= 2) {  // else (GPUs of less shared memory) the register kernel's 3 an SM
      const int items = hidden / 16 * static_cast<int>(a.tokens);
      launch_kernel("moe down (tensor cores, staged) launch", down_staged_kernel<T, kShared>,
                    static_cast<unsigned>(std::min(items, down_staged * sm_count(a.device))),
                    kWarps * 32, kDownStagedSmem, stream, reinterpret_cast<T*>(a.out), static_cast<const T*>(h), ids, dp,
                    static_cast<int>(a.tokens));
    } else {
      const auto down = a.tokens <= 2 ? down_mma_kernel<T, kShared, 2> : down_mma_kernel<T, kShared, 3>;
      launch_kernel("moe down (tensor cores) launch", down, down_grid, kWarps * 32, 0, stream,
                    reinterpret_cast<T*>(a.out), static_cast<const T*>(h), ids, dp);
    }
  };
  shared ? go(std::true_type{}) : go(std::false_type{});
}

}  // namespace

bool moe_decode_mma(const MoeDecodeArgs& a) {
  const bool shared = a.shared_inter != 0;
  const auto int4_128 = [](const ExpertWeights& w) { return w.kind == ExpertKind::Int4 && w.group_size == kInt4Chunk; };
  const bool fits =
      (a.dtype == DType::F16 || a.dtype == DType::BF16) && a.tokens <= kMaxDecodeTokens && int4_128(a.gate_up) && int4_128(a.down) &&
      a.top_k <= kWarps && a.hidden % kPartK == 0 && is_pow2(a.hidden / kPartK) && a.hidden / kPartK <= kWarps &&
      a.inter % kInt4Chunk == 0 && a.inter / kInt4Chunk <= kPartChunks &&
      a.inter % (8 * kWarps / (a.hidden / kPartK)) == 0 &&
      (!shared || (a.shared_gate_up.kind == ExpertKind::Int8 && a.shared_down.kind == ExpertKind::Int8 &&
                   a.shared_gate_up.group_size == 0 && a.shared_down.group_size == 0 && a.shared_inter % 8 == 0 &&
                   a.shared_inter % kInt8Chunk == 0 && a.shared_inter / kInt8Chunk <= kWarps &&
                   a.hidden / kInt8Chunk / kWarps <= kPartChunks && a.hidden % (kInt8Chunk * kWarps) == 0));
  if (!fits || a.tokens == 0) return fits;
  DeviceGuard guard(a.device);
  a.dtype == DType::F16 ? launch<__half>(a, shared) : launch<__nv_bfloat16>(a, shared);
  return true;
}

}  // namespace ninfer

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
// slot's routing weight, in fp32 (moe.cu's order of roundings otherwise).
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
    const auto down = a.tokens <= 2 ? down_mma_kernel<T, kShared, 2> : down_mma_kernel<T, kShared, 3>;
    launch_kernel("moe down (tensor cores) launch", down, down_grid, kWarps * 32, 0, stream,
                  reinterpret_cast<T*>(a.out), static_cast<const T*>(h), ids, dp);
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

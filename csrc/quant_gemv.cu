// Weight-only int8 / int4 GEMV for decode and short prefills. Decode is bound by reading
// the weights, so every weight byte is loaded once, with 16-byte streaming loads, for all m rows.
//
// Work split: a warp owns a tile of 16 weight rows and walks K in chunks of 64 bytes per row
// (16 bytes per lane: lane = 4 * g + t holds rows g and g + 8 of the tile, bytes 16t..16t+15 of
// the chunk). When there are too few tiles to give every SM ~16 warps, `split` warps of a block
// share one tile, take interleaved chunks and add their sums through shared memory.
//
// fp16 / bf16 activations run on tensor cores (mma.m16n8k16, fp32 accumulation): the tile's
// weights, dequantized in registers, are the A operand (16 rows), x is B (rows of x are the 8
// columns; a second MMA takes rows 8..15). The k order inside an MMA is free as long as A and B
// agree, so each lane feeds exactly the weights it loaded and picks the matching x values
// itself: no shuffles, no shared memory for operands. Codes become 16-bit floats with the usual
// magic-number tricks (exact). int8 rows are scaled after the sum, in fp32, and so are int4 groups
// of 128 (each chunk's sums: chunk_mma); a smaller int4 group's scale is multiplied into the weights
// (rounded to the activation dtype), because the four lanes feeding one MMA hold different groups.
// fp32 activations run on CUDA cores with exact fp32 weights; the four lanes of a row then add
// their sums with shuffles and the same epilogue writes the result.
//
// A plain GEMV may also take the gate_up layout below (one dense SwiGLU MLP's gate and up rows)
// or end with a sigmoid gate and an added tensor (quant_gemv.h): the elementwise kernel that
// would follow is folded into the epilogue, one launch fewer.
//
// A plain 16-bit GEMV of up to 4 rows may fold the residual add + RMSNorm before it in front
// (a decoder layer's input norm and its mixer's first projection, quant_gemv.h): every block adds
// x and the residual and norms the rows into shared memory, in rmsnorm_kernel's order (so bit-equal
// to it), while its first weight loads are in flight; B is then read from there. Block 0 writes the
// new residual. Each block norms again, so its K split is the plain GEMV's halved until the grid fits
// one wave, where it can (split_for_norm).
//
// Such a GEMV may also run a GDN decode step's depthwise causal conv as its epilogue (quant_gemv.h
// GemvConvArgs): output row c of a token is the newest input of conv channel c, so the lane that
// writes it convolves it with the channel's weights and conv state (both copied into the stage
// before the wait for x, as the norm's weight is) and shifts the state; the conv kernel's launch
// goes. Only the GEMVs that fold the norm (the decode step's in_proj) build it.
//
// The same kernel is the grouped MoE GEMV (`moe_grouped_gemv`): block y takes one block of
// slots that share an expert (moe_align's layout), offsets the weights to that expert, gathers
// the slots' x rows as its B columns and scatters its outputs to the slots' rows. For gate_up a
// warp's 16 A rows are 8 gate rows and the 8 matching up rows, so each lane's C fragment holds
// the gate and up sums of the same output: SiLU(gate) * up is the epilogue. So every expert hit
// by a batch is read once per block of its slots (the decode kernels of csrc/moe.cu read it once
// per slot), which is what verify rounds, batched decode and short prompts need. A down warp takes
// two row tiles one after another (kRowTiles): at K = 512 a tile is two steps, and the next tile's
// loads are on their way while this one writes its outputs. A bf16 16-slot block's warps take two row
// tiles together instead (kSets): every x load feeds both tiles' MMAs.
#include <algorithm>
#include <array>
#include <atomic>
#include <type_traits>

#include "common.cuh"
#include "launch.cuh"
#include "mma.cuh"
#include "quant_gemv.h"

namespace ninfer {
namespace {

constexpr int kTileRows = 16;    // weight rows per warp: the M of one m16n8k16 MMA
constexpr int kChunkBytes = 64;  // bytes of each row per warp step: 16 per lane, 4 lanes per row
constexpr int kUnroll = 2;       // chunks whose loads a warp has in flight together (4: slower for
                                 // every grouped MoE size on the H200)
constexpr int kWarps = 8;        // warps per block
constexpr int kWideWarps = 16;   // warps per block of a plain GEMV with few row tiles (its K split 16 ways)
constexpr int kWarpsPerSm = 16;  // split K until the grid has about this many warps per SM

using ninfer::load16;  // mma.cuh's global-memory form, beside the staged one below

// A lane's x row in the norm's shared-memory stage (add_norm_rows) rather than in global memory.
template <typename T>
struct StagedX {
  const T* row;
  __device__ StagedX operator+(int i) const { return {row + i}; }
};

// 16 staged bytes (mma.cuh's load_x16 for x in the stage: dead lanes point inside it too).
template <typename T>
__device__ __forceinline__ uint4 load_x16(StagedX<T> at) {
  return *reinterpret_cast<const uint4*>(at.row);
}

// Signed byte i of a word (q + 128 after the xor) as an exact float: 2^23 + u - (2^23 + 128).
__device__ __forceinline__ float int8_at(std::uint32_t biased, int i) {
  return __uint_as_float(__byte_perm(biased, 0x4B000000u, 0x7440u + i)) - 8388736.0f;
}

// Element e (nibble e) of a word of 8 int4 codes as an exact float: 2^23 + n - (2^23 + 8).
__device__ __forceinline__ float int4_at(std::uint32_t word, int e) {
  return __uint_as_float(((word >> (4 * e)) & 0xFu) | 0x4B000000u) - 8388616.0f;
}

// One chunk on CUDA cores (fp32 x): exact fp32 weights (int4 scaled here, int8 in the epilogue).
template <bool kInt4, int kTiles>
__device__ __forceinline__ void chunk_fp32(float (&sum)[2][8 * kTiles], const uint4 (&q)[2],
                                           const std::uint16_t (&sc)[2], const float* x, int m,
                                           std::int64_t k, int kx) {
  constexpr int kElems = kInt4 ? 32 : 16;
  float w[2][kElems];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const std::uint32_t words[4] = {q[r].x, q[r].y, q[r].z, q[r].w};
    const float scale = kInt4 ? bf16_bits_to_float(sc[r]) : 1.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int e = 0; e < kElems / 4; ++e) {
        w[r][j * kElems / 4 + e] =
            kInt4 ? int4_at(words[j], e) * scale : int8_at(words[j] ^ 0x80808080u, e);
      }
    }
  }
#pragma unroll
  for (int row = 0; row < 8 * kTiles; ++row) {
    if (row >= m) break;
    const float4* xv = reinterpret_cast<const float4*>(x + row * k + kx);
#pragma unroll
    for (int v = 0; v < kElems / 4; ++v) {
      const float4 xs = __ldg(xv + v);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        sum[r][row] = fmaf(w[r][4 * v], xs.x, sum[r][row]);
        sum[r][row] = fmaf(w[r][4 * v + 1], xs.y, sum[r][row]);
        sum[r][row] = fmaf(w[r][4 * v + 2], xs.z, sum[r][row]);
        sum[r][row] = fmaf(w[r][4 * v + 3], xs.w, sum[r][row]);
      }
    }
  }
}

// Blocks per SM the registers are budgeted for: 24 / 16 warps on tensor cores keep enough weight
// loads in flight; the fp32 path is not a decode path and gets what its FMAs need. Grouped (MoE)
// GEMVs get 2 (up to 128 registers): at 3 their 8-slot blocks spilled (ncu, 64 tokens: the down 537K
// local requests, 1.96 TB/s); H100, bench_moe_triton.py (thirty-seventh session), 8-slot blocks at 16 /
// 64 / 128 tokens -2.4 / -3.4 / -6.6% a layer with the epilogue pointers below.
template <typename T, int kTiles, bool kGrouped>
constexpr int kMinBlocks = std::is_same_v<T, float> ? 1 : (kTiles == 1 && !kGrouped ? 3 : 2);

// A warp's weight rows: 16 consecutive ones (Dense, Down), or 8 gate rows and their 8 up rows.
enum class Layout { Dense, GateUp, Down };

// The weight codes: int8, int4, or int4 in groups of 128 (a chunk's 128 codes of a row are one
// group, scaled after its MMAs: chunk_mma).
enum class Codes { Int8, Int4, Int4Group128 };

// Grouped layouts only (moe_align's output; see quant_gemv.h).
struct Grouping {
  const int* sorted_slots;   // [blocks * 8 kTiles] slot ids, padding = num_slots
  const int* block_experts;  // [blocks]
  const int* used;           // [1] slot positions in use: blocks at or past it exit at once
  int num_slots;
  int rows_per_x;            // x row of slot s: s / rows_per_x
  std::int64_t expert_rows;  // weight rows per expert
};

// The conv epilogue's inputs (quant_gemv.h GemvConvArgs): pool null without it.
struct ConvEpilogue {
  void* pool;                 // [S, channels, taps - 1]
  const void* weight;         // [channels, taps]
  const std::int64_t* slots;  // [m]
  unsigned* zeroed;           // [zeroed_count]
  int channels;
  int taps;
  int zeroed_count;
};

// The plain GEMV's epilogue inputs (quant_gemv.h): all null for the grouped layouts.
struct Epilogue {
  const void* bias;   // [n]
  const void* gate;   // [m] logits, gate_stride apart
  std::int64_t gate_stride;
  const void* add;    // [m, n]
  ConvEpilogue conv;
};

// What a plain 16-bit GEMV folds in around its product: nothing, the add + RMSNorm in front
// (AddNorm), or that and the GDN conv after (ConvEpilogue).
enum class Fold { None, Norm, NormConv, Conv };

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

template <typename T>
__device__ __forceinline__ T* stage_rows() {
  extern __shared__ uint4 stage[];
  return reinterpret_cast<T*>(stage);
}

// Bytes of the stage for m rows of k 16-bit elements; at most kStageMaxBytes within the limits
// (quant_gemv.h): 80.1 KB, which with a norm kernel's static shared memory (at most 18 KB) fits
// the 99 KB a block may have on sm_86 / sm_89 / sm_120.
constexpr std::size_t stage_bytes(std::int64_t m, std::int64_t k) {
  return static_cast<std::size_t>((m + 1) * (k + kStagePad)) * 2;
}
constexpr std::size_t kStageMaxBytes = stage_bytes(kQuantGemvNormMaxRows, kQuantGemvNormMaxK);

// The conv epilogue's part of the stage, after the norm's (16-byte aligned: k % 16 == 0): the conv
// weights of the block's `rows` weight rows [rows][taps], then the m rows' conv states of those
// channels [m][rows][taps - 1].
constexpr std::size_t conv_stage_bytes(std::int64_t m, std::int64_t rows, int taps) {
  return static_cast<std::size_t>(rows * (taps + m * (taps - 1))) * 2;
}
template <typename T>
__device__ __forceinline__ T* conv_stage(int m, int k) {
  return stage_rows<T>() + (m + 1) * (k + kStagePad);
}
// A block's weight rows: kBlockWarps / split tiles, at most kWarps (a split past kWarps leaves one
// tile to a block of kWideWarps). The largest stage, 89.1 KB (4 rows of 8192, 128 weight rows of 8
// taps), fits the 99 KB of sm_86 / sm_89 / sm_120 beside the static shared memory of a norm kernel
// (4.5 KB for 8 warps, 8.5 KB for 16).
__host__ __device__ constexpr int block_rows(int block_warps, int split) { return block_warps / split * kTileRows; }
constexpr std::size_t kConvStageMaxBytes =
    kStageMaxBytes + conv_stage_bytes(kQuantGemvNormMaxRows, kWarps * kTileRows, kQuantGemvConvMaxTaps);
// The largest dynamic stage of a fold's kernels (allow_largest_stage): the norm folds' (0: within the
// 48 KB a kernel gets unasked, or none).
template <Fold kFold>
constexpr std::size_t kLargestStage = kFold == Fold::Norm       ? kStageMaxBytes
                                      : kFold == Fold::NormConv ? kConvStageMaxBytes
                                                                : 0;

// The norm's weight into the stage's last row: constant, so copied before the wait for x.
template <typename T, int kBlockWarps>
__device__ __forceinline__ void stage_norm_weight(T* stage, const AddNorm& norm, int m, int k) {
  const T* weight = static_cast<const T*>(norm.weight);
  T* row = stage + m * (k + kStagePad);
  for (int i = 8 * threadIdx.x; i < k; i += 8 * kBlockWarps * 32) cp_async16(row + i, weight + i);
}

// The conv weights and states of the block's weight rows first .. first + rows - 1 that are conv
// channels (a multiple of 16, as first is) into the stage. Issued before the wait for x: the weights
// are constant, the states were last written by this layer's previous step and the slots by the host
// or an earlier kernel (two or more launches back).
template <typename T, int kBlockWarps>
__device__ void stage_conv(T* stage, const ConvEpilogue& conv, int m, int first, int rows) {
  constexpr int kPer = 8;  // elements of a 16-byte copy
  const int taps = conv.taps, live = min(rows, conv.channels - first);
  const int weight_copies = live * taps / kPer, state_copies = live * (taps - 1) / kPer;
  const T* weight = static_cast<const T*>(conv.weight) + static_cast<std::int64_t>(first) * taps;
  for (int p = threadIdx.x; p < weight_copies + m * state_copies; p += kBlockWarps * 32) {
    if (p < weight_copies) {
      cp_async16(stage + p * kPer, weight + p * kPer);
      continue;
    }
    const int row = (p - weight_copies) / state_copies, piece = (p - weight_copies) % state_copies;
    const T* state = static_cast<const T*>(conv.pool) + (__ldg(conv.slots + row) * conv.channels + first) * (taps - 1);
    cp_async16(stage + rows * taps + row * rows * (taps - 1) + piece * kPer, state + piece * kPer);
  }
}

// The conv epilogue's output for x row `row` and channel c, the block's weight row r: raw (the
// projection rounded to T) is channel c's newest input. Returns round(silu(w . [state | raw])) as
// gdn_decode.cu's conv kernel computes it (its `acc += w * x`, which nvcc contracts to one FMA a
// tap, oldest first) and moves the pool's conv state on by raw. Predicated to the widest conv, the
// shared loads first: they issue together instead of one FMA's latency apart.
template <typename T>
__device__ __forceinline__ float conv_output(const T* stage, const ConvEpilogue& conv, int rows, int row, int r,
                                             std::int64_t c, T raw) {
  constexpr int kTaps = kQuantGemvConvMaxTaps;
  const int taps = conv.taps;
  const T* weight = stage + r * taps;
  const T* old = stage + rows * taps + (row * rows + r) * (taps - 1);
  T w[kTaps], s[kTaps];  // s: the state, the K-1 inputs before raw
#pragma unroll
  for (int j = 0; j < kTaps; ++j) {
    if (j < taps - 1) {
      w[j] = weight[j];
      s[j] = old[j];
    }
  }
  const float w_raw = to_float(weight[taps - 1]);
  T* state = static_cast<T*>(conv.pool) + (__ldg(conv.slots + row) * conv.channels + c) * (taps - 1);
  float acc = 0.0f;
#pragma unroll
  for (int j = 0; j < kTaps - 1; ++j) {
    if (j < taps - 1) {
      acc = fmaf(to_float(w[j]), to_float(s[j]), acc);
      state[j] = j + 2 < taps ? s[j + 1] : raw;
    }
  }
  return round_to<T>(silu(fmaf(w_raw, to_float(raw), acc)));
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

// kTiles: n8 tiles of x rows (1: m <= 8, 2: m <= 16, 4: grouped blocks of 32 slots).
// kGrouped: one slot block of a grouped MoE GEMV per block y (else rows 8 kTiles y.. of x).
// kBlockWarps: kWarps, or kWideWarps for a grid of about one block an SM (few row tiles): the
// registers may then take what one block an SM leaves.
// kFold: Norm: x is the delta of a residual stream, normed with `norm` into the stage first (plain
// 16-bit Dense GEMVs of up to kQuantGemvNormMaxRows rows: one block row); NormConv: and the conv
// epilogue (epilogue.conv); Conv: the conv epilogue alone (x read as in a plain GEMV, the stage holding
// the conv's part only; up to kQuantGemvConvMaxRows rows).
// kRowTiles: row tiles a warp takes one after another (grouped GEMVs at split 1 only): a short K
// (the MoE down's 512) is a few steps a tile, so the next tile's first loads go out while this one
// ends and writes its outputs, instead of a warp (and a block) ending after every tile.
// kBlocksPerSm: the register budget's blocks an SM where not kMinBlocks' (the norm folds' spill-free
// form: launch).
// kSets: row tiles a warp computes together (grouped GEMVs at split 1 only, one chunk a step): each x
// load feeds both tiles' MMAs, half the x loads a weight byte. A 16-slot block loads twice the x a
// weight byte that an 8-slot one does; Nsight Compute (H100, 512 tokens, fifty-first session) had its
// gate_up's L1/TEX pipe 88% busy at 34% of the DRAM bandwidth, 0.37 issues a cycle a scheduler; with
// two sets 74% busy, 48% of DRAM, 0.53 issues (245 -> 178 us).
template <typename T, Codes kCodes, int kTiles, Layout kLayout, bool kGrouped, int kBlockWarps, Fold kFold,
          int kRowTiles, int kBlocksPerSm, int kSets>
__global__ void __launch_bounds__(kBlockWarps * 32, kBlockWarps != kWarps ? 1
                                                    : kBlocksPerSm > 0    ? kBlocksPerSm
                                                                          : kMinBlocks<T, kTiles, kGrouped>)
    quant_gemv_kernel(T* __restrict__ out, const T* __restrict__ x,
                      const std::uint8_t* __restrict__ qweight, const void* __restrict__ scales,
                      Epilogue epilogue, AddNorm norm, int m, int n, int k, int group_size, int split,
                      Grouping grouping) {
  constexpr bool kNorm = kFold == Fold::Norm || kFold == Fold::NormConv;
  constexpr bool kConv = kFold == Fold::NormConv || kFold == Fold::Conv;
  static_assert(!(kNorm || kConv) || (!std::is_same_v<T, float> && kLayout == Layout::Dense && !kGrouped));
  static_assert(kRowTiles == 1 || (kGrouped && !std::is_same_v<T, float>));
  static_assert(kSets == 1 || (kGrouped && kRowTiles == 1 && !std::is_same_v<T, float>));
  constexpr int kSteps = kSets > 1 ? 1 : kUnroll;  // chunks a step: a set's loads in flight as one tile's
  // the conv's part of the stage: after the norm's rows, or the whole stage without the norm
  T* const conv_at = kNorm ? conv_stage<T>(m, k) : stage_rows<T>();
  constexpr bool kTensorCores = !std::is_same_v<T, float>;
  constexpr bool kInt4 = kCodes != Codes::Int8;
  // A grouped GEMV has no epilogue operands (quant_gemv.h): null at compile time, so none of their
  // pointers or branches take registers (H100, thirty-seventh session: 32-slot blocks 5-7% faster).
  const T* bias = kGrouped ? nullptr : static_cast<const T*>(epilogue.bias);
  const T* gate = kGrouped ? nullptr : static_cast<const T*>(epilogue.gate);
  const T* add = kGrouped ? nullptr : static_cast<const T*>(epilogue.add);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int part = warp % split;  // this warp's share of its tile's chunks
  const std::int64_t tile =
      (static_cast<std::int64_t>(blockIdx.x) * (kBlockWarps / split) + warp / split) * kRowTiles * kSets;
  constexpr int kTileStep = kLayout == Layout::GateUp ? 8 : kTileRows;  // rows from a tile to the next
  const int row_bytes = kInt4 ? k / 2 : k;
  const int groups = kInt4 ? k / group_size : 0;
  // a chunk's group: (2 * offset) / group_size, a shift (group sizes are powers of two)
  const int group_log2 = kCodes == Codes::Int4Group128 ? 7 : (kInt4 ? __ffs(group_size) - 1 : 0);
  // A rows g and g + 8 of the warp's tile: 16 consecutive weight rows, or for gate_up output g
  // of an 8-wide tile as its gate row and its up row (n rows further).
  const std::int64_t pair = kLayout == Layout::GateUp ? n : 8;
  std::int64_t rows[2] = {tile * kTileStep + g, tile * kTileStep + g + pair};  // the tile being computed
  const auto rows_live = [&](std::int64_t row, bool (&live)[2]) {
    live[0] = row < n;
    live[1] = kLayout == Layout::GateUp ? row < n : row + pair < n;
  };
  bool live[2];
  rows_live(rows[0], live);
  const int chunks = (row_bytes + kChunkBytes - 1) / kChunkBytes;
  const int* block_slots = nullptr;
  if constexpr (!kGrouped) {  // block y: rows 8 kTiles y .. of x and out (m > 16: short prefills)
    const int row0 = blockIdx.y * 8 * kTiles;
    x += static_cast<std::int64_t>(row0) * k;
    out += static_cast<std::int64_t>(row0) * n;
    if (gate != nullptr) gate += row0 * epilogue.gate_stride;
    if (add != nullptr) add += static_cast<std::int64_t>(row0) * n;
    m -= row0;
  }
  // The down GEMV's slot blocks were written by moe_align two launches back (align, gate_up, down:
  // moe.py's order), so its blocks read them, and ask for their first weights, before the wait for
  // gate_up's h; gate_up's come from the kernel before.
  constexpr bool kGroupingEarly = kGrouped && kLayout == Layout::Down;
  const auto grouping_int = [](const int* p) {
    if constexpr (kGroupingEarly) {
      return load_early(p);
    } else {
      return __ldcg(p);
    }
  };
  if constexpr (kGrouped) {  // the whole block exits together (before any barrier)
    if constexpr (!kGroupingEarly) enter_kernel();
    const int b = blockIdx.y;
    const int used = grouping_int(grouping.used);  // both in one round trip: the expert's slot is
    const int expert = grouping_int(grouping.block_experts + b);  // in bounds past `used` too
    if (b * 8 * kTiles >= used) return;
    const std::int64_t expert_rows = grouping.expert_rows * expert;
    qweight += expert_rows * row_bytes;
    scales = kInt4 ? static_cast<const void*>(static_cast<const std::uint16_t*>(scales) +
                                              expert_rows * groups)
                   : static_cast<const void*>(static_cast<const float*>(scales) + expert_rows);
    block_slots = grouping.sorted_slots + static_cast<std::int64_t>(b) * 8 * kTiles;
  }
  // Row g + pair lies pair rows past row g: one base pointer per array (fewer registers).
  const std::int64_t base = live[0] ? rows[0] : 0;
  const std::uint8_t* wbase = qweight + base * row_bytes;
  const std::uint16_t* sbase = static_cast<const std::uint16_t*>(scales) + base * groups;
  // The epilogue's constants, an int8 row's scale and its bias, read once a step (so from DRAM),
  // are asked into L2 now by the warps that write (before the wait for x in a plain GEMV); their
  // loads, with the others' of the epilogue, come after the main loop.
  if (part == 0) {
#pragma unroll
    for (int j = 0; j < kRowTiles * kSets; ++j) {
      bool tile_live[2];
      rows_live(rows[0] + j * kTileStep, tile_live);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if (!tile_live[r]) continue;
        if constexpr (!kInt4) prefetch_l2(static_cast<const float*>(scales) + rows[r] + j * kTileStep);
        if (bias != nullptr) prefetch_l2(bias + rows[r] + j * kTileStep);
      }
    }
  }
  // This lane's row of x (its B column) in each n8 tile: in global memory, or normed in the stage.
  std::conditional_t<kNorm, StagedX<T>, const T*> xr[kTiles];
#pragma unroll
  for (int tile_m = 0; tile_m < kTiles; ++tile_m) {
    int row = 8 * tile_m + g;
    if constexpr (kGrouped) {
      const int slot = grouping_int(block_slots + row);
      row = slot < grouping.num_slots ? slot / grouping.rows_per_x : 0;
    } else {
      row = row < m ? row : 0;
    }
    if constexpr (kNorm) {
      xr[tile_m] = {stage_rows<T>() + row * (k + kStagePad)};
    } else {
      xr[tile_m] = x + static_cast<std::int64_t>(row) * k;
    }
  }

  // One step = kSteps chunks; the next step's weights are loaded before this step computes, so
  // every warp keeps loads in flight while its tensor cores / FMAs work. Two buffers, used in
  // turn by a loop unrolled twice: no register copies between the steps. The loads walk running
  // pointers (chunk c of this lane: byte 64 c + 16 t of its rows); a load past the row end is
  // predicated off. (A per-lane cp.async ring in shared memory, 2 steps in flight, measured no
  // faster for the 27B and 4% slower for the 35B on the H200: occupancy, not load depth, binds.)
  uint4 q[2][kSteps][2 * kSets];  // [2 s + r]: row g (r = 0) or g + pair of set s's tile
  std::uint16_t sc[2][kSteps][2 * kSets] = {};
  const int chunk_groups = kInt4 ? (2 * kChunkBytes) >> group_log2 : 0;  // scales a chunk's row spans
  const int stride = split * kSteps;
  const int first = part * kSteps;
  const int tile_steps = (chunks + kSteps - 1) / kSteps;  // a row tile's (kRowTiles > 1: split 1)
  // The load side runs up to two steps ahead of the compute side, so into the next row tile at the
  // end of one: its own tile's rows, liveness and step count.
  const std::uint8_t* wnext = wbase + first * kChunkBytes + 16 * t;
  const std::uint16_t* snext = sbase + first * chunk_groups + ((32 * t) >> group_log2);
  int left = row_bytes - first * kChunkBytes - 16 * t;  // bytes of the row from wnext on
  bool load_live[kSets][2];  // the sets' rows (set 0: the load tile's; kSets > 1: one tile, kRowTiles 1)
#pragma unroll
  for (int set = 0; set < kSets; ++set) rows_live(rows[0] + set * kTileStep, load_live[set]);
  std::int64_t load_row = rows[0];
  int load_steps = 0;  // of the load tile, asked for
  const auto load_step = [&](int b) {
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      const bool in = u * kChunkBytes < left;
#pragma unroll
      for (int r = 0; r < 2 * kSets; ++r) {
        const bool pred = load_live[r / 2][r % 2] && in;
        const std::int64_t row = (r % 2) * pair + (r / 2) * kTileStep;  // rows past the set's row g
        q[b][u][r] = load16<true>(wnext + row * row_bytes + u * kChunkBytes, pred);
        if constexpr (kInt4) sc[b][u][r] = load2(snext + row * groups + u * chunk_groups, pred);
      }
    }
    wnext += stride * kChunkBytes;
    snext += stride * chunk_groups;
    left -= stride * kChunkBytes;
    if constexpr (kRowTiles > 1) {
      if (++load_steps == tile_steps) {  // on to the next tile's first step
        load_steps = 0;
        wnext += kTileStep * row_bytes - tile_steps * stride * kChunkBytes;
        snext += kTileStep * groups - tile_steps * stride * chunk_groups;
        left = row_bytes - first * kChunkBytes - 16 * t;
        load_row += kTileStep;
        rows_live(load_row, load_live[0]);
      }
    }
  };
  float accs[kSets][kTiles][4] = {};
  float (&acc)[kTiles][4] = accs[0];  // the tile's (kSets 1)
  float sum[2][8 * kTiles] = {};  // fp32 path: per (weight row, x row), this lane's k only
  const int kx_last = k - (kInt4 ? 32 : 16);  // the last k a lane's chunk may start at
  const auto compute_step = [&](int b, int c) {
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      if (c + u >= chunks) break;  // warp-uniform
      // This lane's first k; past the row end (a K tail) its weights are zeros, and it reads the
      // row's last x values instead (finite: 0 x = 0).
      const int off = (c + u) * kChunkBytes + 16 * t;
      const int kx = min(kInt4 ? 2 * off : off, kx_last);
      if constexpr (kTensorCores) {
        chunk_mma_sets<T, kInt4, kCodes == Codes::Int4Group128, kTiles, kSets>(accs, q[b][u], sc[b][u], xr, kx);
      } else if (off < row_bytes) {
        chunk_fp32<kInt4, kTiles>(sum, q[b][u], sc[b][u], x, m, k, kx);
      }
    }
  };

  // A plain GEMV's first two steps of weights are on their way before it waits for x (programmatic
  // dependent launch: the previous kernel may still be running; weights are never written) and
  // norms it: a warp of a short K (out_proj split 16 ways: 2 steps) has asked for all of its
  // weights by then. Each buffer is refilled right after it is computed.
  load_step(0);
  if (kRowTiles > 1 || first + stride < chunks) load_step(1);
  if constexpr (kNorm) stage_norm_weight<T, kBlockWarps>(stage_rows<T>(), norm, m, k);
  if constexpr (kConv) {
    const int rows_here = block_rows(kBlockWarps, split);
    stage_conv<T, kBlockWarps>(conv_at, epilogue.conv, m, rows_here * blockIdx.x, rows_here);
  }
  if constexpr (!kGrouped) enter_kernel();
  if constexpr (kGroupingEarly) enter_kernel_after_loads();
  if constexpr (kNorm) add_norm_rows<T, kBlockWarps>(stage_rows<T>(), x, norm, m, k);
  // A tile's outputs: its sums acc (of every split part) through the epilogue into out; rows: its
  // rows g and g + pair, live: theirs.
  __shared__ float partial[kBlockWarps][kTiles * 4][32];  // split > 1: the tile's other warps' sums
  const auto finish_tile = [&](float (&acc)[kTiles][4], const std::int64_t (&rows)[2], const bool (&live)[2]) {
    if constexpr (!kTensorCores) {
      // Add the four lanes of each row, then keep the entries of this lane's MMA C fragment.
#pragma unroll
      for (int r = 0; r < 2; ++r) {
#pragma unroll
        for (int row = 0; row < 8 * kTiles; ++row) {
          sum[r][row] += __shfl_xor_sync(0xffffffffu, sum[r][row], 1);
          sum[r][row] += __shfl_xor_sync(0xffffffffu, sum[r][row], 2);
        }
      }
#pragma unroll
      for (int tile_m = 0; tile_m < kTiles; ++tile_m) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
          for (int tt = 0; tt < 4; ++tt) {
            if (t == tt) acc[tile_m][i] = sum[i >> 1][8 * tile_m + 2 * tt + (i & 1)];
          }
        }
      }
    }

    if constexpr (kConv && !kNorm) {  // the staged conv weights and states (the norm's barriers do this)
      cp_async_wait_all();
      __syncthreads();
    }

    // The epilogue's loads issue before the split's barrier, every entry's at once: the row scales and
    // biases, and the residual to add and the gate logits of earlier kernels. Loaded entry by entry
    // after the barrier, each behind the previous entry's store (which might alias it), they were a
    // chain of round trips at the tail of every GEMV. Entry i of n8 tile tile_m: x row 8 tile_m + 2t + i % 2.
    float row_scale[2] = {1.0f, 1.0f}, row_bias[2] = {};
    if (part == 0) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if (!live[r]) continue;
        if constexpr (!kInt4) row_scale[r] = __ldg(static_cast<const float*>(scales) + rows[r]);
        if (bias != nullptr) row_bias[r] = to_float(bias[rows[r]]);
      }
    }
    float added[kTiles][4] = {}, gated[kTiles][2] = {};
    if constexpr (!kGrouped && kLayout != Layout::GateUp) {
      if (part == 0 && (add != nullptr || gate != nullptr)) {
#pragma unroll
        for (int tile_m = 0; tile_m < kTiles; ++tile_m) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int xrow = 8 * tile_m + 2 * t + (i & 1);
            if (xrow >= m) continue;
            if (add != nullptr && live[i >> 1]) added[tile_m][i] = to_float(add[static_cast<std::int64_t>(xrow) * n + rows[i >> 1]]);
            if (gate != nullptr && i < 2) gated[tile_m][i] = to_float(gate[xrow * epilogue.gate_stride]);
          }
        }
      }
    }

    if (split > 1) {  // the tile's other warps hand their sums to its first warp
      if (part > 0) {
#pragma unroll
        for (int i = 0; i < kTiles * 4; ++i) partial[warp][i][lane] = acc[i / 4][i % 4];
      }
      __syncthreads();
      if (part > 0) return;  // its work is done (split > 1 has one tile a warp: the kernel ends here)
      for (int other = 1; other < split; ++other) {
#pragma unroll
        for (int i = 0; i < kTiles * 4; ++i) acc[i / 4][i % 4] += partial[warp + other][i][lane];
      }
    }

    if constexpr (kConv) {  // the counters of the GDN recurrent kernel launched next
      if (blockIdx.x == 0 && warp == 0) {
        for (int i = lane; i < epilogue.conv.zeroed_count; i += 32) epilogue.conv.zeroed[i] = 0u;
      }
    }
    // C fragment entry i of n8 tile tile_m: A row g (i < 2) or g + pair, x row 8 tile_m + 2t + i % 2.
#pragma unroll
    for (int tile_m = 0; tile_m < kTiles; ++tile_m) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if (!kInt4 && live[i >> 1]) acc[tile_m][i] *= row_scale[i >> 1];
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int xrow = 8 * tile_m + 2 * t + (i & 1);
        std::int64_t out_row = xrow;  // the row of out this entry belongs to
        if constexpr (kGrouped) {
          out_row = __ldg(block_slots + xrow);
          if (out_row >= grouping.num_slots) continue;
        } else if (xrow >= m) {
          continue;
        }
        if (!live[i >> 1]) continue;
        if constexpr (kLayout == Layout::GateUp) {
          if (i >= 2) continue;  // entries 2, 3 are the up sums of entries 0, 1
          // The reference's roundings: linear, silu and the product each in T.
          out[out_row * n + rows[0]] =
              from_float<T>(silu_times<T>(round_to<T>(acc[tile_m][i]), round_to<T>(acc[tile_m][i + 2])));
        } else {
          const std::int64_t at = out_row * n + rows[i >> 1];
          float v = acc[tile_m][i];
          if (bias != nullptr) v += row_bias[i >> 1];
          // csrc/activation.cu's sigmoid_mul roundings
          if (gate != nullptr) v = sigmoid_times<T>(round_to<T>(v), gated[tile_m][i & 1]);
          if (add != nullptr) v = added[tile_m][i] + round_to<T>(v);
          if constexpr (kConv) {
            const int rows_here = block_rows(kBlockWarps, split);
            const int r = static_cast<int>(rows[i >> 1]) - rows_here * static_cast<int>(blockIdx.x);
            if (rows[i >> 1] < epilogue.conv.channels) {
              v = conv_output<T>(conv_at, epilogue.conv, rows_here, xrow, r, rows[i >> 1], from_float<T>(v));
            }
          }
          out[at] = from_float<T>(v);
        }
      }
    }
  };
  if constexpr (kRowTiles == 1) {
    for (int c = first; c < chunks; c += 2 * stride) {
      compute_step(0, c);
      if (c + 2 * stride < chunks) load_step(0);
      if (c + stride >= chunks) break;
      compute_step(1, c + stride);
      if (c + 3 * stride < chunks) load_step(1);
    }
#pragma unroll
    for (int set = 0; set < kSets; ++set) {
      const std::int64_t set_rows[2] = {rows[0] + set * kTileStep, rows[1] + set * kTileStep};
      finish_tile(accs[set], set_rows, load_live[set]);
    }
  } else {  // the same steps numbered over the warp's tiles: the loads run on into the next tile
    // The chunk of the compute side's next step; past a tile's last the tile's outputs are written
    // and the compute side moves on to the next tile.
    const auto next_chunk = [&](int c) {
      c += kSteps;
      if (c >= chunks) {
        finish_tile(acc, rows, live);
        c = 0;
        rows[0] += kTileStep;
        rows[1] += kTileStep;
        rows_live(rows[0], live);
#pragma unroll
        for (int tile_m = 0; tile_m < kTiles; ++tile_m) {
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[tile_m][i] = 0.0f;
        }
      }
      return c;
    };
    const int steps = kRowTiles * tile_steps;
    for (int s = 0, c = 0; s < steps; s += 2) {
      compute_step(0, c);
      if (s + 2 < steps) load_step(0);
      c = next_chunk(c);
      if (s + 1 >= steps) break;
      compute_step(1, c);
      if (s + 3 < steps) load_step(1);
      c = next_chunk(c);
    }
  }
}

// Weight-row tiles of one warp: 16 rows, or 8 outputs (gate + up rows) for gate_up.
std::int64_t row_tiles(std::int64_t n, Layout layout) {
  const int rows = layout == Layout::GateUp ? 8 : kTileRows;
  return (n + rows - 1) / rows;
}

// Lets kKernel (a norm kernel) take its largest stage, `bytes`, past the 48 KB of dynamic shared
// memory a kernel gets unasked; once per device, so graph captures after a warm-up ask nothing.
template <auto kKernel>
void allow_largest_stage(int device, std::size_t bytes) {
  static std::array<std::atomic<bool>, 256> allowed{};  // sm_count has checked the device index
  if (allowed.at(device).load(std::memory_order_relaxed)) return;
  check_cuda(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)),
             "cudaFuncSetAttribute");
  allowed[device].store(true, std::memory_order_relaxed);
}

// Blocks of kKernel an SM holds at once with `stage` bytes of dynamic shared memory. Asked of the
// driver once per kernel, device and stage size (the last size is kept: a model's calls of one
// kernel share their k and rows), so a graph capture after the warm-up asks nothing.
template <auto kKernel, int kThreads>
int resident_blocks(int device, std::size_t stage) {
  static std::array<std::atomic<std::uint64_t>, 256> last{};  // stage << 8 | blocks; 0: not asked
  const std::uint64_t seen = last.at(device).load(std::memory_order_relaxed);
  if (seen != 0 && seen >> 8 == stage) return static_cast<int>(seen & 0xff);
  int blocks = 0;
  check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kKernel, kThreads, stage),
             "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  blocks = std::clamp(blocks, 1, 255);
  last[device].store(static_cast<std::uint64_t>(stage) << 8 | static_cast<std::uint64_t>(blocks),
                     std::memory_order_relaxed);
  return blocks;
}

// The split (1, 2, 4 .. kWarps) that runs a GEMV of `tiles` row tiles (times the grid's rows) in the
// fewest chunk steps a warp, when `capacity` blocks fit the GPU at once: its blocks run in
// ceil(blocks / capacity) waves of chunks / split steps each. choose_split's split stands unless
// another is strictly shorter. Its warps-an-SM goal cannot see waves: the 27B's MLP gate_up (2,176
// tiles, 40 chunks) at split 1 is 272 blocks, 0.69 of one wave (ncu: 16 warps an SM of 24
// possible), where split 4 is 2.75 waves of a quarter of the steps: 41.8 -> 35.8 us on the H200,
// the 27B's in_proj / qkv (split 4 -> 8) 6-11% faster, its decode step 2.6%; the 35B's GEMVs keep
// their splits (docs/performance.md, seventeenth session).
int split_for_waves(int split, std::int64_t tiles, std::int64_t chunks, std::int64_t capacity) {
  const auto steps = [&](int s) {
    const std::int64_t blocks = (tiles + kWarps / s - 1) / (kWarps / s);
    return (blocks + capacity - 1) / capacity * ((chunks + s - 1) / s);
  };
  int best = split;
  for (int s = 1; s <= kWarps && 2LL * s * kUnroll <= chunks; s *= 2) {
    if (steps(s) < steps(best)) best = s;
  }
  return best;
}

// The split of a GEMV that folds the norm in front: every block norms the rows again (x and the
// residual from L2, two barriers: a fixed cost a block), so split_for_waves' split is halved until
// the grid fits one wave, if it can. Replays on the H200 (docs/performance.md, nineteenth session):
// the 27B's in_proj / qkv (K = 5,120; 1,030 / 896 tiles) at split 2 (0.65 / 0.57 of a wave) instead
// of 8 (2.6 / 2.3 waves) made its decode step 2.9% shorter; the 35B's (K = 2,048) keep split 4 (0.97 /
// 0.73 of a wave), against which 2 and 8 were 9-12% slower. Where the split differs from a plain
// GEMV's, the fold's K sums are added in another order than the composition's (its norm stays
// bit-equal to add_rmsnorm).
int split_for_norm(int split, std::int64_t tiles, std::int64_t chunks, std::int64_t capacity) {
  const int waves = split_for_waves(split, tiles, chunks, capacity);
  for (int s = waves; s >= 1; s /= 2) {
    if ((tiles + kWarps / s - 1) / (kWarps / s) <= capacity) return s;
  }
  return waves;
}

template <typename T, Codes kCodes, int kTiles, Layout kLayout, bool kGrouped, int kBlockWarps, Fold kFold,
          int kRowTiles = 1, int kBlocksPerSm = 0, int kSets = 1>
void launch(const QuantGemvArgs& a, int split, unsigned slot_blocks, Grouping grouping) {
  constexpr auto kernel =
      quant_gemv_kernel<T, kCodes, kTiles, kLayout, kGrouped, kBlockWarps, kFold, kRowTiles, kBlocksPerSm, kSets>;
  const int asked = split;
  const std::int64_t tiles = row_tiles(a.n, kLayout);
  std::size_t stage = 0;
  if constexpr (kLargestStage<kFold> > 0) {
    allow_largest_stage<kernel>(a.device, kLargestStage<kFold>);
    stage = stage_bytes(a.m, a.k);
  }
  constexpr bool kConv = kFold == Fold::NormConv || kFold == Fold::Conv;
  if constexpr (!kGrouped && kBlockWarps == kWarps) {  // a grouped GEMV's blocks are known on the device only
    // the conv stage of split 1 (the most rows a block): a bound for every split
    const std::size_t most =
        stage + (kConv ? conv_stage_bytes(a.m, block_rows(kWarps, 1), a.conv.taps) : 0);
    const std::int64_t capacity = static_cast<std::int64_t>(resident_blocks<kernel, kWarps * 32>(a.device, most)) *
                                  sm_count(a.device) / slot_blocks;
    const std::int64_t chunks = ((a.int4 ? a.k / 2 : a.k) + kChunkBytes - 1) / kChunkBytes;
    split = kFold == Fold::None || kFold == Fold::Conv
                ? split_for_waves(split, tiles, chunks, std::max<std::int64_t>(capacity, 1))
                : split_for_norm(split, tiles, chunks, std::max<std::int64_t>(capacity, 1));
    // The norm folds spill 64-72 bytes a thread at 3 blocks an SM; at 2 (no spills) their grid is a
    // wave of 2 blocks an SM, so the form at 2 runs where its split is the same: the 27B's in_proj / qkv
    // (split 2 either way), not the 35B's (split 4 at 3 an SM would halve). H100: every norm fold at 2
    // made the 35B's b1 step 6.7% longer (thirty-seventh session); this rule made the 27B's 2.0% shorter,
    // the 35B's level (thirty-eighth session).
    if constexpr (kLargestStage<kFold> > 0 && kBlocksPerSm == 0 && kTiles == 1) {
      constexpr auto spill_free = quant_gemv_kernel<T, kCodes, kTiles, kLayout, kGrouped, kBlockWarps, kFold, 1, 2, 1>;
      allow_largest_stage<spill_free>(a.device, kLargestStage<kFold>);
      const std::int64_t room = static_cast<std::int64_t>(resident_blocks<spill_free, kWarps * 32>(a.device, most)) *
                                sm_count(a.device) / slot_blocks;
      if (split_for_norm(asked, tiles, chunks, std::max<std::int64_t>(room, 1)) == split) {
        return launch<T, kCodes, kTiles, kLayout, kGrouped, kBlockWarps, kFold, 1, 2>(a, asked, slot_blocks, grouping);
      }
    }
  }
  if (a.split_used != nullptr) *a.split_used = split;
  const int tiles_per_block = kBlockWarps / split * kRowTiles * kSets;
  const dim3 grid(static_cast<unsigned>((tiles + tiles_per_block - 1) / tiles_per_block), slot_blocks);
  const ConvEpilogue conv{reinterpret_cast<void*>(a.conv.pool), reinterpret_cast<const void*>(a.conv.weight),
                          reinterpret_cast<const std::int64_t*>(a.conv.slots),
                          reinterpret_cast<unsigned*>(a.conv.zeroed), static_cast<int>(a.conv.channels), a.conv.taps,
                          a.conv.zeroed_count};
  const Epilogue epilogue{reinterpret_cast<const void*>(a.bias), reinterpret_cast<const void*>(a.gate),
                          a.gate_stride, reinterpret_cast<const void*>(a.add), conv};
  const AddNorm norm{reinterpret_cast<const void*>(a.norm.residual), reinterpret_cast<const void*>(a.norm.weight),
                     reinterpret_cast<void*>(a.norm.residual_out), a.norm.eps, a.norm.zero_centered};
  if constexpr (kConv) stage += conv_stage_bytes(a.m, block_rows(kBlockWarps, split), a.conv.taps);
  // Named by role (errors, NINFER_ABLATE): a decode step's in_proj / qkv fold the norm (a GDN in_proj
  // with its conv epilogue too: the same role), its out_proj / o_proj add the residual; all contain
  // "quant_gemv".
  const char* what = kGrouped                    ? "quant_gemv grouped (MoE) kernel launch"
                     : kFold == Fold::Conv       ? "quant_gemv conv kernel launch"
                     : kFold != Fold::None       ? "quant_gemv norm kernel launch"
                     : kLayout == Layout::GateUp ? "quant_gemv gate_up kernel launch"
                     : a.add != 0                ? "quant_gemv add kernel launch"
                                                 : "quant_gemv kernel launch";
  launch_kernel(what, kernel, grid, kBlockWarps * 32, stage, as_stream(a.stream),
                reinterpret_cast<T*>(a.out), reinterpret_cast<const T*>(a.x),
                reinterpret_cast<const std::uint8_t*>(a.qweight), reinterpret_cast<const void*>(a.scales), epilogue,
                norm, static_cast<int>(a.m), static_cast<int>(a.n), static_cast<int>(a.k), a.group_size, split,
                grouping);
}

static_assert(kQuantGemvNormMaxRows <= 8 && kQuantGemvConvMaxRows <= 8, "the norm's / conv's rows fit one n8 tile (kTiles = 1)");
static_assert(conv_stage_bytes(kQuantGemvConvMaxRows, kWarps * kTileRows, kQuantGemvConvMaxTaps) <= 48 * 1024,
              "a conv-only stage fits the dynamic shared memory a kernel gets unasked");

// split > kWarps: blocks of kWideWarps (plain 16-bit GEMVs only, choose_split).
// row_tiles_per_warp (kRowTiles): 1, or 2 for grouped down GEMVs of 8- and 16-slot blocks at split 1;
// sets (kSets): 1, or 2 for bf16 grouped GEMVs of 16-slot blocks at split 1 (one row tile a warp).
template <typename T, Layout kLayout, bool kGrouped, Fold kFold = Fold::None>
void launch_typed(const QuantGemvArgs& a, int split, int tiles, unsigned slot_blocks,
                  Grouping grouping = {}, int row_tiles_per_warp = 1, int sets = 1) {
  const auto pick = [&](auto codes, auto block_warps) {
    constexpr Codes kCodes = decltype(codes)::value;
    constexpr int kBlockWarps = decltype(block_warps)::value;
    switch (tiles) {
      case 1:
        if constexpr (kGrouped && kLayout == Layout::Down) {
          if (row_tiles_per_warp == 2) return launch<T, kCodes, 1, kLayout, true, kBlockWarps, kFold, 2>(a, split, slot_blocks, grouping);
        }
        launch<T, kCodes, 1, kLayout, kGrouped, kBlockWarps, kFold>(a, split, slot_blocks, grouping);
        break;
      case 2:  // m > 8: never with the norm or the conv (m <= kQuantGemvNormMaxRows, kQuantGemvConvMaxRows)
        // two sets: the chunk sums of 2 tiles would spill, so groups of 128 scale the weights (fp16's
        // down spills even then, 8 bytes: bf16 only)
        if constexpr (kGrouped && std::is_same_v<T, __nv_bfloat16>) {
          constexpr Codes kSetCodes = kCodes == Codes::Int4Group128 ? Codes::Int4 : kCodes;
          if (sets == 2) return launch<T, kSetCodes, 2, kLayout, true, kBlockWarps, kFold, 1, 0, 2>(a, split, slot_blocks, grouping);
        }
        if constexpr (kGrouped && kLayout == Layout::Down) {
          if (row_tiles_per_warp == 2) return launch<T, kCodes, 2, kLayout, true, kBlockWarps, kFold, 2>(a, split, slot_blocks, grouping);
        }
        if constexpr (kFold == Fold::None) {
          launch<T, kCodes, 2, kLayout, kGrouped, kBlockWarps, kFold>(a, split, slot_blocks, grouping);
        }
        break;
      default:  // 32-slot blocks: the chunk sums of 4 tiles would spill, so groups of 128 scale the weights
        if constexpr (kGrouped) {
          constexpr Codes kWide = kCodes == Codes::Int4Group128 ? Codes::Int4 : kCodes;
          launch<T, kWide, 4, kLayout, kGrouped, kBlockWarps, kFold>(a, split, slot_blocks, grouping);
        }
    }
  };
  const auto by_kind = [&](auto block_warps) {
    using C = Codes;
    if (!a.int4) return pick(std::integral_constant<C, C::Int8>{}, block_warps);
    // fp32 activations dequantize on CUDA cores: one int4 form for every group size
    if constexpr (!std::is_same_v<T, float>) {
      if (a.group_size == 2 * kChunkBytes) return pick(std::integral_constant<C, C::Int4Group128>{}, block_warps);
    }
    pick(std::integral_constant<C, C::Int4>{}, block_warps);
  };
  if constexpr (!kGrouped && !std::is_same_v<T, float>) {
    if (split > kWarps) return by_kind(std::integral_constant<int, kWideWarps>{});
  }
  by_kind(std::integral_constant<int, kWarps>{});
}

// Warps per tile (1, 2, 4 .. max_split): K is split until the grid has ~kWarpsPerSm warps per SM,
// as long as every warp keeps at least kUnroll chunks (small n with large k: N = 1 .. 256 rows).
// `tiles`: the warp tiles of the whole grid. A split past kWarps takes blocks of kWideWarps: a
// GDN out_proj / attention o_proj (2,048 x 4,096) had 8 warps an SM, each waiting for 4 round
// trips one after another (ncu: 7 warps an SM active, 0.93 TB/s).
int choose_split(const QuantGemvArgs& a, std::int64_t tiles, int max_split) {
  const int sms = sm_count(a.device);
  const std::int64_t chunks = ((a.int4 ? a.k / 2 : a.k) + kChunkBytes - 1) / kChunkBytes;
  int split = 1;
  while (split < max_split && tiles * split < static_cast<std::int64_t>(kWarpsPerSm) * sms &&
         2LL * split * kUnroll <= chunks) {
    split *= 2;
  }
  return split;
}

}  // namespace

// The launchers trust their arguments: the binding (bind_quant.cpp) is their one caller and checks
// every tensor against quant_gemv.h first.
void quant_gemv(const QuantGemvArgs& a) {
  DeviceGuard guard(a.device);
  const Layout layout = a.gate_up ? Layout::GateUp : Layout::Dense;
  const int tiles = a.m > 8 ? 2 : 1;
  const auto row_blocks = static_cast<unsigned>((a.m + 8 * tiles - 1) / (8 * tiles));
  const int split = choose_split(a, row_tiles(a.n, layout) * row_blocks, a.dtype == DType::F32 ? kWarps : kWideWarps);
  by_dtype(a.dtype, "quant_gemv", [&](auto type) {
    using T = decltype(type);
    if (a.gate_up) {
      launch_typed<T, Layout::GateUp, false>(a, split, tiles, row_blocks);
    } else if (a.norm.residual == 0 && a.conv.pool == 0) {
      launch_typed<T, Layout::Dense, false>(a, split, tiles, row_blocks);
    } else if constexpr (!std::is_same_v<T, float>) {  // the folded norm / conv: fp16 / bf16 only
      if (a.norm.residual == 0) return launch_typed<T, Layout::Dense, false, Fold::Conv>(a, split, tiles, row_blocks);
      if (a.conv.pool != 0) {
        launch_typed<T, Layout::Dense, false, Fold::NormConv>(a, split, tiles, row_blocks);
      } else {
        launch_typed<T, Layout::Dense, false, Fold::Norm>(a, split, tiles, row_blocks);
      }
    }
  });
}

void moe_grouped_gemv(const GroupedGemvArgs& g) {
  const QuantGemvArgs& a = g.gemv;
  if (g.blocks == 0) return;
  const Layout layout = g.gate_up ? Layout::GateUp : Layout::Down;
  const Grouping grouping{reinterpret_cast<const int*>(g.sorted_slots),
                          reinterpret_cast<const int*>(g.block_experts),
                          reinterpret_cast<const int*>(g.used), static_cast<int>(g.num_slots),
                          g.rows_per_x, g.gate_up ? 2 * a.n : a.n};
  DeviceGuard guard(a.device);
  const int split = choose_split(a, row_tiles(a.n, layout) * g.blocks, kWarps);
  const int tiles = g.block_m / 8;
  const auto blocks = static_cast<unsigned>(g.blocks);
  // Row tiles a warp takes: 2 for down at split 1 (K = inter: the 35B's 512 is 2 steps a tile), 1 for
  // gate_up. H200, bench_moe_triton.py (docs/performance.md, twenty-second session), ms a layer 1 -> 2
  // tiles: 8-slot blocks 37 tokens 0.136 -> 0.133, 64 0.166 -> 0.161, 128 0.194 -> 0.188, 8 and 16
  // level; 16-slot blocks 384 tokens 0.335 -> 0.326, 512 0.428 -> 0.414; 4 tiles for down lost at 8 /
  // 16 tokens (+5%), 2 for gate_up lost at 16 to 64 (+4-9%).
  // bf16 16-slot blocks at split 1 take two row tiles a warp together instead (kSets: each x load
  // feeds both), where half the warps still fill the SMs as choose_split asks. H100, bench_moe_triton.py
  // (docs/performance.md, fifty-first session), ms a layer: 16-slot blocks 256 tokens 0.255 -> 0.224,
  // 512 0.386 -> 0.298 (gate_up 252 -> 189 us, down 140 -> 125); 8-slot blocks lost at 64 / 128 tokens
  // (+10% / +3%: a block's x is half of a 16-slot one's, and half the warps hide less latency).
  const int sets = split == 1 && tiles == 2 && a.dtype == DType::BF16 &&
                           choose_split(a, row_tiles(a.n, layout) * g.blocks / 2, kWarps) == 1
                       ? 2
                       : 1;
  const int per_warp = split == 1 && !g.gate_up && sets == 1 ? 2 : 1;
  const auto go = [&](auto type) {
    using T = decltype(type);
    if (g.gate_up) {
      launch_typed<T, Layout::GateUp, true>(a, split, tiles, blocks, grouping, per_warp, sets);
    } else {
      launch_typed<T, Layout::Down, true>(a, split, tiles, blocks, grouping, per_warp, sets);
    }
  };
  a.dtype == DType::F16 ? go(__half{}) : go(__nv_bfloat16{});
}

}  // namespace ninfer

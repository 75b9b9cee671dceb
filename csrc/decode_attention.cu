// Paged KV cache kernels: the KV write (per-token fp8 / int8 quantization) and split-K
// ("flash-decoding") attention for T <= 16 new tokens per sequence (decode, speculative verify).
//
// Attention: one block per (context split, kv head, sequence) handles every query row of the kv
// head's GQA group (T tokens x H / Hkv heads), so each K/V byte is read from DRAM once per kv
// head. (The fp32 O accumulators live in registers, so more than 16384 / head_dim rows, e.g. 16
// tokens x GQA 8 at head_dim 256, go to several "row chunk" blocks that re-read the tile from L2.)
// Per 32-key tile the block stages K and V in shared memory (dequantized to
// the query dtype exactly as the torch reference does), computes S = Q K^T and O += P V on
// tensor cores (mma.sync m16n8k16, fp32 accumulation) with an online softmax in fp32, and
// prefetches the next tile into registers meanwhile. A sequence's split count follows its
// length at run time; the grid is sized by the block table width, so blocks past the end exit
// and one CUDA graph serves a growing context. Partial (max, sum, O) go to a workspace the
// caller allocates; a second kernel combines them (sequences of one split write directly).
// Whichever kernel writes the output applies the layer's output gate there when given one (a
// sigmoid_mul launch fewer per attention layer).
#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "common.cuh"
#include "decode_attention.h"
#include "kv_cache.cuh"
#include "launch.cuh"

namespace ninfer {
namespace {

constexpr int kTile = 32;      // keys per iteration
constexpr int kThreads = 256;  // 8 warps
// Splits of one tile (32 keys) where the occupancy bound allows: a split's blocks are latency-bound,
// so more of them at once win even with a larger reduce (H200, 35B-A3B batch 1 at 4K: decode
// attention 107 -> 83 us a step, replays 2.275 -> 2.260 ms against 2; fewer splits lost, 16 of
// them 343 us; at 16K the occupancy bound, 2 blocks an SM, decides, and 4 an SM lost).
constexpr int kMinTilesPerSplit = 1;
constexpr int kMaxSplits = kDecodeAttentionMaxSplits;
constexpr int kMaxRowsPerBlock = 128;
constexpr int kRowElems = 16384;  // rows x head_dim per block: the fp32 O accumulators (64 a thread)
constexpr int kPad = 8;           // 16-bit elements of row padding: conflict-free ldmatrix
constexpr int kSStride = kTile + 8;
constexpr float kLog2e = 1.4426950408889634f;

int rows_per_block_cap(int head_dim) { return std::min(kMaxRowsPerBlock, kRowElems / head_dim); }

struct Params {
  void* out;
  const void* q;
  const void* gate;  // nullptr: no output gate
  std::int64_t gate_stride_b;
  std::int64_t gate_stride_t;
  std::int64_t gate_stride_h;
  const unsigned char* k_cache;
  const unsigned char* v_cache;
  const float* k_scale;
  const float* v_scale;
  const int* block_table;
  const std::int64_t* cache_lens;
  float* ws_o;
  float* ws_ml;
  int num_new;
  int num_heads;
  int kv_heads;
  int group;           // query heads per kv head
  int rows;            // num_new * group query rows per kv head
  int rows_per_block;  // rows of one block (the last row chunk may have fewer)
  int row_chunks;
  int rows_pad;  // rows_per_block rounded up to 16: the shared-memory layout
  int page_shift;
  int table_width;
  int num_pages;
  int max_splits;
  float scale_log2;  // softmax scale * log2(e): the softmax runs on exp2
};

struct SplitPlan {
  int splits;
  int tiles_per_split;
};

// Keys the sequence attends over, clipped to what its block-table row can address.
__device__ __forceinline__ int kv_length(const Params& p, std::int64_t cache_len) {
  const std::int64_t len = cache_len + p.num_new;
  const std::int64_t cap = static_cast<std::int64_t>(p.table_width) << p.page_shift;
  return static_cast<int>(len < cap ? len : cap);
}

// Same answer in both kernels: at most max_splits splits of >= kMinTilesPerSplit whole tiles.
__device__ __forceinline__ SplitPlan plan_splits(int kv_len, int max_splits) {
  const int tiles = kv_len > 0 ? (kv_len + kTile - 1) / kTile : 1;
  const int by_length = (tiles + kMinTilesPerSplit - 1) / kMinTilesPerSplit;
  const int want = by_length < max_splits ? by_length : max_splits;
  const int per = (tiles + want - 1) / want;
  return {(tiles + per - 1) / per, per};
}

// The gate vector of query token t, head `head` of sequence b; nullptr without an output gate.
template <typename T>
__device__ __forceinline__ const T* gate_row(const Params& p, int b, int t, int head) {
  if (p.gate == nullptr) return nullptr;
  return static_cast<const T*>(p.gate) + b * p.gate_stride_b + t * p.gate_stride_t + head * p.gate_stride_h;
}

// Output element d of a row from its normalized fp32 value o: o rounded to T, then, with a gate,
// times sigmoid(gate[d]) by activation.cu's sigmoid_mul arithmetic (common.cuh sigmoid_times), so
// the gated output is bit-equal to decode_attention followed by sigmoid_mul. Exact in T.
template <typename T>
__device__ __forceinline__ float gated_value(float o, bool gated, float g) {
  const float a = round_to<T>(o);
  return gated ? sigmoid_times<T>(a, g) : a;
}

template <typename T>
__device__ __forceinline__ float output_value(float o, const T* gate, int d) {
  return gated_value<T>(o, gate != nullptr, gate == nullptr ? 0.0f : to_float(gate[d]));
}

template <typename T>
__device__ __forceinline__ std::uint32_t pack2(float a, float b);
template <>
__device__ __forceinline__ std::uint32_t pack2<__half>(float a, float b) {
  const __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<const std::uint32_t*>(&h);
}
template <>
__device__ __forceinline__ std::uint32_t pack2<__nv_bfloat16>(float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const std::uint32_t*>(&h);
}

__device__ __forceinline__ std::uint32_t smem_addr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldmatrix_x2_trans(std::uint32_t (&r)[2], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr(p)));
}

// c += a (16x16, row-major) * b (16x8, column-major), fp32 accumulators.
template <typename T>
__device__ __forceinline__ void mma(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                    std::uint32_t b1) {
  if constexpr (std::is_same_v<T, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two stored 8-bit values (low byte first) as floats.
template <KVDType KV>
__device__ __forceinline__ float2 decode_pair(std::uint32_t bits) {
  if constexpr (KV == KVDType::FP8) {
    const __half2 h(__nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(bits & 0xFFFFu),
                                               __NV_E4M3));
    return __half22float2(h);
  } else {
    return make_float2(static_cast<float>(static_cast<std::int8_t>(bits & 0xFFu)),
                       static_cast<float>(static_cast<std::int8_t>((bits >> 8) & 0xFFu)));
  }
}

// One 16-byte chunk of a cache row into shared memory as T: 8 native values, or 16 quantized
// values dequantized as round_T(float(stored) * scale), bit for bit the reference's dequant.
template <typename T, KVDType KV>
__device__ __forceinline__ void store_chunk(T* dst, const uint4& raw, float scale) {
  if constexpr (KV == KVDType::Native) {
    *reinterpret_cast<uint4*>(dst) = raw;
  } else {
    const std::uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
    std::uint32_t out[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float2 f = decode_pair<KV>(words[i / 2] >> (16 * (i % 2)));
      out[i] = pack2<T>(f.x * scale, f.y * scale);
    }
    reinterpret_cast<uint4*>(dst)[0] = make_uint4(out[0], out[1], out[2], out[3]);
    reinterpret_cast<uint4*>(dst)[1] = make_uint4(out[4], out[5], out[6], out[7]);
  }
}

template <typename T, KVDType KV, int D, int MT>
__global__ void __launch_bounds__(kThreads, MT == 1 ? 2 : 1)
    decode_attention_kernel(const Params p) {
  using C = typename CacheElem<T, KV>::type;
  constexpr int kChunkElems = 16 / sizeof(C);
  constexpr int kChunksPerRow = D / kChunkElems;
  constexpr int kChunksPerTile = kTile * kChunksPerRow;  // of K; V the same
  constexpr int kLoads = 2 * kChunksPerTile / kThreads;
  static_assert(kLoads >= 1 && 2 * kChunksPerTile % kThreads == 0, "tile / thread mismatch");
  constexpr int kStride = D + kPad;
  constexpr int kNW = D / 64;            // 8-column output tiles per warp (8 warps cover D)
  constexpr int kQKTiles = (MT + 1) / 2;  // row tiles per warp in S = Q K^T

  const int split = blockIdx.x;
  const int kvh = blockIdx.y / p.row_chunks;
  const int row0 = (blockIdx.y % p.row_chunks) * p.rows_per_block;
  const int b = blockIdx.z;
  const std::int64_t cache_len = p.cache_lens[b];
  const int kv_len = kv_length(p, cache_len);
  const SplitPlan plan = plan_splits(kv_len, p.max_splits);
  if (split >= plan.splits) return;
  const int key_begin = split * plan.tiles_per_split * kTile;
  const int key_end = min(kv_len, key_begin + plan.tiles_per_split * kTile);
  const int num_tiles = key_end > key_begin ? (key_end - key_begin + kTile - 1) / kTile : 0;
  const int nrows = min(p.rows_per_block, p.rows - row0);
  const int mt_count = (nrows + 15) / 16;

  extern __shared__ __align__(16) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);  // [rows_pad][kStride]
  T* sK = sQ + p.rows_pad * kStride;   // [kTile][kStride]
  T* sV = sK + kTile * kStride;
  float* sS = reinterpret_cast<float*>(sV + kTile * kStride);  // [rows_pad][kSStride] log2 scores
  T* sP = reinterpret_cast<T*>(sS + p.rows_pad * kSStride);    // [rows_pad][kSStride] probabilities
  float* sAlpha = reinterpret_cast<float*>(sP + p.rows_pad * kSStride);  // [rows_pad] rescale
  float* sL = sAlpha + p.rows_pad;                                       // [rows_pad] final sums

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = lane >> 2;   // mma fragment row
  const int tig = lane & 3;  // mma fragment column pair

  // Prefetch registers: thread tid owns 16-byte chunks tid + j * kThreads of [K tile | V tile].
  uint4 pre[kLoads];
  float pre_scale[kLoads];
  const int* table = p.block_table + static_cast<std::int64_t>(b) * p.table_width;
  const int page_mask = (1 << p.page_shift) - 1;
  auto load_tile = [&](int tile) {
    const int key0 = key_begin + tile * kTile;
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      const int c = tid + j * kThreads;
      const bool is_v = c >= kChunksPerTile;
      const int cc = is_v ? c - kChunksPerTile : c;
      const int key = key0 + cc / kChunksPerRow;
      pre[j] = make_uint4(0, 0, 0, 0);
      pre_scale[j] = 0.0f;
      const int page = key < key_end ? table[key >> p.page_shift] : -1;
      if (page >= 0 && page < p.num_pages) {
        const std::int64_t row =
            ((static_cast<std::int64_t>(page) << p.page_shift) + (key & page_mask)) * p.kv_heads + kvh;
        const unsigned char* base = is_v ? p.v_cache : p.k_cache;
        pre[j] = __ldg(reinterpret_cast<const uint4*>(
            base + (row * D + (cc % kChunksPerRow) * kChunkElems) * sizeof(C)));
        if constexpr (KV != KVDType::Native) pre_scale[j] = __ldg((is_v ? p.v_scale : p.k_scale) + row);
      }
    }
  };
  auto store_tile = [&]() {
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      const int c = tid + j * kThreads;
      const bool is_v = c >= kChunksPerTile;
      const int cc = is_v ? c - kChunksPerTile : c;
      T* dst = (is_v ? sV : sK) + (cc / kChunksPerRow) * kStride + (cc % kChunksPerRow) * kChunkElems;
      store_chunk<T, KV>(dst, pre[j], pre_scale[j]);
    }
  };

  // This split's first tile, when it holds no new token's key (those the kernel before writes),
  // loads before the wait: cache_lens and the block table come from the host, older keys from
  // kernels two or more launches back (complete once this kernel runs).
  const bool early_tile = num_tiles > 0 && key_begin + kTile <= cache_len;
  if (early_tile) load_tile(0);
  enter_kernel();

  // Query rows r = t * group + j (head kvh * group + j), zeros past the block's rows.
  const T* q = static_cast<const T*>(p.q);
  for (int i = tid; i < p.rows_pad * (D / 8); i += kThreads) {
    const int r = i / (D / 8);
    const int c = i % (D / 8);
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r < nrows) {
      const int rg = row0 + r;
      const int head = kvh * p.group + rg % p.group;
      const std::int64_t token = static_cast<std::int64_t>(b) * p.num_new + rg / p.group;
      v = *reinterpret_cast<const uint4*>(q + (token * p.num_heads + head) * D + c * 8);
    }
    *reinterpret_cast<uint4*>(sQ + r * kStride + c * 8) = v;
  }

  // Softmax role: tpr consecutive threads per query row (rows rounded up to a power of two).
  int rows_pow2 = 16;
  while (rows_pow2 < mt_count * 16) rows_pow2 <<= 1;
  const int tpr = kThreads / rows_pow2;
  const int srow = tid / tpr;
  const int spart = tid % tpr;
  const bool srow_active = srow < mt_count * 16;
  // The last cache index this row may see (-1: padding row, sees nothing).
  const std::int64_t limit = srow < nrows ? cache_len + (row0 + srow) / p.group : -1;
  float m_run = -INFINITY;
  float l_run = 0.0f;

  float o[MT][kNW][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNW; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][nt][e] = 0.0f;

  if (num_tiles > 0 && !early_tile) load_tile(0);
  for (int tile = 0; tile < num_tiles; ++tile) {
    store_tile();
    __syncthreads();
    if (tile + 1 < num_tiles) load_tile(tile + 1);
    const int key0 = key_begin + tile * kTile;

    {  // S = Q K^T (log2 units): warp -> keys (warp % 4) * 8 .. + 8, row tiles warp / 4 + 2i
      const int nk = warp & 3;
      float acc[kQKTiles][2][4];  // even / odd k-steps: two independent mma chains
#pragma unroll
      for (int i = 0; i < kQKTiles; ++i)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[i][e / 4][e % 4] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < D; kk += 32) {
        std::uint32_t bk[4];  // B fragments of k-steps kk and kk + 16
        ldmatrix_x4(bk, sK + (nk * 8 + (lane & 7)) * kStride + kk + (lane >> 3) * 8);
#pragma unroll
        for (int i = 0; i < kQKTiles; ++i) {
          const int mt = (warp >> 2) + 2 * i;
          if (mt < mt_count) {
            const T* qa = sQ + (mt * 16 + (lane & 15)) * kStride + kk + (lane >> 4) * 8;
            std::uint32_t a[4];
            ldmatrix_x4(a, qa);
            mma<T>(acc[i][0], a, bk[0], bk[1]);
            ldmatrix_x4(a, qa + 16);
            mma<T>(acc[i][1], a, bk[2], bk[3]);
          }
        }
      }
#pragma unroll
      for (int i = 0; i < kQKTiles; ++i) {
        const int mt = (warp >> 2) + 2 * i;
        if (mt < mt_count) {
          float v[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) v[e] = (acc[i][0][e] + acc[i][1][e]) * p.scale_log2;
          float* s = sS + (mt * 16 + g) * kSStride + nk * 8 + tig * 2;
          *reinterpret_cast<float2*>(s) = make_float2(v[0], v[1]);
          *reinterpret_cast<float2*>(s + 8 * kSStride) = make_float2(v[2], v[3]);
        }
      }
    }
    __syncthreads();

    {  // online softmax of the tile; masked keys (causal, past the split) get probability 0
      float mx = -INFINITY;
      for (int n = spart; n < kTile; n += tpr) {
        const int key = key0 + n;
        if (srow_active && key < key_end && key <= limit) mx = fmaxf(mx, sS[srow * kSStride + n]);
      }
      for (int off = tpr >> 1; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float m_new = fmaxf(m_run, mx);
      const float alpha = m_new == -INFINITY ? 1.0f : exp2f(m_run - m_new);
      float sum = 0.0f;
      for (int n = spart; n < kTile; n += tpr) {
        const int key = key0 + n;
        float pr = 0.0f;
        if (srow_active && key < key_end && key <= limit) pr = exp2f(sS[srow * kSStride + n] - m_new);
        sum += pr;
        if (srow_active) sP[srow * kSStride + n] = from_float<T>(pr);
      }
      for (int off = tpr >> 1; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      l_run = l_run * alpha + sum;
      m_run = m_new;
      if (srow_active && spart == 0) sAlpha[srow] = alpha;
    }
    __syncthreads();

    {  // O = alpha * O + P V: warp -> output columns warp * kNW * 8 .. + kNW * 8, every row tile
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if (mt < mt_count) {
          const float lo = sAlpha[mt * 16 + g];
          const float hi = sAlpha[mt * 16 + g + 8];
#pragma unroll
          for (int nt = 0; nt < kNW; ++nt) {
            o[mt][nt][0] *= lo;
            o[mt][nt][1] *= lo;
            o[mt][nt][2] *= hi;
            o[mt][nt][3] *= hi;
          }
        }
      }
      const int d0 = warp * kNW * 8;
#pragma unroll
      for (int ks = 0; ks < kTile; ks += 16) {
        std::uint32_t bv[kNW][2];
        const T* vb = sV + (ks + (lane & 7) + ((lane >> 3) & 1) * 8) * kStride + d0;
        if constexpr (kNW % 2 == 0) {
#pragma unroll
          for (int np = 0; np < kNW / 2; ++np) {
            std::uint32_t r[4];
            ldmatrix_x4_trans(r, vb + np * 16 + (lane >> 4) * 8);
            bv[2 * np][0] = r[0];
            bv[2 * np][1] = r[1];
            bv[2 * np + 1][0] = r[2];
            bv[2 * np + 1][1] = r[3];
          }
        } else {
          std::uint32_t r[2];
          ldmatrix_x2_trans(r, vb);
          bv[0][0] = r[0];
          bv[0][1] = r[1];
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          if (mt < mt_count) {
            std::uint32_t a[4];
            ldmatrix_x4(a, sP + (mt * 16 + (lane & 15)) * kSStride + ks + (lane >> 4) * 8);
#pragma unroll
            for (int nt = 0; nt < kNW; ++nt) mma<T>(o[mt][nt], a, bv[nt][0], bv[nt][1]);
          }
        }
      }
    }
    __syncthreads();
  }

  if (srow_active && spart == 0) {
    sL[srow] = l_run;
    if (plan.splits > 1 && srow < nrows) {
      float* ml = p.ws_ml + ((static_cast<std::int64_t>(b) * p.kv_heads + kvh) * p.max_splits + split) *
                                p.rows * 2 +
                  (row0 + srow) * 2;
      ml[0] = m_run;
      ml[1] = l_run;
    }
  }
  __syncthreads();

  const int d0 = warp * kNW * 8;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = mt * 16 + g + 8 * half;
      if (mt >= mt_count || r >= nrows) continue;
      const int rg = row0 + r;
      if (plan.splits == 1) {
        const float l = sL[r];
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        const int t = rg / p.group;
        const int head = kvh * p.group + rg % p.group;
        const std::int64_t token = static_cast<std::int64_t>(b) * p.num_new + t;
        T* dst = static_cast<T*>(p.out) + (token * p.num_heads + head) * D + d0 + tig * 2;
        const T* gate = gate_row<T>(p, b, t, head);
#pragma unroll
        for (int nt = 0; nt < kNW; ++nt) {
          const int d = d0 + tig * 2 + nt * 8;
          *reinterpret_cast<std::uint32_t*>(dst + nt * 8) =
              pack2<T>(output_value<T>(o[mt][nt][2 * half] * inv, gate, d),
                       output_value<T>(o[mt][nt][2 * half + 1] * inv, gate, d + 1));
        }
      } else {
        float* dst = p.ws_o +
                     (((static_cast<std::int64_t>(b) * p.kv_heads + kvh) * p.max_splits + split) * p.rows + rg) * D +
                     d0 + tig * 2;
#pragma unroll
        for (int nt = 0; nt < kNW; ++nt) {
          *reinterpret_cast<float2*>(dst + nt * 8) = make_float2(o[mt][nt][2 * half], o[mt][nt][2 * half + 1]);
        }
      }
    }
  }
}

constexpr int kReduceThreads = 256;
constexpr int kReduceCols = 64;  // head dims per reduce block: 16 threads x 4, 16 split groups

// Block-wide max / sum (blockDim.x == kReduceThreads); `red` is reusable once they return.
__device__ __forceinline__ float block_max(float v, float* red) {
  v = warp_max(v);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  v = (threadIdx.x & 31) < kReduceThreads / 32 ? red[threadIdx.x & 31] : -INFINITY;
  v = warp_max(v);
  __syncthreads();
  return v;
}

__device__ __forceinline__ float block_sum(float v, float* red) {
  v = warp_sum(v);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  v = (threadIdx.x & 31) < kReduceThreads / 32 ? red[threadIdx.x & 31] : 0.0f;
  v = warp_sum(v);
  __syncthreads();
  return v;
}

// out[row] = sum_s 2^(m_s - M) O_s / sum_s 2^(m_s - M) l_s over the sequence's splits.
// Grid (D / 64, rows x kv_heads, B). Every load issues before the first barrier: a thread's
// (m, l), its first kHeld O vectors and (before the wait: the qkv projection that wrote it is
// launches back) its gate values; the O loop used to wait out an L2 round trip per split group
// it held, after the (m, l) pass's own.
constexpr int kHeld = 8;  // O vectors a thread holds: 16 kHeld = 128 splits in one round of loads

// 4 blocks an SM (64 registers): batch 8 at 512 is 512 blocks, one wave (3 an SM, at the 71
// registers the held vectors take unbounded, made 1.3 waves: H200, +0.4% a batch-8 step).
template <typename T>
__global__ void __launch_bounds__(kReduceThreads, 4)
    decode_attention_reduce_kernel(const Params p, int head_dim) {
  const int rg = blockIdx.y % p.rows;
  const int kvh = blockIdx.y / p.rows;
  const int b = blockIdx.z;
  const int tid = threadIdx.x;
  const int col = tid & 15;
  const int grp = tid >> 4;
  const int d = blockIdx.x * kReduceCols + col * 4;
  const int t = rg / p.group;
  const int head = kvh * p.group + rg % p.group;
  const T* gate = gate_row<T>(p, b, t, head);
  float g[4] = {};
  if (gate != nullptr && grp == 0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) g[i] = to_float(gate[d + i]);
  }
  const SplitPlan plan = plan_splits(kv_length(p, p.cache_lens[b]), p.max_splits);
  enter_kernel();
  if (plan.splits == 1) return;

  extern __shared__ float weights[];  // [max_splits]
  __shared__ float red[32];
  __shared__ float4 part[kReduceThreads / 16][16];
  const std::int64_t first = (static_cast<std::int64_t>(b) * p.kv_heads + kvh) * p.max_splits;
  const float* ml = p.ws_ml + rg * 2;
  const auto o_at = [&](int s) {
    return *reinterpret_cast<const float4*>(p.ws_o + ((first + s) * p.rows + rg) * head_dim + d);
  };
  float4 held[kHeld];
#pragma unroll
  for (int i = 0; i < kHeld; ++i) {
    if (grp + 16 * i < plan.splits) held[i] = o_at(grp + 16 * i);
  }
  float m_own = -INFINITY, l_own = 0.0f;  // split tid's
  if (tid < plan.splits) {
    m_own = ml[(first + tid) * p.rows * 2];
    l_own = ml[(first + tid) * p.rows * 2 + 1];
  }
  float mx = m_own;
  for (int s = tid + kReduceThreads; s < plan.splits; s += kReduceThreads) mx = fmaxf(mx, ml[(first + s) * p.rows * 2]);
  mx = block_max(mx, red);
  const auto weigh = [&](int s, float m, float l, float& sum) {
    const float w = m == -INFINITY ? 0.0f : exp2f(m - mx);
    weights[s] = w;
    sum += w * l;
  };
  float total = 0.0f;
  if (tid < plan.splits) weigh(tid, m_own, l_own, total);
  for (int s = tid + kReduceThreads; s < plan.splits; s += kReduceThreads) {
    const float* e = ml + (first + s) * p.rows * 2;
    weigh(s, e[0], e[1], total);
  }
  total = block_sum(total, red);  // its barriers also publish `weights`
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;

  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  const auto add = [&](int s, const float4& v) {
    const float w = weights[s];
    acc.x += w * v.x;
    acc.y += w * v.y;
    acc.z += w * v.z;
    acc.w += w * v.w;
  };
#pragma unroll
  for (int i = 0; i < kHeld; ++i) {
    if (grp + 16 * i < plan.splits) add(grp + 16 * i, held[i]);
  }
  for (int s = grp + 16 * kHeld; s < plan.splits; s += kReduceThreads / 16) add(s, o_at(s));
  part[grp][col] = acc;
  __syncthreads();
  if (grp != 0) return;
#pragma unroll
  for (int i = 1; i < kReduceThreads / 16; ++i) {
    acc.x += part[i][col].x;
    acc.y += part[i][col].y;
    acc.z += part[i][col].z;
    acc.w += part[i][col].w;
  }
  const std::int64_t token = static_cast<std::int64_t>(b) * p.num_new + t;
  T* dst = static_cast<T*>(p.out) + (token * p.num_heads + head) * head_dim + d;
  const bool gated = gate != nullptr;
  *reinterpret_cast<uint2*>(dst) =
      make_uint2(pack2<T>(gated_value<T>(acc.x * inv, gated, g[0]), gated_value<T>(acc.y * inv, gated, g[1])),
                 pack2<T>(gated_value<T>(acc.z * inv, gated, g[2]), gated_value<T>(acc.w * inv, gated, g[3])));
}

template <typename T, KVDType KV, int D, int MT>
void launch_attention(const Params& p, int batch, cudaStream_t stream) {
  const std::size_t bytes = (static_cast<std::size_t>(p.rows_pad) + 2 * kTile) * (D + kPad) * sizeof(T) +
                            static_cast<std::size_t>(p.rows_pad) * kSStride * (sizeof(float) + sizeof(T)) +
                            2 * static_cast<std::size_t>(p.rows_pad) * sizeof(float);
  auto* kernel = decode_attention_kernel<T, KV, D, MT>;
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)),
             "decode_attention: shared memory size");
  const dim3 grid(p.max_splits, p.kv_heads * p.row_chunks, batch);
  launch_kernel("decode_attention kernel launch", kernel, grid, kThreads, bytes, stream, p);
  if (p.max_splits > 1) {
    const dim3 reduce_grid(D / kReduceCols, p.rows * p.kv_heads, batch);
    launch_kernel("decode_attention reduce kernel launch", decode_attention_reduce_kernel<T>, reduce_grid,
                  kReduceThreads, p.max_splits * sizeof(float), stream, p, D);
  }
}

template <typename T, KVDType KV, int D>
void launch_rows(const Params& p, int batch, cudaStream_t stream) {
  constexpr int kWide = std::min(kMaxRowsPerBlock, kRowElems / D) / 16;
  if (p.rows_pad == 16) {
    launch_attention<T, KV, D, 1>(p, batch, stream);
  } else {
    launch_attention<T, KV, D, kWide>(p, batch, stream);
  }
}

template <typename T>
void launch_kv(const Params& p, KVDType kv, int head_dim, int batch, cudaStream_t stream) {
  by_kv_dtype(kv, "decode_attention", [&](auto cache) {
    by_head_dim(head_dim, "decode_attention", [&](auto dim) {
      launch_rows<T, decltype(cache)::value, decltype(dim)::value>(p, batch, stream);
    });
  });
}

// ---------------------------------------------------------------------------------- KV write

struct WriteParams {
  unsigned char* k_cache;
  unsigned char* v_cache;
  float* k_scale;
  float* v_scale;
  const void* k;
  const void* v;
  const std::int64_t* slot_mapping;
  std::int64_t pairs;  // tokens x kv_heads
  std::int64_t num_slots;
  int kv_heads;
};

constexpr int kWriteWarps = 4;

// One warp per (token, kv head): k then v stored by store_kv_vector (kv_cache.cuh).
template <typename T, KVDType KV, int D>
__global__ void __launch_bounds__(32 * kWriteWarps) write_kv_kernel(const WriteParams w) {
  enter_kernel();
  constexpr int kEpl = D / 32;  // elements per lane
  const std::int64_t pair = static_cast<std::int64_t>(blockIdx.x) * kWriteWarps + threadIdx.y;
  if (pair >= w.pairs) return;
  const std::int64_t slot = w.slot_mapping[pair / w.kv_heads];
  if (slot < 0 || slot >= w.num_slots) return;
  const std::int64_t dst_row = slot * w.kv_heads + pair % w.kv_heads;
  const int lane = threadIdx.x;
#pragma unroll
  for (int which = 0; which < 2; ++which) {
    const T* src = static_cast<const T*>(which ? w.v : w.k) + pair * D + lane * kEpl;
    const Vec<T, kEpl> x = *reinterpret_cast<const Vec<T, kEpl>*>(src);  // one aligned load
    store_kv_vector<T, KV, kEpl>(x, which ? w.v_cache : w.k_cache, which ? w.v_scale : w.k_scale, dst_row, lane);
  }
}

template <typename T>
void launch_write_kv(const WriteParams& w, KVDType kv, int head_dim, cudaStream_t stream) {
  const dim3 block(32, kWriteWarps);
  const dim3 grid(static_cast<unsigned>((w.pairs + kWriteWarps - 1) / kWriteWarps));
  by_kv_dtype(kv, "write_kv", [&](auto cache) {
    by_head_dim(head_dim, "write_kv", [&](auto dim) {
      launch_kernel("write_kv kernel launch", write_kv_kernel<T, decltype(cache)::value, decltype(dim)::value>, grid,
                    block, 0, stream, w);
    });
  });
}

int log2_int(int v) {
  int s = 0;
  while ((1 << s) < v) ++s;
  return s;
}

}  // namespace

// write_kv and decode_attention trust their arguments: the binding (bind_attention.cpp) checks them
// against decode_attention.h. Left here: the grids' limits, which follow from the kernels' block shapes.
void write_kv(const WriteKVArgs& a) {
  if (a.tokens * a.kv_heads >= (1LL << 31) * kWriteWarps) {
    throw std::invalid_argument("write_kv: too many (token, kv head) pairs for the grid");
  }
  if (a.tokens == 0) return;
  const WriteParams w{reinterpret_cast<unsigned char*>(a.k_cache), reinterpret_cast<unsigned char*>(a.v_cache),
                      reinterpret_cast<float*>(a.k_scale),         reinterpret_cast<float*>(a.v_scale),
                      reinterpret_cast<const void*>(a.k),          reinterpret_cast<const void*>(a.v),
                      reinterpret_cast<const std::int64_t*>(a.slot_mapping),
                      a.tokens * a.kv_heads,
                      a.num_slots,
                      a.kv_heads};
  DeviceGuard guard(a.device);
  switch (a.dtype) {
    case DType::F16: launch_write_kv<__half>(w, a.kv_dtype, a.head_dim, as_stream(a.stream)); break;
    case DType::BF16: launch_write_kv<__nv_bfloat16>(w, a.kv_dtype, a.head_dim, as_stream(a.stream)); break;
    default: throw std::invalid_argument("write_kv: dtype must be float16 or bfloat16");
  }
}

int decode_attention_max_splits(int batch, int num_new, int num_heads, int kv_heads, int head_dim,
                                int page_size, int table_width, int num_sms) {
  if (kv_heads <= 0 || num_heads % kv_heads != 0 || num_new < 1 || head_dim <= 0 || page_size <= 0 ||
      table_width <= 0) {
    throw std::invalid_argument("decode_attention_max_splits: bad shape");
  }
  const int cap = rows_per_block_cap(head_dim);
  const std::int64_t rows = static_cast<std::int64_t>(num_new) * (num_heads / kv_heads);
  const std::int64_t blocks = std::max(1, batch) * static_cast<std::int64_t>(kv_heads) * ((rows + cap - 1) / cap);
  const std::int64_t tiles = (static_cast<std::int64_t>(table_width) * page_size + kTile - 1) / kTile;
  const std::int64_t by_length = (tiles + kMinTilesPerSplit - 1) / kMinTilesPerSplit;
  const std::int64_t by_occupancy = (2LL * std::max(1, num_sms) + blocks - 1) / blocks;
  return static_cast<int>(std::clamp<std::int64_t>(std::min(by_length, by_occupancy), 1, kMaxSplits));
}

void decode_attention(const DecodeAttentionArgs& a) {
  if (a.batch == 0) return;

  Params p{};
  p.out = reinterpret_cast<void*>(a.out);
  p.q = reinterpret_cast<const void*>(a.q);
  p.gate = reinterpret_cast<const void*>(a.gate);
  p.gate_stride_b = a.gate_stride_b;
  p.gate_stride_t = a.gate_stride_t;
  p.gate_stride_h = a.gate_stride_h;
  p.k_cache = reinterpret_cast<const unsigned char*>(a.k_cache);
  p.v_cache = reinterpret_cast<const unsigned char*>(a.v_cache);
  p.k_scale = reinterpret_cast<const float*>(a.k_scale);
  p.v_scale = reinterpret_cast<const float*>(a.v_scale);
  p.block_table = reinterpret_cast<const int*>(a.block_table);
  p.cache_lens = reinterpret_cast<const std::int64_t*>(a.cache_lens);
  p.ws_o = reinterpret_cast<float*>(a.workspace_o);
  p.ws_ml = reinterpret_cast<float*>(a.workspace_ml);
  p.num_new = a.num_new;
  p.num_heads = a.num_heads;
  p.kv_heads = a.kv_heads;
  p.group = a.num_heads / a.kv_heads;
  p.rows = a.num_new * p.group;
  p.rows_per_block = std::min(p.rows, rows_per_block_cap(a.head_dim));
  p.row_chunks = (p.rows + p.rows_per_block - 1) / p.rows_per_block;
  p.rows_pad = (p.rows_per_block + 15) / 16 * 16;
  p.page_shift = log2_int(a.page_size);
  p.table_width = a.table_width;
  p.num_pages = a.num_pages;
  p.max_splits = a.max_splits;
  p.scale_log2 = a.scale * kLog2e;
  if (static_cast<std::int64_t>(p.kv_heads) * p.row_chunks > 65535 ||
      static_cast<std::int64_t>(p.rows) * p.kv_heads > 65535) {
    throw std::invalid_argument("decode_attention: too many heads for the grid");
  }

  DeviceGuard guard(a.device);
  const cudaStream_t stream = as_stream(a.stream);
  switch (a.dtype) {
    case DType::F16: launch_kv<__half>(p, a.kv_dtype, a.head_dim, a.batch, stream); break;
    case DType::BF16: launch_kv<__nv_bfloat16>(p, a.kv_dtype, a.head_dim, a.batch, stream); break;
    default: throw std::invalid_argument("decode_attention: dtype must be float16 or bfloat16");
  }
}

}  // namespace ninfer

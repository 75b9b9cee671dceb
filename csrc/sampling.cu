// Sampler: temperature, top-k, top-p, min-p and one inverse-CDF draw per row, without sorting the
// vocabulary (contract in sampling.h). Two launches: segment_kernel spreads the row's one full pass
// over many blocks, then one block per row finishes it.
//
// Every filter is monotone in the logit, so a row keeps {logit >= L} (min-p tested per token on
// the same weights) and the work is finding L, the kept mass and then the token:
// 1. segment_kernel: the max (and argmax) of each of the row's <= 1024 segments of contiguous
//    tokens, a warp a segment, blocks over the whole GPU (and the probs row zeroed, when asked);
//    a single block read the row at the bandwidth of one SM: ~0.11 ms a 248k-token row, flat
//    from batch 1 to 64 (bench_sampling.py, fortieth session);
// 2. a lower bound tau <= L: the k-th largest of the segment maxima (top-k, k <= segments: k
//    tokens are >= it), else one pass of a histogram of x = (logit - max) / T over (-32, 0] in
//    bins of 1/8 (counts for top-k, mass for top-p) whose top bins holding k tokens / top_p of
//    the mass bound L;
// 3. the candidates {logit >= tau} from the segments whose max is >= tau (with top-k 20 about 20
//    of ~970: the row is not read again); when they fit (the usual case: top-k 20, or top-p on a
//    peaked row) the rest is bitonic sorts and scans of at most 4096 candidates, and the probs
//    are written over those segments only (the rest is segment_kernel's zeros);
// 4. otherwise the full-vocabulary path: radix select on the logit's order key (11 + 11 + 10
//    bits, 2048-bin shared histograms of counts for top-k, of mass for top-p; tokens below tau
//    skip the atomics; it stops once the selected bin holds the answer alone), one pass for the
//    kept mass, and a tiled block scan in id order that stops at the drawn token.
// Order and ties come from the logit's bits, as in the float64 reference (equal logits tie,
// distinct ones never do). A token's mass is exp(x) in fp32 rounded to 64-bit fixed point (the
// max token = 2^(62 - ceil(log2 vocab))), so every sum is exact and independent of thread
// order: the kept set matches the float64 reference except where top_p * mass or min_p lies
// within fp32 rounding (~1e-7 relative) of a boundary, and tokens below ~2^-45 of the max token
// (together < 1e-8 of a 248k row) carry no mass, so they are never drawn.
#include "sampling.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <utility>

#include "common.cuh"
#include "launch.cuh"

namespace ninfer {
namespace {

using u64 = unsigned long long;  // the type CUDA's 64-bit atomics and shuffles take

constexpr int kThreads = 1024;
static_assert(kSampleMaxSegments == kThreads, "the sampling kernel's thread t holds segment t's max");
constexpr int kWarps = kThreads / 32;
constexpr int kCapacity = kSampleMaxCandidates;
constexpr int kSlots = kCapacity / kThreads;  // candidate slots per thread
constexpr int kBins = 2048;                   // radix digit of 11 bits
constexpr int kGridBins = 256;
constexpr float kGridPerUnit = 8.0f;  // grid bins per unit of x: they cover x in (-32, 0]
constexpr unsigned kFull = 0xffffffffu;
constexpr unsigned kNone = 0xffffffffu;
constexpr unsigned kBadKey = 0xffffffffu;  // above order_key of every non-NaN float, +inf's too

struct Shared {
  u64 buf[kCapacity];  // segment maxima, candidates, or histograms (one use at a time)
  u64 scratch[kWarps];
  int picked[kThreads];  // the segments whose max is >= tau
  int picked_count;
  u64 sel_above;
  unsigned sel_bin;
  unsigned sel_count;
  int count;
};

struct Params {
  std::int64_t* tokens;
  float* probs;
  float* threshold;
  const float* logits;
  const double* columns;  // [4, rows]: temperature, top_k, top_p, min_p
  std::int64_t rows;
  const double* uniform;
  const u64* segments;  // [rows, kThreads] segment_kernel's maxima
  int vocab;
  int segment;   // tokens a segment: a multiple of 4 * 32 (a warp's 16-byte loads)
  int segments_count;  // a row's: <= kThreads
  int capacity;
  float scale;  // fixed-point mass of weight 1
};

// Unsigned key with the float order; -0 is +0, so the two tie as in the reference.
__device__ __forceinline__ unsigned order_key(float v) {
  const unsigned b = v == 0.0f ? 0u : __float_as_uint(v);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float key_value(unsigned key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// key above, id below inverted: the larger pack is the larger key, then the lower id.
__device__ __forceinline__ u64 pack(unsigned key, unsigned id) {
  return static_cast<u64>(key) << 32 | (kFull - id);
}

struct Row {
  const float* __restrict__ x;
  int vocab;
  float max;
  float temperature;
  float scale;
  __device__ __forceinline__ float z(float v) const { return (v - max) / temperature; }
  __device__ __forceinline__ float weight(float v) const { return expf(z(v)); }
  __device__ __forceinline__ u64 quantize(float w) const { return __float2ull_rn(w * scale); }
};

struct Sum {
  __device__ u64 operator()(u64 a, u64 b) const { return a + b; }
};
struct Min {
  __device__ u64 operator()(u64 a, u64 b) const { return a < b ? a : b; }
};
struct Max {
  __device__ u64 operator()(u64 a, u64 b) const { return a > b ? a : b; }
};

// Every thread gets the result. Starts with a barrier, so scratch may be reused back to back.
template <typename Op>
__device__ u64 block_reduce(u64 v, Op op, u64* scratch) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(kFull, v, offset));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  v = scratch[0];
  for (int w = 1; w < kWarps; ++w) v = op(v, scratch[w]);
  return v;
}

// Sum of v over the threads before this one (thread order); *total gets the block's sum.
__device__ u64 block_exclusive_scan(u64 v, u64* scratch, u64* total) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  u64 inclusive = v;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const u64 n = __shfl_up_sync(kFull, inclusive, offset);
    if (lane >= offset) inclusive += n;
  }
  __syncthreads();
  if (lane == 31) scratch[warp] = inclusive;
  __syncthreads();
  u64 before = 0;
  u64 all = 0;
  for (int w = 0; w < kWarps; ++w) {
    const u64 part = scratch[w];
    before += w < warp ? part : 0;
    all += part;
  }
  *total = all;
  return before + inclusive - v;
}

// Descending bitonic sort of a[0, n), n a power of two <= kCapacity.
__device__ void sort_desc(u64* a, int n) {
  for (int size = 2; size <= n; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      __syncthreads();
      for (int t = threadIdx.x; t < n / 2; t += kThreads) {
        const int i = 2 * t - (t & (stride - 1));
        const int j = i + stride;
        const u64 ai = a[i];
        const u64 aj = a[j];
        if ((ai < aj) == ((i & size) == 0)) {
          a[i] = aj;
          a[j] = ai;
        }
      }
    }
  }
  __syncthreads();
}

template <int VEC, typename F>
__device__ __forceinline__ void for_each(const float* __restrict__ x, int vocab, F&& f) {
  if constexpr (VEC == 4) {
    const float4* x4 = reinterpret_cast<const float4*>(x);
    for (int i = threadIdx.x; i < vocab / 4; i += kThreads) {
      const float4 v = __ldg(x4 + i);
      f(4 * i, v.x);
      f(4 * i + 1, v.y);
      f(4 * i + 2, v.z);
      f(4 * i + 3, v.w);
    }
  } else {
    for (int i = threadIdx.x; i < vocab; i += kThreads) f(i, __ldg(x + i));
  }
}

template <int VEC, typename F>
__device__ void write_row(float* out, const float* __restrict__ x, int vocab, F&& prob) {
  if constexpr (VEC == 4) {
    const float4* x4 = reinterpret_cast<const float4*>(x);
    for (int i = threadIdx.x; i < vocab / 4; i += kThreads) {
      const float4 v = __ldg(x4 + i);
      reinterpret_cast<float4*>(out)[i] = make_float4(prob(4 * i, v.x), prob(4 * i + 1, v.y),
                                                      prob(4 * i + 2, v.z), prob(4 * i + 3, v.w));
    }
  } else {
    for (int i = threadIdx.x; i < vocab; i += kThreads) out[i] = prob(i, __ldg(x + i));
  }
}

// Lane `lane`'s tokens of segment `seg` ([seg * len, (seg + 1) * len) clipped to the row), kBatch
// 16-byte loads in flight before f sees them; f(i, v) in no particular order.
template <int VEC, int kBatch, typename F>
__device__ __forceinline__ void for_segment(const float* x, int vocab, int seg, int len, int lane, F&& f) {
  const int begin = seg * len, end = min(begin + len, vocab);
  for (int i0 = begin + VEC * lane; i0 < end; i0 += kBatch * 32 * VEC) {
    float v[kBatch][VEC];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int i = i0 + b * 32 * VEC;
      if (i >= end) continue;
      if constexpr (VEC == 4) {
        const float4 f4 = __ldcg(reinterpret_cast<const float4*>(x + i));
        v[b][0] = f4.x, v[b][1] = f4.y, v[b][2] = f4.z, v[b][3] = f4.w;
      } else {
        v[b][0] = __ldcg(x + i);
      }
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int i = i0 + b * 32 * VEC;
      if (i >= end) break;
#pragma unroll
      for (int j = 0; j < VEC; ++j) f(i + j, v[b][j]);
    }
  }
}

constexpr int kSegmentWarps = 8;  // segments a segment_kernel block: grid (rows, segments / 8)

// Block (row, y), warp w: segment 8 y + w of the row, its max as pack(key, id) (the largest key at
// its lowest id; NaN and +inf the bad key above all) into segments[row, seg]; the segment's probs
// zeroed where asked (the sampling
// kernel then writes only the kept tokens' ones, or the whole row on its full-vocabulary path).
template <int VEC>
__global__ void __launch_bounds__(kSegmentWarps * 32)
    segment_kernel(const float* logits, u64* __restrict__ segments, float* __restrict__ probs, int vocab, int len,
                   int count) {
  enter_kernel();  // the logits are the kernel before's output; probs may be what it reads
  const int lane = threadIdx.x & 31;
  const int seg = blockIdx.y * kSegmentWarps + (threadIdx.x >> 5);
  if (seg >= count) return;
  const std::int64_t offset = static_cast<std::int64_t>(blockIdx.x) * vocab;
  u64 best = 0;
  for_segment<VEC, 2>(logits + offset, vocab, seg, len, lane, [&](int i, float v) {
    const u64 e = pack(isnan(v) || v == INFINITY ? kBadKey : order_key(v), static_cast<unsigned>(i));
    best = best > e ? best : e;
  });
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const u64 other = __shfl_xor_sync(kFull, best, o);
    best = best > other ? best : other;
  }
  if (lane == 0) segments[static_cast<std::int64_t>(blockIdx.x) * kThreads + seg] = best;
  if (probs != nullptr) {
    float* out = probs + offset;
    const int begin = seg * len, end = min(begin + len, vocab);
    if constexpr (VEC == 4) {
      for (int i = begin + 4 * lane; i < end; i += 4 * 32)
        *reinterpret_cast<float4*>(out + i) = make_float4(0, 0, 0, 0);
    } else {
      for (int i = begin + lane; i < end; i += 32) out[i] = 0.0f;
    }
  }
}

// u in [0, 1) -> the mass position the draw looks for: the first kept token whose running mass
// exceeds it. Clamped below the total, so a zero-mass token is never chosen.
__device__ __forceinline__ u64 draw_target(double u, u64 total) {
  const u64 t = static_cast<u64>(fmin(fmax(u, 0.0), 1.0) * static_cast<double>(total));
  return t < total ? t : total - 1;
}

// Lower bound on a row's threshold from one pass: a histogram of x over (-32, 0] in bins of 1/8,
// of counts for top-k, of mass for top-p (the tail below only adds to the row mass). Every token
// in the top bins that hold >= k tokens (>= top_p of the row mass) is >= the returned key, and a
// token below it has them all strictly above it, so it is not kept. 0 = no bound.
template <int VEC>
__device__ unsigned grid_bound(const Row& r, int k, float top_p, Shared& s, u64* row_mass) {
  u64* bins = s.buf;
  for (int b = threadIdx.x; b < kGridBins; b += kThreads) bins[b] = 0;
  __syncthreads();
  u64 total = 0;
  for_each<VEC>(r.x, r.vocab, [&](int, float v) {
    const float z = r.z(v);
    u64 add = 1;
    if (k == 0) {
      add = r.quantize(expf(z));
      total += add;
    }
    if (z > -kGridBins / kGridPerUnit) {
      atomicAdd(bins + min(kGridBins - 1, static_cast<int>(-z * kGridPerUnit)), add);
    }
  });
  *row_mass = block_reduce(total, Sum{}, s.scratch);
  const int t = threadIdx.x;
  const u64 v = t < kGridBins ? bins[t] : 0;
  u64 all;
  const u64 upto = block_exclusive_scan(v, s.scratch, &all) + v;
  const bool reached =
      t < kGridBins && (k > 0 ? upto >= static_cast<u64>(k)
                              : static_cast<double>(upto) >=
                                    static_cast<double>(top_p) * static_cast<double>(*row_mass));
  const u64 first = block_reduce(reached ? static_cast<u64>(t) : ~0ull, Min{}, s.scratch);
  if (first == ~0ull) return 0;
  // Bins 0..first hold z > edge; z is monotone in the logit, so a logit whose z is <= edge is
  // below all of them.
  const float edge = -static_cast<float>(first + 1) / kGridPerUnit;
  float low = r.max + r.temperature * edge;
  while (r.z(low) > edge) low = nextafterf(low, -INFINITY);
  return order_key(low);
}

// Radix select over the whole row on the order key, counting only keys >= floor (a lower bound
// on the answer: the tokens below it need no atomics).
//   kMass = false: the k-th largest key (rank = k).
//   kMass = true:  the top-p threshold among the keys >= k_floor (the top-k survivors): the
//                  smallest key whose strictly-greater mass is < top_p * their total mass.
// Returns t with kept = {key >= t}.
template <int VEC, bool kMass>
__device__ unsigned radix_select(const Row& r, Shared& s, unsigned floor, unsigned k_floor,
                                 int rank, float top_p) {
  u64* mass = s.buf;
  unsigned* count = reinterpret_cast<unsigned*>(s.buf + kBins);
  unsigned prefix = 0;
  unsigned mask = 0;
  u64 above = 0;  // kMass: mass of the keys above the prefix's range
  double target = 0.0;
  for (int pass = 0; pass < 3; ++pass) {
    const int shift = pass == 0 ? 21 : pass == 1 ? 10 : 0;
    const unsigned bins = pass == 2 ? kBins / 2 : kBins;
    for (int b = threadIdx.x; b < kBins; b += kThreads) {
      count[b] = 0;
      if constexpr (kMass) mass[b] = 0;
    }
    __syncthreads();
    if (threadIdx.x == 0) s.sel_bin = kNone;
    u64 total = 0;
    for_each<VEC>(r.x, r.vocab, [&](int, float v) {
      const unsigned key = order_key(v);
      const bool counted = key >= floor && (key & mask) == prefix;
      const unsigned bin = (key >> shift) & (bins - 1);
      if constexpr (kMass) {
        const bool summed = pass == 0 && key >= k_floor;
        if (counted || summed) {
          const u64 q = r.quantize(r.weight(v));
          if (summed) total += q;
          if (counted) {
            atomicAdd(count + bin, 1u);
            atomicAdd(mass + bin, q);
          }
        }
      } else if (counted) {
        atomicAdd(count + bin, 1u);
      }
    });
    if (kMass && pass == 0) {
      target = static_cast<double>(top_p) *
               static_cast<double>(block_reduce(total, Sum{}, s.scratch));
    } else {
      __syncthreads();
    }
    // Thread t owns bins hi = bins-1-2t and hi-1: thread order is descending key order.
    const int hi = static_cast<int>(bins) - 1 - 2 * static_cast<int>(threadIdx.x);
    const bool owns = hi > 0;
    const unsigned c_hi = owns ? count[hi] : 0u;
    const unsigned c_lo = owns ? count[hi - 1] : 0u;
    u64 v_hi = c_hi;
    u64 v_lo = c_lo;
    if constexpr (kMass) {
      v_hi = owns ? mass[hi] : 0;
      v_lo = owns ? mass[hi - 1] : 0;
    }
    u64 all;
    const u64 before = block_exclusive_scan(v_hi + v_lo, s.scratch, &all);
    if constexpr (kMass) {  // the lowest non-empty bin whose greater mass is still < target
      const u64 a_hi = above + before;
      const u64 a_lo = a_hi + v_hi;
      if (c_lo > 0 && static_cast<double>(a_lo) < target) {
        atomicMin(&s.sel_bin, static_cast<unsigned>(hi - 1));
      } else if (c_hi > 0 && static_cast<double>(a_hi) < target) {
        atomicMin(&s.sel_bin, static_cast<unsigned>(hi));
      }
      __syncthreads();
      const int b = static_cast<int>(s.sel_bin);
      if (owns && (b == hi || b == hi - 1)) {
        s.sel_above = b == hi ? a_hi : a_lo;
        s.sel_count = b == hi ? c_hi : c_lo;
      }
    } else {  // the bin holding the rank-th largest
      const u64 want = static_cast<u64>(rank);
      if (owns && before < want && want <= before + c_hi) {
        s.sel_bin = hi;
        s.sel_above = before;
        s.sel_count = c_hi;
      } else if (owns && before + c_hi < want && want <= before + c_hi + c_lo) {
        s.sel_bin = hi - 1;
        s.sel_above = before + c_hi;
        s.sel_count = c_lo;
      }
    }
    __syncthreads();
    prefix |= s.sel_bin << shift;
    mask |= (bins - 1) << shift;
    const unsigned n = s.sel_count;
    bool done;
    if constexpr (kMass) {
      above = s.sel_above;
      done = n == 1;
    } else {
      rank -= static_cast<int>(s.sel_above);
      done = n == static_cast<unsigned>(rank);
    }
    if (done) return max(prefix, floor);  // the whole bin (>= floor) is kept
  }
  return prefix;
}

struct Kept {
  unsigned threshold;  // kept = key >= threshold && weight >= min_p
  u64 mass;
  unsigned lowest;  // smallest kept key
};

// Kept mass and smallest kept key over the whole row.
template <int VEC>
__device__ Kept kept_mass(const Row& r, Shared& s, unsigned threshold, float min_p) {
  u64 mass = 0;
  u64 lowest = kNone;
  for_each<VEC>(r.x, r.vocab, [&](int, float v) {
    const unsigned key = order_key(v);
    if (key < threshold) return;
    const float w = r.weight(v);
    if (w >= min_p) {
      mass += r.quantize(w);
      lowest = lowest < key ? lowest : key;
    }
  });
  const u64 total = block_reduce(mass, Sum{}, s.scratch);
  return {threshold, total, static_cast<unsigned>(block_reduce(lowest, Min{}, s.scratch))};
}

// Inverse CDF over the kept tokens in id order, one tile of kThreads * VEC tokens at a time.
template <int VEC>
__device__ void scan_draw(const Row& r, Shared& s, const Kept& kept, float min_p, double u,
                          std::int64_t* token) {
  const u64 target = draw_target(u, kept.mass);
  u64 run = 0;
  for (int tile = 0; tile < r.vocab; tile += kThreads * VEC) {
    const int first = tile + static_cast<int>(threadIdx.x) * VEC;
    float v[VEC] = {};
    if (first < r.vocab) {
      if constexpr (VEC == 4) {
        const float4 f = __ldg(reinterpret_cast<const float4*>(r.x + first));
        v[0] = f.x;
        v[1] = f.y;
        v[2] = f.z;
        v[3] = f.w;
      } else {
        v[0] = __ldg(r.x + first);
      }
    }
    u64 q[VEC];
    u64 local = 0;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      q[j] = 0;
      if (first < r.vocab && order_key(v[j]) >= kept.threshold) {
        const float w = r.weight(v[j]);
        if (w >= min_p) q[j] = r.quantize(w);
      }
      local += q[j];
    }
    u64 tile_mass;
    u64 at = run + block_exclusive_scan(local, s.scratch, &tile_mass);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      if (q[j] > 0 && at <= target && target < at + q[j]) *token = first + j;
      at += q[j];
    }
    run += tile_mass;
    if (run > target) return;
  }
}

// The candidates s.buf[0, n) (pack(key, id) of every token >= a lower bound of the threshold)
// hold every kept token and every token more likely than one: sort them by key, apply the
// filters, and when `token` is set re-sort the kept ones by id and draw.
__device__ Kept candidate_path(const Row& r, Shared& s, int n, int k, float top_p, float min_p,
                               u64 row_mass, double u, std::int64_t* token) {
  int width = 1;
  while (width < n) width <<= 1;
  for (int i = n + threadIdx.x; i < width; i += kThreads) s.buf[i] = 0;
  sort_desc(s.buf, width);
  const unsigned top_k_key = k > 0 ? static_cast<unsigned>(s.buf[k - 1] >> 32) : 0u;
  const int base = static_cast<int>(threadIdx.x) * kSlots;
  unsigned key[kSlots];
  unsigned id[kSlots];
  u64 q[kSlots];
  u64 local = 0;
#pragma unroll
  for (int j = 0; j < kSlots; ++j) {
    const int i = base + j;
    const u64 e = i < n ? s.buf[i] : 0;
    key[j] = static_cast<unsigned>(e >> 32);
    id[j] = kFull - static_cast<unsigned>(e);
    q[j] = i < n && key[j] >= top_k_key ? r.quantize(r.weight(key_value(key[j]))) : 0;
    local += q[j];
  }
  unsigned threshold = top_k_key;
  if (top_p < 1.0f) {  // a tie group's first slot carries the mass strictly above the group
    u64 survivors;
    u64 run = block_exclusive_scan(local, s.scratch, &survivors);
    const double target =
        static_cast<double>(top_p) * static_cast<double>(k > 0 ? survivors : row_mass);
    u64 pick = kNone;
#pragma unroll
    for (int j = 0; j < kSlots; ++j) {
      const int i = base + j;
      const bool starts = i == 0 || static_cast<unsigned>(s.buf[i - 1] >> 32) != key[j];
      if (i < n && key[j] >= top_k_key && starts && static_cast<double>(run) < target) {
        pick = pick < key[j] ? pick : key[j];
      }
      run += q[j];
    }
    threshold = max(threshold, static_cast<unsigned>(block_reduce(pick, Min{}, s.scratch)));
  }
  bool kept[kSlots];
  u64 mass = 0;
  u64 lowest = kNone;
#pragma unroll
  for (int j = 0; j < kSlots; ++j) {
    kept[j] = base + j < n && key[j] >= threshold && r.weight(key_value(key[j])) >= min_p;
    if (kept[j]) {
      mass += q[j];
      lowest = lowest < key[j] ? lowest : key[j];
    }
  }
  const Kept result{threshold, block_reduce(mass, Sum{}, s.scratch),
                    static_cast<unsigned>(block_reduce(lowest, Min{}, s.scratch))};
  if (token == nullptr) return result;
  // Every read of s.buf above happened before the reductions' barriers.
#pragma unroll
  for (int j = 0; j < kSlots; ++j) {
    if (base + j < n) s.buf[base + j] = kept[j] ? static_cast<u64>(kFull - id[j]) << 32 | key[j] : 0;
  }
  sort_desc(s.buf, width);  // the kept tokens first, in ascending id
  local = 0;
#pragma unroll
  for (int j = 0; j < kSlots; ++j) {
    const u64 e = base + j < n ? s.buf[base + j] : 0;
    id[j] = kFull - static_cast<unsigned>(e >> 32);
    q[j] = e > 0 ? r.quantize(r.weight(key_value(static_cast<unsigned>(e)))) : 0;
    local += q[j];
  }
  const u64 target = draw_target(u, result.mass);
  u64 all;
  u64 at = block_exclusive_scan(local, s.scratch, &all);
#pragma unroll
  for (int j = 0; j < kSlots; ++j) {
    if (q[j] > 0 && at <= target && target < at + q[j]) *token = id[j];
    at += q[j];
  }
  return result;
}

template <int VEC>
__global__ void __launch_bounds__(kThreads) sampling_kernel(const Params p) {
  enter_kernel();  // segment_kernel's maxima
  __shared__ Shared s;
  const int row = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const std::int64_t offset = static_cast<std::int64_t>(row) * p.vocab;
  const float* x = p.logits + offset;

  // this thread's segment max as pack(key, id); 0 past the row's segments (below every token)
  const u64 best =
      threadIdx.x < p.segments_count ? __ldcg(p.segments + static_cast<std::int64_t>(row) * kThreads + threadIdx.x) : 0;
  const u64 top = block_reduce(best, Max{}, s.scratch);
  const unsigned top_key = static_cast<unsigned>(top >> 32);
  if (top_key == kBadKey || top_key <= order_key(-INFINITY)) {  // NaN / +inf, or nothing finite
    if (threadIdx.x == 0 && p.tokens != nullptr) p.tokens[row] = -1;
    if (threadIdx.x == 0 && p.threshold != nullptr) p.threshold[row] = NAN;
    return;  // probs: segment_kernel's zeros
  }
  const float top_value = key_value(top_key);
  // The row's columns in float64 as the caller has them: a positive temperature below fp32's
  // smallest normal stays positive (0 means greedy); top-k outside 1..vocab - 1 is none.
  const double* c = p.columns + row;
  const float temperature = c[0] > 0.0 ? static_cast<float>(fmax(c[0], static_cast<double>(FLT_MIN))) : 0.0f;
  if (temperature == 0.0f) {  // greedy: the max, lowest id on ties
    const int argmax = static_cast<int>(kFull - static_cast<unsigned>(top));
    if (threadIdx.x == 0 && p.tokens != nullptr) p.tokens[row] = argmax;
    if (threadIdx.x == 0 && p.threshold != nullptr) p.threshold[row] = top_value;
    if (threadIdx.x == 0 && p.probs != nullptr) p.probs[offset + argmax] = 1.0f;  // the rest: segment_kernel's 0
    return;
  }

  const Row r{x, p.vocab, top_value, temperature, p.scale};
  const double top_k = c[p.rows];
  const int k = top_k >= 1.0 && top_k < p.vocab ? static_cast<int>(top_k) : 0;
  const float top_p = static_cast<float>(c[2 * p.rows]);
  const float min_p = static_cast<float>(c[3 * p.rows]);
  unsigned tau = 0;
  u64 row_mass = 0;  // set by grid_bound; the candidate path needs it for top-p without top-k
  if (k > 0 && k <= p.segments_count) {
    s.buf[threadIdx.x] = best >> 32 << 32;
    sort_desc(s.buf, kThreads);
    tau = static_cast<unsigned>(s.buf[k - 1] >> 32);
    __syncthreads();
  } else if (k > 0 || top_p < 1.0f) {
    tau = grid_bound<VEC>(r, k, top_p, s, &row_mass);
  }

  int n = kCapacity + 1;
  const bool gathered = p.capacity > 0 && (tau > 0 || p.vocab <= p.capacity);
  if (gathered) {  // the tokens >= tau lie in the segments whose max is >= tau
    if (threadIdx.x == 0) s.count = s.picked_count = 0;
    __syncthreads();
    if (threadIdx.x < p.segments_count && static_cast<unsigned>(best >> 32) >= tau) {
      s.picked[atomicAdd(&s.picked_count, 1)] = threadIdx.x;
    }
    __syncthreads();
    for (int j = warp; j < s.picked_count; j += kWarps) {
      for_segment<VEC, 1>(x, p.vocab, s.picked[j], p.segment, lane, [&](int i, float v) {
        const unsigned key = order_key(v);
        if (key < tau) return;
        const int slot = atomicAdd(&s.count, 1);
        if (slot < p.capacity) s.buf[slot] = pack(key, static_cast<unsigned>(i));
      });
    }
    __syncthreads();
    n = s.count;
  }

  std::int64_t* token = p.tokens != nullptr ? p.tokens + row : nullptr;
  const double u = token != nullptr ? p.uniform[row] : 0.0;
  const bool candidates = n <= p.capacity;
  Kept kept;
  if (candidates) {
    kept = candidate_path(r, s, n, k, top_p, min_p, row_mass, u, token);
  } else {
    unsigned threshold = k > 0 ? radix_select<VEC, false>(r, s, tau, 0, k, 0.0f) : 0u;
    if (top_p < 1.0f) {
      threshold = max(threshold, radix_select<VEC, true>(r, s, max(tau, threshold), threshold,
                                                         0, top_p));
    }
    kept = kept_mass<VEC>(r, s, threshold, min_p);
    if (token != nullptr) scan_draw<VEC>(r, s, kept, min_p, u, token);
  }
  if (threadIdx.x == 0 && p.threshold != nullptr) p.threshold[row] = key_value(kept.lowest);
  if (p.probs != nullptr) {
    const float norm = static_cast<float>(static_cast<double>(p.scale) /
                                          static_cast<double>(kept.mass));
    const auto prob = [&](float v) {
      if (order_key(v) < kept.threshold) return 0.0f;
      const float w = r.weight(v);
      return w >= min_p ? w * norm : 0.0f;
    };
    float* out = p.probs + offset;
    if (candidates) {  // every kept token is a candidate, in a picked segment; the rest are 0 already
      for (int j = warp; j < s.picked_count; j += kWarps) {
        for_segment<VEC, 1>(x, p.vocab, s.picked[j], p.segment, lane, [&](int i, float v) { out[i] = prob(v); });
      }
    } else {
      write_row<VEC>(out, x, p.vocab, [&](int, float v) { return prob(v); });
    }
  }
}

std::int64_t ceil_div(std::int64_t n, std::int64_t d) { return (n + d - 1) / d; }

// A row's split into segments: at most kThreads (one a thread of the row's block), each a multiple
// of a warp's 16-byte loads. (tokens a segment, segments)
std::pair<std::int64_t, std::int64_t> segment_split(std::int64_t vocab) {
  const std::int64_t segment = ceil_div(ceil_div(vocab, kThreads), 4 * 32) * 4 * 32;
  return {segment, ceil_div(vocab, segment)};
}

// The fixed-point mass of weight 1 for a row of `vocab` tokens: vocab * scale <= 2^62, so sums never overflow.
float fixed_point_scale(std::int64_t vocab) {
  int bits = 0;
  while ((1LL << bits) < vocab) ++bits;
  return std::ldexp(1.0f, 62 - bits);
}

template <int VEC>
void launch(const SamplingArgs& a, float scale) {
  const auto [segment, segments] = segment_split(a.vocab);
  const Params p{reinterpret_cast<std::int64_t*>(a.tokens),
                 reinterpret_cast<float*>(a.probs),
                 reinterpret_cast<float*>(a.threshold),
                 reinterpret_cast<const float*>(a.logits),
                 reinterpret_cast<const double*>(a.columns),
                 a.rows,
                 reinterpret_cast<const double*>(a.uniform),
                 reinterpret_cast<const u64*>(a.segments),
                 static_cast<int>(a.vocab),
                 static_cast<int>(segment),
                 static_cast<int>(segments),
                 a.max_candidates,
                 scale};
  const auto stream = as_stream(a.stream);
  launch_kernel("sampling segment kernel launch", segment_kernel<VEC>,
                dim3(static_cast<unsigned>(a.rows), static_cast<unsigned>(ceil_div(segments, kSegmentWarps))),
                dim3(kSegmentWarps * 32), 0, stream, p.logits, reinterpret_cast<u64*>(a.segments), p.probs, p.vocab,
                p.segment, p.segments_count);
  launch_kernel("sampling kernel launch", sampling_kernel<VEC>, static_cast<unsigned>(a.rows), kThreads, 0, stream, p);
}

}  // namespace

// Trusts its arguments: the binding (bind_sampling.cpp) checks them against sampling.h.
void sample_rows(const SamplingArgs& a) {
  if (a.rows == 0) return;
  DeviceGuard guard(a.device);
  const float scale = fixed_point_scale(a.vocab);
  if (a.vocab % 4 == 0 && is_aligned(a.logits, 16) && (a.probs == 0 || is_aligned(a.probs, 16))) {
    launch<4>(a, scale);
  } else {
    launch<1>(a, scale);
  }
}

// ---- plain greedy: the argmax of each row over (chunks, rows) blocks -----------------------------
//
// At batch 1 a decode step samples one 248k-token row between two CUDA graphs: one block per row
// would leave a single SM reading its 0.5 MB, so a row is split into chunks, one block each, about
// two blocks per SM over the batch. A block reduces its chunk (16-byte loads) to one pack(key, id)
// (the max of packs is the largest value at its lowest id), NaN / +inf taking the bad key above
// every value's; the block of a row that finishes last reduces the row's partials and writes the
// token (the router's pattern in moe.cu), then resets the row's counter for the next launch.
namespace {

constexpr int kGreedyThreads = 256;
constexpr int kGreedyWarps = kGreedyThreads / 32;
constexpr int kGreedyBatch = 4;  // items a thread loads before it compares them
static_assert(kGreedyMaxChunks <= kGreedyThreads, "the last block reads one partial per thread");

// Coherent (.cg) loads: ptxas may hoist read-only (.nc) ones above the PDL wait (launch.cuh), and
// the row is read once, so L1 need not keep it.
template <typename T, int VEC>
__device__ __forceinline__ Vec<T, VEC> load_items(const T* x, unsigned i) {
  Vec<T, VEC> v;
  if constexpr (sizeof(v) == 16) {
    *reinterpret_cast<uint4*>(&v) = __ldcg(reinterpret_cast<const uint4*>(x) + i);
  } else {
    static_assert(VEC == 1, "16-byte vectors or single elements");
    v.v[0] = __ldcg(x + i);
  }
  return v;
}

// The block's max lands in thread 0. Barrier first, so scratch may be reused back to back.
__device__ __forceinline__ u64 greedy_block_max(u64 v, u64* scratch) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = max(v, __shfl_xor_sync(kFull, v, offset));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kGreedyWarps; ++w) v = max(v, scratch[w]);
  }
  return v;
}

// Block (c, r) reduces items [c chunk, (c + 1) chunk) of row r (an item: VEC elements).
template <typename T, int VEC>
__global__ void __launch_bounds__(kGreedyThreads)
    greedy_kernel(std::int64_t* __restrict__ tokens, const T* logits, u64* __restrict__ partials,
                  unsigned* __restrict__ counters, int vocab, unsigned chunk) {
  __shared__ u64 scratch[kGreedyWarps];
  __shared__ bool last;
  const int row = blockIdx.y;
  const T* x = logits + static_cast<std::int64_t>(row) * vocab;
  const unsigned end = min((blockIdx.x + 1) * chunk, static_cast<unsigned>(vocab / VEC));
  enter_kernel();  // the logits are the kernel before's output
  float best = -INFINITY;
  unsigned best_id = 0;  // kept while best is -inf: such a pack never decides a token
  bool bad = false;
  // A thread walks its ids upwards and takes only a strictly larger value: the lowest id of its
  // max (-0 == +0 tie, as in torch). NaN never compares larger; it and +inf set `bad`. Loads go
  // out kGreedyBatch at a time (predicated, one basic block): at batch 8 a thread has ~4 items,
  // whose DRAM round trips then overlap instead of queueing behind each other's compares.
  for (unsigned i0 = blockIdx.x * chunk + threadIdx.x; i0 < end; i0 += kGreedyBatch * kGreedyThreads) {
    Vec<T, VEC> v[kGreedyBatch];
#pragma unroll
    for (int b = 0; b < kGreedyBatch; ++b) {
      if (i0 + b * kGreedyThreads < end) v[b] = load_items<T, VEC>(x, i0 + b * kGreedyThreads);
    }
#pragma unroll
    for (int b = 0; b < kGreedyBatch; ++b) {
      const unsigned i = i0 + b * kGreedyThreads;
      if (i >= end) break;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float f = to_float(v[b].v[j]);
        bad |= isnan(f) || f == INFINITY;
        if (f > best) best = f, best_id = i * VEC + j;
      }
    }
  }
  u64 top = greedy_block_max(pack(bad ? kBadKey : order_key(best), best_id), scratch);
  if (gridDim.x > 1) {
    u64* row_partials = partials + static_cast<std::int64_t>(row) * kGreedyMaxChunks;
    if (threadIdx.x == 0) {
      row_partials[blockIdx.x] = top;
      __threadfence();  // the partial is visible before this block counts itself done
      last = atomicAdd(counters + row, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    // through L2 (.cg): the other blocks' partials may be stale in this SM's L1
    top = greedy_block_max(threadIdx.x < gridDim.x ? __ldcg(row_partials + threadIdx.x) : 0, scratch);
  }
  if (threadIdx.x == 0) {
    // Torch's argmax then picks a non-finite logit: NaN / +inf (the bad key), or -inf when the
    // row holds nothing larger; the sampler rejects those rows.
    const unsigned key = static_cast<unsigned>(top >> 32);
    const bool rejected = key == kBadKey || key <= order_key(-INFINITY);
    tokens[row] = rejected ? -1 : static_cast<std::int64_t>(kFull - static_cast<unsigned>(top));
    if (gridDim.x > 1) counters[row] = 0;  // every block of the row has counted: 0 for the next launch
  }
}

template <typename T, int VEC>
void launch_greedy(const GreedyArgs& a) {
  constexpr std::int64_t kMaxGridY = 65535;
  const std::int64_t items = a.vocab / VEC;
  const auto ceil_div = [](std::int64_t n, std::int64_t d) { return (n + d - 1) / d; };
  // About two blocks per SM over the batch, each thread at least one item, so that every load is
  // in flight in the first wave; at most kGreedyMaxChunks (one partial per thread of the last).
  const std::int64_t per_row = std::max<std::int64_t>(1, 2 * sm_count(a.device) / a.rows);
  const std::int64_t chunks = std::min({ceil_div(items, kGreedyThreads), per_row, std::int64_t{kGreedyMaxChunks}});
  const std::int64_t chunk = ceil_div(items, chunks);
  const unsigned grid_x = static_cast<unsigned>(ceil_div(items, chunk));  // no empty block
  for (std::int64_t r0 = 0; r0 < a.rows; r0 += kMaxGridY) {  // gridDim.y is 16-bit
    const auto rows = static_cast<unsigned>(std::min(a.rows - r0, kMaxGridY));
    launch_kernel("greedy kernel launch", greedy_kernel<T, VEC>, dim3(grid_x, rows), dim3(kGreedyThreads), 0,
                  as_stream(a.stream), reinterpret_cast<std::int64_t*>(a.tokens) + r0,
                  reinterpret_cast<const T*>(a.logits) + r0 * a.vocab,
                  reinterpret_cast<u64*>(a.partials) + r0 * kGreedyMaxChunks,
                  reinterpret_cast<unsigned*>(a.counters) + r0, static_cast<int>(a.vocab),
                  static_cast<unsigned>(chunk));
  }
}

}  // namespace

// Trusts its arguments: the binding (bind_sampling.cpp) checks them against sampling.h.
void greedy_rows(const GreedyArgs& a) {
  if (a.rows == 0) return;
  DeviceGuard guard(a.device);
  by_dtype(a.dtype, "greedy_rows", [&](auto zero) {
    using T = decltype(zero);
    constexpr int kVec = 16 / sizeof(T);
    if (a.vocab % kVec == 0 && is_aligned(a.logits, 16)) {
      launch_greedy<T, kVec>(a);
    } else {
      launch_greedy<T, 1>(a);
    }
  });
}

// ---- speculative rejection sampling: a round's verdict per sequence ------------------------------
//
// engine/speculative/verify.py's rule (its torch reference: ops/rejection.py `judge_ref`) for B
// sequences on the device, in two launches as the sampler: the residual's segment masses over the
// whole GPU, then a block per sequence. Masses are exact 64-bit fixed point (the sampler's scale), so
// the drawn token is the reference's bit for bit, whatever the order of the sums.
namespace {

struct JudgeParams {
  std::int64_t* out;           // [2B]: accepted counts, then last tokens
  const float* p;              // [P, V] the target distributions
  const float* q;              // [Q, V] the drafter's, or null (every draft one-hot)
  const std::int64_t* drafts;  // [B, W]
  const double* u;             // [B, W + 1]
  const std::int64_t* meta;    // [B, 3]: k, p's first row, q's first row (-1: one-hot drafts)
  const bool* finite;          // [P] or null
  u64* sums;                   // [B, kThreads, 2] segment masses of the residual and of p_n
  int batch, width, vocab, segment, segments;
  double scale;
};

struct Verdict {
  int n;                  // drafts accepted
  std::int64_t p_row;     // the row the last token comes from
  std::int64_t q_row;     // the rejected draft's q row, or -1
  std::int64_t one_hot;   // the rejected one-hot draft's token, or -1
};

// Warp-wide: lane t judges draft t (accept with probability min(1, p / q)); the first rejection ends it.
__device__ Verdict judge_drafts(const JudgeParams& a, int b, int lane) {
  const std::int64_t* m = a.meta + 3 * static_cast<std::int64_t>(b);
  const int k = static_cast<int>(m[0]);
  const std::int64_t p0 = m[1], q0 = m[2];
  bool rejected = false;
  if (lane < k) {
    const std::int64_t d = a.drafts[static_cast<std::int64_t>(b) * a.width + lane];
    const double p_d = a.p[(p0 + lane) * a.vocab + d];
    const double q_d = q0 >= 0 ? static_cast<double>(a.q[(q0 + lane) * a.vocab + d]) : 1.0;
    rejected = a.u[static_cast<std::int64_t>(b) * (a.width + 1) + lane] * q_d >= p_d;
  }
  const unsigned mask = __ballot_sync(kFull, rejected);
  const int n = mask ? __ffs(mask) - 1 : k;
  const bool rejecting = n < k;
  return {n, p0 + n, rejecting && q0 >= 0 ? q0 + n : -1,
          rejecting && q0 < 0 ? a.drafts[static_cast<std::int64_t>(b) * a.width + n] : -1};
}

// Token i's fixed-point masses: (residual max(0, p_n - q_n), p_n), each product rounded to the nearest.
__device__ __forceinline__ void residual_masses(const JudgeParams& a, const Verdict& v, std::int64_t i, u64* r,
                                                u64* pn) {
  const double p = a.p[v.p_row * a.vocab + i];
  const double q = v.q_row >= 0 ? static_cast<double>(a.q[v.q_row * a.vocab + i]) : (i == v.one_hot ? 1.0 : 0.0);
  *r = __double2ull_rn(fmax(p - q, 0.0) * a.scale);
  *pn = __double2ull_rn(p * a.scale);
}

// Block (b, y), warp w: sequence b's segment 8 y + w, its two masses into sums.
__global__ void __launch_bounds__(kSegmentWarps * 32) judge_segment_kernel(const JudgeParams a) {
  enter_kernel();  // p is the sampler's output
  const int lane = threadIdx.x & 31, b = blockIdx.x;
  const int seg = blockIdx.y * kSegmentWarps + (threadIdx.x >> 5);
  if (seg >= a.segments) return;
  const Verdict v = judge_drafts(a, b, lane);
  const std::int64_t begin = static_cast<std::int64_t>(seg) * a.segment;
  const std::int64_t end = min(begin + a.segment, static_cast<std::int64_t>(a.vocab));
  u64 r_sum = 0, p_sum = 0;
  for (std::int64_t i = begin + lane; i < end; i += 32) {
    u64 r, pn;
    residual_masses(a, v, i, &r, &pn);
    r_sum += r;
    p_sum += pn;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    r_sum += __shfl_xor_sync(kFull, r_sum, o);
    p_sum += __shfl_xor_sync(kFull, p_sum, o);
  }
  if (lane == 0) {
    u64* out = a.sums + 2 * (static_cast<std::int64_t>(b) * kThreads + seg);
    out[0] = r_sum;
    out[1] = p_sum;
  }
}

// Block b: the residual's mass (p_n's where the residual is empty: p == q up to rounding), the draw
// u[b, k] * mass located first in the segments, then token by token in id order inside the one that
// holds it (warp 0); the verdict, -1 where a row judged on was not finite.
__global__ void __launch_bounds__(kThreads) judge_draw_kernel(const JudgeParams a) {
  enter_kernel();  // judge_segment_kernel's masses
  __shared__ u64 scratch[kWarps];
  __shared__ Verdict verdict;
  __shared__ int picked;
  __shared__ u64 below;  // the mass before the picked segment
  const int b = blockIdx.x, lane = threadIdx.x & 31;
  if (threadIdx.x < 32) {
    const Verdict v = judge_drafts(a, b, lane);
    if (lane == 0) verdict = v;
  }
  if (threadIdx.x == 0) picked = -1;
  const u64* sums = a.sums + 2 * static_cast<std::int64_t>(b) * kThreads;
  const bool mine = threadIdx.x < a.segments;
  const u64 r = mine ? __ldcg(sums + 2 * threadIdx.x) : 0, pn = mine ? __ldcg(sums + 2 * threadIdx.x + 1) : 0;
  const bool residual = block_reduce(r, Sum{}, scratch) > 0;  // its barriers publish verdict and picked
  const u64 mass = residual ? r : pn;
  u64 total;
  const u64 before = block_exclusive_scan(mass, scratch, &total);
  const Verdict v = verdict;
  const std::int64_t* m = a.meta + 3 * static_cast<std::int64_t>(b);
  const int k = static_cast<int>(m[0]);
  const double u = a.u[static_cast<std::int64_t>(b) * (a.width + 1) + k];
  const u64 target = total > 0 ? draw_target(u, total) : 0;
  if (total > 0 && mass > 0 && before <= target && target < before + mass) {
    picked = threadIdx.x;
    below = before;
  }
  __syncthreads();
  if (threadIdx.x >= 32) return;
  std::int64_t token = -1;
  if (picked >= 0) {  // lane l: a run of the segment's tokens, in id order
    const std::int64_t begin = static_cast<std::int64_t>(picked) * a.segment;
    const std::int64_t end = min(begin + a.segment, static_cast<std::int64_t>(a.vocab));
    const std::int64_t per_lane = (a.segment + 31) / 32;
    const std::int64_t first = begin + lane * per_lane, last = min(first + per_lane, end);
    u64 run = 0;
    for (std::int64_t i = first; i < last; ++i) {
      u64 rr, pp;
      residual_masses(a, v, i, &rr, &pp);
      run += residual ? rr : pp;
    }
    u64 at = run;  // inclusive scan over the lanes, then this lane's start
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const u64 x = __shfl_up_sync(kFull, at, o);
      if (lane >= o) at += x;
    }
    at = below + at - run;
    std::int64_t hit = -1;
    if (at <= target && target < at + run) {
      for (std::int64_t i = first; i < last; ++i) {
        u64 rr, pp;
        residual_masses(a, v, i, &rr, &pp);
        const u64 x = residual ? rr : pp;
        if (x > 0 && target < at + x) {
          hit = i;
          break;
        }
        at += x;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) hit = max(hit, static_cast<std::int64_t>(__shfl_xor_sync(kFull, hit, o)));
    token = hit;
  }
  if (lane != 0) return;
  bool judged_bad = false;  // a row at or before the last token's
  if (a.finite != nullptr) {
    for (int t = 0; t <= v.n; ++t) judged_bad |= !a.finite[m[1] + t];
  }
  a.out[b] = judged_bad ? 0 : v.n;
  a.out[a.batch + b] = judged_bad ? -1 : token;
}

}  // namespace

// Trusts its arguments: the binding (bind_sampling.cpp) checks them against sampling.h.
void judge_rows(const JudgeArgs& a) {
  if (a.batch == 0) return;
  DeviceGuard guard(a.device);
  const auto [segment, segments] = segment_split(a.vocab);
  const JudgeParams p{reinterpret_cast<std::int64_t*>(a.out),
                      reinterpret_cast<const float*>(a.p),
                      reinterpret_cast<const float*>(a.q),
                      reinterpret_cast<const std::int64_t*>(a.drafts),
                      reinterpret_cast<const double*>(a.u),
                      reinterpret_cast<const std::int64_t*>(a.meta),
                      reinterpret_cast<const bool*>(a.finite),
                      reinterpret_cast<u64*>(a.sums),
                      static_cast<int>(a.batch),
                      static_cast<int>(a.width),
                      static_cast<int>(a.vocab),
                      static_cast<int>(segment),
                      static_cast<int>(segments),
                      static_cast<double>(fixed_point_scale(a.vocab))};
  const auto stream = as_stream(a.stream);
  launch_kernel("judge segment kernel launch", judge_segment_kernel,
                dim3(static_cast<unsigned>(a.batch), static_cast<unsigned>(ceil_div(segments, kSegmentWarps))),
                dim3(kSegmentWarps * 32), 0, stream, p);
  launch_kernel("judge draw kernel launch", judge_draw_kernel, static_cast<unsigned>(a.batch), kThreads, 0, stream, p);
}

}  // namespace ninfer

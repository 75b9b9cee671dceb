// Tensor-core building blocks of the weight-only GEMVs (csrc/quant_gemv.cu) and the MoE decode
// kernels (csrc/moe_decode_mma.cu): predicated 16-byte loads and cp.async copies, int8 / int4 codes
// as exact 16-bit pairs, and one 64-byte chunk of 16 weight rows through mma.m16n8k16 (fp32
// accumulation).
//
// The lane layout: lane = 4 g + t holds rows g and g + 8 of a 16-row tile, bytes 16 t .. 16 t + 15
// of each 64-byte chunk of those rows. The k order inside an MMA is free as long as A and B agree,
// so each lane feeds exactly the weights it loaded and picks the matching x values itself (x row
// n of an n8 tile from lane g = n): no shuffles, no shared memory for operands.
#pragma once

#include <cstdint>
#include <type_traits>

#include "common.cuh"

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

// load16<true> for before the PDL wait: volatile, so that nvcc keeps it there (common.cuh load_early16).
__device__ __forceinline__ uint4 load16_early(const void* ptr, bool pred) {
  uint4 v = make_uint4(0, 0, 0, 0);
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n"
               " @p ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n}"
               : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w)
               : "l"(ptr), "r"(static_cast<int>(pred)));
  return v;
}

// Global to shared memory without registers (cp.async, sm_80+). cp_async16: 16 bytes, which the
// issuing thread sees after cp_async_wait_all, the others after a barrier that follows it (cp_async4 too).
// cp_async_zfill: `kBytes` (8 or 16), zeros where !pred (a src-size of 0), in groups closed by
// cp_async_commit; cp_async_wait_one waits for all but the newest group.
__device__ __forceinline__ void cp_async16(void* shared, const void* global) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(static_cast<std::uint32_t>(__cvta_generic_to_shared(shared))),
               "l"(global)
               : "memory");
}

// 4 bytes (the GDN recurrent kernel's fp32 activations, csrc/gdn_decode.cu), seen as cp_async16's.
__device__ __forceinline__ void cp_async4(void* shared, const void* global) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(static_cast<std::uint32_t>(__cvta_generic_to_shared(shared))),
               "l"(global)
               : "memory");
}

template <int kBytes>
__device__ __forceinline__ void cp_async_zfill(void* shared, const void* global, bool pred) {
  const auto to = static_cast<std::uint32_t>(__cvta_generic_to_shared(shared));
  if constexpr (kBytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(to), "l"(global), "r"(pred ? 16 : 0) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(to), "l"(global), "r"(pred ? 8 : 0) : "memory");
  }
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_one() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// 16 bytes of x (an MMA's B operand) through L1, unpredicated: a lane whose x row does not exist
// points at a real one (row 0, k 0), and its products land in C columns nobody reads, so no zeros
// are needed (a predicated load would cost 4 moves to zero its registers and a setp).
template <typename T>
__device__ __forceinline__ uint4 load_x16(const T* ptr) {
  uint4 v;
  asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr));
  return v;
}

__device__ __forceinline__ std::uint16_t load2(const void* ptr, bool pred) {
  std::uint16_t v = 0;
  asm("{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n @p ld.global.nc.u16 %0, [%1];\n}"
      : "+h"(v)
      : "l"(ptr), "r"(static_cast<int>(pred)));
  return v;
}

__device__ __forceinline__ float bf16_bits_to_float(std::uint16_t bits) {
  return __uint_as_float(static_cast<std::uint32_t>(bits) << 16);
}

template <typename P>
__device__ __forceinline__ P as_pair(std::uint32_t u) {
  return *reinterpret_cast<const P*>(&u);
}

template <typename P>
__device__ __forceinline__ std::uint32_t as_u32(P p) {
  return *reinterpret_cast<const std::uint32_t*>(&p);
}

// The 16-bit MMA types: code -> pair conversions and the MMA itself.
template <typename T>
struct Mma;

template <>
struct Mma<__half> {
  using Pair = __half2;
  // A nibble n in bits 0-3 of each half under 0x6400 reads as 1024 + n; minus 1032 gives n - 8.
  static constexpr std::uint32_t kNibbleMagic = 0x64006400u;
  static constexpr std::uint32_t kNibbleBias = 0x64086408u;

  __device__ static Pair scale(std::uint16_t bf16_bits) {
    return __float2half2_rn(bf16_bits_to_float(bf16_bits));
  }

  // Codes e0..e3 of a word as pairs (e0, e1), (e2, e3): byte u under 0x64 is 1024 + u, u = q + 128.
  __device__ static void int8_pairs(std::uint32_t word, std::uint32_t (&p)[2]) {
    const std::uint32_t biased = word ^ 0x80808080u;
    const Pair bias = as_pair<Pair>(0x64806480u);  // 1152 = 1024 + 128
    p[0] = as_u32(__hsub2(as_pair<Pair>(__byte_perm(biased, 0x64646464u, 0x4140u)), bias));
    p[1] = as_u32(__hsub2(as_pair<Pair>(__byte_perm(biased, 0x64646464u, 0x4342u)), bias));
  }

  __device__ static void mma(float (&c)[4], std::uint32_t a0, std::uint32_t a1, std::uint32_t a2,
                             std::uint32_t a3, std::uint32_t b0, std::uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};

template <>
struct Mma<__nv_bfloat16> {
  using Pair = __nv_bfloat162;
  // Under 0x4300 a nibble in bits 0-3 reads as 128 + n; minus 136 gives n - 8.
  static constexpr std::uint32_t kNibbleMagic = 0x43004300u;
  static constexpr std::uint32_t kNibbleBias = 0x43084308u;

  __device__ static Pair scale(std::uint16_t bf16_bits) {
    return as_pair<Pair>(static_cast<std::uint32_t>(bf16_bits) * 0x10001u);
  }

  // bf16 stores 7 mantissa bits, too few for a byte under a magic exponent. A code q = l - 128 s
  // (l: its low 7 bits, s: its sign bit) is (0x4300 | l) - (0x4300 | s << 7) = (128 + l) - (128
  // or 256), exact: a byte permute, two ANDs and a subtraction a pair (through fp32: five).
  __device__ static void int8_pairs(std::uint32_t word, std::uint32_t (&p)[2]) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const std::uint32_t codes = __byte_perm(word, 0x43434343u, i ? 0x4342u : 0x4140u);  // 0x43 q 0x43 q
      p[i] = as_u32(__hsub2(as_pair<Pair>(codes & 0x437F437Fu), as_pair<Pair>(codes & 0x43804380u)));
    }
  }

  __device__ static void mma(float (&c)[4], std::uint32_t a0, std::uint32_t a1, std::uint32_t a2,
                             std::uint32_t a3, std::uint32_t b0, std::uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};

// (a & kMask) | kMagic in one LOP3 (from C++ the compiler emits two, one for each immediate).
template <std::uint32_t kMask, std::uint32_t kMagic>
__device__ __forceinline__ std::uint32_t and_or(std::uint32_t a) {
  std::uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "n"(kMask), "n"(kMagic));
  return d;
}

// A word of 8 int4 codes e0..e7 as pairs (e_i, e_i+4), i = 0..3, of q (exact from the magic
// number), or of q * scale (one rounding) when kScaled. Pair i is nibble i of each half under the
// magic: a shift and one LOP3, then the bias off. fp16 (Marlin's form) takes nibbles 1 and 3 in
// place as 16 n under the magic and divides by 16 in the same FMA that takes the bias off (exact):
// a shift a word fewer. bf16's 7 mantissa bits cannot hold 16 n, so it shifts for each nibble.
template <typename T, bool kScaled>
__device__ __forceinline__ void int4_pairs(std::uint32_t word, typename Mma<T>::Pair scale,
                                           std::uint32_t (&p)[4]) {
  using Pair = typename Mma<T>::Pair;
  constexpr std::uint32_t kMagic = Mma<T>::kNibbleMagic;
  const Pair bias = as_pair<Pair>(Mma<T>::kNibbleBias);
  if constexpr (std::is_same_v<T, __half>) {
    const std::uint32_t high = word >> 8;
    const Pair sixteenth = as_pair<Pair>(0x2C002C00u);  // 1 / 16
    const Pair high_bias = as_pair<Pair>(0xD480D480u);  // -72: (1024 + 16 n) / 16 - 72 = n - 8
    p[0] = as_u32(__hsub2(as_pair<Pair>(and_or<0x000F000Fu, kMagic>(word)), bias));
    p[1] = as_u32(__hfma2(as_pair<Pair>(and_or<0x00F000F0u, kMagic>(word)), sixteenth, high_bias));
    p[2] = as_u32(__hsub2(as_pair<Pair>(and_or<0x000F000Fu, kMagic>(high)), bias));
    p[3] = as_u32(__hfma2(as_pair<Pair>(and_or<0x00F000F0u, kMagic>(high)), sixteenth, high_bias));
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) p[i] = as_u32(__hsub2(as_pair<Pair>(and_or<0x000F000Fu, kMagic>(word >> (4 * i))), bias));
  }
  if constexpr (kScaled) {
#pragma unroll
    for (int i = 0; i < 4; ++i) p[i] = as_u32(__hmul2(as_pair<Pair>(p[i]), scale));
  }
}

// Word i of 16 loaded bytes (i known at compile time once the loops unroll).
__device__ __forceinline__ std::uint32_t word_of(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// The two MMA k-steps of word j of an int4 chunk (k = kx + 8j .. kx + 8j + 7) into c, from the
// A pairs of rows g (a0[s]) and g + 8 (a1[s]) of each of kSets weight tiles: one x load of a tile
// feeds every set's MMAs (a grouped GEMV's warp takes two tiles: half the x loads a weight byte).
template <typename T, int kTiles, int kSets, typename XRow>
__device__ __forceinline__ void word_mma(float (&c)[kSets][kTiles][4], const std::uint32_t (&a0)[kSets][4],
                                         const std::uint32_t (&a1)[kSets][4], const XRow (&xr)[kTiles], int kx,
                                         int j) {
#pragma unroll
  for (int tile = 0; tile < kTiles; ++tile) {
    const uint4 xv = load_x16(xr[tile] + kx + 8 * j);
    // A pairs hold k (i, i + 4) of the word, so B pairs x the same way.
    const std::uint32_t b[4] = {__byte_perm(xv.x, xv.z, 0x5410u), __byte_perm(xv.x, xv.z, 0x7632u),
                                __byte_perm(xv.y, xv.w, 0x5410u), __byte_perm(xv.y, xv.w, 0x7632u)};
#pragma unroll
    for (int s = 0; s < kSets; ++s) {
      Mma<T>::mma(c[s][tile], a0[s][0], a1[s][0], a0[s][1], a1[s][1], b[0], b[1]);
      Mma<T>::mma(c[s][tile], a0[s][2], a1[s][2], a0[s][3], a1[s][3], b[2], b[3]);
    }
  }
}

// One int4 chunk's sums of the exact codes (q - 8, no scale) into c: a group of 128's MMAs before
// its scale (chunk_mma, csrc/moe_decode_mma.cu). Arguments as chunk_mma_sets'.
template <typename T, int kTiles, int kSets, typename XRow>
__device__ __forceinline__ void int4_chunk_sums_sets(float (&c)[kSets][kTiles][4], const uint4 (&q)[2 * kSets],
                                                     const XRow (&xr)[kTiles], int kx) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {  // word j: k = kx + 8j .. kx + 8j + 7, two MMA k-steps
    std::uint32_t a0[kSets][4], a1[kSets][4];
#pragma unroll
    for (int s = 0; s < kSets; ++s) {
      int4_pairs<T, false>(word_of(q[2 * s], j), {}, a0[s]);
      int4_pairs<T, false>(word_of(q[2 * s + 1], j), {}, a1[s]);
    }
    word_mma<T, kTiles, kSets>(c, a0, a1, xr, kx, j);
  }
}

template <typename T, int kTiles, typename XRow>
__device__ __forceinline__ void int4_chunk_sums(float (&c)[kTiles][4], const uint4 (&q)[2], const XRow (&xr)[kTiles],
                                                int kx) {
  int4_chunk_sums_sets<T, kTiles, 1>(reinterpret_cast<float(&)[1][kTiles][4]>(c), q, xr, kx);
}

// One chunk on tensor cores. q: this lane's 16 bytes of rows g and g + 8 of each of kSets weight
// tiles (q[2s], q[2s + 1]; sc likewise); kx: their first k; xr: this lane's x row of each n8 tile
// (const T* or StagedX<T>), a real row even where the tile has none for this lane (its C column is
// not read), and kx inside the row (a K tail's lanes read k 0 against zero weights). kGroupChunk
// (int4): the chunk is one group of every row (group_size 128: the 4 lanes of a row share its
// scale), so its MMAs take the exact codes and the chunk's sums are scaled in fp32: exact weights,
// and 4 FMAs instead of 32 pair multiplies a lane (H200: 27B batch-1 steps 1.2% faster, the 35B's
// grouped MoE at batch 8 level). Smaller groups scale the weights (rounded to T) before the MMA.
template <typename T, bool kInt4, bool kGroupChunk, int kTiles, int kSets, typename XRow>
__device__ __forceinline__ void chunk_mma_sets(float (&acc)[kSets][kTiles][4], const uint4 (&q)[2 * kSets],
                                               const std::uint16_t (&sc)[2 * kSets], const XRow (&xr)[kTiles],
                                               int kx) {
  using M = Mma<T>;
  if constexpr (kInt4 && kGroupChunk) {
    float c[kSets][kTiles][4] = {};
    int4_chunk_sums_sets<T, kTiles, kSets>(c, q, xr, kx);
#pragma unroll
    for (int s = 0; s < kSets; ++s) {
      const float f0 = bf16_bits_to_float(sc[2 * s]), f1 = bf16_bits_to_float(sc[2 * s + 1]);
#pragma unroll
      for (int tile = 0; tile < kTiles; ++tile) {  // entries 0, 1: row g; 2, 3: row g + 8
        acc[s][tile][0] = fmaf(f0, c[s][tile][0], acc[s][tile][0]);
        acc[s][tile][1] = fmaf(f0, c[s][tile][1], acc[s][tile][1]);
        acc[s][tile][2] = fmaf(f1, c[s][tile][2], acc[s][tile][2]);
        acc[s][tile][3] = fmaf(f1, c[s][tile][3], acc[s][tile][3]);
      }
    }
  } else if constexpr (kInt4) {
    typename M::Pair scale[2 * kSets];
#pragma unroll
    for (int r = 0; r < 2 * kSets; ++r) scale[r] = M::scale(sc[r]);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      std::uint32_t a0[kSets][4], a1[kSets][4];
#pragma unroll
      for (int s = 0; s < kSets; ++s) {
        int4_pairs<T, true>(word_of(q[2 * s], j), scale[2 * s], a0[s]);
        int4_pairs<T, true>(word_of(q[2 * s + 1], j), scale[2 * s + 1], a1[s]);
      }
      word_mma<T, kTiles, kSets>(acc, a0, a1, xr, kx, j);
    }
  } else {
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // 8 x values: words 2h, 2h + 1, one MMA k-step each
      uint4 xv[kTiles];
#pragma unroll
      for (int tile = 0; tile < kTiles; ++tile) {
        xv[tile] = load_x16(xr[tile] + kx + 8 * h);
      }
#pragma unroll
      for (int jj = 0; jj < 2; ++jj) {
#pragma unroll
        for (int s = 0; s < kSets; ++s) {
          std::uint32_t a0[2], a1[2];
          M::int8_pairs(word_of(q[2 * s], 2 * h + jj), a0);
          M::int8_pairs(word_of(q[2 * s + 1], 2 * h + jj), a1);
#pragma unroll
          for (int tile = 0; tile < kTiles; ++tile) {
            M::mma(acc[s][tile], a0[0], a1[0], a0[1], a1[1], jj ? xv[tile].z : xv[tile].x,
                   jj ? xv[tile].w : xv[tile].y);
          }
        }
      }
    }
  }
}

// chunk_mma_sets of one weight tile (the decode kernels', and a GEMV warp's single tile).
template <typename T, bool kInt4, bool kGroupChunk, int kTiles, typename XRow>
__device__ __forceinline__ void chunk_mma(float (&acc)[kTiles][4], const uint4 (&q)[2],
                                          const std::uint16_t (&sc)[2], const XRow (&xr)[kTiles], int kx) {
  chunk_mma_sets<T, kInt4, kGroupChunk, kTiles, 1>(reinterpret_cast<float(&)[1][kTiles][4]>(acc), q, sc, xr, kx);
}

}  // namespace ninfer

// Dot products of one 16-byte vector of quantized weight codes with activations staged in shared
// memory, shared by the decode kernels that stream weights (moe.cu's experts, stream_gemv.cu's
// projections): the staging layout and the code -> float tricks that make a dot ~3 instructions
// a weight. Every product and fp32 sum is the one (code - zero) * x gives.
#pragma once

#include "common.cuh"

namespace ninfer {

// An activation vector is staged as fp32 float4 quads, quad-major: quad q (elements 4q..4q+3) of
// the chunk c of kVec elements that one 16-byte weight vector covers lives at x4[q * chunks + c].
// The lanes of a warp read consecutive chunks, so their loads of quad q are consecutive 16-byte
// words (no bank conflicts), and quad q of a chunk is one immediate-offset step from quad 0: the
// dot products spend no instructions on shared-memory addresses.
// C::kNibbleScaled (int4): element 4q + m is staged times 16^-m, exactly (a power of two), because
// the int4 dot takes nibble m of a 16-bit half word in place, as n * 16^m (see Int4Codes).
template <typename C, typename T>
__device__ __forceinline__ void stage(float* dst, const T* __restrict__ src, int n) {
  constexpr int kVec = C::kVec;
  const int chunks = n / kVec;
  const auto put = [&](int p, float v) {
    const int m = p % 4;
    if constexpr (C::kNibbleScaled) v *= __uint_as_float((127u - 4u * m) << 23);  // 2^(-4m)
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

// The kVec codes' floats f dotted with the staged chunk at x (its quad 0; quad q at x[q * chunks]).
template <typename C>
__device__ __forceinline__ float dot_floats(const float (&f)[C::kVec], const float4* x, int chunks) {
  float acc = 0.0f;
#pragma unroll
  for (int q = 0; q < C::kVec / 4; ++q) acc = dot4(f[4 * q], f[4 * q + 1], f[4 * q + 2], f[4 * q + 3], x[q * chunks], acc);
  return acc;
}

// A vector of codes dotted with its staged chunk (C: Int8Codes / Int4Codes below).
template <typename C>
__device__ __forceinline__ float codes_dot(const uint4& v, const float4* x, int chunks) {
  float f[C::kVec];
  C::floats(v, f);
  return dot_floats<C>(f, x, chunks);
}

// int8 codes, 16 a vector: byte b of word q is element 4q + b. 0x4B0000xx is the float 2^23 + xx
// exactly; with the sign bit flipped, xx = value + 128: two instructions per element instead of
// a slow I2F.
struct Int8Codes {
  static constexpr int kVec = 16;
  static constexpr bool kNibbleScaled = false;

  __device__ __forceinline__ static void floats(const uint4& v, float (&f)[kVec]) {
    const std::uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const std::uint32_t u = words[q] ^ 0x80808080u;
#pragma unroll
      for (int b = 0; b < 4; ++b) f[4 * q + b] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7440u + b)) - 8388736.0f;
    }
  }
  __device__ __forceinline__ static float dot(const uint4& v, const float4* x, int chunks) {
    return codes_dot<Int8Codes>(v, x, chunks);
  }
};

// int4 codes, 32 a vector: nibble m of word w is element 8w + m, stored as value + 8. Quad q = 2w +
// h is the 16-bit half h of word w; its nibble m (bits 4m..4m+3 of the half) is read in place:
// 0x4B000000 | (bits) is the float 2^23 + n 16^m exactly, minus 2^23 + 8 16^m gives (n - 8) 16^m,
// one LOP3 and one FADD an element. The staged x carries the 16^-m (stage), so each product, and
// so every fp32 sum, is the one (n - 8) * x would give.
struct Int4Codes {
  static constexpr int kVec = 32;
  static constexpr bool kNibbleScaled = true;

  __device__ __forceinline__ static void floats(const uint4& v, float (&f)[kVec]) {
    const std::uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      const std::uint32_t u = q % 2 ? words[q / 2] >> 16 : words[q / 2];
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        f[4 * q + m] = __uint_as_float((u & (0xFu << (4 * m))) | 0x4B000000u) - (8388608.0f + 8.0f * (1 << (4 * m)));
      }
    }
  }
  __device__ __forceinline__ static float dot(const uint4& v, const float4* x, int chunks) {
    return codes_dot<Int4Codes>(v, x, chunks);
  }
};

}  // namespace ninfer

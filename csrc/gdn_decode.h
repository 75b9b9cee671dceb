// Host entry point of the fused Gated DeltaNet steps (gdn_decode.cu). Plain C++ like ops.h:
// tensors travel as raw device pointers, the stream as torch's Stream.cuda_stream.
#pragma once

#include <cstdint>

#include "ops.h"

namespace ninfer {

// Limits of the fused steps (gdn_decode.cu), checked at the binding.
inline constexpr int kGdnMaxTaps = 8;
inline constexpr int kGdnMaxHeadDim = 256;
inline constexpr int kGdnMaxStepTokens = 16;  // speculative verify: K + 1 <= 16

// T new tokens for each of `batch` sequences, one GDN layer (see ninfer_core/ops/gdn.py):
//   conv + SiLU over [conv state | qkv tokens], q / k l2-normalised (q also scaled by q_scale),
//   g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), the delta rule on the fp32 state
//   token by token, out = gated RMSNorm(o, z) per value head and token.
// Row b's pools advance through its first counts[b] tokens (all T when counts is 0) if write_state,
// and stay untouched otherwise; out (0: not computed) gets every token's output from the state
// advanced through all T tokens (with counts: the first counts[b] tokens only, the other rows
// untouched). Decode: T = 1, write_state; speculative verify: T = K + 1, no write; commit of the
// accepted tokens: counts, write_state, no out; the tail of a forked prefill chunk: offsets,
// fork_slots, counts, write_state, out.
// offsets [B] int64 or 0: row b's token t is row offsets[b] + t of its sequence in qkv / a / b /
// z / out, whose sequences are seq_rows rows apart (seq_rows = T without offsets). fork_slots [B]
// int64 or 0: the pools' state of slots[b] before these tokens is also copied to fork_slots[b].
// Shapes (C = 2 Hk dk + Hv dv): qkv [B, T, C], a / b [B, T, Hv], z / out [B, T, Hv dv] with
// their last axis contiguous and qkv / a and b / z rows (tokens) qkv_stride / ab_stride / z_stride
// elements apart (slices of one merged projection need no copy; out is contiguous), conv_pool [S, C, K-1], state_pool [S, Hv, dk, dv] fp32 (16-byte aligned), slots
// [B] int64 (distinct), counts [B] int64 or 0, conv_weight [C, K], A_log / dt_bias [Hv],
// norm_weight [dv], scratch B (T C + Hv) words of 4 bytes (fp32 activations, then per-head
// counters; no initial contents needed). Everything but state_pool, slots, counts and scratch has
// `dtype`; everything else is contiguous. dk, dv multiples of 32 up to 256, Hv a multiple of Hk, 2 <= K <= 8, 1 <= T <= 16.
// conv_done: the conv already ran in the in_proj GEMV's epilogue (quant_gemv.h GemvConvArgs): qkv
// holds its outputs, the conv state has advanced, and only the recurrence runs; a 16-bit decode
// step's (T = 1, out, write_state, no counts / offsets / fork_slots). scratch is then the B Hv
// counters alone (int32 [B Hv]), which that GEMV zeroed.
// act_ready: scratch is a verify's scratch over these same T tokens (its fp32 activations: the conv's
// outputs, q / k normalised), kept for its commit: no conv kernel runs; the recurrence reads them, and
// its blocks move the conv states on through the first counts[b] tokens themselves. A commit's (counts,
// write_state, no out / offsets / fork_slots).
struct GdnStepsArgs {
  std::uintptr_t out;
  std::uintptr_t scratch;
  std::uintptr_t qkv;
  std::uintptr_t a;
  std::uintptr_t b;
  std::uintptr_t z;
  std::uintptr_t conv_pool;
  std::uintptr_t state_pool;
  std::uintptr_t slots;
  std::uintptr_t counts;
  std::uintptr_t offsets;
  std::uintptr_t fork_slots;
  std::uintptr_t conv_weight;
  std::uintptr_t A_log;
  std::uintptr_t dt_bias;
  std::uintptr_t norm_weight;
  std::int64_t qkv_stride;
  std::int64_t ab_stride;
  std::int64_t z_stride;
  std::int64_t batch;
  std::int64_t seq_rows;
  int num_tokens;
  bool write_state;
  int num_k_heads;
  int num_v_heads;
  int head_k_dim;
  int head_v_dim;
  int conv_kernel;
  bool conv_done;
  bool act_ready;
  float q_scale;  // head_k_dim^-1/2, rounded to fp32 as torch rounds the Python scalar
  float eps;      // of the gated RMSNorm
  DType dtype;
  int device;
  std::uintptr_t stream;
};

void gdn_steps(const GdnStepsArgs& args);

}  // namespace ninfer

// MoE routing and the fused expert decode step (csrc/moe.cu). Plain C++, raw device pointers.
#pragma once

#include <cstdint>

#include "ops.h"

namespace ninfer {

// Limits of the kernels (moe.cu), checked at the binding: a token's top-k and probabilities in one
// warp's registers, the decode kernels' static shared memory, the router kernel's batch.
inline constexpr int kMoeMaxTopK = 64;
inline constexpr int kMoeMaxRouteExperts = 512;
inline constexpr int kMoeMaxSharedBytes = 48 * 1024;
inline constexpr int kMoeRouterMaxTokens = 8;

// Softmax over all experts in fp32, top-k (descending; ties to the lower id), optional
// renormalisation of the k weights, weights rounded to the logits' dtype.
//   logits [tokens, experts] (dtype), weights [tokens, top_k] (dtype), ids [tokens, top_k] int32.
struct MoeRouteArgs {
  std::uintptr_t weights;
  std::uintptr_t ids;
  std::uintptr_t logits;
  // 0, or [tokens] int64: token n routes logits row rows[n] (a padded prompt chunk's padding tokens
  // route as real ones, so they hit no expert the real tokens do not; moe_route only: the router
  // kernel, at most kMoeRouterMaxTokens rows, leaves this 0)
  std::uintptr_t rows;
  std::int64_t tokens;
  std::int64_t experts;
  std::int64_t top_k;
  bool renormalize;
  DType dtype;
  int device;
  std::uintptr_t stream;
};

void moe_route(const MoeRouteArgs& args);

// The router of a decode step (1..8 tokens, fp16 / bf16) in one launch: logits [tokens, rows] =
// x [tokens, hidden] @ w [rows, hidden]^T (fp32 sums rounded to dtype; rows past `experts` are
// extra outputs such as a shared expert's gate), then moe_route over the first `experts` columns.
// `route`: moe_route's arguments, its logits the router's output (tokens x rows, of which the first
// `experts` columns are routed). `done`: a uint32 counter that is 0 before the launch and 0 after
// it (its last block resets it).
// With `norm.residual` set, x is the delta of the residual add that precedes the MoE's RMSNorm
// (csrc/rmsnorm.cu's fused form, folded in: one launch fewer a layer): the router reads
// norm(x + residual), and writes the normed rows [tokens, hidden] to `norm.normed` and the sums
// to `norm.residual_out`, bit-equal to rmsnorm's (same roundings, same order of the sum of squares;
// hidden / 8 a multiple of 32 and at most 256 vectors). Outputs must not overlap the inputs.
// hidden is at most kMoeRouterMaxHidden.
constexpr std::int64_t kMoeRouterMaxHidden = 4096;
struct RouterNormArgs {
  std::uintptr_t residual;  // 0: x is already normed
  std::uintptr_t weight;    // [hidden], dtype
  std::uintptr_t normed;
  std::uintptr_t residual_out;
  float eps;
  bool zero_centered;
};

struct MoeRouterArgs {
  MoeRouteArgs route;
  // 0, or [1] int32: the tokens from live[0] on are a graph's spare rows, routed dead (ids -1,
  // weights 0): the decode kernels read no expert for them (moe_decode_mma.cu, moe.cu)
  std::uintptr_t live;
  std::uintptr_t done;
  std::uintptr_t x;
  std::uintptr_t w;
  std::int64_t hidden;
  std::int64_t rows;
  RouterNormArgs norm;
};

void moe_router(const MoeRouterArgs& args);

// The (token, slot) pairs of ids [slots] (int32, e.g. [tokens, top_k] flattened) grouped by
// expert for the grouped GEMMs, on the device (no host sync):
//   sorted_slots int32 [capacity]: expert 0's slot ids, padded with `slots` to a multiple of
//                 block_m, then expert 1's, ...; the rest up to capacity is padding too;
//   block_experts int32 [capacity / block_m]: the expert of each block of positions (past
//                 *used: the last expert);  used int32 [1]: the positions in use.
// An id outside [0, experts) is left out. capacity >= moe_align_capacity(...): the most blocks
// any routing needs, so shapes never depend on the routing.
struct MoeAlignArgs {
  std::uintptr_t sorted_slots;
  std::uintptr_t block_experts;
  std::uintptr_t used;
  std::uintptr_t ids;
  std::int64_t slots;
  std::int64_t experts;
  int block_m;  // 8, 16, 32, 64 or 128
  std::int64_t capacity;
  int device;
  std::uintptr_t stream;
};

// sum over experts of ceil(count / block_m) <= (slots + hit * (block_m - 1)) / block_m, with at
// most min(experts, slots) experts hit.
inline std::int64_t moe_align_capacity(std::int64_t slots, std::int64_t experts, int block_m) {
  const std::int64_t hit = slots < experts ? slots : experts;
  return (slots + hit * (block_m - 1)) / block_m * block_m;
}

void moe_align(const MoeAlignArgs& args);

// out [tokens, hidden] = sum_j weights[n, j] * y[n * top_k + j] for each token n: the grouped paths'
// slot outputs y [tokens * top_k, hidden] (f16 / bf16, hidden % 8 == 0) weighted by the routing and
// summed, as ninfer_core/ops/moe_align.py combine_slots_ref does (its roundings: the weights rounded to
// y's dtype, fp32 sums, one rounding). weights [tokens, top_k] f32 / f16 / bf16, top_k <= kMoeMaxTopK.
struct MoeCombineArgs {
  std::uintptr_t out;
  std::uintptr_t y;
  std::uintptr_t weights;
  std::int64_t tokens;
  std::int64_t top_k;
  std::int64_t hidden;
  DType dtype;
  DType weights_dtype;
  int device;
  std::uintptr_t stream;
};

void moe_combine(const MoeCombineArgs& args);

// How a fused expert tensor [E, N, K] is stored (the formats of ninfer_core/ops/quant.py).
enum class ExpertKind : int {
  Dense = 0,  // weight: [E, N, K] in the activation dtype; scales: 0
  Int8 = 1,   // weight: int8 [E, N, K]; scales: fp32 [E, N]; w = q * scale
  Int4 = 2,   // weight: uint8 [E, N, K / 2], element 2j in the low nibble of byte j, stored q + 8;
              // scales: bf16 [E, N, K / group_size]; w = (nibble - 8) * scale[k / group_size]
};

struct ExpertWeights {
  std::uintptr_t weight;
  std::uintptr_t scales;
  ExpertKind kind;
  int group_size;  // Int4 only: a multiple of 32 dividing K
};

// One decode step of the routed experts, for a few tokens (the whole step is two kernels):
//   h[n, j]  = round(round(silu(round(g))) * round(u)),  [g | u] = gate_up[ids[n, j]] @ x[n]
//   out[n]   = round(sum_j weights[n, j] * down[ids[n, j]] @ h[n, j])   (fp32 sum, no atomics)
// x, out [tokens, hidden] and the scratch h [tokens, top_k, inter] in dtype; weights (in
// weights_dtype) and ids (int32) [tokens, top_k] are read on the device (no host sync, so the
// step is graph-capturable). gate_up is
// [E, 2 * inter, hidden] (gate rows first), down [E, hidden, inter]. An id outside [0, experts)
// contributes nothing.
struct MoeDecodeArgs {
  std::uintptr_t out;
  std::uintptr_t h;
  std::uintptr_t x;
  std::uintptr_t weights;
  std::uintptr_t ids;
  ExpertWeights gate_up;
  ExpertWeights down;
  std::int64_t tokens;
  std::int64_t top_k;
  std::int64_t hidden;
  std::int64_t inter;
  std::int64_t experts;
  DType dtype;
  DType weights_dtype;
  int device;
  std::uintptr_t stream;
  // A shared expert (shared_inter > 0; fp16 / bf16 x, quantized routed experts, int8 / int4
  // weights) rides along: its gate_up rows in extra gate_up blocks, into h[n, top_k] (h rows are
  // then top_k * inter + shared_inter long), its down row beside the routed ones, and
  //   out[n] = round(round(routed) + round(round(shared_down @ h_s) * round(sigmoid(g[n]))))
  // with g[n] = shared_gate[n * shared_gate_stride]: the roundings of the composed kernels.
  ExpertWeights shared_gate_up = {};  // [2 * shared_inter, hidden]
  ExpertWeights shared_down = {};     // [hidden, shared_inter]
  std::int64_t shared_inter = 0;
  std::uintptr_t shared_gate = 0;     // [tokens] logits in dtype
  std::int64_t shared_gate_stride = 0;
};

void moe_decode(const MoeDecodeArgs& args);

// moe_decode's two kernels on tensor cores (csrc/moe_decode_mma.cu) where they cover the call:
// fp16 / bf16, int4 experts in groups of 128 (hidden 512 / 1,024 / 2,048 / 4,096, inter a multiple
// of 128 up to 512), top_k <= 8, an int8 shared expert (per-row scales) or none. Returns false,
// launching nothing, otherwise. The arguments are moe_decode's, already checked.
bool moe_decode_mma(const MoeDecodeArgs& args);

}  // namespace ninfer

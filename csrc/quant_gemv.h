// Weight-only int8 / int4 GEMV: out[m, n] = x[m, k] @ W^T (+ bias), decode and short prefills.
// Plain C++ (no CUDA or torch types): tensors travel as raw device pointers.
#pragma once

#include <cstdint>

#include "ops.h"

namespace ninfer {

// Rows go 16 per block (along grid y), each block reading the weight once (after the first, mostly
// from L2): decode batches, and short prompt chunks instead of a dequantized copy + GEMM.
inline constexpr int kQuantGemvMaxRows = 1024;

// The add + RMSNorm a plain GEMV may fold in front (GemvAddNormArgs): up to 4 rows (batch-1 decode,
// a verify round of 3 drafts; at 8 rows every block norming all of them cost more than the launch it
// saves: batch-8 decode 1,419 -> 1,336 tok/s on the H200), k <= 8192 (one vector of a row per
// rmsnorm thread).
inline constexpr int kQuantGemvNormMaxRows = 4;
inline constexpr int kQuantGemvNormMaxK = 8192;
inline constexpr int kQuantGemvConvMaxTaps = 8;  // the conv epilogue's kernel width (GemvConvArgs)
inline constexpr int kQuantGemvConvMaxRows = 8;  // its rows without the norm (with it, the norm's limit)

// Weight formats (ninfer_core/ops/quant.py):
//   int8: qweight int8 [n, k], scales fp32 [n]; w = q * scale.
//   int4: qweight uint8 [n, k / 2], element 2j in the low nibble of byte j and 2j + 1 in the
//         high nibble, each stored as q + 8; scales bf16 [n, k / group_size]; w = q * scale.
// Accumulation is fp32. int8 is exact up to summation order; the int4 path rounds q * scale to
// the activation dtype for fp16 / bf16 (the weights dequantize(qw, x.dtype) gives), and is exact
// for fp32. Limits (std::invalid_argument otherwise): 1 <= m <= 1024; int8: k % 16 == 0;
// int4: group_size in {32, 64, 128}, k % group_size == 0; x and qweight 16-byte aligned.
// Two epilogues fold the elementwise kernel that would follow into the GEMV (ops/quant.py):
//   gate_up: W is [2n, k] = [gate; up], out[m, i] = round(round(silu(round(g))) * round(u)) with
//            g = gate row i . x[m], u = up row i . x[m] (a SwiGLU MLP's first half; no bias);
//   gate / add: out[m, i] = round(add[m, i] + round(round(v) * round(sigmoid(gate[m * gate_stride]))))
//            with v the plain output (the shared expert's down projection, its sigmoid gate and
//            the routed experts' sum); add may be 0 alone or with gate.
// Both give exactly the roundings of the separate kernels (csrc/activation.cu).
//
// The norm (residual != 0) folds the add + RMSNorm before the GEMV in front of it: x is then the
// delta of the residual stream and out = norm(x + residual) @ W^T (+ bias), norm(s) = rmsnorm(s)
// with its weight, zero-centred or not; residual_out = x + residual rounded to dtype. Both are
// bit-equal to csrc/rmsnorm.cu's add_rmsnorm (its 16-byte path) then the plain GEMV. fp16 / bf16,
// Dense layout (no gate_up, gate or add), within the kQuantGemvNorm limits; residual, weight ([k],
// dtype) and residual_out 16-byte aligned; residual_out and out overlap none of x, residual and
// each other.
struct GemvAddNormArgs {
  std::uintptr_t residual = 0;      // [m, k] in dtype; 0: no norm
  std::uintptr_t weight = 0;        // [k] in dtype
  std::uintptr_t residual_out = 0;  // [m, k] in dtype
  float eps = 0.0f;
  bool zero_centered = false;
};

// The conv (pool != 0) a GEMV may run as its epilogue: a GDN decode step's depthwise causal conv +
// SiLU (ninfer_core/ops/gdn.py gdn_decode_step_folded), one launch fewer than its own kernel; with
// the norm folded in front (up to kQuantGemvNormMaxRows rows) or without it (a plain 16-bit GEMV of
// up to kQuantGemvConvMaxRows rows, the norm run before: batches past the norm's limit).
// Output c < channels of row i is the newest input of channel c's conv, whose state pool[slots[i]]
// [channels, taps - 1] holds the previous inputs, oldest first:
//   out[i, c] = round(silu(sum_j weight[c, j] w_j)),  w = [state | round(v)],  v the plain output,
// in fp32 with one FMA a tap, oldest first (gdn_decode.cu's conv kernel, bit for bit); the state
// drops its oldest input for round(v). Outputs c >= channels are the plain ones. The kernel also
// zeroes zeroed[0 .. zeroed_count - 1] (int32): the completion counters of the GDN recurrent kernel
// that follows it, which the conv kernel zeroes otherwise. Dense layout; channels % 16 == 0 and
// <= n, 2 <= taps <= kQuantGemvConvMaxTaps; pool (contiguous [S, channels, taps - 1]) and weight
// ([channels, taps]) in dtype and 16-byte aligned, overlapping no other operand; slots [m] int64,
// distinct. Weights, states and slots are read before the wait for the kernel launched just before
// (launch.cuh): none of them may come from it. The binding (bind_quant.cpp: conv_pool, conv_weight,
// conv_slots, zeroed) reads channels and taps off the weight and zeroed_count off `zeroed`, and checks
// all of this but what lies in device memory (the slots' values: distinct and < S).
struct GemvConvArgs {
  std::uintptr_t pool = 0;  // 0: no conv
  std::uintptr_t weight = 0;
  std::uintptr_t slots = 0;
  std::uintptr_t zeroed = 0;
  std::int64_t channels = 0;
  int taps = 0;
  int zeroed_count = 0;
};

struct QuantGemvArgs {
  std::uintptr_t out;      // [m, n] in dtype
  std::uintptr_t x;        // [m, k] in dtype, contiguous
  std::uintptr_t qweight;  // contiguous
  std::uintptr_t scales;   // contiguous
  std::uintptr_t bias;     // [n] in dtype; 0 for none
  std::int64_t m;
  std::int64_t n;
  std::int64_t k;
  int group_size;  // int4 only
  bool int4;
  DType dtype;
  int device;
  std::uintptr_t stream;  // cudaStream_t as an integer (torch's Stream.cuda_stream)
  bool gate_up = false;          // W is [2n, k]: SwiGLU epilogue
  std::uintptr_t gate = 0;       // [m] logits in dtype, gate_stride elements apart; 0 for none
  std::int64_t gate_stride = 0;
  std::uintptr_t add = 0;        // [m, n] in dtype, contiguous; 0 for none
  GemvAddNormArgs norm = {};
  GemvConvArgs conv = {};
  int* split_used = nullptr;  // where the launch writes its K split (warps a tile); null: nowhere
};

void quant_gemv(const QuantGemvArgs& args);

// The same GEMV over MoE experts grouped by moe_align (csrc/moe.h): slot block b (block_m slots of
// expert block_experts[b]; positions at or past *used are idle) multiplies its slots' x rows by
// that expert's weight [expert_rows, k], gemv.qweight / gemv.scales being [E, expert_rows, ...]
// in the formats above. fp16 / bf16 activations, no bias; gemv.m is unused.
//   gate_up (expert_rows = 2 n):  out[s, i] = round(round(silu(round(g))) * round(u)),
//                                 g = gate row i . x[s / rows_per_x], u = up row n + i . x[...]
//   down    (expert_rows = n):    out[s, i] = row i . x[s / rows_per_x]
// Every real slot's row of out is written once; the weights of an expert are read once per block.
struct GroupedGemvArgs {
  QuantGemvArgs gemv;           // out [num_slots, n], x, qweight, scales, n, k, format, stream
  std::uintptr_t sorted_slots;  // int32 [blocks * block_m]; padding entries hold num_slots
  std::uintptr_t block_experts; // int32 [blocks]
  std::uintptr_t used;          // int32 [1]
  std::int64_t blocks;
  int block_m;                  // 8, 16 or 32
  std::int64_t num_slots;
  int rows_per_x;
  bool gate_up;
};

void moe_grouped_gemv(const GroupedGemvArgs& args);

// The dense weight [rows, k] in dtype from int8 / int4 codes (formats above): w = q * scale in
// fp32, rounded once (csrc/dequant.cu). Needs k % 8 == 0, out 16-byte and qweight 8-byte aligned.
struct DequantArgs {
  std::uintptr_t out;
  std::uintptr_t qweight;
  std::uintptr_t scales;
  std::int64_t rows;  // all leading dims flattened
  std::int64_t k;
  int group_size;  // int4 only
  bool int4;
  DType dtype;
  int device;
  std::uintptr_t stream;
};

void dequant(const DequantArgs& args);

}  // namespace ninfer

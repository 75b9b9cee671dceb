// The routed experts of a MoE layer's decode step on the CPU (ops/moe.py `_cpu_experts`), with the
// shared expert, in one call: the Python loop over hit experts is ~10 torch ops an expert (~0.3 ms of
// a 35B layer's 2.2 ms, most of a small model's), the same GEMVs in the same order here.
#pragma once

#include <cstdint>

#include "decode_layer.h"

namespace ninfer::cpu {

// E experts' [n, k] weights stacked ([E, n, k] codes, [E, n, groups] scales / offsets; or K-quant
// blocks, each expert's packed on its own, [E, bytes]): expert e's pointers are `first`'s plus e
// times the strides, in bytes (a K-quant expert's blocks move by codes_stride).
struct ExpertWeights {
  LayerLinear first;
  std::int64_t codes_stride, scales_stride, offsets_stride;
};

struct MoeArgs {
  float* out;                // [N, H]
  const float* x;            // [N, H]
  const float* weights;      // [N, k] routing weights
  const std::int32_t* ids;   // [N, k] expert ids, distinct within a row
  std::int64_t tokens, top_k, num_experts;
  ExpertWeights gate_up;     // [E, 2I, H], gate rows first
  ExpertWeights down;        // [E, H, I]
  // the shared expert, or null: out += sigmoid(shared_gate[t]) * down(silu(g) * u), [g | u] = gate_up(x)
  const LayerLinear* shared_gate_up;  // [2 I_s, H]
  const LayerLinear* shared_down;     // [H, I_s]
  const float* shared_gate;           // token t's logit at t * shared_gate_stride
  std::int64_t shared_gate_stride;
  int threads;
  bool int8_activations;
};

// out[t] = sum over t's experts e, in ascending e, of weights[t, j] * down_e(silu(g) * u), [g | u] =
// gate_up_e(x[t]): each hit expert's tokens multiplied together (ops/moe.py `_hit_experts`' order).
// An id outside [0, num_experts) throws std::out_of_range before anything is written.
void moe_experts(const MoeArgs& args);

// A MoE layer of a decode step after the mixer, in one call (layers/moe.py SparseMoE.add_norm_forward,
// whose Python path is a router GEMM and ~10 torch ops around the experts' call, ~0.15 ms of a 35B
// layer): h = norm(x + residual) (add_rmsnorm; the sum to residual_out), logits = h @ router^T, the
// softmax of the first num_experts logits in fp32, its top_k in descending order (ties: the lower id)
// renormalized to sum 1 where asked, then moe_experts over h, the shared expert gated by logit
// num_experts. `experts` holds the experts, shared ones and threads; its x, weights, ids and shared
// gate are set here.
struct MoeLayerArgs {
  MoeArgs experts;
  const float* x;             // [N, H]: the mixer's output
  const float* residual;      // [N, H]
  const float* norm_weight;   // [H]
  float* residual_out;        // [N, H]: x + residual
  float eps;
  bool zero_centered;
  const float* router;        // [router_rows, H]: the experts' rows, then the shared expert's gate (if any)
  std::int64_t router_rows;
  bool renormalize;
  float* normed;              // [N, H]
  float* logits;              // [N, router_rows]
  float* weights;             // [N, top_k]
  std::int32_t* ids;          // [N, top_k]
};

void moe_layer(const MoeLayerArgs& args);

}  // namespace ninfer::cpu

// One attention decoder layer of a Llama-family model (Llama, SmolLM, Qwen2, Qwen3) decoding on the
// CPU with compact weights, in one call: the ops of decode_ops.h and quant_matmul.h in the order
// layers/attention.py and models/decoder.py run them. Why: a small model's decode step is ~10
// Python-wrapped calls per layer at 10-25 us each, as much time as its matmuls (SmolLM2-135M:
// ~6 of 19 ms); one call per layer leaves the arithmetic.
#pragma once

#include <cstdint>

#include "decode_ops.h"
#include "kquant.h"
#include "quant_matmul.h"

namespace ninfer::cpu {

struct LayerLinear {
  bool kquant;      // kw (K-quant blocks, int8 activations) rather than w
  QuantWeight w;
  KQuantWeight kw;
  const float* bias;  // [n] or null
};

// out [rows, n] = x [rows, k] @ l^T (+ bias): quant_matmul or kquant_matmul.
void layer_linear(const LayerLinear& l, float* out, const float* x, std::int64_t rows, int threads,
                  bool int8_activations);
std::int64_t layer_linear_rows(const LayerLinear& l);    // n
std::int64_t layer_linear_inputs(const LayerLinear& l);  // k

struct DecodeLayerArgs {
  // the layer
  const float* input_norm;  // [hidden]
  const float* post_norm;   // [hidden]
  const float* q_norm;      // [head_dim] or null (Qwen3's per-head q / k norms)
  const float* k_norm;
  float eps;
  LayerLinear qkv, o, gate_up, down;  // qkv: [q | k | v] rows; gate_up: [gate | up]
  std::int64_t hidden, heads, kv_heads, head_dim, rotary_dim;
  // the step: tokens = batch * num_new rows
  const float* x;         // [tokens, hidden] the previous layer's output (layer 0: the embeddings)
  const float* residual;  // [tokens, hidden] or null on layer 0
  float* out;             // [tokens, hidden] this layer's output
  float* residual_out;    // [tokens, hidden] x + residual + attention: the stream after this layer's mixer
  const float* cos;       // [tokens, rotary_dim]
  const float* sin;
  float* k_cache;  // [pages, page_size, kv_heads, head_dim] of `cache`'s type
  float* v_cache;
  CacheType cache;
  const std::int64_t* slots;         // [tokens] flat cache row of each new token
  const std::int32_t* block_table;   // [batch, table_width]
  const std::int64_t* cache_lens;    // [batch]
  std::int64_t batch, num_new, page_size, table_width;
  float scale;
  float* scratch;  // decode_layer_scratch() floats
  int threads;
  bool int8_activations;
};

// Floats of scratch a call needs.
std::int64_t decode_layer_scratch(std::int64_t tokens, std::int64_t hidden, std::int64_t intermediate);

void decode_layer(const DecodeLayerArgs& a);

// A gated-attention layer's token mixer of a decode step in one call (Qwen3.5 / 3.6: layers/attention.py
// with the input norm pending): h = norm(x + residual) (the sum to residual_out), qkv(h) whose q rows
// hold each head's query then, with output_gate, its gate ([q_h | gate_h]), q / k head norms, rotary
// on the first rotary_dim, k / v to the cache, decode attention, times sigmoid(gate), o_proj. The same
// kernels in the order the layer calls them one by one (its gate: torch's sigmoid, an ulp apart).
struct AttentionMixerArgs {
  LayerLinear qkv, o;
  const float* input_norm;  // [hidden]
  float norm_eps;
  bool norm_zero_centered;
  const float* q_norm;  // [head_dim] or null, with k_norm
  const float* k_norm;
  float head_eps;
  bool head_zero_centered;
  std::int64_t heads, kv_heads, head_dim, rotary_dim;
  bool output_gate;
  const float* x;         // [tokens, hidden]: the residual stream's delta
  const float* residual;  // [tokens, hidden]
  float* residual_out;    // [tokens, hidden]
  float* out;             // [tokens, hidden]
  const float* cos;       // [tokens, rotary_dim]
  const float* sin;
  float* k_cache;
  float* v_cache;
  CacheType cache;
  const std::int64_t* slots;
  const std::int32_t* block_table;
  const std::int64_t* cache_lens;
  std::int64_t batch, num_new, page_size, table_width;
  float scale;
  int threads;
  bool int8_activations;
};

void attention_mixer(const AttentionMixerArgs& a);

// A dense SwiGLU MLP block of a decode step in one call (a Qwen3.5 / 3.6 dense layer after its mixer;
// decode_layer's second half): h = norm(x + residual), the sum to residual_out (which may be residual
// itself), out = down(silu(gate) * up) for [gate | up] = gate_up(h). The kernels the layer's calls
// run one by one (add_rmsnorm, the projections, silu_mul), in their order: the same bits.
struct MlpBlockArgs {
  LayerLinear gate_up, down;
  const float* norm;  // [hidden]
  float eps;
  bool zero_centered;
  const float* x;         // [tokens, hidden]
  const float* residual;  // [tokens, hidden]
  float* residual_out;    // [tokens, hidden]
  float* out;             // [tokens, hidden]
  std::int64_t tokens;
  float* scratch;  // mlp_block_scratch() floats
  int threads;
  bool int8_activations;
};
std::int64_t mlp_block_scratch(std::int64_t tokens, std::int64_t hidden, std::int64_t intermediate);
void mlp_block(const MlpBlockArgs& a);

}  // namespace ninfer::cpu

#include "decode_layer.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "decode_ops.h"

namespace ninfer::cpu {

void layer_linear(const LayerLinear& l, float* out, const float* x, std::int64_t rows, int threads,
                  bool int8_activations) {
  const auto out_p = reinterpret_cast<std::uintptr_t>(out), x_p = reinterpret_cast<std::uintptr_t>(x);
  const auto bias_p = reinterpret_cast<std::uintptr_t>(l.bias);
  if (l.kquant) {
    kquant_matmul({l.kw, out_p, x_p, bias_p, rows, threads});
  } else {
    quant_matmul({l.w, out_p, x_p, bias_p, rows, threads, int8_activations});
  }
}

std::int64_t layer_linear_rows(const LayerLinear& l) {
  if (!l.kquant) return l.w.n;
  std::int64_t n = 0;
  for (int i = 0; i < l.kw.parts; ++i) n += l.kw.part[i].rows;
  return n;
}

std::int64_t layer_linear_inputs(const LayerLinear& l) { return l.kquant ? l.kw.k : l.w.k; }

namespace {

// The attention of a step's normed rows, qkv to o_proj's output `out` (decode_layer and
// attention_mixer): qkv's rows [q (| gate) | k | v], each head's query then (output_gate) its gate,
// the head norms, rotary, the KV append, decode attention (times sigmoid(gate)), o. Only a's
// attention fields are read; its buffers are the calling thread's, kept between calls.
void attend(const AttentionMixerArgs& a, const float* normed, float* out) {
  const std::int64_t tokens = a.batch * a.num_new, dim = a.head_dim;
  const std::int64_t q_width = a.heads * dim, kv_width = a.kv_heads * dim;
  const std::int64_t q_rows = a.output_gate ? 2 * q_width : q_width, width = q_rows + 2 * kv_width;
  thread_local std::vector<float> buffer;
  buffer.resize(tokens * (width + 3 * q_width + 2 * kv_width));
  float* projected = buffer.data();
  float* q = projected + tokens * width;
  float* gate = q + tokens * q_width;  // output_gate only
  float* k = gate + tokens * q_width;
  float* v = k + tokens * kv_width;
  float* attention = v + tokens * kv_width;
  layer_linear(a.qkv, projected, normed, tokens, a.threads, a.int8_activations);
  const std::int64_t per_head = a.output_gate ? 2 * dim : dim;  // a head's [query | gate]
  for (std::int64_t t = 0; t < tokens; ++t) {
    const float* row = projected + t * width;
    for (std::int64_t h = 0; h < a.heads; ++h) {
      std::memcpy(q + t * q_width + h * dim, row + h * per_head, dim * sizeof(float));
      if (a.output_gate) std::memcpy(gate + t * q_width + h * dim, row + h * per_head + dim, dim * sizeof(float));
    }
    std::memcpy(k + t * kv_width, row + q_rows, kv_width * sizeof(float));
    std::memcpy(v + t * kv_width, row + q_rows + kv_width, kv_width * sizeof(float));
  }
  if (a.q_norm) {
    add_rmsnorm(q, nullptr, q, nullptr, a.q_norm, tokens * a.heads, dim, a.head_eps, a.head_zero_centered);
    add_rmsnorm(k, nullptr, k, nullptr, a.k_norm, tokens * a.kv_heads, dim, a.head_eps, a.head_zero_centered);
  }
  rotary(q, q, a.cos, a.sin, tokens, a.heads, dim, a.rotary_dim);
  rotary(k, k, a.cos, a.sin, tokens, a.kv_heads, dim, a.rotary_dim);
  const auto k_cache = reinterpret_cast<std::uintptr_t>(a.k_cache);
  const auto v_cache = reinterpret_cast<std::uintptr_t>(a.v_cache);
  if (a.cache != CacheType::F32) {
    write_kv_narrow(k_cache, v_cache, k, v, a.slots, tokens, kv_width, a.cache);
  } else {
    write_kv(k_cache, v_cache, reinterpret_cast<std::uintptr_t>(k), reinterpret_cast<std::uintptr_t>(v), a.slots,
             tokens, kv_width * static_cast<std::int64_t>(sizeof(float)));
  }
  decode_attention({attention, q, a.k_cache, a.v_cache, a.block_table, a.cache_lens, a.batch, a.num_new, a.heads,
                    a.kv_heads, dim, a.page_size, a.table_width, a.scale, a.threads, a.cache});
  if (a.output_gate) {
    for (std::int64_t i = 0; i < tokens * q_width; ++i) attention[i] *= 1.0f / (1.0f + std::exp(-gate[i]));
  }
  layer_linear(a.o, out, attention, tokens, a.threads, a.int8_activations);
}

}  // namespace

std::int64_t mlp_block_scratch(std::int64_t tokens, std::int64_t hidden, std::int64_t intermediate) {
  return tokens * (hidden + 3 * intermediate);  // normed, gate|up, act
}

void mlp_block(const MlpBlockArgs& a) {
  const std::int64_t hidden = layer_linear_rows(a.down), intermediate = layer_linear_inputs(a.down);
  float* normed = a.scratch;
  float* gate_up = normed + a.tokens * hidden;
  float* act = gate_up + a.tokens * 2 * intermediate;
  add_rmsnorm(normed, a.residual_out, a.x, a.residual, a.norm, a.tokens, hidden, a.eps, a.zero_centered);
  layer_linear(a.gate_up, gate_up, normed, a.tokens, a.threads, a.int8_activations);
  silu_mul(act, gate_up, a.tokens, intermediate);
  layer_linear(a.down, a.out, act, a.tokens, a.threads, a.int8_activations);
}

std::int64_t decode_layer_scratch(std::int64_t tokens, std::int64_t hidden, std::int64_t intermediate) {
  // o, then the MLP block's (its normed rows are the attention's input before)
  return tokens * hidden + mlp_block_scratch(tokens, hidden, intermediate);
}

void decode_layer(const DecodeLayerArgs& a) {
  const std::int64_t tokens = a.batch * a.num_new;
  float* o = a.scratch;
  float* normed = o + tokens * a.hidden;  // the MLP block's scratch begins with its normed rows

  // h = norm(x + residual); the stream so far to residual_out (layer 0: the embeddings)
  if (a.residual) {
    add_rmsnorm(normed, a.residual_out, a.x, a.residual, a.input_norm, tokens, a.hidden, a.eps, false);
  } else {
    std::memcpy(a.residual_out, a.x, tokens * a.hidden * sizeof(float));
    add_rmsnorm(normed, nullptr, a.x, nullptr, a.input_norm, tokens, a.hidden, a.eps, false);
  }
  AttentionMixerArgs attention{};
  attention.qkv = a.qkv, attention.o = a.o;
  attention.q_norm = a.q_norm, attention.k_norm = a.k_norm, attention.head_eps = a.eps;
  attention.heads = a.heads, attention.kv_heads = a.kv_heads, attention.head_dim = a.head_dim;
  attention.rotary_dim = a.rotary_dim;
  attention.cos = a.cos, attention.sin = a.sin, attention.k_cache = a.k_cache, attention.v_cache = a.v_cache;
  attention.cache = a.cache, attention.slots = a.slots, attention.block_table = a.block_table;
  attention.cache_lens = a.cache_lens, attention.batch = a.batch, attention.num_new = a.num_new;
  attention.page_size = a.page_size, attention.table_width = a.table_width, attention.scale = a.scale;
  attention.threads = a.threads, attention.int8_activations = a.int8_activations;
  attend(attention, normed, o);
  // h = norm(o + stream), the stream going on in residual_out; the MLP of h
  MlpBlockArgs mlp{};
  mlp.gate_up = a.gate_up, mlp.down = a.down, mlp.norm = a.post_norm, mlp.eps = a.eps, mlp.zero_centered = false;
  mlp.x = o, mlp.residual = a.residual_out, mlp.residual_out = a.residual_out, mlp.out = a.out;
  mlp.tokens = tokens, mlp.scratch = normed, mlp.threads = a.threads, mlp.int8_activations = a.int8_activations;
  mlp_block(mlp);
}

void attention_mixer(const AttentionMixerArgs& a) {
  const std::int64_t tokens = a.batch * a.num_new, hidden = layer_linear_inputs(a.qkv);
  std::vector<float> normed(tokens * hidden);
  add_rmsnorm(normed.data(), a.residual_out, a.x, a.residual, a.input_norm, tokens, hidden, a.norm_eps,
              a.norm_zero_centered);
  attend(a, normed.data(), a.out);
}

}  // namespace ninfer::cpu

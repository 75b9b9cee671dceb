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

void linear(const LayerLinear& l, float* out, const float* x, std::int64_t rows, const DecodeLayerArgs& a) {
  layer_linear(l, out, x, rows, a.threads, a.int8_activations);
}

}  // namespace

std::int64_t decode_layer_scratch(std::int64_t tokens, std::int64_t hidden, std::int64_t heads,
                                  std::int64_t kv_heads, std::int64_t head_dim, std::int64_t intermediate) {
  const std::int64_t q = heads * head_dim, kv = kv_heads * head_dim;
  // normed, q|k|v, q, k, v, attention, o, gate|up, act
  return tokens * (hidden + (q + 2 * kv) + q + 2 * kv + q + hidden + 3 * intermediate);
}

void decode_layer(const DecodeLayerArgs& a) {
  const std::int64_t tokens = a.batch * a.num_new, q_width = a.heads * a.head_dim, kv_width = a.kv_heads * a.head_dim;
  const std::int64_t qkv_width = q_width + 2 * kv_width;
  float* normed = a.scratch;
  float* qkv = normed + tokens * a.hidden;
  float* q = qkv + tokens * qkv_width;
  float* k = q + tokens * q_width;
  float* v = k + tokens * kv_width;
  float* attention = v + tokens * kv_width;
  float* o = attention + tokens * q_width;
  float* gate_up = o + tokens * a.hidden;
  float* act = gate_up + tokens * 2 * a.intermediate;

  // h = norm(x + residual); the stream so far to residual_out (layer 0: the embeddings)
  if (a.residual) {
    add_rmsnorm(normed, a.residual_out, a.x, a.residual, a.input_norm, tokens, a.hidden, a.eps, false);
  } else {
    std::memcpy(a.residual_out, a.x, tokens * a.hidden * sizeof(float));
    add_rmsnorm(normed, nullptr, a.x, nullptr, a.input_norm, tokens, a.hidden, a.eps, false);
  }
  linear(a.qkv, qkv, normed, tokens, a);
  for (std::int64_t t = 0; t < tokens; ++t) {  // [q | k | v] rows -> contiguous heads
    const float* row = qkv + t * qkv_width;
    std::memcpy(q + t * q_width, row, q_width * sizeof(float));
    std::memcpy(k + t * kv_width, row + q_width, kv_width * sizeof(float));
    std::memcpy(v + t * kv_width, row + q_width + kv_width, kv_width * sizeof(float));
  }
  if (a.q_norm) {
    add_rmsnorm(q, nullptr, q, nullptr, a.q_norm, tokens * a.heads, a.head_dim, a.eps, false);
    add_rmsnorm(k, nullptr, k, nullptr, a.k_norm, tokens * a.kv_heads, a.head_dim, a.eps, false);
  }
  rotary(q, q, a.cos, a.sin, tokens, a.heads, a.head_dim, a.rotary_dim);
  rotary(k, k, a.cos, a.sin, tokens, a.kv_heads, a.head_dim, a.rotary_dim);
  const auto k_cache = reinterpret_cast<std::uintptr_t>(a.k_cache), v_cache = reinterpret_cast<std::uintptr_t>(a.v_cache);
  if (a.cache != CacheType::F32) {
    write_kv_narrow(k_cache, v_cache, k, v, a.slots, tokens, kv_width, a.cache);
  } else {
    write_kv(k_cache, v_cache, reinterpret_cast<std::uintptr_t>(k), reinterpret_cast<std::uintptr_t>(v), a.slots, tokens,
             kv_width * static_cast<std::int64_t>(sizeof(float)));
  }
  decode_attention({attention, q, a.k_cache, a.v_cache, a.block_table, a.cache_lens, a.batch, a.num_new, a.heads,
                    a.kv_heads, a.head_dim, a.page_size, a.table_width, a.scale, a.threads, a.cache});
  linear(a.o, o, attention, tokens, a);
  // h = norm(o + stream); the stream goes on in residual_out
  add_rmsnorm(normed, a.residual_out, o, a.residual_out, a.post_norm, tokens, a.hidden, a.eps, false);
  linear(a.gate_up, gate_up, normed, tokens, a);
  silu_mul(act, gate_up, tokens, a.intermediate);
  linear(a.down, a.out, act, tokens, a);
}

void attention_mixer(const AttentionMixerArgs& a) {
  const std::int64_t tokens = a.batch * a.num_new, hidden = layer_linear_inputs(a.qkv), dim = a.head_dim;
  const std::int64_t q_width = a.heads * dim, kv_width = a.kv_heads * dim;
  const std::int64_t q_rows = a.output_gate ? 2 * q_width : q_width, width = q_rows + 2 * kv_width;
  std::vector<float> normed(tokens * hidden), projected(tokens * width), q(tokens * q_width), gate;
  std::vector<float> k(tokens * kv_width), v(tokens * kv_width), attention(tokens * q_width);
  if (a.output_gate) gate.resize(tokens * q_width);
  add_rmsnorm(normed.data(), a.residual_out, a.x, a.residual, a.input_norm, tokens, hidden, a.norm_eps,
              a.norm_zero_centered);
  layer_linear(a.qkv, projected.data(), normed.data(), tokens, a.threads, a.int8_activations);
  const std::int64_t per_head = a.output_gate ? 2 * dim : dim;  // a head's [query | gate]
  for (std::int64_t t = 0; t < tokens; ++t) {
    const float* row = projected.data() + t * width;
    for (std::int64_t h = 0; h < a.heads; ++h) {
      std::memcpy(q.data() + t * q_width + h * dim, row + h * per_head, dim * sizeof(float));
      if (a.output_gate) {
        std::memcpy(gate.data() + t * q_width + h * dim, row + h * per_head + dim, dim * sizeof(float));
      }
    }
    std::memcpy(k.data() + t * kv_width, row + q_rows, kv_width * sizeof(float));
    std::memcpy(v.data() + t * kv_width, row + q_rows + kv_width, kv_width * sizeof(float));
  }
  if (a.q_norm) {
    add_rmsnorm(q.data(), nullptr, q.data(), nullptr, a.q_norm, tokens * a.heads, dim, a.head_eps,
                a.head_zero_centered);
    add_rmsnorm(k.data(), nullptr, k.data(), nullptr, a.k_norm, tokens * a.kv_heads, dim, a.head_eps,
                a.head_zero_centered);
  }
  rotary(q.data(), q.data(), a.cos, a.sin, tokens, a.heads, dim, a.rotary_dim);
  rotary(k.data(), k.data(), a.cos, a.sin, tokens, a.kv_heads, dim, a.rotary_dim);
  const auto k_cache = reinterpret_cast<std::uintptr_t>(a.k_cache);
  const auto v_cache = reinterpret_cast<std::uintptr_t>(a.v_cache);
  if (a.cache != CacheType::F32) {
    write_kv_narrow(k_cache, v_cache, k.data(), v.data(), a.slots, tokens, kv_width, a.cache);
  } else {
    write_kv(k_cache, v_cache, reinterpret_cast<std::uintptr_t>(k.data()), reinterpret_cast<std::uintptr_t>(v.data()),
             a.slots, tokens, kv_width * static_cast<std::int64_t>(sizeof(float)));
  }
  decode_attention({attention.data(), q.data(), a.k_cache, a.v_cache, a.block_table, a.cache_lens, a.batch, a.num_new,
                    a.heads, a.kv_heads, dim, a.page_size, a.table_width, a.scale, a.threads, a.cache});
  if (a.output_gate) {
    for (std::int64_t i = 0; i < tokens * q_width; ++i) attention[i] *= 1.0f / (1.0f + std::exp(-gate[i]));
  }
  layer_linear(a.o, a.out, attention.data(), tokens, a.threads, a.int8_activations);
}

}  // namespace ninfer::cpu

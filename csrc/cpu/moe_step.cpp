#include "moe_step.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "decode_ops.h"
#include "quant_kernels.h"
#include "thread_pool.h"

namespace ninfer::cpu {
namespace {

LayerLinear expert(const ExpertWeights& w, std::int64_t e) {
  LayerLinear l = w.first;
  if (l.kquant) {
    l.kw.data += e * w.codes_stride;
    return l;
  }
  l.w.codes += e * w.codes_stride;
  l.w.scales += e * w.scales_stride;
  if (l.w.offsets) l.w.offsets += e * w.offsets_stride;
  return l;
}

// out [rows, H] = down(silu(g) * u) with [g | u] = gate_up(x [rows, H]); h, act: scratch
void ffn(const LayerLinear& gate_up, const LayerLinear& down, const float* x, std::int64_t rows, float* h, float* act,
         float* out, const MoeArgs& a) {
  layer_linear(gate_up, h, x, rows, a.threads, a.int8_activations);
  silu_mul(act, h, rows, layer_linear_rows(gate_up) / 2);
  layer_linear(down, out, act, rows, a.threads, a.int8_activations);
}

// The top k of the softmax of logits [experts] into weights / ids (moe.py moe_route_ref's fp32 math).
void route(const float* logits, std::int64_t experts, std::int64_t top_k, bool renormalize, float* weights,
           std::int32_t* ids) {
  std::vector<float> p(logits, logits + experts);
  const float top = *std::max_element(p.begin(), p.end());
  float sum = 0.0f;
  for (float& v : p) sum += (v = std::exp(v - top));
  for (float& v : p) v /= sum;
  float kept = 0.0f;
  for (std::int64_t j = 0; j < top_k; ++j) {
    const auto best = std::max_element(p.begin(), p.end());  // the first of equal maxima: the lower id
    ids[j] = static_cast<std::int32_t>(best - p.begin());
    kept += weights[j] = *best;
    *best = -1.0f;  // probabilities are >= 0
  }
  if (renormalize) {
    for (std::int64_t j = 0; j < top_k; ++j) weights[j] /= kept;
  }
}

}  // namespace

void moe_layer(const MoeLayerArgs& a) {
  MoeArgs e = a.experts;
  const std::int64_t tokens = e.tokens, hidden = layer_linear_rows(e.down.first), rows = a.router_rows;
  add_rmsnorm(a.normed, a.residual_out, a.x, a.residual, a.norm_weight, tokens, hidden, a.eps, a.zero_centered);
  constexpr std::int64_t kRowsATask = 16;  // 2,048-wide fp32 rows: 128 KB of router a task
  const std::int64_t blocks = (rows + kRowsATask - 1) / kRowsATask;
  const IsaKernels& impl = active_kernels();
  parallel_for(tokens * blocks, e.threads, [&](std::int64_t i) {
    const std::int64_t t = i / blocks, r0 = i % blocks * kRowsATask;
    impl.dot_rows(a.normed + t * hidden, a.router, hidden, r0, std::min(rows, r0 + kRowsATask), a.logits + t * rows);
  });
  for (std::int64_t t = 0; t < tokens; ++t) {
    route(a.logits + t * rows, e.num_experts, e.top_k, a.renormalize, a.weights + t * e.top_k, a.ids + t * e.top_k);
  }
  e.x = a.normed, e.weights = a.weights, e.ids = a.ids;
  if (e.shared_gate_up) e.shared_gate = a.logits + e.num_experts, e.shared_gate_stride = rows;
  moe_experts(e);
}

void moe_experts(const MoeArgs& a) {
  const std::int64_t hidden = layer_linear_rows(a.down.first), pairs = a.tokens * a.top_k;
  const std::int64_t widest =
      std::max(layer_linear_rows(a.gate_up.first), a.shared_gate_up ? layer_linear_rows(*a.shared_gate_up) : 0);
  std::vector<float> rows(a.tokens * hidden), h(a.tokens * widest), act(a.tokens * widest / 2), y(a.tokens * hidden);
  std::vector<std::int64_t> order(pairs);  // (token, slot) pairs by expert, then token
  for (std::int64_t i = 0; i < pairs; ++i) {
    if (a.ids[i] < 0 || a.ids[i] >= a.num_experts) throw std::out_of_range("moe_experts: an expert id out of range");
    order[i] = i;
  }
  std::stable_sort(order.begin(), order.end(), [&](std::int64_t i, std::int64_t j) { return a.ids[i] < a.ids[j]; });
  std::memset(a.out, 0, a.tokens * hidden * sizeof(float));
  for (std::int64_t first = 0; first < pairs;) {
    const std::int32_t e = a.ids[order[first]];
    std::int64_t last = first;
    for (; last < pairs && a.ids[order[last]] == e; ++last) {
      std::memcpy(rows.data() + (last - first) * hidden, a.x + order[last] / a.top_k * hidden, hidden * sizeof(float));
    }
    const std::int64_t count = last - first;
    ffn(expert(a.gate_up, e), expert(a.down, e), rows.data(), count, h.data(), act.data(), y.data(), a);
    for (std::int64_t r = 0; r < count; ++r) {
      const std::int64_t pair = order[first + r];
      const float w = a.weights[pair];
      float* o = a.out + pair / a.top_k * hidden;
      const float* yr = y.data() + r * hidden;
      for (std::int64_t i = 0; i < hidden; ++i) o[i] += yr[i] * w;
    }
    first = last;
  }
  if (!a.shared_gate_up) return;
  ffn(*a.shared_gate_up, *a.shared_down, a.x, a.tokens, h.data(), act.data(), y.data(), a);
  for (std::int64_t t = 0; t < a.tokens; ++t) {
    const float gate = 1.0f / (1.0f + std::exp(-a.shared_gate[t * a.shared_gate_stride]));
    float* o = a.out + t * hidden;
    const float* yr = y.data() + t * hidden;
    for (std::int64_t i = 0; i < hidden; ++i) o[i] += gate * yr[i];
  }
}

}  // namespace ninfer::cpu

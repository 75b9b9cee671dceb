#include "gdn_step.h"

#include <vector>

#include "decode_ops.h"
#include "quant_kernels.h"
#include "thread_pool.h"

namespace ninfer::cpu {

void gdn_steps(const GdnStepArgs& a) {
  constexpr std::int64_t kConvChannels = 512;  // channels a conv work item
  const std::int64_t dk = a.head_k_dim, dv = a.head_v_dim;
  const std::int64_t channels = 2 * a.num_k_heads * dk + a.num_v_heads * dv;
  const std::int64_t blocks = (channels + kConvChannels - 1) / kConvChannels;
  std::vector<float> mixed(a.batch * a.tokens * channels);
  std::vector<std::int64_t> keep(a.batch, 0);  // tokens row b's pools advance through
  for (std::int64_t b = 0; b < a.batch; ++b) {
    if (a.write_state) keep[b] = a.counts ? (a.counts[b] < 0 ? 0 : lesser(a.counts[b], a.tokens)) : a.tokens;
  }
  const IsaKernels& impl = active_kernels();
  parallel_for(a.batch * blocks, a.threads, [&](std::int64_t item) {
    const std::int64_t b = item / blocks, c0 = item % blocks * kConvChannels;
    impl.gdn_conv(a, b, c0, lesser(c0 + kConvChannels, channels), keep[b], mixed.data());
  });
  parallel_for(a.batch * a.num_v_heads, a.threads, [&](std::int64_t item) {
    thread_local std::vector<float> work;
    work.resize(2 * (dk + dv) + dk * dv);
    const std::int64_t b = item / a.num_v_heads;
    impl.gdn_head(a, mixed.data(), b, item % a.num_v_heads, keep[b], work.data());
  });
}

void gdn_mixer(const GdnMixerArgs& a) {
  GdnStepArgs step = a.step;
  const std::int64_t rows = step.batch * step.tokens, hidden = layer_linear_inputs(a.in_proj);
  const std::int64_t width = layer_linear_rows(a.in_proj), values = step.num_v_heads * step.head_v_dim;
  const std::int64_t channels = 2 * step.num_k_heads * step.head_k_dim + values;
  std::vector<float> normed(rows * hidden), projected(rows * width), mixed(rows * values);
  add_rmsnorm(normed.data(), a.residual_out, a.x, a.residual, a.norm_weight, rows, hidden, a.norm_eps,
              a.zero_centered);
  layer_linear(a.in_proj, projected.data(), normed.data(), rows, step.threads, a.int8_activations);
  step.out = mixed.data();
  step.qkv = projected.data();
  step.z = step.qkv + channels;
  step.b = step.z + values;
  step.a = step.b + step.num_v_heads;
  step.qkv_stride = step.ab_stride = step.z_stride = width;
  gdn_steps(step);
  if (a.out_order) {  // out_proj's inputs in the order its columns are stored
    std::vector<float> taken(rows * values);
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t i = 0; i < values; ++i) taken[r * values + i] = mixed[r * values + a.out_order[i]];
    }
    mixed.swap(taken);
  }
  layer_linear(a.out_proj, a.out, mixed.data(), rows, step.threads, a.int8_activations);
}

}  // namespace ninfer::cpu

#include "gdn_step.h"

#include <vector>

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

}  // namespace ninfer::cpu

#include "decode_ops.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "quant_kernels.h"
#include "thread_pool.h"

namespace ninfer::cpu {
namespace {

// sum of a[i] * b[i] over n values, in 8 interleaved partial sums: the compiler vectorizes that
// (one running sum would be a chain it may not reorder).
float dot(const float* a, const float* b, std::int64_t n) {
  float part[8] = {};
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) part[l] += a[i + l] * b[i + l];
  float total = 0;
  for (; i < n; ++i) total += a[i] * b[i];
  for (float p : part) total += p;
  return total;
}

}  // namespace

void add_rmsnorm(float* out, float* residual_out, const float* x, const float* residual, const float* weight,
                 std::int64_t rows, std::int64_t hidden, float eps, bool zero_centered) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * hidden;
    float* o = out + r * hidden;
    const float* s = xr;
    if (residual) {
      float* sum = residual_out + r * hidden;
      const float* res = residual + r * hidden;
      for (std::int64_t i = 0; i < hidden; ++i) sum[i] = xr[i] + res[i];
      s = sum;
    }
    const float squares = dot(s, s, hidden);
    const float rstd = 1.0f / std::sqrt(squares / static_cast<float>(hidden) + eps);
    for (std::int64_t i = 0; i < hidden; ++i) o[i] = s[i] * rstd * (zero_centered ? 1.0f + weight[i] : weight[i]);
  }
}

void silu_mul(float* out, const float* x, std::int64_t rows, std::int64_t cols) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* gate = x + r * 2 * cols;
    const float* up = gate + cols;
    float* o = out + r * cols;
    for (std::int64_t i = 0; i < cols; ++i) o[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
  }
}

void rotary(float* out, const float* x, const float* cos, const float* sin, std::int64_t tokens, std::int64_t heads,
            std::int64_t dim, std::int64_t rotary) {
  const std::int64_t half = rotary / 2;
  for (std::int64_t t = 0; t < tokens; ++t) {
    const float* c = cos + t * rotary;
    const float* s = sin + t * rotary;
    for (std::int64_t h = 0; h < heads; ++h) {
      const float* xh = x + (t * heads + h) * dim;
      float* o = out + (t * heads + h) * dim;
      for (std::int64_t i = 0; i < half; ++i) {
        const float x1 = xh[i], x2 = xh[i + half];
        o[i] = x1 * c[i] - x2 * s[i];
        o[i + half] = x2 * c[i + half] + x1 * s[i + half];
      }
      if (o != xh) std::memcpy(o + rotary, xh + rotary, (dim - rotary) * sizeof(float));
    }
  }
}

void write_kv_narrow(std::uintptr_t k_cache, std::uintptr_t v_cache, const float* k, const float* v,
                     const std::int64_t* slots, std::int64_t tokens, std::int64_t row, CacheType cache) {
  const auto narrow = cache == CacheType::BF16 ? bf16_bits : half_bits;
  for (std::int64_t t = 0; t < tokens; ++t) {
    auto* kc = reinterpret_cast<std::uint16_t*>(k_cache) + slots[t] * row;
    auto* vc = reinterpret_cast<std::uint16_t*>(v_cache) + slots[t] * row;
    for (std::int64_t i = 0; i < row; ++i) kc[i] = narrow(k[t * row + i]), vc[i] = narrow(v[t * row + i]);
  }
}

void write_kv(std::uintptr_t k_cache, std::uintptr_t v_cache, std::uintptr_t k, std::uintptr_t v,
              const std::int64_t* slots, std::int64_t tokens, std::int64_t row_bytes) {
  for (std::int64_t t = 0; t < tokens; ++t) {
    std::memcpy(reinterpret_cast<char*>(k_cache) + slots[t] * row_bytes, reinterpret_cast<const char*>(k) + t * row_bytes,
                row_bytes);
    std::memcpy(reinterpret_cast<char*>(v_cache) + slots[t] * row_bytes, reinterpret_cast<const char*>(v) + t * row_bytes,
                row_bytes);
  }
}

void decode_attention(const AttentionArgs& a) {
  const std::int64_t group = a.heads / a.kv_heads, heads = a.batch * a.kv_heads;
  std::int64_t longest = 0;
  for (std::int64_t b = 0; b < a.batch; ++b) longest = a.cache_lens[b] > longest ? a.cache_lens[b] : longest;
  const std::int64_t chunks = (longest + a.num_new + kAttentionChunk - 1) / kAttentionChunk;  // per kv head, at most
  // A work item: a (sequence, kv head)'s chunk of keys for all its new tokens, which then read each K / V
  // row from memory once, not once a token (attention_kernels.h).
  const std::int64_t items = heads * chunks, per_item = a.num_new * group;
  // per item and token: each head's max and sum, its weighted values; per item: its chunk's scores
  std::vector<float> m(items * per_item), l(items * per_item, 0.0f), acc(items * per_item * a.dim);
  std::vector<float> scores(items * group * kAttentionChunk);
  // threads only where the work pays for handing it over: a short context is a few microseconds
  const bool long_enough = a.batch * a.num_new * a.heads * (longest + a.num_new) * a.dim >= (1 << 16);
  const IsaKernels& impl = active_kernels();
  parallel_for(items, long_enough ? a.threads : 1, [&](std::int64_t item) {
    const std::int64_t b = item / chunks / a.kv_heads, kv_head = item / chunks % a.kv_heads;
    const std::int64_t j0 = item % chunks * kAttentionChunk;
    if (j0 >= a.cache_lens[b] + a.num_new) return;  // a shorter sequence than the longest: l stays 0
    thread_local std::vector<float> widened;  // a 16-bit chunk's K and V rows as fp32, where the kernel widens
    widened.resize(2 * kAttentionChunk * a.dim);
    impl.attend_chunk(a, b, kv_head, j0, scores.data() + item * group * kAttentionChunk,
                      widened.data(), m.data() + item * per_item, l.data() + item * per_item,
                      acc.data() + item * per_item * a.dim);
  });
  // merge each query head's chunks: out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c
  for (std::int64_t head = 0; head < heads; ++head) {
    const std::int64_t b = head / a.kv_heads, kv_head = head % a.kv_heads;
    for (std::int64_t t = 0; t < a.num_new; ++t) {
      for (std::int64_t g = 0; g < group; ++g) {
        float* out = a.out + ((b * a.num_new + t) * a.heads + kv_head * group + g) * a.dim;
        float top = -INFINITY, total = 0;
        for (std::int64_t c = 0; c < chunks; ++c) {
          const std::int64_t at = (head * chunks + c) * per_item + t * group + g;
          if (l[at] > 0) top = m[at] > top ? m[at] : top;
        }
        for (std::int64_t i = 0; i < a.dim; ++i) out[i] = 0;
        for (std::int64_t c = 0; c < chunks; ++c) {
          const std::int64_t at = (head * chunks + c) * per_item + t * group + g;
          if (l[at] == 0) continue;
          const float w = std::exp(m[at] - top);
          total += w * l[at];
          const float* part = acc.data() + at * a.dim;
          for (std::int64_t i = 0; i < a.dim; ++i) out[i] += w * part[i];
        }
        for (std::int64_t i = 0; i < a.dim; ++i) out[i] /= total;
      }
    }
  }
}

}  // namespace ninfer::cpu

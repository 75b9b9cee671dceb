#include "decode_ops.h"

#include <cmath>
#include <cstring>
#include <vector>

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

void write_kv(std::uintptr_t k_cache, std::uintptr_t v_cache, std::uintptr_t k, std::uintptr_t v,
              const std::int64_t* slots, std::int64_t tokens, std::int64_t row_bytes) {
  for (std::int64_t t = 0; t < tokens; ++t) {
    std::memcpy(reinterpret_cast<char*>(k_cache) + slots[t] * row_bytes, reinterpret_cast<const char*>(k) + t * row_bytes,
                row_bytes);
    std::memcpy(reinterpret_cast<char*>(v_cache) + slots[t] * row_bytes, reinterpret_cast<const char*>(v) + t * row_bytes,
                row_bytes);
  }
}

namespace {

// The query heads of one kv head, for one (sequence, token): scores of every key they see, their
// softmax, then one pass over V that serves all of the group's heads (GQA reads each K / V row
// once). `scratch`: group * (keys + dim) floats.
void attend_group(const AttentionArgs& a, std::int64_t b, std::int64_t t, std::int64_t kv_head, float* scratch) {
  const std::int64_t dim = a.dim, group = a.heads / a.kv_heads, keys = a.cache_lens[b] + t + 1;
  const float* q = a.q + ((b * a.num_new + t) * a.heads + kv_head * group) * dim;
  float* probs = scratch;                 // [group][keys]
  float* acc = scratch + group * keys;    // [group][dim]
  auto row = [&](std::int64_t j) {
    const std::int64_t page = a.block_table[b * a.table_width + j / a.page_size];
    return ((page * a.page_size + j % a.page_size) * a.kv_heads + kv_head) * dim;
  };
  for (std::int64_t j = 0; j < keys; ++j) {
    const float* k = a.k_cache + row(j);
    for (std::int64_t g = 0; g < group; ++g) probs[g * keys + j] = dot(q + g * dim, k, dim) * a.scale;
  }
  for (std::int64_t g = 0; g < group; ++g) {
    float* p = probs + g * keys;
    float max = -INFINITY, total = 0;
    for (std::int64_t j = 0; j < keys; ++j) max = p[j] > max ? p[j] : max;
    for (std::int64_t j = 0; j < keys; ++j) total += (p[j] = std::exp(p[j] - max));
    for (std::int64_t j = 0; j < keys; ++j) p[j] /= total;
  }
  for (std::int64_t i = 0; i < group * dim; ++i) acc[i] = 0;
  for (std::int64_t j = 0; j < keys; ++j) {
    const float* v = a.v_cache + row(j);
    for (std::int64_t g = 0; g < group; ++g) {
      const float p = probs[g * keys + j];
      float* o = acc + g * dim;
      for (std::int64_t i = 0; i < dim; ++i) o[i] += p * v[i];
    }
  }
  std::memcpy(a.out + ((b * a.num_new + t) * a.heads + kv_head * group) * dim, acc, group * dim * sizeof(float));
}

}  // namespace

void decode_attention(const AttentionArgs& a) {
  const std::int64_t items = a.batch * a.num_new * a.kv_heads;
  std::int64_t longest = 0;
  for (std::int64_t b = 0; b < a.batch; ++b) longest = a.cache_lens[b] > longest ? a.cache_lens[b] : longest;
  const std::int64_t scratch = (a.heads / a.kv_heads) * (longest + a.num_new + a.dim);
  // threads only where the work pays for waking them: a short context is a few microseconds
  const bool long_enough = a.batch * a.num_new * a.heads * (longest + a.num_new) * a.dim >= (1 << 18);
  parallel_for(items, long_enough ? a.threads : 1, [&](std::int64_t item) {
    std::vector<float> buffer(scratch);
    attend_group(a, item / (a.num_new * a.kv_heads), item / a.kv_heads % a.num_new, item % a.kv_heads, buffer.data());
  });
}

}  // namespace ninfer::cpu

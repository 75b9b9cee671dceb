// The fp32 ops of a CPU decode step around the quantized matmuls: what the torch references in
// ninfer_core/ops (rmsnorm.py, activation.py, attention.py) compute, in one call each. A small
// model's decode step is made of ~60 such tiny ops per layer; each torch op costs microseconds of
// dispatch, which is most of the step once the weights are compact.
#pragma once

#include <cstdint>

namespace ninfer::cpu {

// out = norm(s) with s = x (+ residual; then residual_out = s), rows of `hidden` fp32 values:
// norm(v) = v * rstd * (1 + w) when zero_centered, else v * rstd * w; rstd = 1 / sqrt(mean(v^2) + eps).
// out may alias x; residual_out may alias residual.
void add_rmsnorm(float* out, float* residual_out, const float* x, const float* residual, const float* weight,
                 std::int64_t rows, std::int64_t hidden, float eps, bool zero_centered);

// out [rows, cols] = silu(x[:, :cols]) * x[:, cols:], x [rows, 2 * cols].
void silu_mul(float* out, const float* x, std::int64_t rows, std::int64_t cols);

// Rotate-half RoPE on the first `rotary` dims of each head: x, out [tokens, heads, dim]; cos, sin
// [tokens, rotary]; dims from `rotary` on are copied. out may alias x.
void rotary(float* out, const float* x, const float* cos, const float* sin, std::int64_t tokens, std::int64_t heads,
            std::int64_t dim, std::int64_t rotary);

// Rows of `row_bytes` bytes (one token's kv heads) to the flat cache rows `slots` of k / v.
void write_kv(std::uintptr_t k_cache, std::uintptr_t v_cache, std::uintptr_t k, std::uintptr_t v,
              const std::int64_t* slots, std::int64_t tokens, std::int64_t row_bytes);
// What the rows of a KV cache hold: fp32, or a 16-bit float the kernels round fp32 into and widen back
// out of (ops/attention.py CACHE_TYPES gives the numbers).
enum class CacheType : int { F32 = 0, BF16 = 1, F16 = 2 };
// The same from fp32 rows of `row` values into a bf16 or fp16 cache (rounded to nearest even, as torch's .to()).
void write_kv_narrow(std::uintptr_t k_cache, std::uintptr_t v_cache, const float* k, const float* v,
                     const std::int64_t* slots, std::int64_t tokens, std::int64_t row, CacheType cache);

// Keys per work item. Fixed, so that a result does not depend on the thread count; 256 keys of one kv
// head are 64 KB of K and V at head_dim 64, a chunk's scores a few KB.
inline constexpr std::int64_t kAttentionChunk = 256;

// Causal attention of `num_new` new tokens per sequence over a paged fp32 KV cache (the contract
// of ops/attention.py decode_attention): q, out [batch, num_new, heads, dim]; cache
// [pages, page_size, kv_heads, dim]; token i of sequence b in page block_table[b][i / page_size];
// query t sees cache indices 0 .. cache_lens[b] + t.
struct AttentionArgs {
  float* out;
  const float* q;
  const float* k_cache;
  const float* v_cache;
  const std::int32_t* block_table;  // [batch, table_width]
  const std::int64_t* cache_lens;   // [batch]
  std::int64_t batch, num_new, heads, kv_heads, dim, page_size, table_width;
  float scale;
  int threads;
  CacheType cache = CacheType::F32;  // what k_cache / v_cache hold (the pointers then point at it)
};
void decode_attention(const AttentionArgs& args);

}  // namespace ninfer::cpu

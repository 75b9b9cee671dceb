// Paged KV cache kernels: the KV write (with fp8 / int8 quantization) and split-K decode
// attention. Plain C++ like ops.h: tensors are raw device pointers, the stream an integer.
#pragma once

#include <cstdint>

#include "ops.h"

namespace ninfer {

// Limits of decode_attention.cu, checked at the binding.
inline constexpr int kDecodeAttentionMaxSplits = 1024;
inline constexpr int kDecodeAttentionMaxNew = 16;  // new tokens a sequence (speculative K + 1)

// What the KV pages store. Native: the query dtype. FP8 (e4m3fn) / Int8: value = stored * scale
// with one fp32 scale per (token, kv head), scale = absmax / 448 (fp8) or / 127 (int8), 1 for 0.
enum class KVDType : int { Native = 0, FP8 = 1, Int8 = 2 };

// k, v [tokens, kv_heads, head_dim] (dtype, contiguous) -> cache rows slot_mapping[token] of
// k_cache / v_cache [num_slots, kv_heads, head_dim] (+ k_scale / v_scale [num_slots, kv_heads]
// for FP8 / Int8). Slots outside [0, num_slots) are skipped. head_dim in {64, 128, 256}.
struct WriteKVArgs {
  std::uintptr_t k_cache;
  std::uintptr_t v_cache;
  std::uintptr_t k_scale;  // 0 for Native
  std::uintptr_t v_scale;
  std::uintptr_t k;
  std::uintptr_t v;
  std::uintptr_t slot_mapping;  // [tokens] int64
  std::int64_t tokens;
  std::int64_t num_slots;  // num_pages * page_size
  int kv_heads;
  int head_dim;
  DType dtype;  // F16 or BF16
  KVDType kv_dtype;
  int device;
  std::uintptr_t stream;
};

void write_kv(const WriteKVArgs& args);

// out [B, T, H, D] = causal attention of q [B, T, H, D] over the paged cache: query t of
// sequence b sees cache indices 0 .. cache_lens[b] + t (its own k/v already written). Cache
// index i lives in page block_table[b, i / page_size], row i % page_size.
// Split-K: the grid is (max_splits, kv_heads x row chunks, B); each sequence uses as many
// splits as its length needs (at most max_splits, see decode_attention_max_splits), writes
// partial results to workspace_o [B, kv_heads, max_splits, T * H / kv_heads, D] and
// workspace_ml [..., 2] (fp32), and a second kernel combines them. A sequence that fits one
// split is written directly. T <= 16, D in {64, 128, 256}, page_size a power of two.
// With a gate (the attention output gate, read in place: element d of (b, t, h) at gate +
// b * gate_stride_b + t * gate_stride_t + h * gate_stride_h + d) the final write is
// round(round(out) * round(sigmoid(gate))), activation.h's sigmoid_mul to the bit, in the same
// launches; out must not overlap the gate.
struct DecodeAttentionArgs {
  std::uintptr_t out;
  std::uintptr_t q;
  std::uintptr_t gate;  // [B, T, H, D] of dtype, or 0: no output gate
  std::int64_t gate_stride_b;
  std::int64_t gate_stride_t;
  std::int64_t gate_stride_h;
  std::uintptr_t k_cache;  // [num_pages, page_size, kv_heads, D]
  std::uintptr_t v_cache;
  std::uintptr_t k_scale;  // [num_pages, page_size, kv_heads] fp32; 0 for Native
  std::uintptr_t v_scale;
  std::uintptr_t block_table;  // [B, table_width] int32
  std::uintptr_t cache_lens;   // [B] int64
  std::uintptr_t workspace_o;
  std::uintptr_t workspace_ml;
  int batch;
  int num_new;  // T
  int num_heads;
  int kv_heads;
  int head_dim;
  int page_size;
  int table_width;
  int num_pages;
  int max_splits;
  float scale;
  DType dtype;  // F16 or BF16 (q, out; Native cache)
  KVDType kv_dtype;
  int device;
  std::uintptr_t stream;
};

void decode_attention(const DecodeAttentionArgs& args);

// The split count the grid is sized for: enough blocks to fill the GPU at batch x kv_heads,
// never more than the table's width needs. Fixed by the table width, so a CUDA graph captured
// with it serves every context length up to the width.
int decode_attention_max_splits(int batch, int num_new, int num_heads, int kv_heads, int head_dim,
                                int page_size, int table_width, int num_sms);

}  // namespace ninfer

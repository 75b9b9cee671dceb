// Bindings of the attention family: KV write (+ fp8 / int8 quantization), split-K decode
// attention over the paged cache, the head norm + rotary alone and as the decode prologue with
// the KV write, and the per-forward rotary and KV-slot tables. The tensors arrive as
// torch.Tensors; sizes, strides and the cache's kind are read from them and checked against
// decode_attention.h, rope.h and step_tables.h before anything launches.
#include <string>

#include "bind.h"
#include "decode_attention.h"
#include "rope.h"
#include "step_tables.h"
#include "tensor_arg.h"

namespace py = pybind11;

namespace ninfer {
namespace {

// The head dims the kernels are compiled for.
void require_head_dim(const ArgCheck& check, std::int64_t head_dim) {
  check.require(head_dim == 64 || head_dim == 128 || head_dim == 256, "head_dim ", head_dim, " must be 64, 128 or 256");
}

// The paged cache k / v [num_pages, page_size, kv_heads, head_dim] (kAny: any kv_heads) and its
// scales, for activations x. What the pages store follows from their dtype: float8_e4m3fn and
// int8 pages come with fp32 scales [num_pages, page_size, kv_heads], pages of x's dtype without.
// 16-byte aligned: the attention kernel reads the pages in 16-byte chunks.
KVDType check_cache(ArgCheck& check, const TensorArg& k_cache, const TensorArg& v_cache,
                    const std::optional<TensorArg>& k_scale, const std::optional<TensorArg>& v_scale,
                    const TensorArg& x, std::int64_t kv_heads, std::int64_t head_dim) {
  check("k_cache", k_cache).shape({kAny, kAny, kv_heads, head_dim})
      .dtype({x.type, ScalarType::F8E4M3, ScalarType::I8}).contiguous().aligned(16);
  check("v_cache", v_cache).matches(k_cache, "k_cache").contiguous().aligned(16);
  const KVDType kind = k_cache.type == ScalarType::F8E4M3 ? KVDType::FP8
                       : k_cache.type == ScalarType::I8   ? KVDType::Int8
                                                          : KVDType::Native;
  const bool quantized = kind != KVDType::Native;
  check.require(k_scale.has_value() == quantized && v_scale.has_value() == quantized,
                quantized ? "fp8 / int8 caches need k_scale and v_scale" : "a native cache has no k_scale / v_scale");
  check("k_scale", k_scale).shape({k_cache.size(0), k_cache.size(1), k_cache.size(2)}).dtype(ScalarType::F32)
      .contiguous();
  check("v_scale", v_scale).shape({k_cache.size(0), k_cache.size(1), k_cache.size(2)}).dtype(ScalarType::F32)
      .contiguous();
  return kind;
}

// cos / sin [B, T, R] for x (`name`) [B, T, H, D] (last axes contiguous; one set of strides indexes both)
// within rope.h's limits: D in {64, 128, 256}; R even, 0 < R <= D, R / 2 a multiple of D / 32 (a
// lane's elements rotate together). Returns R.
int check_rotary(ArgCheck& check, const char* name, const TensorArg& x, const TensorArg& cos, const TensorArg& sin) {
  const std::int64_t batch = x.size(0), tokens = x.size(1), head_dim = x.size(3);
  require_head_dim(check, head_dim);
  check.require(tokens >= 1 && x.size(2) >= 1, name, " has shape ", x.shape_str(), ": no head vectors");
  check.require(tokens <= (1 << 30), name, " has ", tokens, " tokens, past the kernel's 2^30");
  check("cos", cos).shape({batch, tokens, kAny}).dtype(x.type).unit_last_stride();
  check("sin", sin).matches(cos, "cos").unit_last_stride();
  check.require((batch == 1 || sin.stride(0) == cos.stride(0)) && (tokens == 1 || sin.stride(1) == cos.stride(1)),
                "sin and cos need the same strides (one set indexes both)");
  const std::int64_t rotary = cos.size(2);
  check.require(rotary >= 2 && rotary <= head_dim && rotary % 2 == 0 && (rotary / 2) % (head_dim / 32) == 0,
                "rotary_dim ", rotary, " must be even, at most ", head_dim, ", its half a multiple of ", head_dim / 32);
  return static_cast<int>(rotary);
}

// x [B, T, H, D] read in place: its pointer and the strides of its first three axes.
HeadsIn heads_in(const TensorArg& t) { return {t.data, t.stride(0), t.stride(1), t.stride(2)}; }

}  // namespace

void bind_attention(py::module_& m) {
  m.def(
      "write_kv",
      [](TensorArg k_cache, TensorArg v_cache, std::optional<TensorArg> k_scale, std::optional<TensorArg> v_scale,
         TensorArg k, TensorArg v, TensorArg slot_mapping, std::uintptr_t stream) {
        ArgCheck check("write_kv");
        TensorCheck k_check = check("k", k);
        k_check.shape({kAny, kAny, kAny}).dtype({ScalarType::F16, ScalarType::BF16}).contiguous();
        const std::int64_t tokens = k.size(0), kv_heads = k.size(1), head_dim = k.size(2);
        require_head_dim(check, head_dim);
        check.require(kv_heads >= 1, "k has no kv heads");
        const int lane_bytes = static_cast<int>(head_dim / 32 * 2);  // a lane loads D / 32 elements at once
        k_check.aligned(lane_bytes);
        check("v", v).matches(k, "k").contiguous().aligned(lane_bytes);
        const KVDType kind = check_cache(check, k_cache, v_cache, k_scale, v_scale, k, kv_heads, head_dim);
        check("slot_mapping", slot_mapping).shape({tokens}).dtype(ScalarType::I64).contiguous();
        const DType dtype = kernel_dtype(check, "k", k);
        const int device = check.device();
        write_kv({k_cache.data, v_cache.data, data_or_null(k_scale), data_or_null(v_scale), k.data, v.data,
                  slot_mapping.data, tokens, k_cache.size(0) * k_cache.size(1), static_cast<int>(kv_heads),
                  static_cast<int>(head_dim), dtype, kind, device, stream});
      },
      py::arg("k_cache"), py::arg("v_cache"), py::arg("k_scale"), py::arg("v_scale"), py::arg("k"), py::arg("v"),
      py::arg("slot_mapping"), py::arg("stream"),
      "Store k, v [tokens, kv_heads, head_dim] at the cache's flat rows slot_mapping (quantizing into fp8 / int8 "
      "pages; scales None for a native cache). See csrc/decode_attention.h.");

  m.def(
      "decode_attention",
      [](TensorArg out, TensorArg q, std::optional<TensorArg> gate, TensorArg k_cache, TensorArg v_cache,
         std::optional<TensorArg> k_scale, std::optional<TensorArg> v_scale, TensorArg block_table,
         TensorArg cache_lens, TensorArg workspace, int max_splits, float scale, std::uintptr_t stream) {
        ArgCheck check("decode_attention");
        check("q", q).shape({kAny, kAny, kAny, kAny}).dtype({ScalarType::F16, ScalarType::BF16}).contiguous()
            .aligned(16);  // 16-byte loads of q rows
        const std::int64_t batch = q.size(0), num_new = q.size(1), heads = q.size(2), head_dim = q.size(3);
        check.require(num_new >= 1 && num_new <= kDecodeAttentionMaxNew,
                      "q has ", num_new, " new tokens, expected 1..", kDecodeAttentionMaxNew);
        check.require(batch <= 65535, "batch ", batch, " is over 65535");
        require_head_dim(check, head_dim);
        check("out", out).matches(q, "q").contiguous().aligned(8);
        check("gate", gate).matches(q, "q").unit_last_stride();  // read in place, any other strides
        if (gate) check("out", out).disjoint(*gate, "gate");
        const KVDType kind = check_cache(check, k_cache, v_cache, k_scale, v_scale, q, kAny, head_dim);
        const std::int64_t num_pages = k_cache.size(0), page_size = k_cache.size(1), kv_heads = k_cache.size(2);
        check.require(num_pages >= 1 && page_size >= 1 && (page_size & (page_size - 1)) == 0,
                      "the cache's page size ", page_size, " must be a power of two");
        check.require(num_pages <= (1LL << 31) - 1, "the cache has ", num_pages, " pages, past the kernel's 2^31 - 1");
        check.require(kv_heads >= 1 && heads % kv_heads == 0, heads, " heads are not a multiple of ", kv_heads, " kv heads");
        check("block_table", block_table).shape({batch, kAny}).dtype(ScalarType::I32).contiguous();
        const std::int64_t table_width = block_table.size(1);
        check.require(table_width >= 1 && table_width * page_size < (1 << 30),
                      "block_table width ", table_width, " out of range");
        check("cache_lens", cache_lens).shape({batch}).dtype(ScalarType::I64).contiguous();
        check.require(max_splits >= 1 && max_splits <= kDecodeAttentionMaxSplits, "max_splits ", max_splits, " out of range 1..", kDecodeAttentionMaxSplits);
        // Split partials: O [B, Hkv, splits, T H / Hkv, D] (read as float4), then (max, sum) of each row.
        const std::int64_t partials = batch * kv_heads * max_splits * num_new * (heads / kv_heads);
        check("workspace", workspace).dtype(ScalarType::F32).contiguous().min_numel(partials * (head_dim + 2))
            .aligned(16);
        const DType dtype = kernel_dtype(check, "q", q);
        const int device = check.device();
        const HeadsIn g = gate ? heads_in(*gate) : HeadsIn{};  // all 0 without a gate
        decode_attention({out.data, q.data, g.data, g.stride_b, g.stride_t, g.stride_h,
                          k_cache.data, v_cache.data, data_or_null(k_scale), data_or_null(v_scale), block_table.data,
                          cache_lens.data, workspace.data, workspace.data + 4 * partials * head_dim,
                          static_cast<int>(batch), static_cast<int>(num_new), static_cast<int>(heads),
                          static_cast<int>(kv_heads), static_cast<int>(head_dim), static_cast<int>(page_size),
                          static_cast<int>(table_width), static_cast<int>(num_pages), max_splits, scale, dtype, kind,
                          device, stream});
      },
      py::arg("out"), py::arg("q"), py::arg("gate"), py::arg("k_cache"), py::arg("v_cache"), py::arg("k_scale"),
      py::arg("v_scale"), py::arg("block_table"), py::arg("cache_lens"), py::arg("workspace"), py::arg("max_splits"),
      py::arg("scale"), py::arg("stream"),
      "Split-K causal attention of T <= 16 new tokens over the paged KV cache (times sigmoid(gate) with a gate; "
      "None: none). workspace: fp32, sized for max_splits. See csrc/decode_attention.h.");

  m.def("decode_attention_max_splits", &decode_attention_max_splits, py::arg("batch"), py::arg("num_new"),
        py::arg("num_heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("page_size"),
        py::arg("table_width"), py::arg("num_sms"),
        "Splits the decode_attention grid and workspace are sized for (fixed by the table width).");
  m.def(
      "norm_rotary",
      [](TensorArg out, TensorArg x, std::optional<TensorArg> weight, TensorArg cos, TensorArg sin, float eps,
         bool zero_centered, std::uintptr_t stream) {
        ArgCheck check("norm_rotary");
        check("x", x).shape({kAny, kAny, kAny, kAny}).unit_last_stride();  // heads read in place, any strides
        check.require(x.size(2) <= (1 << 20), "x has ", x.size(2), " heads, past the kernel's 2^20");
        const DType dtype = kernel_dtype(check, "x", x);
        const int rotary = check_rotary(check, "x", x, cos, sin);
        check("out", out).shape({x.size(0), x.size(1), x.size(2), x.size(3)}).dtype(x.type).contiguous();
        check("weight", weight).shape({x.size(3)}).dtype(x.type).contiguous();
        const int device = check.device();
        norm_rotary({out.data, x.data, data_or_null(weight), cos.data, sin.data, x.size(0), x.size(1), x.size(2),
                     x.stride(0), x.stride(1), x.stride(2), cos.stride(0), cos.stride(1),
                     static_cast<int>(x.size(3)), rotary, eps, zero_centered, dtype, device, stream});
      },
      py::arg("out"), py::arg("x"), py::arg("weight"), py::arg("cos"), py::arg("sin"), py::arg("eps"),
      py::arg("zero_centered"), py::arg("stream"),
      "Head RMSNorm (weight None: none) + rotate-half RoPE in one kernel. See csrc/rope.h.");
  m.def(
      "norm_rotary_write_kv",
      [](TensorArg q_out, TensorArg q, TensorArg k, TensorArg v, std::optional<TensorArg> q_weight,
         std::optional<TensorArg> k_weight, TensorArg cos, TensorArg sin, TensorArg k_cache, TensorArg v_cache,
         std::optional<TensorArg> k_scale, std::optional<TensorArg> v_scale, TensorArg slot_mapping, float eps,
         bool zero_centered, std::uintptr_t stream) {
        ArgCheck check("norm_rotary_write_kv");
        // q, k, v read in place (slices of the merged projection): any strides but the last
        check("q", q).shape({kAny, kAny, kAny, kAny}).dtype({ScalarType::F16, ScalarType::BF16}).unit_last_stride();
        const std::int64_t batch = q.size(0), tokens = q.size(1), heads = q.size(2), head_dim = q.size(3);
        check("k", k).shape({batch, tokens, kAny, head_dim}).dtype(q.type).unit_last_stride();
        check("v", v).matches(k, "k").unit_last_stride();
        const std::int64_t kv_heads = k.size(2);
        check.require(kv_heads >= 1, "k has no kv heads");
        check.require(heads + kv_heads <= (1 << 20), "q and k have ", heads, " + ", kv_heads, " heads, past the kernel's 2^20");
        const int rotary = check_rotary(check, "q", q, cos, sin);
        check("q_out", q_out).shape({batch, tokens, heads, head_dim}).dtype(q.type).contiguous();
        check("q_weight", q_weight).shape({head_dim}).dtype(q.type).contiguous();
        check("k_weight", k_weight).shape({head_dim}).dtype(q.type).contiguous();
        const KVDType kind = check_cache(check, k_cache, v_cache, k_scale, v_scale, q, kv_heads, head_dim);
        check("slot_mapping", slot_mapping).shape({batch, tokens}).dtype(ScalarType::I64).contiguous();
        const DType dtype = kernel_dtype(check, "q", q);
        const int device = check.device();
        norm_rotary_write_kv({q_out.data, heads_in(q), heads_in(k), heads_in(v), data_or_null(q_weight),
                              data_or_null(k_weight), cos.data, sin.data, cos.stride(0), cos.stride(1), k_cache.data,
                              v_cache.data, data_or_null(k_scale), data_or_null(v_scale), slot_mapping.data,
                              k_cache.size(0) * k_cache.size(1), batch, tokens, static_cast<int>(heads),
                              static_cast<int>(kv_heads), static_cast<int>(head_dim), rotary, eps, zero_centered,
                              dtype, kind, device, stream});
      },
      py::arg("q_out"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("q_weight"), py::arg("k_weight"),
      py::arg("cos"), py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"), py::arg("k_scale"), py::arg("v_scale"),
      py::arg("slot_mapping"), py::arg("eps"), py::arg("zero_centered"), py::arg("stream"),
      "norm_rotary of q and k, then k and v stored at slot_mapping [B, T] as write_kv does, in one kernel. "
      "See csrc/rope.h.");
  m.def(
      "rotary_tables",
      [](TensorArg cos, TensorArg sin, TensorArg positions, TensorArg inv_freq, std::uintptr_t stream) {
        ArgCheck check("rotary_tables");
        check("positions", positions).dtype(ScalarType::I64).contiguous();
        const std::int64_t tokens = positions.numel();
        check("inv_freq", inv_freq).shape({kAny}).dtype(ScalarType::F32).contiguous();
        const std::int64_t rotary = 2 * inv_freq.size(0);
        check.require(rotary >= 2, "inv_freq is empty");
        check("cos", cos).shape({tokens, rotary}).dtype({ScalarType::F32, ScalarType::F16, ScalarType::BF16})
            .contiguous();
        check("sin", sin).matches(cos, "cos").contiguous().disjoint(cos, "cos");
        const DType dtype = kernel_dtype(check, "cos", cos);
        const int device = check.device();
        rotary_tables({cos.data, sin.data, positions.data, inv_freq.data, tokens, static_cast<int>(rotary), dtype,
                       device, stream});
      },
      py::arg("cos"), py::arg("sin"), py::arg("positions"), py::arg("inv_freq"), py::arg("stream"),
      "cos / sin [tokens, R] of positions (int64, tokens in all) at inv_freq [R / 2], in one kernel. "
      "See csrc/step_tables.h.");
  m.def(
      "kv_slots",
      [](TensorArg slots, TensorArg table_out, TensorArg block_table, TensorArg cache_lens,
         std::optional<TensorArg> valid_tokens, std::int64_t page_size, std::int64_t num_pages, std::int64_t pad_row,
         std::uintptr_t stream) {
        ArgCheck check("kv_slots");
        check("block_table", block_table).shape({kAny, kAny}).dtype({ScalarType::I32, ScalarType::I64})
            .unit_last_stride();
        const std::int64_t batch = block_table.size(0), width = block_table.size(1);
        check.require(batch >= 1 && batch <= 65535, "batch ", batch, " out of range 1..65535");
        check.require(width >= 1, "block_table has no columns");
        check.require(page_size >= 1 && num_pages >= 1 && num_pages <= (1LL << 31) - 1,
                      "page_size ", page_size, " / num_pages ", num_pages, " out of range");
        check("cache_lens", cache_lens).shape({batch}).dtype(ScalarType::I64).contiguous();
        check("valid_tokens", valid_tokens).shape({batch}).dtype(ScalarType::I64).contiguous();
        check("slots", slots).shape({batch, kAny}).dtype(ScalarType::I64).contiguous();
        check("table_out", table_out).shape({batch, width}).dtype(ScalarType::I32).contiguous()
            .disjoint(block_table, "block_table");
        const int device = check.device();
        kv_slots({slots.data, table_out.data, block_table.data, cache_lens.data, data_or_null(valid_tokens), batch,
                  slots.size(1), width, block_table.stride(0), page_size, num_pages, pad_row,
                  block_table.type == ScalarType::I64, device, stream});
      },
      py::arg("slots"), py::arg("table_out"), py::arg("block_table"), py::arg("cache_lens"), py::arg("valid_tokens"),
      py::arg("page_size"), py::arg("num_pages"), py::arg("pad_row"), py::arg("stream"),
      "The KV rows slots [B, T] of each row's T new tokens and the clamped int32 block table, in one kernel. "
      "See csrc/step_tables.h.");
}

}  // namespace ninfer

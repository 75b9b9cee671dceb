// Bindings of the attention family: KV write (+ fp8 / int8 quantization), split-K decode
// attention over the paged cache, the head norm + rotary alone and as the decode prologue with
// the KV write. See decode_attention.h and rope.h for the argument contracts.
#include "bind.h"
#include "decode_attention.h"
#include "rope.h"

namespace py = pybind11;

namespace ninfer {

void bind_attention(py::module_& m) {
  py::enum_<KVDType>(m, "KVDType")
      .value("NATIVE", KVDType::Native)
      .value("FP8", KVDType::FP8)
      .value("INT8", KVDType::Int8);

  m.def(
      "write_kv",
      [](std::uintptr_t k_cache, std::uintptr_t v_cache, std::uintptr_t k_scale, std::uintptr_t v_scale,
         std::uintptr_t k, std::uintptr_t v, std::uintptr_t slot_mapping, std::int64_t tokens,
         std::int64_t num_slots, int kv_heads, int head_dim, DType dtype, KVDType kv_dtype, int device,
         std::uintptr_t stream) {
        write_kv({k_cache, v_cache, k_scale, v_scale, k, v, slot_mapping, tokens, num_slots, kv_heads, head_dim,
                  dtype, kv_dtype, device, stream});
      },
      py::arg("k_cache"), py::arg("v_cache"), py::arg("k_scale"), py::arg("v_scale"), py::arg("k"), py::arg("v"),
      py::arg("slot_mapping"), py::arg("tokens"), py::arg("num_slots"), py::arg("kv_heads"), py::arg("head_dim"),
      py::arg("dtype"), py::arg("kv_dtype"), py::arg("device"), py::arg("stream"),
      "Store k, v [tokens, kv_heads, head_dim] at cache rows slot_mapping (quantizing for FP8 / INT8).");

  m.def(
      "decode_attention",
      [](std::uintptr_t out, std::uintptr_t q, std::uintptr_t gate, std::int64_t gate_stride_b,
         std::int64_t gate_stride_t, std::int64_t gate_stride_h, std::uintptr_t k_cache, std::uintptr_t v_cache,
         std::uintptr_t k_scale, std::uintptr_t v_scale, std::uintptr_t block_table, std::uintptr_t cache_lens,
         std::uintptr_t workspace_o, std::uintptr_t workspace_ml, int batch, int num_new, int num_heads,
         int kv_heads, int head_dim, int page_size, int table_width, int num_pages, int max_splits, float scale,
         DType dtype, KVDType kv_dtype, int device, std::uintptr_t stream) {
        decode_attention({out, q, gate, gate_stride_b, gate_stride_t, gate_stride_h, k_cache, v_cache, k_scale,
                          v_scale, block_table, cache_lens, workspace_o, workspace_ml, batch, num_new, num_heads,
                          kv_heads, head_dim, page_size, table_width, num_pages, max_splits, scale, dtype, kv_dtype,
                          device, stream});
      },
      py::arg("out"), py::arg("q"), py::arg("gate"), py::arg("gate_stride_b"), py::arg("gate_stride_t"),
      py::arg("gate_stride_h"), py::arg("k_cache"), py::arg("v_cache"), py::arg("k_scale"),
      py::arg("v_scale"), py::arg("block_table"), py::arg("cache_lens"), py::arg("workspace_o"),
      py::arg("workspace_ml"), py::arg("batch"), py::arg("num_new"), py::arg("num_heads"), py::arg("kv_heads"),
      py::arg("head_dim"), py::arg("page_size"), py::arg("table_width"), py::arg("num_pages"),
      py::arg("max_splits"), py::arg("scale"), py::arg("dtype"), py::arg("kv_dtype"), py::arg("device"),
      py::arg("stream"),
      "Split-K causal attention of T <= 16 new tokens over the paged KV cache (times sigmoid(gate) with a gate).");

  m.def("decode_attention_max_splits", &decode_attention_max_splits, py::arg("batch"), py::arg("num_new"),
        py::arg("num_heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("page_size"),
        py::arg("table_width"), py::arg("num_sms"),
        "Splits the decode_attention grid and workspace are sized for (fixed by the table width).");
  m.def(
      "norm_rotary",
      [](std::uintptr_t out, std::uintptr_t x, std::uintptr_t weight, std::uintptr_t cos,
         std::uintptr_t sin, std::int64_t batch, std::int64_t tokens, std::int64_t heads,
         std::int64_t stride_b, std::int64_t stride_t, std::int64_t stride_h,
         std::int64_t cs_stride_b, std::int64_t cs_stride_t, int head_dim, int rotary_dim,
         float eps, bool zero_centered, DType dtype, int device, std::uintptr_t stream) {
        norm_rotary({out, x, weight, cos, sin, batch, tokens, heads, stride_b, stride_t, stride_h,
                     cs_stride_b, cs_stride_t, head_dim, rotary_dim, eps, zero_centered, dtype,
                     device, stream});
      },
      py::arg("out"), py::arg("x"), py::arg("weight"), py::arg("cos"), py::arg("sin"),
      py::arg("batch"), py::arg("tokens"), py::arg("heads"), py::arg("stride_b"),
      py::arg("stride_t"), py::arg("stride_h"), py::arg("cs_stride_b"), py::arg("cs_stride_t"),
      py::arg("head_dim"), py::arg("rotary_dim"), py::arg("eps"), py::arg("zero_centered"),
      py::arg("dtype"), py::arg("device"), py::arg("stream"),
      "Head RMSNorm (optional) + rotate-half RoPE in one kernel. See csrc/rope.h.");
  m.def(
      "norm_rotary_write_kv",
      [](std::uintptr_t q_out, std::uintptr_t q, std::int64_t q_stride_b, std::int64_t q_stride_t,
         std::int64_t q_stride_h, std::uintptr_t k, std::int64_t k_stride_b, std::int64_t k_stride_t,
         std::int64_t k_stride_h, std::uintptr_t v, std::int64_t v_stride_b, std::int64_t v_stride_t,
         std::int64_t v_stride_h, std::uintptr_t q_weight, std::uintptr_t k_weight, std::uintptr_t cos,
         std::uintptr_t sin, std::int64_t cs_stride_b, std::int64_t cs_stride_t, std::uintptr_t k_cache,
         std::uintptr_t v_cache, std::uintptr_t k_scale, std::uintptr_t v_scale, std::uintptr_t slot_mapping,
         std::int64_t num_slots, std::int64_t batch, std::int64_t tokens, int heads, int kv_heads, int head_dim,
         int rotary_dim, float eps, bool zero_centered, DType dtype, KVDType kv_dtype, int device,
         std::uintptr_t stream) {
        norm_rotary_write_kv({q_out, {q, q_stride_b, q_stride_t, q_stride_h}, {k, k_stride_b, k_stride_t, k_stride_h},
                              {v, v_stride_b, v_stride_t, v_stride_h}, q_weight, k_weight, cos, sin, cs_stride_b,
                              cs_stride_t, k_cache, v_cache, k_scale, v_scale, slot_mapping, num_slots, batch, tokens,
                              heads, kv_heads, head_dim, rotary_dim, eps, zero_centered, dtype, kv_dtype, device,
                              stream});
      },
      py::arg("q_out"), py::arg("q"), py::arg("q_stride_b"), py::arg("q_stride_t"), py::arg("q_stride_h"),
      py::arg("k"), py::arg("k_stride_b"), py::arg("k_stride_t"), py::arg("k_stride_h"), py::arg("v"),
      py::arg("v_stride_b"), py::arg("v_stride_t"), py::arg("v_stride_h"), py::arg("q_weight"),
      py::arg("k_weight"), py::arg("cos"), py::arg("sin"), py::arg("cs_stride_b"), py::arg("cs_stride_t"),
      py::arg("k_cache"), py::arg("v_cache"), py::arg("k_scale"), py::arg("v_scale"), py::arg("slot_mapping"),
      py::arg("num_slots"), py::arg("batch"), py::arg("tokens"), py::arg("heads"), py::arg("kv_heads"),
      py::arg("head_dim"), py::arg("rotary_dim"), py::arg("eps"), py::arg("zero_centered"), py::arg("dtype"),
      py::arg("kv_dtype"), py::arg("device"), py::arg("stream"),
      "norm_rotary of q and k, then k and v stored at slot_mapping as write_kv does, in one kernel. See csrc/rope.h.");
}

}  // namespace ninfer

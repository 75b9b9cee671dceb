// ninfer_core._C.gdn_steps: fused Gated DeltaNet steps (decode, verify, commit; gdn_decode.cu).
#include "bind.h"
#include "gdn_conv.h"
#include "gdn_decode.h"

namespace py = pybind11;

namespace ninfer {

void bind_gdn(py::module_& m) {
  m.def(
      "gdn_steps",
      [](std::uintptr_t out, std::uintptr_t scratch, std::uintptr_t qkv, std::uintptr_t a,
         std::uintptr_t b, std::uintptr_t z, std::uintptr_t conv_pool, std::uintptr_t state_pool,
         std::uintptr_t slots, std::uintptr_t counts, std::uintptr_t offsets, std::uintptr_t fork_slots,
         std::uintptr_t conv_weight, std::uintptr_t A_log, std::uintptr_t dt_bias, std::uintptr_t norm_weight,
         std::int64_t qkv_stride, std::int64_t ab_stride, std::int64_t z_stride, std::int64_t batch,
         std::int64_t seq_rows, int num_tokens, bool write_state, int num_k_heads, int num_v_heads,
         int head_k_dim, int head_v_dim, int conv_kernel, float q_scale, float eps, DType dtype,
         int device, std::uintptr_t stream) {
        gdn_steps({out, scratch, qkv, a, b, z, conv_pool, state_pool, slots, counts, offsets, fork_slots,
                   conv_weight, A_log, dt_bias, norm_weight, qkv_stride, ab_stride, z_stride, batch, seq_rows,
                   num_tokens, write_state, num_k_heads,
                   num_v_heads, head_k_dim, head_v_dim, conv_kernel, q_scale, eps, dtype, device,
                   stream});
      },
      py::arg("out"), py::arg("scratch"), py::arg("qkv"), py::arg("a"), py::arg("b"), py::arg("z"),
      py::arg("conv_pool"), py::arg("state_pool"), py::arg("slots"), py::arg("counts"),
      py::arg("offsets"), py::arg("fork_slots"), py::arg("conv_weight"), py::arg("A_log"), py::arg("dt_bias"), py::arg("norm_weight"),
      py::arg("qkv_stride"), py::arg("ab_stride"), py::arg("z_stride"), py::arg("batch"), py::arg("seq_rows"), py::arg("num_tokens"), py::arg("write_state"), py::arg("num_k_heads"),
      py::arg("num_v_heads"), py::arg("head_k_dim"), py::arg("head_v_dim"),
      py::arg("conv_kernel"), py::arg("q_scale"), py::arg("eps"), py::arg("dtype"),
      py::arg("device"), py::arg("stream"),
      "Fused GDN steps (conv, delta rule, gated RMSNorm over T tokens); see csrc/gdn_decode.h.");
  m.def(
      "gdn_conv_prefill",
      [](std::uintptr_t out, std::uintptr_t qkv, std::uintptr_t conv_pool, std::uintptr_t slots,
         std::uintptr_t valid, std::uintptr_t weight, std::int64_t qkv_stride_b,
         std::int64_t qkv_stride_t, std::int64_t batch, std::int64_t tokens,
         std::int64_t channels, int taps, DType dtype, int device, std::uintptr_t stream) {
        gdn_conv_prefill({out, qkv, conv_pool, slots, valid, weight, qkv_stride_b, qkv_stride_t,
                          batch, tokens, channels, taps, dtype, device, stream});
      },
      py::arg("out"), py::arg("qkv"), py::arg("conv_pool"), py::arg("slots"), py::arg("valid"),
      py::arg("weight"), py::arg("qkv_stride_b"), py::arg("qkv_stride_t"), py::arg("batch"),
      py::arg("tokens"), py::arg("channels"), py::arg("taps"), py::arg("dtype"),
      py::arg("device"), py::arg("stream"),
      "GDN prefill conv + SiLU advancing the pooled conv state; see csrc/gdn_conv.h.");
}

}  // namespace ninfer

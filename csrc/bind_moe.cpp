// pybind11 registration of the MoE kernels (csrc/moe.cu): routing and the fused decode step.
#include "bind.h"
#include "moe.h"

namespace py = pybind11;

namespace ninfer {

void bind_moe(py::module_& m) {
  py::enum_<ExpertKind>(m, "ExpertKind")
      .value("DENSE", ExpertKind::Dense)
      .value("INT8", ExpertKind::Int8)
      .value("INT4", ExpertKind::Int4);

  m.def(
      "moe_route",
      [](std::uintptr_t weights, std::uintptr_t ids, std::uintptr_t logits, std::int64_t tokens,
         std::int64_t experts, std::int64_t top_k, bool renormalize, DType dtype, int device,
         std::uintptr_t stream) {
        moe_route(
            {weights, ids, logits, tokens, experts, top_k, renormalize, dtype, device, stream});
      },
      py::arg("weights"), py::arg("ids"), py::arg("logits"), py::arg("tokens"),
      py::arg("experts"), py::arg("top_k"), py::arg("renormalize"), py::arg("dtype"),
      py::arg("device"), py::arg("stream"),
      "Softmax top-k routing, one warp per token. See csrc/moe.h.");

  m.def(
      "moe_router",
      [](std::uintptr_t logits, std::uintptr_t weights, std::uintptr_t ids, std::uintptr_t done,
         std::uintptr_t x, std::uintptr_t w, std::int64_t tokens, std::int64_t hidden, std::int64_t rows,
         std::int64_t experts, std::int64_t top_k, bool renormalize, DType dtype, int device,
         std::uintptr_t stream, std::uintptr_t residual, std::uintptr_t norm_weight, std::uintptr_t normed,
         std::uintptr_t residual_out, float eps, bool zero_centered) {
        moe_router({{weights, ids, logits, tokens, experts, top_k, renormalize, dtype, device, stream}, done, x, w,
                    hidden, rows, {residual, norm_weight, normed, residual_out, eps, zero_centered}});
      },
      py::arg("logits"), py::arg("weights"), py::arg("ids"), py::arg("done"), py::arg("x"), py::arg("w"),
      py::arg("tokens"), py::arg("hidden"), py::arg("rows"), py::arg("experts"), py::arg("top_k"),
      py::arg("renormalize"), py::arg("dtype"), py::arg("device"), py::arg("stream"), py::arg("residual") = 0,
      py::arg("norm_weight") = 0, py::arg("normed") = 0, py::arg("residual_out") = 0, py::arg("eps") = 0.0f,
      py::arg("zero_centered") = false,
      "A decode step's router GEMV + softmax top-k in one launch, optionally after the add + RMSNorm before it. "
      "See csrc/moe.h.");

  m.def(
      "moe_align",
      [](std::uintptr_t sorted_slots, std::uintptr_t block_experts, std::uintptr_t used,
         std::uintptr_t ids, std::int64_t slots, std::int64_t experts, int block_m,
         std::int64_t capacity, int device, std::uintptr_t stream) {
        moe_align({sorted_slots, block_experts, used, ids, slots, experts, block_m, capacity,
                   device, stream});
      },
      py::arg("sorted_slots"), py::arg("block_experts"), py::arg("used"), py::arg("ids"),
      py::arg("slots"), py::arg("experts"), py::arg("block_m"), py::arg("capacity"),
      py::arg("device"), py::arg("stream"),
      "Group (token, slot) pairs by expert in blocks of block_m, on the device. See csrc/moe.h.");
  m.def(
      "moe_decode",
      [](std::uintptr_t out, std::uintptr_t h, std::uintptr_t x, std::uintptr_t weights,
         std::uintptr_t ids, std::uintptr_t gate_up, std::uintptr_t gate_up_scales,
         ExpertKind gate_up_kind, int gate_up_group_size, std::uintptr_t down,
         std::uintptr_t down_scales, ExpertKind down_kind, int down_group_size,
         std::int64_t tokens, std::int64_t top_k, std::int64_t hidden, std::int64_t inter,
         std::int64_t experts, DType dtype, DType weights_dtype, int device,
         std::uintptr_t stream, std::uintptr_t shared_gate_up, std::uintptr_t shared_gate_up_scales,
         ExpertKind shared_gate_up_kind, int shared_gate_up_group_size, std::uintptr_t shared_down,
         std::uintptr_t shared_down_scales, ExpertKind shared_down_kind, int shared_down_group_size,
         std::int64_t shared_inter, std::uintptr_t shared_gate, std::int64_t shared_gate_stride) {
        moe_decode({out, h, x, weights, ids,
                    {gate_up, gate_up_scales, gate_up_kind, gate_up_group_size},
                    {down, down_scales, down_kind, down_group_size}, tokens, top_k, hidden, inter,
                    experts, dtype, weights_dtype, device, stream,
                    {shared_gate_up, shared_gate_up_scales, shared_gate_up_kind, shared_gate_up_group_size},
                    {shared_down, shared_down_scales, shared_down_kind, shared_down_group_size},
                    shared_inter, shared_gate, shared_gate_stride});
      },
      py::arg("out"), py::arg("h"), py::arg("x"), py::arg("weights"), py::arg("ids"),
      py::arg("gate_up"), py::arg("gate_up_scales"), py::arg("gate_up_kind"),
      py::arg("gate_up_group_size"), py::arg("down"), py::arg("down_scales"),
      py::arg("down_kind"), py::arg("down_group_size"), py::arg("tokens"), py::arg("top_k"),
      py::arg("hidden"), py::arg("inter"), py::arg("experts"), py::arg("dtype"),
      py::arg("weights_dtype"), py::arg("device"), py::arg("stream"), py::arg("shared_gate_up") = 0,
      py::arg("shared_gate_up_scales") = 0, py::arg("shared_gate_up_kind") = ExpertKind::Int8,
      py::arg("shared_gate_up_group_size") = 0, py::arg("shared_down") = 0, py::arg("shared_down_scales") = 0,
      py::arg("shared_down_kind") = ExpertKind::Int8, py::arg("shared_down_group_size") = 0,
      py::arg("shared_inter") = 0, py::arg("shared_gate") = 0, py::arg("shared_gate_stride") = 0,
      "Routed experts of a few tokens: gate_up GEMV + SwiGLU, then down GEMV summed over the "
      "experts, optionally with a gated shared expert. See csrc/moe.h.");
}

}  // namespace ninfer

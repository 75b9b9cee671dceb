// Bindings of the quant kernel family (int8 / int4 weight-only GEMV, csrc/quant_gemv.cu).
#include "bind.h"
#include "quant_gemv.h"

namespace py = pybind11;

namespace ninfer {

void bind_quant(py::module_& module) {
  module.def(
      "quant_gemv",
      [](std::uintptr_t out, std::uintptr_t x, std::uintptr_t qweight, std::uintptr_t scales,
         std::uintptr_t bias, std::int64_t m, std::int64_t n, std::int64_t k, int group_size,
         bool int4, DType dtype, int device, std::uintptr_t stream, bool gate_up,
         std::uintptr_t gate, std::int64_t gate_stride, std::uintptr_t add, std::uintptr_t residual,
         std::uintptr_t norm_weight, std::uintptr_t residual_out, float eps, bool zero_centered) {
        quant_gemv({out, x, qweight, scales, bias, m, n, k, group_size, int4, dtype, device,
                    stream, gate_up, gate, gate_stride, add,
                    {residual, norm_weight, residual_out, eps, zero_centered}});
      },
      py::arg("out"), py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("bias"),
      py::arg("m"), py::arg("n"), py::arg("k"), py::arg("group_size"), py::arg("int4"),
      py::arg("dtype"), py::arg("device"), py::arg("stream"), py::arg("gate_up") = false,
      py::arg("gate") = 0, py::arg("gate_stride") = 0, py::arg("add") = 0, py::arg("residual") = 0,
      py::arg("norm_weight") = 0, py::arg("residual_out") = 0, py::arg("eps") = 0.0f,
      py::arg("zero_centered") = false,
      "out[m, n] = x[m, k] @ W^T (+ bias) for int8 / int4 W, m <= 1024; bias=0 for none; "
      "gate_up: SwiGLU of W = [gate; up]; gate / add: add + sigmoid(gate) * out; residual: "
      "x + residual into residual_out and its RMSNorm (norm_weight, eps, zero_centered) as the "
      "GEMV's input. See csrc/quant_gemv.h.");
  module.def(
      "moe_grouped_gemv",
      [](std::uintptr_t out, std::uintptr_t x, std::uintptr_t qweight, std::uintptr_t scales,
         std::uintptr_t sorted_slots, std::uintptr_t block_experts, std::uintptr_t used,
         std::int64_t blocks, int block_m, std::int64_t num_slots, int rows_per_x, bool gate_up,
         std::int64_t n, std::int64_t k, int group_size, bool int4, DType dtype, int device,
         std::uintptr_t stream) {
        moe_grouped_gemv({{out, x, qweight, scales, 0, 0, n, k, group_size, int4, dtype, device,
                           stream},
                          sorted_slots, block_experts, used, blocks, block_m, num_slots,
                          rows_per_x, gate_up});
      },
      py::arg("out"), py::arg("x"), py::arg("qweight"), py::arg("scales"),
      py::arg("sorted_slots"), py::arg("block_experts"), py::arg("used"), py::arg("blocks"),
      py::arg("block_m"), py::arg("num_slots"), py::arg("rows_per_x"), py::arg("gate_up"),
      py::arg("n"), py::arg("k"), py::arg("group_size"), py::arg("int4"), py::arg("dtype"),
      py::arg("device"), py::arg("stream"),
      "The quant GEMV over MoE experts grouped by moe_align: gate_up (+ SwiGLU) or down per "
      "slot. See csrc/quant_gemv.h.");
  module.def(
      "dequant",
      [](std::uintptr_t out, std::uintptr_t qweight, std::uintptr_t scales, std::int64_t rows,
         std::int64_t k, int group_size, bool int4, DType dtype, int device, std::uintptr_t stream) {
        dequant({out, qweight, scales, rows, k, group_size, int4, dtype, device, stream});
      },
      py::arg("out"), py::arg("qweight"), py::arg("scales"), py::arg("rows"), py::arg("k"),
      py::arg("group_size"), py::arg("int4"), py::arg("dtype"), py::arg("device"), py::arg("stream"),
      "Dense weight from int8 / int4 codes (one pass). See csrc/quant_gemv.h.");
}

}  // namespace ninfer

// Bindings of the fused elementwise epilogues (csrc/activation.cu).
#include "activation.h"
#include "bind.h"

namespace py = pybind11;

namespace ninfer {

void bind_activation(py::module_& m) {
  m.def(
      "silu_mul",
      [](std::uintptr_t out, std::uintptr_t x, std::int64_t rows, std::int64_t cols, DType dtype, int device,
         std::uintptr_t stream) { silu_mul({out, x, rows, cols, dtype, device, stream}); },
      py::arg("out"), py::arg("x"), py::arg("rows"), py::arg("cols"), py::arg("dtype"), py::arg("device"),
      py::arg("stream"), "silu(gate) * up of x [rows, gate | up]. See csrc/activation.h.");
  m.def(
      "sigmoid_mul",
      [](std::uintptr_t out, std::uintptr_t x, std::uintptr_t gate, std::uintptr_t add, std::int64_t rows,
         std::int64_t cols, std::int64_t gate_stride, int gate_cols, DType dtype, int device, std::uintptr_t stream) {
        sigmoid_mul({out, x, gate, add, rows, cols, gate_stride, gate_cols, dtype, device, stream});
      },
      py::arg("out"), py::arg("x"), py::arg("gate"), py::arg("add"), py::arg("rows"), py::arg("cols"),
      py::arg("gate_stride"), py::arg("gate_cols"), py::arg("dtype"), py::arg("device"), py::arg("stream"),
      "x * sigmoid(gate) (+ add). See csrc/activation.h.");
}

}  // namespace ninfer

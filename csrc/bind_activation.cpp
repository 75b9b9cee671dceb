// Bindings of the fused elementwise epilogues (csrc/activation.cu).
#include "activation.h"
#include "bind.h"
#include "tensor_arg.h"

namespace py = pybind11;

namespace ninfer {

void bind_activation(py::module_& m) {
  m.def(
      "silu_mul",
      [](TensorArg out, TensorArg x, std::uintptr_t stream) {
        ArgCheck check("silu_mul");
        check.require(x.dim >= 1 && x.numel() > 0 && x.size(-1) % 2 == 0, "x needs an even, non-empty last axis");
        const std::int64_t cols = x.size(-1) / 2, rows = x.numel() / x.size(-1);
        const DType dtype = kernel_dtype(check, "x", x);
        check("x", x).contiguous();
        check("out", out).dtype(x.type).contiguous();
        check.require(out.numel() == rows * cols, "out has ", out.numel(), " elements, expected ", rows * cols);
        silu_mul({out.data, x.data, rows, cols, dtype, check.device(), stream});
      },
      py::arg("out"), py::arg("x"), py::arg("stream"), "silu(gate) * up of x [..., gate | up]. See csrc/activation.h.");
  m.def(
      "sigmoid_mul",
      [](TensorArg out, TensorArg x, TensorArg gate, std::optional<TensorArg> add, std::uintptr_t stream) {
        ArgCheck check("sigmoid_mul");
        check.require(x.dim >= 1 && x.numel() > 0, "x needs at least one element");
        const std::int64_t cols = x.size(-1), rows = x.numel() / cols;
        const DType dtype = kernel_dtype(check, "x", x);
        check("x", x).contiguous();
        check("out", out).matches(x, "x").contiguous();
        check("add", add).matches(x, "x").contiguous();
        TensorCheck gate_check = check("gate", gate);
        gate_check.dtype(x.type).shape({rows, kAny});
        const std::int64_t gate_cols = gate.size(1);
        check.require(gate_cols == 1 || gate_cols == cols, "gate has ", gate_cols, " columns, expected 1 or ", cols);
        gate_check.unit_last_stride();
        sigmoid_mul({out.data, x.data, gate.data, data_or_null(add), rows, cols, gate.stride(0),
                     static_cast<int>(gate_cols), dtype, check.device(), stream});
      },
      py::arg("out"), py::arg("x"), py::arg("gate"), py::arg("add"), py::arg("stream"),
      "x * sigmoid(gate) (+ add); gate [rows, cols or 1] with any row stride. See csrc/activation.h.");
}

}  // namespace ninfer

// pybind11 module ninfer_core._C: thin wrappers over the launchers in ops.h. Tensors arrive as
// torch.Tensors, checked against each kernel's contract at the binding (tensor_arg.h), and the
// stream as Stream.cuda_stream; no torch headers.
#include <pybind11/pybind11.h>

#include "bind.h"
#include "ops.h"
#include "tensor_arg.h"

namespace py = pybind11;
using ninfer::ArgCheck;
using ninfer::DType;
using ninfer::ScalarType;
using ninfer::TensorArg;
using ninfer::data_or_null;
using ninfer::kernel_dtype;

PYBIND11_MODULE(_C, m) {
  m.doc() = "ninfer CUDA kernels (call them through ninfer_core.ops)";

  py::enum_<ninfer::DType>(m, "DType")
      .value("F32", ninfer::DType::F32)
      .value("F16", ninfer::DType::F16)
      .value("BF16", ninfer::DType::BF16);

  ninfer::register_tensor_arg(m);

  m.def(
      "rmsnorm",
      [](TensorArg out, std::optional<TensorArg> residual_out, TensorArg x, std::optional<TensorArg> residual,
         TensorArg weight, float eps, bool zero_centered, std::uintptr_t stream) {
        ArgCheck check("rmsnorm");
        check.require(x.dim >= 1 && x.numel() > 0, "x needs at least one element");
        check.require(residual.has_value() == residual_out.has_value(), "residual and residual_out go together");
        const std::int64_t hidden = x.size(-1);
        check.require(hidden <= (1 << 30) && x.numel() / hidden <= (1LL << 31) - 1,
                      "x has shape ", x.shape_str(), ", out of the kernel's range");
        const DType dtype = kernel_dtype(check, "x", x);
        check("x", x).contiguous();
        check("out", out).matches(x, "x").contiguous();
        check("residual", residual).matches(x, "x").contiguous();
        check("residual_out", residual_out).matches(x, "x").contiguous();
        check("weight", weight).shape({hidden}).dtype({x.type, ScalarType::F32}).contiguous();
        const int device = check.device();
        ninfer::rmsnorm({out.data, data_or_null(residual_out), x.data, data_or_null(residual), weight.data,
                         x.numel() / hidden, hidden, eps, zero_centered, dtype, kernel_dtype(check, "weight", weight),
                         device, stream});
      },
      py::arg("out"), py::arg("residual_out"), py::arg("x"), py::arg("residual"), py::arg("weight"),
      py::arg("eps"), py::arg("zero_centered"), py::arg("stream"),
      "Fused (residual add +) RMSNorm over x's last axis; None for no residual. See csrc/ops.h.");

  ninfer::bind_quant(m);
  ninfer::bind_moe(m);
  ninfer::bind_gdn(m);
  ninfer::bind_attention(m);
  ninfer::bind_sampling(m);
  ninfer::bind_activation(m);
}

// pybind11 module ninfer_core._C: thin wrappers over the launchers in ops.h. Tensors arrive as
// device pointers (Tensor.data_ptr()) and the stream as Stream.cuda_stream, so no torch headers.
#include <pybind11/pybind11.h>

#include "bind.h"
#include "ops.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "ninfer CUDA kernels (raw-pointer interface; call them through ninfer_core.ops)";

  py::enum_<ninfer::DType>(m, "DType")
      .value("F32", ninfer::DType::F32)
      .value("F16", ninfer::DType::F16)
      .value("BF16", ninfer::DType::BF16);

  m.def(
      "rmsnorm",
      [](std::uintptr_t out, std::uintptr_t residual_out, std::uintptr_t x,
         std::uintptr_t residual, std::uintptr_t weight, std::int64_t rows, std::int64_t hidden,
         float eps, bool zero_centered, ninfer::DType dtype, ninfer::DType weight_dtype,
         int device, std::uintptr_t stream) {
        ninfer::rmsnorm({out, residual_out, x, residual, weight, rows, hidden, eps,
                         zero_centered, dtype, weight_dtype, device, stream});
      },
      py::arg("out"), py::arg("residual_out"), py::arg("x"), py::arg("residual"),
      py::arg("weight"), py::arg("rows"), py::arg("hidden"), py::arg("eps"),
      py::arg("zero_centered"), py::arg("dtype"), py::arg("weight_dtype"), py::arg("device"),
      py::arg("stream"),
      "Fused (residual add +) RMSNorm; residual=0 for none. See csrc/ops.h.");

  ninfer::bind_quant(m);
  ninfer::bind_moe(m);
  ninfer::bind_gdn(m);
  ninfer::bind_attention(m);
  ninfer::bind_sampling(m);
  ninfer::bind_activation(m);
}

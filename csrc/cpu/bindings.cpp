// pybind11 module ninfer_core._cpu: the CPU quant kernels (raw-pointer interface like ninfer_core._C;
// call them through ninfer_core.ops). The GIL is released while a kernel runs.
#include <pybind11/pybind11.h>

#include "quant_matmul.h"

namespace py = pybind11;
using ninfer::cpu::QuantWeight;
using ninfer::cpu::ScaleType;

PYBIND11_MODULE(_cpu, m) {
  m.doc() = "ninfer CPU kernels: weight-only int8 / int4 matmul (see csrc/cpu/quant_matmul.h)";
  py::enum_<ScaleType>(m, "ScaleType")
      .value("F32", ScaleType::F32)
      .value("F16", ScaleType::F16)
      .value("BF16", ScaleType::BF16);
  m.def(
      "quant_matmul",
      [](std::uintptr_t out, std::uintptr_t x, std::uintptr_t codes, std::uintptr_t scales, std::uintptr_t offsets,
         std::uintptr_t bias, std::int64_t m, std::int64_t n, std::int64_t k, std::int64_t group, bool int4,
         ScaleType scale_type, int threads) {
        ninfer::cpu::quant_matmul(
            {QuantWeight{codes, scales, offsets, n, k, group, int4, scale_type}, out, x, bias, m, threads});
      },
      py::arg("out"), py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("offsets"), py::arg("bias"),
      py::arg("m"), py::arg("n"), py::arg("k"), py::arg("group"), py::arg("int4"), py::arg("scale_type"),
      py::arg("threads"),
      py::call_guard<py::gil_scoped_release>(),
      "out[m, n] = x[m, k] @ W^T (+ bias), fp32; offsets / bias 0 for none.");
  m.def(
      "dequantize",
      [](std::uintptr_t out, std::uintptr_t codes, std::uintptr_t scales, std::uintptr_t offsets, std::int64_t n,
         std::int64_t k, std::int64_t group, bool int4, ScaleType scale_type, int threads) {
        ninfer::cpu::dequantize(QuantWeight{codes, scales, offsets, n, k, group, int4, scale_type}, out, threads);
      },
      py::arg("out"), py::arg("codes"), py::arg("scales"), py::arg("offsets"), py::arg("n"), py::arg("k"),
      py::arg("group"), py::arg("int4"), py::arg("scale_type"), py::arg("threads"), py::call_guard<py::gil_scoped_release>(),
      "out fp32 [n, k] = the dense weight.");
  m.def("isa", &ninfer::cpu::isa, "The instruction set the kernels run with: avx512, avx2 or generic.");
}

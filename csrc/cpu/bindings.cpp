// pybind11 module ninfer_core._cpu: the CPU quant kernels (raw-pointer interface like ninfer_core._C;
// call them through ninfer_core.ops). The GIL is released while a kernel runs.
#include <pybind11/pybind11.h>

#include "quant_matmul.h"

namespace py = pybind11;
using ninfer::cpu::QuantWeight;
using ninfer::cpu::ScaleType;

PYBIND11_MODULE(_cpu, m) {
  m.doc() = "ninfer CPU kernels: weight-only int8 / int4 matmul (see csrc/cpu/quant_matmul.h)";
  // Argument order: the call's own values first, then the weight's (ops/quant.py caches those).
  m.def(
      "quant_matmul",
      [](std::uintptr_t out, std::uintptr_t x, std::uintptr_t bias, std::int64_t m, std::int64_t n, int threads,
         std::uintptr_t codes, std::uintptr_t scales, std::uintptr_t offsets, std::int64_t k, std::int64_t group,
         bool int4, int scale_type) {
        const QuantWeight w{codes, scales, offsets, n, k, group, int4, static_cast<ScaleType>(scale_type)};
        ninfer::cpu::quant_matmul({w, out, x, bias, m, threads});
      },
      py::arg("out"), py::arg("x"), py::arg("bias"), py::arg("m"), py::arg("n"), py::arg("threads"),
      py::arg("codes"), py::arg("scales"), py::arg("offsets"), py::arg("k"), py::arg("group"), py::arg("int4"),
      py::arg("scale_type"), py::call_guard<py::gil_scoped_release>(),
      "out[m, n] = x[m, k] @ W^T (+ bias), fp32; offsets / bias 0 for none; scale_type: ScaleType's value.");
  m.def(
      "dequantize",
      [](std::uintptr_t out, std::int64_t n, int threads, std::uintptr_t codes, std::uintptr_t scales,
         std::uintptr_t offsets, std::int64_t k, std::int64_t group, bool int4, int scale_type) {
        const QuantWeight w{codes, scales, offsets, n, k, group, int4, static_cast<ScaleType>(scale_type)};
        ninfer::cpu::dequantize(w, out, threads);
      },
      py::arg("out"), py::arg("n"), py::arg("threads"), py::arg("codes"), py::arg("scales"), py::arg("offsets"),
      py::arg("k"), py::arg("group"), py::arg("int4"), py::arg("scale_type"),
      py::call_guard<py::gil_scoped_release>(), "out fp32 [n, k] = the dense weight.");
  m.def("isa", &ninfer::cpu::isa, "The instruction set the kernels run with: avx512, avx2 or generic.");
}

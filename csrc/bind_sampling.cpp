// pybind11 registration of the sampler kernel (sampling.cu); the contract is in sampling.h.
#include "bind.h"
#include "sampling.h"

namespace py = pybind11;

namespace ninfer {

void bind_sampling(py::module_& m) {
  m.def(
      "sample_rows",
      [](std::uintptr_t tokens, std::uintptr_t probs, std::uintptr_t threshold,
         std::uintptr_t logits, std::uintptr_t temperature, std::uintptr_t top_k,
         std::uintptr_t top_p, std::uintptr_t min_p, std::uintptr_t uniform, std::int64_t rows,
         std::int64_t vocab, int max_candidates, int device, std::uintptr_t stream) {
        sample_rows({tokens, probs, threshold, logits, temperature, top_k, top_p, min_p, uniform,
                     rows, vocab, max_candidates, device, stream});
      },
      py::arg("tokens"), py::arg("probs"), py::arg("threshold"), py::arg("logits"),
      py::arg("temperature"), py::arg("top_k"), py::arg("top_p"), py::arg("min_p"),
      py::arg("uniform"), py::arg("rows"), py::arg("vocab"), py::arg("max_candidates"),
      py::arg("device"), py::arg("stream"),
      "Temperature / top-k / top-p / min-p sampling, one block per row; 0 for an unused output. "
      "See csrc/sampling.h.");
}

}  // namespace ninfer

// pybind11 registration of the sampler and greedy kernels (sampling.cu); the contracts are in
// sampling.h. The tensors arrive as torch.Tensors, checked against them before the launch.
#include <string>

#include "bind.h"
#include "sampling.h"
#include "tensor_arg.h"

namespace py = pybind11;

namespace ninfer {
void bind_sampling(py::module_& m) {
  m.def(
      "sample_rows",
      [](std::optional<TensorArg> tokens, std::optional<TensorArg> probs, std::optional<TensorArg> threshold,
         TensorArg logits, TensorArg temperature, TensorArg top_k, TensorArg top_p, TensorArg min_p,
         std::optional<TensorArg> uniform, int max_candidates, std::uintptr_t stream) {
        ArgCheck check("sample_rows");
        check("logits", logits).shape({kAny, kAny}).dtype(ScalarType::F32).contiguous();
        const std::int64_t rows = logits.size(0), vocab = logits.size(1);
        check.require(vocab >= 1 && vocab < (std::int64_t{1} << 31) && rows < (std::int64_t{1} << 31),
                      "logits has shape ", logits.shape_str(), ", out of the kernel's range");
        check("temperature", temperature).shape({rows}).dtype(ScalarType::F32).contiguous();
        check("top_k", top_k).shape({rows}).dtype(ScalarType::I32).contiguous();
        check("top_p", top_p).shape({rows}).dtype(ScalarType::F32).contiguous();
        check("min_p", min_p).shape({rows}).dtype(ScalarType::F32).contiguous();
        check("uniform", uniform).shape({rows}).dtype(ScalarType::F64).contiguous();
        check.require(!tokens || uniform, "tokens needs uniform (the draws)");
        check("tokens", tokens).shape({rows}).dtype(ScalarType::I64).contiguous();
        check("probs", probs).shape({rows, vocab}).dtype(ScalarType::F32).contiguous();
        check("threshold", threshold).shape({rows}).dtype(ScalarType::F32).contiguous();
        check.require(max_candidates >= 0 && max_candidates <= kSampleMaxCandidates,
                      "max_candidates ", max_candidates, " out of range 0..", kSampleMaxCandidates);
        const int device = check.device();
        sample_rows({data_or_null(tokens), data_or_null(probs), data_or_null(threshold), logits.data,
                     temperature.data, top_k.data, top_p.data, min_p.data, data_or_null(uniform), rows, vocab,
                     max_candidates, device, stream});
      },
      py::arg("tokens"), py::arg("probs"), py::arg("threshold"), py::arg("logits"), py::arg("temperature"),
      py::arg("top_k"), py::arg("top_p"), py::arg("min_p"), py::arg("uniform"), py::arg("max_candidates"),
      py::arg("stream"),
      "Temperature / top-k / top-p / min-p sampling, one block per row; None for an unused output. "
      "See csrc/sampling.h.");
  m.def(
      "greedy_rows",
      [](TensorArg tokens, TensorArg logits, TensorArg partials, TensorArg counters, std::uintptr_t stream) {
        ArgCheck check("greedy_rows");
        check("logits", logits).shape({kAny, kAny}).dtype({ScalarType::F32, ScalarType::F16, ScalarType::BF16})
            .contiguous();
        const std::int64_t rows = logits.size(0), vocab = logits.size(1);
        check.require(vocab >= 1 && vocab < (std::int64_t{1} << 31) && rows < (std::int64_t{1} << 31),
                      "logits has shape ", logits.shape_str(), ", out of the kernel's range");
        check("tokens", tokens).shape({rows}).dtype(ScalarType::I64).contiguous().disjoint(logits, "logits");
        check("partials", partials).shape({kAny}).dtype(ScalarType::I64).contiguous()
            .min_numel(rows * kGreedyMaxChunks).disjoint(logits, "logits").disjoint(tokens, "tokens");
        check("counters", counters).shape({kAny}).dtype(ScalarType::I32).contiguous().min_numel(rows)
            .disjoint(logits, "logits").disjoint(tokens, "tokens").disjoint(partials, "partials");
        const DType dtype = kernel_dtype(check, "logits", logits);
        const int device = check.device();
        greedy_rows({tokens.data, logits.data, partials.data, counters.data, rows, vocab, dtype, device, stream});
      },
      py::arg("tokens"), py::arg("logits"), py::arg("partials"), py::arg("counters"), py::arg("stream"),
      "Plain greedy: the argmax of each row (lowest id on ties), -1 for a row with NaN / +inf or no "
      "finite value; partials / counters are the workspace (counters zero before and after). See "
      "csrc/sampling.h.");
}

}  // namespace ninfer

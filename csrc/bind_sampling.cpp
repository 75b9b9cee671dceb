// pybind11 registration of the sampler and greedy kernels (sampling.cu); the contracts are in
// sampling.h. The tensors arrive as torch.Tensors, checked against them before the launch.
#include <string>

#include "bind.h"
#include "penalties.h"
#include "sampling.h"
#include "tensor_arg.h"

namespace py = pybind11;

namespace ninfer {
void bind_sampling(py::module_& m) {
  m.def(
      "sample_rows",
      [](std::optional<TensorArg> tokens, std::optional<TensorArg> probs, std::optional<TensorArg> threshold,
         TensorArg logits, TensorArg columns, std::optional<TensorArg> uniform, TensorArg segments, int max_candidates,
         std::uintptr_t stream) {
        ArgCheck check("sample_rows");
        check("logits", logits).shape({kAny, kAny}).dtype(ScalarType::F32).contiguous();
        const std::int64_t rows = logits.size(0), vocab = logits.size(1);
        check.require(vocab >= 1 && vocab < (std::int64_t{1} << 31) && rows < (std::int64_t{1} << 31),
                      "logits has shape ", logits.shape_str(), ", out of the kernel's range");
        check("columns", columns).shape({4, rows}).dtype(ScalarType::F64).contiguous();
        check("uniform", uniform).shape({rows}).dtype(ScalarType::F64).contiguous();
        check.require(!tokens || uniform, "tokens needs uniform (the draws)");
        check("tokens", tokens).shape({rows}).dtype(ScalarType::I64).contiguous();
        // probs: zeroed before the row is read, so never the logits themselves
        check("probs", probs).shape({rows, vocab}).dtype(ScalarType::F32).contiguous().disjoint(logits, "logits");
        check("threshold", threshold).shape({rows}).dtype(ScalarType::F32).contiguous();
        check("segments", segments).shape({kAny}).dtype(ScalarType::I64).contiguous()
            .min_numel(rows * kSampleMaxSegments).disjoint(logits, "logits");
        if (probs) check("segments", segments).disjoint(*probs, "probs");
        if (tokens) check("segments", segments).disjoint(*tokens, "tokens");
        check.require(max_candidates >= 0 && max_candidates <= kSampleMaxCandidates,
                      "max_candidates ", max_candidates, " out of range 0..", kSampleMaxCandidates);
        const int device = check.device();
        sample_rows({data_or_null(tokens), data_or_null(probs), data_or_null(threshold), logits.data, columns.data,
                     data_or_null(uniform), segments.data, rows, vocab, max_candidates, device, stream});
      },
      py::arg("tokens"), py::arg("probs"), py::arg("threshold"), py::arg("logits"), py::arg("columns"),
      py::arg("uniform"), py::arg("segments"), py::arg("max_candidates"),
      py::arg("stream"),
      "Temperature / top-k / top-p / min-p sampling (two launches); None for an unused output; "
      "segments: the workspace. See csrc/sampling.h.");
  m.def(
      "penalise",
      [](TensorArg out, TensorArg logits, TensorArg seen, TensorArg counts, std::optional<TensorArg> rows,
         TensorArg repetition, TensorArg presence, TensorArg frequency, std::uintptr_t stream) {
        ArgCheck check("penalise");
        check("logits", logits).shape({kAny, kAny}).dtype(ScalarType::F32).contiguous();
        const std::int64_t num_rows = logits.size(0), vocab = logits.size(1);
        check.require(num_rows >= 1 && num_rows < 65536 && vocab >= 1, "logits has shape ", logits.shape_str(),
                      ", out of the kernel's range (1..65535 rows)");
        check("out", out).matches(logits, "logits").contiguous();
        check("seen", seen).shape({kAny, vocab}).dtype(ScalarType::Bool).contiguous();
        check("counts", counts).shape({seen.size(0), vocab}).dtype(ScalarType::I32).contiguous();
        check.require(rows || seen.size(0) == num_rows, "without rows, seen / counts need ", num_rows, " rows, got ",
                      seen.size(0));
        check("rows", rows).shape({num_rows}).dtype(ScalarType::I64).contiguous();
        check("repetition", repetition).shape({num_rows}).dtype(ScalarType::F32).contiguous();
        check("presence", presence).shape({num_rows}).dtype(ScalarType::F32).contiguous();
        check("frequency", frequency).shape({num_rows}).dtype(ScalarType::F32).contiguous();
        const int device = check.device();
        penalise({out.data, logits.data, seen.data, counts.data, data_or_null(rows), repetition.data, presence.data,
                  frequency.data, num_rows, vocab, device, stream});
      },
      py::arg("out"), py::arg("logits"), py::arg("seen"), py::arg("counts"), py::arg("rows"), py::arg("repetition"),
      py::arg("presence"), py::arg("frequency"), py::arg("stream"),
      "Repetition / presence / frequency penalties on fp32 logits from per-slot tables (rows: the table row "
      "of each logits row, None: row r). See csrc/penalties.h.");
  m.def(
      "record_tokens",
      [](TensorArg seen, TensorArg counts, TensorArg rows, TensorArg ids, std::uintptr_t stream) {
        ArgCheck check("record_tokens");
        check("seen", seen).shape({kAny, kAny}).dtype(ScalarType::Bool).contiguous();
        check("counts", counts).shape({seen.size(0), seen.size(1)}).dtype(ScalarType::I32).contiguous()
            .disjoint(seen, "seen");
        check("rows", rows).shape({kAny}).dtype(ScalarType::I64).contiguous();
        check("ids", ids).shape({rows.size(0)}).dtype(ScalarType::I64).contiguous();
        const int device = check.device();
        record_tokens({seen.data, counts.data, rows.data, ids.data, rows.size(0), seen.size(0), seen.size(1), device,
                       stream});
      },
      py::arg("seen"), py::arg("counts"), py::arg("rows"), py::arg("ids"), py::arg("stream"),
      "Generated tokens into the penalty tables: counts[rows[i], ids[i]] += 1, seen[...] = true; ids[i] < 0 "
      "(no token) skipped. See csrc/penalties.h.");
  m.def(
      "judge_rows",
      [](TensorArg out, TensorArg p, std::optional<TensorArg> q, TensorArg drafts, TensorArg u, TensorArg meta,
         std::optional<TensorArg> finite, TensorArg sums, std::uintptr_t stream) {
        ArgCheck check("judge_rows");
        check("p", p).shape({kAny, kAny}).dtype(ScalarType::F32).contiguous();
        const std::int64_t vocab = p.size(1);
        check.require(vocab >= 1 && vocab < (std::int64_t{1} << 31), "p has shape ", p.shape_str(),
                      ", out of the kernel's range");
        check("q", q).shape({kAny, vocab}).dtype(ScalarType::F32).contiguous();
        check("drafts", drafts).shape({kAny, kAny}).dtype(ScalarType::I64).contiguous();
        const std::int64_t batch = drafts.size(0), width = drafts.size(1);
        check.require(width <= kJudgeMaxDrafts, "drafts has ", width, " columns, at most ", kJudgeMaxDrafts);
        check("u", u).shape({batch, width + 1}).dtype(ScalarType::F64).contiguous();
        check("meta", meta).shape({batch, 3}).dtype(ScalarType::I64).contiguous();
        check("finite", finite).shape({p.size(0)}).dtype(ScalarType::Bool).contiguous();
        check("out", out).shape({2 * batch}).dtype(ScalarType::I64).contiguous().disjoint(p, "p");
        check("sums", sums).shape({kAny}).dtype(ScalarType::I64).contiguous()
            .min_numel(2 * batch * kSampleMaxSegments).disjoint(p, "p").disjoint(out, "out");
        const int device = check.device();
        judge_rows({out.data, p.data, data_or_null(q), drafts.data, u.data, meta.data, data_or_null(finite), sums.data,
                    batch, width, vocab, device, stream});
      },
      py::arg("out"), py::arg("p"), py::arg("q"), py::arg("drafts"), py::arg("u"), py::arg("meta"), py::arg("finite"),
      py::arg("sums"), py::arg("stream"),
      "Speculative rejection sampling of a round: each sequence's accepted drafts and last token; sums: the "
      "workspace. See csrc/sampling.h.");
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

// pybind11 registration of the MoE kernels (csrc/moe.cu): routing and the fused decode step. Each
// binding takes the torch.Tensors and checks them against csrc/moe.h before anything launches.
#include <algorithm>
#include <utility>
#include <vector>

#include "bind.h"
#include "moe.h"
#include "tensor_arg.h"

namespace py = pybind11;

namespace ninfer {
namespace {

// The experts and top_k routing takes: a token's probabilities in one warp's registers (moe.h).
void require_route(const ArgCheck& check, std::int64_t experts, std::int64_t top_k) {
  check.require(experts >= 1 && experts <= kMoeMaxRouteExperts && top_k >= 1 && top_k <= std::min<std::int64_t>(experts, kMoeMaxTopK),
                "experts ", experts, " / top_k ", top_k, " out of range (experts <= ", kMoeMaxRouteExperts,
                ", top_k <= min(experts, ", kMoeMaxTopK, "))");
}

// An expert weight as the decode kernels read it (moe.h ExpertKind), its kind from the codes'
// dtype: x's dtype (dense, no scales), int8 with fp32 scales [.., rows] or int4 pairs (uint8) with
// bf16 scales [.., rows, cols / group_size]; [experts, rows, cols] when `experts` is set (the
// routed experts), else [rows, cols] (the shared expert).
ExpertWeights expert_weights(ArgCheck& check, const char* name, const char* scales_name, const TensorArg& w,
                             const std::optional<TensorArg>& scales, std::optional<std::int64_t> experts,
                             std::int64_t rows, std::int64_t cols, const TensorArg& x) {
  const bool int8 = w.type == ScalarType::I8, int4 = w.type == ScalarType::U8;
  const std::int64_t width = int4 ? cols / 2 : cols;
  TensorCheck codes = check(name, w);
  codes.dtype({ScalarType::I8, ScalarType::U8, x.type});
  experts ? codes.shape({*experts, rows, width}) : codes.shape({rows, width});
  codes.contiguous().aligned(16);
  check.require(scales.has_value() == (int8 || int4),
                scales_name, (scales ? " given for dense " : " missing for quantized "), name);
  const ExpertKind kind = int8 ? ExpertKind::Int8 : int4 ? ExpertKind::Int4 : ExpertKind::Dense;
  ExpertWeights weights{w.data, data_or_null(scales), kind, 0};
  TensorCheck scale = check(scales_name, scales);
  if (int8) {
    scale.dtype(ScalarType::F32);
    experts ? scale.shape({*experts, rows}) : scale.shape({rows});
  } else if (int4) {
    scale.dtype(ScalarType::BF16);
    experts ? scale.shape({*experts, rows, kAny}) : scale.shape({rows, kAny});
    const std::int64_t groups = scales->size(-1);
    const std::int64_t group = groups > 0 && cols % groups == 0 ? cols / groups : 0;
    check.require(group >= 32 && (group & (group - 1)) == 0,
                  scales_name, " has ", groups, " groups of ", cols,
                  " columns: int4 groups must be a power of two >= 32");
    weights.group_size = static_cast<int>(group);
  }
  scale.contiguous();
  const std::int64_t vec = int8 ? 16 : int4 ? 32 : 16 / element_size(x.type);  // elements of a 16-byte load
  check.require(cols % vec == 0, name, " has ", cols, " columns, not a multiple of ", vec, " (16-byte loads)");
  return weights;
}

}  // namespace

void bind_moe(py::module_& m) {
  m.def(
      "moe_route",
      [](TensorArg weights, TensorArg ids, TensorArg logits, std::optional<TensorArg> rows, bool renormalize,
         std::uintptr_t stream) {
        ArgCheck check("moe_route");
        const DType dtype = kernel_dtype(check, "logits", logits);
        check("logits", logits).shape({kAny, kAny}).contiguous();
        const std::int64_t tokens = logits.size(0), experts = logits.size(1);
        check.require(tokens <= (1LL << 31) - 1, "logits has ", tokens, " rows, past the kernel's 2^31 - 1");
        check("weights", weights).shape({tokens, kAny}).dtype(logits.type).contiguous();
        const std::int64_t top_k = weights.size(1);
        require_route(check, experts, top_k);
        check("ids", ids).shape({tokens, top_k}).dtype(ScalarType::I32).contiguous();
        // rows[n] < tokens is the caller's to keep (ops/moe.py builds them on the device, unchecked)
        check("rows", rows).shape({tokens}).dtype(ScalarType::I64).contiguous();
        const int device = check.device();
        moe_route({weights.data, ids.data, logits.data, data_or_null(rows), tokens, experts, top_k, renormalize, dtype,
                   device, stream});
      },
      py::arg("weights"), py::arg("ids"), py::arg("logits"), py::arg("rows"), py::arg("renormalize"), py::arg("stream"),
      "Softmax top-k routing of logits [tokens, experts] (token n's row rows[n] where rows is given), one warp "
      "per token, into weights and ids [tokens, top_k]. See csrc/moe.h.");

  m.def(
      "moe_router",
      [](TensorArg logits, TensorArg weights, TensorArg ids, TensorArg done, TensorArg x, TensorArg w,
         std::int64_t experts, bool renormalize, std::uintptr_t stream, std::optional<TensorArg> residual,
         std::optional<TensorArg> norm_weight, std::optional<TensorArg> normed,
         std::optional<TensorArg> residual_out, float eps, bool zero_centered, std::optional<TensorArg> live) {
        ArgCheck check("moe_router");
        check("x", x).shape({kAny, kAny}).dtype({ScalarType::F16, ScalarType::BF16}).contiguous().aligned(16);
        const DType dtype = kernel_dtype(check, "x", x);
        const std::int64_t tokens = x.size(0), hidden = x.size(1);
        check.require(tokens >= 1 && tokens <= kMoeRouterMaxTokens,
                      "tokens ", tokens, " must be in 1..", kMoeRouterMaxTokens);
        // each thread holds its vectors of 8 of a row
        check.require(hidden >= 8 && hidden % 8 == 0 && hidden <= kMoeRouterMaxHidden,
                      "hidden ", hidden, " must be a multiple of 8 up to ", kMoeRouterMaxHidden);
        check("w", w).shape({kAny, hidden}).dtype(x.type).contiguous().aligned(16);
        const std::int64_t rows = w.size(0);
        check.require(rows >= experts && rows <= (1 << 20),
                      "w has ", rows, " rows for ", experts, " experts");
        check("logits", logits).shape({tokens, rows}).dtype(x.type).contiguous();
        check("weights", weights).shape({tokens, kAny}).dtype(x.type).contiguous();
        const std::int64_t top_k = weights.size(1);
        require_route(check, experts, top_k);
        check("ids", ids).shape({tokens, top_k}).dtype(ScalarType::I32).contiguous();
        check("done", done).shape({1}).dtype(ScalarType::I32);  // the blocks' completion counter
        check("live", live).shape({1}).dtype(ScalarType::I32);  // a graph's real tokens (any value: min'd)
        const bool norm = residual.has_value();
        check.require(norm_weight.has_value() == norm && normed.has_value() == norm && residual_out.has_value() == norm,
                      "residual, norm_weight, normed and residual_out go together");
        if (norm) {  // one warp-wide vector loop over a row (moe.h)
          check.require(hidden % 256 == 0 && hidden <= 2048,
                        "a folded norm needs hidden a multiple of 256, at most 2048, got ", hidden);
          check.require(eps >= 0.0f, "eps must be >= 0");
        }
        check("residual", residual).matches(x, "x").contiguous().aligned(16);
        check("norm_weight", norm_weight).shape({hidden}).dtype(x.type).contiguous().aligned(16);
        check("normed", normed).matches(x, "x").contiguous().aligned(16);
        check("residual_out", residual_out).matches(x, "x").contiguous().aligned(16);
        // Outputs must not overlap the inputs (moe.h): blocks read x while others write.
        std::vector<std::pair<const char*, const TensorArg*>> outputs{{"logits", &logits}, {"weights", &weights},
                                                                      {"ids", &ids}},
            inputs{{"x", &x}, {"w", &w}};
        if (norm) {
          outputs.insert(outputs.end(), {{"normed", &*normed}, {"residual_out", &*residual_out}});
          inputs.insert(inputs.end(), {{"residual", &*residual}, {"norm_weight", &*norm_weight}});
        }
        for (const auto& [out_name, out] : outputs) {
          for (const auto& [in_name, in] : inputs) {
            check(out_name, *out).disjoint(*in, in_name);
          }
        }
        const int device = check.device();
        moe_router({{weights.data, ids.data, logits.data, 0, tokens, experts, top_k, renormalize, dtype, device, stream},
                    data_or_null(live), done.data, x.data, w.data, hidden, rows,
                    {data_or_null(residual), data_or_null(norm_weight), data_or_null(normed),
                     data_or_null(residual_out), eps, zero_centered}});
      },
      py::arg("logits"), py::arg("weights"), py::arg("ids"), py::arg("done"), py::arg("x"), py::arg("w"),
      py::arg("experts"), py::arg("renormalize"), py::arg("stream"), py::arg("residual") = py::none(),
      py::arg("norm_weight") = py::none(), py::arg("normed") = py::none(), py::arg("residual_out") = py::none(),
      py::arg("eps") = 0.0f, py::arg("zero_centered") = false, py::arg("live") = py::none(),
      "A decode step's router GEMV (logits = x @ w^T) + softmax top-k over the first `experts` columns in "
      "one launch, optionally after the add + RMSNorm before it; tokens from live[0] on routed dead (ids "
      "-1, weights 0). See csrc/moe.h.");

  m.def(
      "moe_align",
      [](TensorArg sorted_slots, TensorArg block_experts, TensorArg used, TensorArg ids, std::int64_t experts,
         int block_m, std::uintptr_t stream) {
        ArgCheck check("moe_align");
        check("ids", ids).dtype(ScalarType::I32).contiguous();
        const std::int64_t slots = ids.numel();
        check.require(experts >= 1 && experts <= 4096 && slots <= (1LL << 30),
                      "slots ", slots, " / experts ", experts, " out of range");
        check.require(block_m == 8 || block_m == 16 || block_m == 32 || block_m == 64 || block_m == 128,
                      "block_m must be 8, 16, 32, 64 or 128, got ", block_m);
        check("sorted_slots", sorted_slots).shape({kAny}).dtype(ScalarType::I32).contiguous();
        const std::int64_t capacity = sorted_slots.size(0), needed = moe_align_capacity(slots, experts, block_m);
        check.require(capacity >= needed && capacity % block_m == 0,
                      "sorted_slots has ", capacity, " positions, needs a multiple of block_m of at least ", needed);
        check("block_experts", block_experts).shape({capacity / block_m}).dtype(ScalarType::I32).contiguous();
        check("used", used).shape({1}).dtype(ScalarType::I32);
        const int device = check.device();
        moe_align({sorted_slots.data, block_experts.data, used.data, ids.data, slots, experts, block_m, capacity,
                   device, stream});
      },
      py::arg("sorted_slots"), py::arg("block_experts"), py::arg("used"), py::arg("ids"), py::arg("experts"),
      py::arg("block_m"), py::arg("stream"),
      "Group the (token, slot) pairs of ids (int32, any shape) by expert in blocks of block_m, on the device. "
      "See csrc/moe.h.");

  m.def(
      "moe_combine",
      [](TensorArg out, TensorArg y, TensorArg weights, std::uintptr_t stream) {
        ArgCheck check("moe_combine");
        const DType dtype = kernel_dtype(check, "y", y);
        check("y", y).dtype({ScalarType::F16, ScalarType::BF16}).shape({kAny, kAny}).contiguous().aligned(16);
        const DType weights_dtype = kernel_dtype(check, "weights", weights);
        check("weights", weights).shape({kAny, kAny}).contiguous();
        const std::int64_t tokens = weights.size(0), top_k = weights.size(1), hidden = y.size(1);
        check.require(top_k >= 1 && top_k <= kMoeMaxTopK, "top_k ", top_k, " out of range (1 .. ", kMoeMaxTopK, ")");
        check.require(hidden % 8 == 0, "y has ", hidden, " columns, not a multiple of 8 (16-byte loads)");
        check.require(tokens * top_k <= (1LL << 31) - 1 && tokens * hidden <= (1LL << 34),
                      "tokens ", tokens, " past the kernel's int indices");
        check("y", y).shape({tokens * top_k, hidden});
        check("out", out).shape({tokens, hidden}).dtype(y.type).contiguous().aligned(16);
        const int device = check.device();
        moe_combine({out.data, y.data, weights.data, tokens, top_k, hidden, dtype, weights_dtype, device, stream});
      },
      py::arg("out"), py::arg("y"), py::arg("weights"), py::arg("stream"),
      "out [tokens, hidden] = each token's top_k slot rows of y [tokens * top_k, hidden] weighted by "
      "weights [tokens, top_k] and summed. See csrc/moe.h.");

  m.def(
      "moe_decode",
      [](TensorArg out, TensorArg h, TensorArg x, TensorArg weights, TensorArg ids, TensorArg gate_up,
         std::optional<TensorArg> gate_up_scales, TensorArg down, std::optional<TensorArg> down_scales,
         std::uintptr_t stream, std::optional<TensorArg> shared_gate_up,
         std::optional<TensorArg> shared_gate_up_scales, std::optional<TensorArg> shared_down,
         std::optional<TensorArg> shared_down_scales, std::optional<TensorArg> shared_gate) {
        ArgCheck check("moe_decode");
        const DType dtype = kernel_dtype(check, "x", x);
        // 16-byte aligned: the tensor-core kernels (moe_decode_mma.cu) load x in 16-byte vectors
        check("x", x).shape({kAny, kAny}).contiguous().aligned(16);
        const std::int64_t tokens = x.size(0), hidden = x.size(1);
        check("ids", ids).shape({tokens, kAny}).dtype(ScalarType::I32).contiguous();
        const std::int64_t top_k = ids.size(1);
        const DType weights_dtype = kernel_dtype(check, "weights", weights);
        check("weights", weights).shape({tokens, top_k}).contiguous();
        check("out", out).matches(x, "x").contiguous();
        check("gate_up", gate_up).shape({kAny, kAny, kAny});
        const std::int64_t experts = gate_up.size(0), inter = gate_up.size(1) / 2;  // [E, 2 inter, hidden]
        const bool shared = shared_gate_up.has_value();
        check.require(shared_down.has_value() == shared && shared_gate.has_value() == shared &&
                          (shared || !(shared_gate_up_scales || shared_down_scales)),
                      "shared_gate_up, shared_down, shared_gate and their scales go together");
        const std::int64_t shared_inter = shared ? shared_gate_up->size(0) / 2 : 0;  // [2 shared_inter, hidden]
        // x in gate_up's shared memory, h and the slot weights / ids in down's
        check.require(top_k >= 1 && top_k <= kMoeMaxTopK && experts >= 1 && hidden >= 1 && inter >= 1 &&
                          tokens * top_k <= 65535 && 4 * hidden <= kMoeMaxSharedBytes &&
                          4 * (top_k * (inter + 2) + shared_inter) <= kMoeMaxSharedBytes,
                      "tokens ", tokens, " / top_k ", top_k, " / hidden ", hidden, " / inter ", inter,
                      " / shared_inter ", shared_inter, " out of range");
        const ExpertWeights gu = expert_weights(check, "gate_up", "gate_up_scales", gate_up, gate_up_scales, experts,
                                                2 * inter, hidden, x);
        const ExpertWeights dn = expert_weights(check, "down", "down_scales", down, down_scales, experts, hidden,
                                                inter, x);
        ExpertWeights shared_gu{}, shared_dn{};
        std::int64_t gate_stride = 0;
        if (shared) {
          check.require(dtype != DType::F32 && gu.kind != ExpertKind::Dense && dn.kind != ExpertKind::Dense,
                        "a shared expert needs fp16 / bf16 x and quantized routed experts");
          check("shared_gate_up", shared_gate_up).dtype({ScalarType::I8, ScalarType::U8});
          check("shared_down", shared_down).dtype({ScalarType::I8, ScalarType::U8});
          check.require(shared_inter >= 1, "shared_gate_up has no rows");
          shared_gu = expert_weights(check, "shared_gate_up", "shared_gate_up_scales", *shared_gate_up,
                                     shared_gate_up_scales, std::nullopt, 2 * shared_inter, hidden, x);
          shared_dn = expert_weights(check, "shared_down", "shared_down_scales", *shared_down, shared_down_scales,
                                     std::nullopt, hidden, shared_inter, x);
          // one logit a token, a stride apart (a column of the router's output); one token needs none
          check("shared_gate", shared_gate).shape({tokens, 1}).dtype(x.type);
          gate_stride = tokens <= 1 ? 1 : shared_gate->stride(0);
          check.require(gate_stride >= 1, "shared_gate needs rows a positive stride apart");
        }
        check("h", h).shape({tokens, top_k * inter + shared_inter}).dtype(x.type).contiguous().aligned(16);
        const int device = check.device();
        moe_decode({out.data, h.data, x.data, weights.data, ids.data, gu, dn, tokens, top_k, hidden, inter, experts,
                    dtype, weights_dtype, device, stream, shared_gu, shared_dn, shared_inter,
                    data_or_null(shared_gate), gate_stride});
      },
      py::arg("out"), py::arg("h"), py::arg("x"), py::arg("weights"), py::arg("ids"), py::arg("gate_up"),
      py::arg("gate_up_scales"), py::arg("down"), py::arg("down_scales"), py::arg("stream"),
      py::arg("shared_gate_up") = py::none(), py::arg("shared_gate_up_scales") = py::none(),
      py::arg("shared_down") = py::none(), py::arg("shared_down_scales") = py::none(),
      py::arg("shared_gate") = py::none(),
      "Routed experts of a few tokens: gate_up GEMV + SwiGLU into h, then down GEMV summed over the "
      "experts, optionally with a gated shared expert; expert formats from the codes' dtypes (x's dtype: "
      "dense, None for scales), int4 group sizes from the scales' shapes. See csrc/moe.h.");
}

}  // namespace ninfer

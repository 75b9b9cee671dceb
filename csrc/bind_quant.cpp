// Bindings of the quant kernel family (int8 / int4 weight-only GEMV, csrc/quant_gemv.cu): each takes
// the torch.Tensors and checks them against csrc/quant_gemv.h before anything launches.
#include "bind.h"
#include "quant_gemv.h"
#include "tensor_arg.h"

namespace py = pybind11;

namespace ninfer {
namespace {

// A weight in the GPU formats (quant_gemv.h), [experts, rows, k] when `experts` is set, else
// [rows, k]: int8 codes with fp32 scales [.., rows], or int4 pairs (uint8) [.., rows, k / 2] with
// bf16 scales [.., rows, k / group_size]. Returns the group size its scales give (0 for int8).
int weight_format(ArgCheck& check, const TensorArg& qweight, const TensorArg& scales,
                  std::optional<std::int64_t> experts, std::int64_t rows, std::int64_t k) {
  const bool int4 = qweight.type == ScalarType::U8;
  const std::int64_t width = int4 ? k / 2 : k;
  TensorCheck codes = check("qweight", qweight);
  codes.dtype({ScalarType::I8, ScalarType::U8});
  experts ? codes.shape({*experts, rows, width}) : codes.shape({rows, width});
  codes.contiguous();
  TensorCheck scale = check("scales", scales);
  scale.dtype(int4 ? ScalarType::BF16 : ScalarType::F32);
  if (!int4) {
    experts ? scale.shape({*experts, rows}) : scale.shape({rows});
    scale.contiguous();
    return 0;
  }
  experts ? scale.shape({*experts, rows, kAny}) : scale.shape({rows, kAny});
  scale.contiguous();
  const std::int64_t groups = scales.size(-1);
  check.require(k % 2 == 0 && groups > 0 && k % groups == 0,
                "scales has ", groups, " groups, which do not divide k=", k);
  return static_cast<int>(k / groups);
}

// The GEMV kernels' formats (quant_gemv.h): int4 groups of 32, 64 or 128; int8 rows of whole
// 16-byte loads; n output rows and k columns within the kernels' 32-bit grid and offsets.
void require_gemv_format(const ArgCheck& check, int group_size, bool int4, std::int64_t n, std::int64_t k) {
  check.require(n <= (1LL << 31) - 1 && k <= (1LL << 30), "n=", n, " / k=", k, " past the kernels' range");
  if (int4) {
    check.require(group_size == 32 || group_size == 64 || group_size == 128,
                  "int4 group_size must be 32, 64 or 128, got ", group_size);
  } else {
    check.require(k % 16 == 0, "int8 needs k % 16 == 0 (16-byte row loads), got k=", k);
  }
}

}  // namespace

void bind_quant(py::module_& module) {
  module.def(
      "quant_gemv",
      [](TensorArg out, TensorArg x, TensorArg qweight, TensorArg scales, std::optional<TensorArg> bias,
         std::uintptr_t stream, bool gate_up, std::optional<TensorArg> gate, std::optional<TensorArg> add,
         std::optional<TensorArg> residual, std::optional<TensorArg> norm_weight,
         std::optional<TensorArg> residual_out, float eps, bool zero_centered, std::optional<TensorArg> conv_pool,
         std::optional<TensorArg> conv_weight, std::optional<TensorArg> conv_slots, std::optional<TensorArg> zeroed) {
        ArgCheck check("quant_gemv");
        const DType dtype = kernel_dtype(check, "x", x);
        check("x", x).shape({kAny, kAny}).contiguous().aligned(16);
        const std::int64_t m = x.size(0), k = x.size(1);
        check.require(m >= 1 && m <= kQuantGemvMaxRows,
                      "rows m=", m, " must be in 1..", kQuantGemvMaxRows);
        check.require(k >= 1, "x has no columns");
        const std::int64_t rows = qweight.dim > 0 ? qweight.size(0) : 0;
        check.require(rows >= 1 && (!gate_up || rows % 2 == 0), "qweight has ", rows, " rows",
                      gate_up ? ", gate_up needs an even count" : "");
        const std::int64_t n = gate_up ? rows / 2 : rows;  // gate_up: W = [gate; up]
        const bool int4 = qweight.type == ScalarType::U8;
        const int group_size = weight_format(check, qweight, scales, std::nullopt, rows, k);
        require_gemv_format(check, group_size, int4, n, k);
        check("qweight", qweight).aligned(16);
        check("out", out).shape({m, n}).dtype(x.type).contiguous();
        check("bias", bias).shape({n}).dtype(x.type).contiguous();
        check.require(!gate_up || !(bias || gate || add), "gate_up takes no bias, gate or add");
        check("gate", gate).shape({m, 1}).dtype(x.type);
        // one logit a row, a stride apart (a column of a merged projection); one row needs none
        const std::int64_t gate_stride = !gate ? 0 : m == 1 ? 1 : gate->stride(0);
        check.require(!gate || gate_stride >= 1, "gate needs rows a positive stride apart");
        check("add", add).shape({m, n}).dtype(x.type).contiguous();
        // The folded add + RMSNorm: every block norms all rows before its GEMV (GemvAddNormArgs).
        const bool norm = residual.has_value();
        check.require(norm_weight.has_value() == norm && residual_out.has_value() == norm,
                      "residual, norm_weight and residual_out go together");
        if (norm) {
          check.require(dtype != DType::F32, "the folded norm needs fp16 / bf16 x");
          check.require(!gate_up && !gate && !add, "the folded norm takes no gate_up, gate or add");
          check.require(m <= kQuantGemvNormMaxRows && k <= kQuantGemvNormMaxK,
                        "the folded norm takes m <= ", kQuantGemvNormMaxRows, " rows of k <= ", kQuantGemvNormMaxK,
                        ", got m=", m, ", k=", k);
          check.require(eps >= 0.0f, "eps must be >= 0");
        }
        check("residual", residual).matches(x, "x").contiguous().aligned(16);
        check("norm_weight", norm_weight).shape({k}).dtype(x.type).contiguous().aligned(16);
        check("residual_out", residual_out).matches(x, "x").contiguous().aligned(16);
        // blocks read x and residual while block 0 writes residual_out and every block its part of out
        if (norm) {
          check("residual_out", residual_out).disjoint(x, "x").disjoint(*residual, "residual");
          check("out", out).disjoint(x, "x").disjoint(*residual, "residual").disjoint(*residual_out, "residual_out");
        }
        // The GDN decode conv as the GEMV's epilogue, with the norm or without it (GemvConvArgs):
        // channels and taps from the weight, the counters to zero from `zeroed`.
        const bool conv = conv_pool.has_value();
        check.require(conv_weight.has_value() == conv && conv_slots.has_value() == conv,
                      "conv_pool, conv_weight and conv_slots go together");
        check.require(conv || !zeroed, "zeroed goes with the conv");
        std::int64_t channels = 0, taps = 0, zeroed_count = 0;
        if (conv) {
          check.require(dtype != DType::F32, "the conv epilogue needs fp16 / bf16 x");
          check.require(!gate_up && !gate && !add, "the conv epilogue takes no gate_up, gate or add");
          check.require(norm || m <= kQuantGemvConvMaxRows, "the conv epilogue without the norm takes m <= ",
                        kQuantGemvConvMaxRows, " rows, got m=", m);
          check("conv_weight", conv_weight).shape({kAny, kAny}).dtype(x.type).contiguous().aligned(16);
          channels = conv_weight->size(0);
          taps = conv_weight->size(1);
          check.require(channels >= 16 && channels % 16 == 0 && channels <= n, "conv_weight has ", channels,
                        " channels, expected a multiple of 16 in 16..", n, " (out's columns)");
          check.require(taps >= 2 && taps <= kQuantGemvConvMaxTaps, "conv_weight has ", taps, " taps, expected 2..",
                        kQuantGemvConvMaxTaps);
          TensorCheck pool_check = check("conv_pool", conv_pool);
          pool_check.shape({kAny, channels, taps - 1}).dtype(x.type).contiguous().aligned(16);
          check("conv_slots", conv_slots).shape({m}).dtype(ScalarType::I64).contiguous().aligned(8);
          // int32 counters (the GDN recurrent kernel's), written as whole words
          TensorCheck zeroed_check = check("zeroed", zeroed);
          zeroed_check.shape({kAny}).dtype(ScalarType::I32).contiguous().aligned(4);
          zeroed_count = zeroed ? zeroed->numel() : 0;
          check.require(zeroed_count < (std::int64_t{1} << 31), "zeroed has ", zeroed_count, " words, too many");
          // The states are read (staged before the wait for x) and written in place by the blocks that
          // own their channels, block 0 warp 0 writes the counters, and every block reads the weights
          // and slots and writes its part of out: the two written conv operands share no byte with
          // any other operand, and out and residual_out none with the conv's inputs.
          const TensorArg &pool = *conv_pool, &weight = *conv_weight, &slots = *conv_slots;
          const std::pair<const char*, const TensorArg*> operands[] = {
              {"x", &x}, {"qweight", &qweight}, {"scales", &scales}, {"residual", residual ? &*residual : nullptr},
              {"norm_weight", norm_weight ? &*norm_weight : nullptr},
              {"residual_out", residual_out ? &*residual_out : nullptr}, {"out", &out},
              {"conv_weight", &weight}, {"conv_slots", &slots}, {"bias", bias ? &*bias : nullptr}};
          for (const auto& [name, other] : operands) {
            if (other == nullptr) continue;
            pool_check.disjoint(*other, name);
            zeroed_check.disjoint(*other, name);  // absent: passes
          }
          zeroed_check.disjoint(pool, "conv_pool");
          check("out", out).disjoint(weight, "conv_weight").disjoint(slots, "conv_slots");
          check("residual_out", residual_out).disjoint(weight, "conv_weight").disjoint(slots, "conv_slots");
          check("out", out).disjoint(x, "x");  // without the norm: read by other blocks while one writes
        }
        const int device = check.device();
        int split = 0;
        quant_gemv({out.data, x.data, qweight.data, scales.data, data_or_null(bias), m, n, k, group_size, int4,
                    dtype, device, stream, gate_up, data_or_null(gate), gate_stride, data_or_null(add),
                    {data_or_null(residual), data_or_null(norm_weight), data_or_null(residual_out), eps,
                     zero_centered},
                    {data_or_null(conv_pool), data_or_null(conv_weight), data_or_null(conv_slots),
                     data_or_null(zeroed), channels, static_cast<int>(taps), static_cast<int>(zeroed_count)},
                    &split});
        return split;
      },
      py::arg("out"), py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("bias"), py::arg("stream"),
      py::arg("gate_up") = false, py::arg("gate") = py::none(), py::arg("add") = py::none(),
      py::arg("residual") = py::none(), py::arg("norm_weight") = py::none(), py::arg("residual_out") = py::none(),
      py::arg("eps") = 0.0f, py::arg("zero_centered") = false, py::arg("conv_pool") = py::none(),
      py::arg("conv_weight") = py::none(), py::arg("conv_slots") = py::none(), py::arg("zeroed") = py::none(),
      "out[m, n] = x[m, k] @ W^T (+ bias) for int8 / int4 W (format from qweight's dtype, group size from "
      "scales' shape), m <= 1024; None for no bias; gate_up: SwiGLU of W = [gate; up]; gate [m, 1] / add "
      "[m, n]: add + sigmoid(gate) * out; residual: x + residual into residual_out and its RMSNorm "
      "(norm_weight, eps, zero_centered) as the GEMV's input; conv_pool [S, C, K-1] (with the norm): a GDN "
      "decode conv by conv_weight [C, K] on outputs < C, rows continuing conv_slots [m] (int64), zeroing "
      "`zeroed` (int32). Returns the K split it ran with (warps a tile). See csrc/quant_gemv.h.");
  module.def(
      "moe_grouped_gemv",
      [](TensorArg out, TensorArg x, TensorArg qweight, TensorArg scales, TensorArg sorted_slots,
         TensorArg block_experts, TensorArg used, int block_m, bool gate_up, std::uintptr_t stream) {
        ArgCheck check("moe_grouped_gemv");
        check("x", x).shape({kAny, kAny}).dtype({ScalarType::F16, ScalarType::BF16}).contiguous().aligned(16);
        const DType dtype = kernel_dtype(check, "x", x);
        check("out", out).shape({kAny, kAny}).dtype(x.type).contiguous();
        const std::int64_t slots = out.size(0), n = out.size(1), k = x.size(1);
        // x row s / rows_per_x feeds slot s: a token's top_k slots (gate_up), or the slot's own row (down)
        check.require(k >= 1, "x has no columns");
        check.require(slots <= (1LL << 31) - 1, "out has ", slots, " rows, past the kernels' 2^31 - 1");
        check.require(slots >= 1 && n >= 1 && x.size(0) >= 1 && slots % x.size(0) == 0,
                      "out has ", slots, " rows of ", n, ", needs rows a multiple of x's ", x.size(0));
        const std::int64_t rows_per_x = slots / x.size(0);
        check.require(block_m == 8 || block_m == 16 || block_m == 32,
                      "block_m must be 8, 16 or 32, got ", block_m);
        check("block_experts", block_experts).shape({kAny}).dtype(ScalarType::I32).contiguous();
        const std::int64_t blocks = block_experts.size(0);
        check.require(blocks <= 65535, "block_experts has ", blocks, " blocks, at most 65535");
        check("sorted_slots", sorted_slots).shape({blocks * block_m}).dtype(ScalarType::I32).contiguous();
        check("used", used).shape({1}).dtype(ScalarType::I32);
        const bool int4 = qweight.type == ScalarType::U8;
        const std::int64_t experts = qweight.dim > 0 ? qweight.size(0) : 0;
        const int group_size = weight_format(check, qweight, scales, experts, gate_up ? 2 * n : n, k);
        require_gemv_format(check, group_size, int4, n, k);
        check("qweight", qweight).aligned(16);
        const int device = check.device();
        moe_grouped_gemv({{out.data, x.data, qweight.data, scales.data, 0, 0, n, k, group_size, int4, dtype, device,
                           stream},
                          sorted_slots.data, block_experts.data, used.data, blocks, block_m, slots,
                          static_cast<int>(rows_per_x), gate_up});
      },
      py::arg("out"), py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("sorted_slots"),
      py::arg("block_experts"), py::arg("used"), py::arg("block_m"), py::arg("gate_up"), py::arg("stream"),
      "The quant GEMV over MoE experts [E, rows, k] grouped by moe_align: out [slots, n], x [slots / "
      "rows_per_x, k]; gate_up (+ SwiGLU, rows = 2 n) or down per slot. See csrc/quant_gemv.h.");
  module.def(
      "dequant",
      [](TensorArg out, TensorArg qweight, TensorArg scales, std::uintptr_t stream) {
        ArgCheck check("dequant");
        const DType dtype = kernel_dtype(check, "out", out);
        check("out", out).shape({kAny, kAny}).contiguous().aligned(16);
        const std::int64_t rows = out.size(0), k = out.size(1);
        check.require(rows >= 1 && k >= 8 && k % 8 == 0, "out has ", rows, " rows of k=", k,
                      ", needs rows >= 1 and k a multiple of 8");
        const bool int4 = qweight.type == ScalarType::U8;
        const int group_size = weight_format(check, qweight, scales, std::nullopt, rows, k);
        // each thread turns 8 codes into values with one scale: groups of a multiple of 8
        check.require(group_size % 8 == 0, "int4 groups of ", group_size, " are not a multiple of 8");
        check("qweight", qweight).aligned(8);
        const int device = check.device();
        dequant({out.data, qweight.data, scales.data, rows, k, group_size, int4, dtype, device, stream});
      },
      py::arg("out"), py::arg("qweight"), py::arg("scales"), py::arg("stream"),
      "Dense weight out [rows, k] from int8 / int4 codes [rows, k or k / 2] and their scales (one pass; "
      "leading dims flattened into rows). See csrc/quant_gemv.h.");
}

}  // namespace ninfer

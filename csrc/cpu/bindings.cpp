// pybind11 module ninfer_core._cpu: the CPU kernels (raw-pointer interface like ninfer_core._C;
// call them through ninfer_core.ops). The GIL is released while a kernel runs.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>

#include "decode_layer.h"
#include "decode_ops.h"
#include "gdn_step.h"
#include "kquant.h"
#include "moe_step.h"
#include "quant_matmul.h"

namespace py = pybind11;
using ninfer::cpu::KQuantWeight;
using ninfer::cpu::QuantWeight;
using ninfer::cpu::ScaleType;

namespace {

// A K-quant weight from ops/kquant.py's cpu_plan: (data, k, block types, rows per part).
KQuantWeight kquant_weight(std::uintptr_t data, std::int64_t k, const py::tuple& types, const py::tuple& rows) {
  if (types.size() != rows.size() || types.size() < 1 || types.size() > ninfer::cpu::kMaxParts) {
    throw std::invalid_argument("kquant: 1 to 8 parts, one block type and row count each");
  }
  KQuantWeight w{data, k, static_cast<int>(types.size()), {}};
  for (std::size_t i = 0; i < types.size(); ++i) {
    w.part[i] = {static_cast<ninfer::cpu::BlockType>(types[i].cast<int>()), rows[i].cast<std::int64_t>()};
  }
  return w;
}

// ops/attention.py CACHE_TYPES' number of a KV cache's element type (0 fp32, 1 bf16, 2 fp16).
ninfer::cpu::CacheType cache_of(int type) {
  if (type < 0 || type > 2) throw std::invalid_argument("KV cache type: 0 (fp32), 1 (bf16) or 2 (fp16)");
  return static_cast<ninfer::cpu::CacheType>(type);
}

// A 16-bit one (write_kv_narrow's).
ninfer::cpu::CacheType narrow_cache(int type) {
  if (type != 1 && type != 2) throw std::invalid_argument("write_kv_narrow: cache_type 1 (bf16) or 2 (fp16)");
  return cache_of(type);
}

// A weight from ops/quant.py's cpu_plan (codes, scales, offsets, k, group, int4, scale_type) and its rows n.
QuantWeight quant_weight(const py::tuple& plan, std::int64_t n) {
  return {plan[0].cast<std::uintptr_t>(), plan[1].cast<std::uintptr_t>(), plan[2].cast<std::uintptr_t>(), n,
          plan[3].cast<std::int64_t>(),   plan[4].cast<std::int64_t>(),   plan[5].cast<bool>(),
          static_cast<ScaleType>(plan[6].cast<int>())};
}

// A linear as a tuple (n, bias, kquant, plan): the output width, the bias pointer (0 for none), and the weight's
// cpu_plan, ops/quant.py's (codes, scales, offsets, k, group, int4, scale_type) or with kquant ops/kquant.py's.
ninfer::cpu::LayerLinear layer_linear(const py::tuple& t) {
  ninfer::cpu::LayerLinear l{};
  l.bias = reinterpret_cast<const float*>(t[1].cast<std::uintptr_t>());
  l.kquant = t[2].cast<bool>();
  const auto plan = t[3].cast<py::tuple>();
  if (l.kquant) {
    l.kw = kquant_weight(plan[0].cast<std::uintptr_t>(), plan[1].cast<std::int64_t>(), plan[2].cast<py::tuple>(),
                         plan[3].cast<py::tuple>());
  } else {
    l.w = quant_weight(plan, t[0].cast<std::int64_t>());
  }
  return l;
}

// moe_experts' arguments from Python's tuples (ops/moe.py `_cpu_expert_plan`, ops/cpu_layer.py
// `linear_plan`), the shapes checked; x, weights, ids and the shared gate are the caller's to fill.
// Holds the shared linears the args point to.
struct ExpertsCall {
  ninfer::cpu::MoeArgs args{};
  ninfer::cpu::LayerLinear shared_gate_up{}, shared_down{};

  ExpertsCall(std::uintptr_t out, std::int64_t tokens, std::int64_t top_k, std::int64_t num_experts,
              const py::tuple& gate_up, const py::tuple& down, const py::object& shared, int threads,
              bool int8_activations) {
    const auto experts = [](const py::tuple& t) {
      const auto strides = t[1].cast<py::tuple>();
      return ninfer::cpu::ExpertWeights{layer_linear(t[0].cast<py::tuple>()), strides[0].cast<std::int64_t>(),
                                        strides[1].cast<std::int64_t>(), strides[2].cast<std::int64_t>()};
    };
    using ninfer::cpu::layer_linear_inputs, ninfer::cpu::layer_linear_rows;
    args.out = reinterpret_cast<float*>(out);
    args.tokens = tokens, args.top_k = top_k, args.num_experts = num_experts;
    args.gate_up = experts(gate_up), args.down = experts(down);
    args.threads = threads, args.int8_activations = int8_activations;
    const auto fits = [&](const ninfer::cpu::LayerLinear& gu, const ninfer::cpu::LayerLinear& dn) {
      const std::int64_t n = layer_linear_rows(gu);
      return n % 2 == 0 && layer_linear_inputs(dn) * 2 == n && layer_linear_inputs(gu) == layer_linear_rows(dn);
    };
    if (!fits(args.gate_up.first, args.down.first)) {
      throw std::invalid_argument("moe_experts: gate_up [E, 2I, H] and down [E, H, I] do not match");
    }
    if (shared.is_none()) return;
    const auto t = shared.cast<py::tuple>();
    shared_gate_up = layer_linear(t[0].cast<py::tuple>()), shared_down = layer_linear(t[1].cast<py::tuple>());
    if (!fits(shared_gate_up, shared_down) || layer_linear_rows(shared_down) != layer_linear_rows(args.down.first)) {
      throw std::invalid_argument("moe_experts: the shared gate_up [2I, H] and down [H, I] do not match");
    }
    args.shared_gate_up = &shared_gate_up, args.shared_down = &shared_down;
  }
  ExpertsCall(const ExpertsCall&) = delete;
  ExpertsCall& operator=(const ExpertsCall&) = delete;
};

}  // namespace

PYBIND11_MODULE(_cpu, m) {
  m.doc() = "ninfer CPU kernels: weight-only int8 / int4 matmul (csrc/cpu/quant_matmul.h) and the fp32 decode ops "
            "around it (csrc/cpu/decode_ops.h)";
  // Argument order: the call's own values first, then the weight's (ops/quant.py caches those).
  m.def(
      "quant_matmul",
      [](std::uintptr_t out, std::uintptr_t x, std::uintptr_t bias, std::int64_t m, std::int64_t n, int threads,
         bool int8_activations, std::uintptr_t codes, std::uintptr_t scales, std::uintptr_t offsets, std::int64_t k,
         std::int64_t group, bool int4, int scale_type) {
        const QuantWeight w{codes, scales, offsets, n, k, group, int4, static_cast<ScaleType>(scale_type)};
        ninfer::cpu::quant_matmul({w, out, x, bias, m, threads, int8_activations});
      },
      py::arg("out"), py::arg("x"), py::arg("bias"), py::arg("m"), py::arg("n"), py::arg("threads"),
      py::arg("int8_activations"), py::arg("codes"), py::arg("scales"), py::arg("offsets"), py::arg("k"), py::arg("group"), py::arg("int4"),
      py::arg("scale_type"), py::call_guard<py::gil_scoped_release>(),
      "out[m, n] = x[m, k] @ W^T (+ bias), fp32; offsets / bias 0 for none; scale_type: ScaleType's value; "
      "int8_activations: x quantized per block of 32 (csrc/cpu/quant_matmul.h).");
  m.def(
      "dequantize",
      [](std::uintptr_t out, std::int64_t n, std::int64_t first, std::int64_t count, bool bf16, int threads,
         std::uintptr_t codes, std::uintptr_t scales, std::uintptr_t offsets, std::int64_t k, std::int64_t group,
         bool int4, int scale_type) {
        const QuantWeight w{codes, scales, offsets, n, k, group, int4, static_cast<ScaleType>(scale_type)};
        ninfer::cpu::dequantize(w, first, count, out, bf16, threads);
      },
      py::arg("out"), py::arg("n"), py::arg("first"), py::arg("count"), py::arg("bf16"), py::arg("threads"),
      py::arg("codes"), py::arg("scales"), py::arg("offsets"), py::arg("k"), py::arg("group"), py::arg("int4"),
      py::arg("scale_type"), py::call_guard<py::gil_scoped_release>(),
      "out fp32 (bf16: bf16) [count, k] = rows first.. of the dense weight [n, k].");
  m.def(
      "kquant_matmul",
      [](std::uintptr_t out, std::uintptr_t x, std::uintptr_t bias, std::int64_t m, int threads, std::uintptr_t data,
         std::int64_t k, const py::tuple& types, const py::tuple& rows) {
        const KQuantWeight w = kquant_weight(data, k, types, rows);
        py::gil_scoped_release release;
        ninfer::cpu::kquant_matmul({w, out, x, bias, m, threads});
      },
      py::arg("out"), py::arg("x"), py::arg("bias"), py::arg("m"), py::arg("threads"), py::arg("data"), py::arg("k"),
      py::arg("types"), py::arg("rows"),
      "out[m, n] = x[m, k] @ W^T (+ bias) over packed K-quant blocks, x quantized per 256 (csrc/cpu/kquant.h).");
  m.def(
      "kquant_dequantize",
      [](std::uintptr_t out, std::int64_t first, std::int64_t count, bool bf16, int threads, std::uintptr_t data,
         std::int64_t k, const py::tuple& types, const py::tuple& rows) {
        const KQuantWeight w = kquant_weight(data, k, types, rows);
        py::gil_scoped_release release;
        ninfer::cpu::kquant_dequantize(w, first, count, out, bf16, threads);
      },
      py::arg("out"), py::arg("first"), py::arg("count"), py::arg("bf16"), py::arg("threads"), py::arg("data"),
      py::arg("k"), py::arg("types"), py::arg("rows"),
      "out fp32 (bf16: bf16) [count, k] = rows first.. of a packed K-quant weight, gguf-py's values.");
  m.def(
      "add_rmsnorm",
      [](std::uintptr_t out, std::uintptr_t residual_out, std::uintptr_t x, std::uintptr_t residual,
         std::uintptr_t weight, std::int64_t rows, std::int64_t hidden, float eps, bool zero_centered) {
        ninfer::cpu::add_rmsnorm(reinterpret_cast<float*>(out), reinterpret_cast<float*>(residual_out),
                                 reinterpret_cast<const float*>(x), reinterpret_cast<const float*>(residual),
                                 reinterpret_cast<const float*>(weight), rows, hidden, eps, zero_centered);
      },
      py::arg("out"), py::arg("residual_out"), py::arg("x"), py::arg("residual"), py::arg("weight"),
      py::arg("rows"), py::arg("hidden"), py::arg("eps"), py::arg("zero_centered"),
      "fp32 (residual add +) RMSNorm; residual = 0 for none. See csrc/cpu/decode_ops.h.");
  m.def(
      "silu_mul",
      [](std::uintptr_t out, std::uintptr_t x, std::int64_t rows, std::int64_t cols) {
        ninfer::cpu::silu_mul(reinterpret_cast<float*>(out), reinterpret_cast<const float*>(x), rows, cols);
      },
      py::arg("out"), py::arg("x"), py::arg("rows"), py::arg("cols"), "fp32 silu(gate) * up.");
  m.def(
      "rotary",
      [](std::uintptr_t out, std::uintptr_t x, std::uintptr_t cos, std::uintptr_t sin, std::int64_t tokens,
         std::int64_t heads, std::int64_t dim, std::int64_t rotary) {
        ninfer::cpu::rotary(reinterpret_cast<float*>(out), reinterpret_cast<const float*>(x),
                            reinterpret_cast<const float*>(cos), reinterpret_cast<const float*>(sin), tokens, heads,
                            dim, rotary);
      },
      py::arg("out"), py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("tokens"), py::arg("heads"),
      py::arg("dim"), py::arg("rotary"), "fp32 rotate-half RoPE on the first `rotary` dims of each head.");
  m.def(
      "write_kv",
      [](std::uintptr_t k_cache, std::uintptr_t v_cache, std::uintptr_t k, std::uintptr_t v, std::uintptr_t slots,
         std::int64_t tokens, std::int64_t row_bytes) {
        ninfer::cpu::write_kv(k_cache, v_cache, k, v, reinterpret_cast<const std::int64_t*>(slots), tokens, row_bytes);
      },
      py::arg("k_cache"), py::arg("v_cache"), py::arg("k"), py::arg("v"), py::arg("slots"), py::arg("tokens"),
      py::arg("row_bytes"), "Copy token rows to the flat cache rows `slots` (int64).");
  m.def(
      "write_kv_narrow",
      [](std::uintptr_t k_cache, std::uintptr_t v_cache, std::uintptr_t k, std::uintptr_t v, std::uintptr_t slots,
         std::int64_t tokens, std::int64_t row, int cache_type) {
        ninfer::cpu::write_kv_narrow(k_cache, v_cache, reinterpret_cast<const float*>(k), reinterpret_cast<const float*>(v),
                                     reinterpret_cast<const std::int64_t*>(slots), tokens, row, narrow_cache(cache_type));
      },
      py::arg("k_cache"), py::arg("v_cache"), py::arg("k"), py::arg("v"), py::arg("slots"), py::arg("tokens"),
      py::arg("row"), py::arg("cache_type"),
      "fp32 token rows (`row` values) rounded into a bf16 (1) or fp16 (2) cache's rows `slots` (int64).");
  m.def(
      "decode_attention",
      [](std::uintptr_t out, std::uintptr_t q, std::uintptr_t k_cache, std::uintptr_t v_cache,
         std::uintptr_t block_table, std::uintptr_t cache_lens, std::int64_t batch, std::int64_t num_new,
         std::int64_t heads, std::int64_t kv_heads, std::int64_t dim, std::int64_t page_size,
         std::int64_t table_width, float scale, int threads, int cache_type) {
        ninfer::cpu::decode_attention({reinterpret_cast<float*>(out), reinterpret_cast<const float*>(q),
                                       reinterpret_cast<const float*>(k_cache), reinterpret_cast<const float*>(v_cache),
                                       reinterpret_cast<const std::int32_t*>(block_table),
                                       reinterpret_cast<const std::int64_t*>(cache_lens), batch, num_new, heads,
                                       kv_heads, dim, page_size, table_width, scale, threads, cache_of(cache_type)});
      },
      py::arg("out"), py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"),
      py::arg("cache_lens"), py::arg("batch"), py::arg("num_new"), py::arg("heads"), py::arg("kv_heads"),
      py::arg("dim"), py::arg("page_size"), py::arg("table_width"), py::arg("scale"), py::arg("threads"),
      py::arg("cache_type"),
      py::call_guard<py::gil_scoped_release>(),
      "fp32 causal attention over a paged cache (int32 block table, int64 lengths). See csrc/cpu/decode_ops.h.");
  m.def(
      "gdn_steps",
      [](std::uintptr_t out, std::uintptr_t qkv, std::uintptr_t a, std::uintptr_t b, std::uintptr_t z,
         std::uintptr_t conv_pool, std::uintptr_t state_pool, std::uintptr_t slots, std::uintptr_t counts,
         std::uintptr_t conv_weight, std::uintptr_t A_log, std::uintptr_t dt_bias, std::uintptr_t norm_weight,
         std::int64_t batch, std::int64_t tokens, std::int64_t num_k_heads, std::int64_t num_v_heads,
         std::int64_t head_k_dim, std::int64_t head_v_dim, std::int64_t taps, std::int64_t qkv_stride,
         std::int64_t ab_stride, std::int64_t z_stride, float q_scale, float eps, bool write_state, int threads) {
        // the kernel's stack window and head split rely on these (ops/gdn.py checks shapes against each other)
        if (tokens < 1 || tokens > ninfer::cpu::kMaxTokens || taps < 2 || taps > ninfer::cpu::kMaxTaps ||
            num_k_heads < 1 || num_v_heads % num_k_heads || head_k_dim < 1 || head_v_dim < 1 || (out && !z)) {
          throw std::invalid_argument("gdn_steps: 1-16 tokens, 2-8 taps, value heads a multiple of key heads, z with out");
        }
        const auto f = [](std::uintptr_t p) { return reinterpret_cast<const float*>(p); };
        ninfer::cpu::gdn_steps({reinterpret_cast<float*>(out), f(qkv), f(a), f(b), f(z), reinterpret_cast<float*>(conv_pool),
                                reinterpret_cast<float*>(state_pool), reinterpret_cast<const std::int64_t*>(slots),
                                reinterpret_cast<const std::int64_t*>(counts), f(conv_weight), f(A_log), f(dt_bias),
                                f(norm_weight), batch, tokens, num_k_heads, num_v_heads, head_k_dim, head_v_dim, taps,
                                qkv_stride, ab_stride, z_stride, q_scale, eps, write_state, threads});
      },
      py::arg("out"), py::arg("qkv"), py::arg("a"), py::arg("b"), py::arg("z"), py::arg("conv_pool"),
      py::arg("state_pool"), py::arg("slots"), py::arg("counts"), py::arg("conv_weight"), py::arg("A_log"),
      py::arg("dt_bias"), py::arg("norm_weight"), py::arg("batch"), py::arg("tokens"), py::arg("num_k_heads"),
      py::arg("num_v_heads"), py::arg("head_k_dim"), py::arg("head_v_dim"), py::arg("taps"), py::arg("qkv_stride"),
      py::arg("ab_stride"), py::arg("z_stride"), py::arg("q_scale"), py::arg("eps"), py::arg("write_state"),
      py::arg("threads"), py::call_guard<py::gil_scoped_release>(),
      "The fused GDN steps on fp32 tensors (pointers as ints, 0 for none). See csrc/cpu/gdn_step.h.");
  // tensors: (x, residual, residual_out, out, conv_pool, state_pool, slots, conv_weight, A_log, dt_bias,
  // gated norm weight, input norm weight, out_order or 0) as pointers; in_proj / out_proj as layer_linear takes them.
  m.def(
      "gdn_mixer",
      [](const py::tuple& tensors, std::int64_t batch, std::int64_t tokens, std::int64_t num_k_heads,
         std::int64_t num_v_heads, std::int64_t head_k_dim, std::int64_t head_v_dim, std::int64_t taps, float q_scale,
         float eps, float norm_eps, bool zero_centered, const py::tuple& in_proj, const py::tuple& out_proj,
         int threads, bool int8_activations) {
        const auto p = [&](int i) { return tensors[i].cast<std::uintptr_t>(); };
        const auto f = [&](int i) { return reinterpret_cast<float*>(p(i)); };
        ninfer::cpu::GdnMixerArgs a{};
        a.in_proj = layer_linear(in_proj), a.out_proj = layer_linear(out_proj);
        using ninfer::cpu::layer_linear_inputs, ninfer::cpu::layer_linear_rows;
        const std::int64_t values = num_v_heads * head_v_dim, hidden = layer_linear_inputs(a.in_proj);
        const std::int64_t width = 2 * num_k_heads * head_k_dim + 2 * values + 2 * num_v_heads;
        if (tokens < 1 || tokens > ninfer::cpu::kMaxTokens || taps < 2 || taps > ninfer::cpu::kMaxTaps ||
            num_k_heads < 1 || num_v_heads % num_k_heads || head_k_dim < 1 || head_v_dim < 1 ||
            layer_linear_rows(a.in_proj) != width || layer_linear_inputs(a.out_proj) != values ||
            layer_linear_rows(a.out_proj) != hidden) {
          throw std::invalid_argument("gdn_mixer: 1-16 tokens, 2-8 taps, value heads a multiple of key heads, "
                                      "in_proj [qkv | z | b | a] of H inputs, out_proj [H, Hv dv]");
        }
        a.step = {nullptr, nullptr, nullptr, nullptr, nullptr, f(4), f(5),
                  reinterpret_cast<const std::int64_t*>(p(6)), nullptr, f(7), f(8), f(9), f(10), batch, tokens,
                  num_k_heads, num_v_heads, head_k_dim, head_v_dim, taps, 0, 0, 0, q_scale, eps, true, threads};
        a.x = f(0), a.residual = f(1), a.residual_out = f(2), a.out = f(3), a.norm_weight = f(11);
        a.norm_eps = norm_eps, a.zero_centered = zero_centered;
        a.out_order = reinterpret_cast<const std::int64_t*>(p(12));
        a.int8_activations = int8_activations;
        py::gil_scoped_release released;
        ninfer::cpu::gdn_mixer(a);
      },
      py::arg("tensors"), py::arg("batch"), py::arg("tokens"), py::arg("num_k_heads"), py::arg("num_v_heads"),
      py::arg("head_k_dim"), py::arg("head_v_dim"), py::arg("taps"), py::arg("q_scale"), py::arg("eps"),
      py::arg("norm_eps"), py::arg("zero_centered"), py::arg("in_proj"), py::arg("out_proj"), py::arg("threads"),
      py::arg("int8_activations"),
      "A decode step's GDN mixer (input norm, in_proj, steps, out_proj) of fp32 rows. See csrc/cpu/gdn_step.h.");
  // experts: (linear, (codes, scales, offsets) strides in bytes between experts), linear as layer_linear takes
  // it (K-quant blocks: the first stride moves them); shared: None or (gate_up linear, down linear, gate
  // pointer, gate stride in floats)
  m.def(
      "moe_experts",
      [](std::uintptr_t out, std::uintptr_t x, std::uintptr_t weights, std::uintptr_t ids, std::int64_t tokens,
         std::int64_t top_k, std::int64_t num_experts, const py::tuple& gate_up, const py::tuple& down,
         const py::object& shared, int threads, bool int8_activations) {
        ExpertsCall call(out, tokens, top_k, num_experts, gate_up, down, shared, threads, int8_activations);
        if (!shared.is_none()) {
          const auto t = shared.cast<py::tuple>();
          call.args.shared_gate = reinterpret_cast<const float*>(t[2].cast<std::uintptr_t>());
          call.args.shared_gate_stride = t[3].cast<std::int64_t>();
        }
        call.args.x = reinterpret_cast<const float*>(x);
        call.args.weights = reinterpret_cast<const float*>(weights);
        call.args.ids = reinterpret_cast<const std::int32_t*>(ids);
        py::gil_scoped_release released;
        ninfer::cpu::moe_experts(call.args);
      },
      py::arg("out"), py::arg("x"), py::arg("weights"), py::arg("ids"), py::arg("tokens"), py::arg("top_k"),
      py::arg("num_experts"), py::arg("gate_up"), py::arg("down"), py::arg("shared"), py::arg("threads"),
      py::arg("int8_activations"),
      "The routed (and shared) experts of fp32 rows. See csrc/cpu/moe_step.h.");
  // A decode step's MoE layer in one call: tensors (out, x, residual, norm_weight, residual_out, router, normed,
  // logits, weights, ids) as pointers; shared: None or (gate_up linear, down linear), gated by logit num_experts.
  m.def(
      "moe_layer",
      [](const py::tuple& tensors, float eps, bool zero_centered, std::int64_t router_rows, bool renormalize,
         std::int64_t tokens, std::int64_t top_k, std::int64_t num_experts, const py::tuple& gate_up,
         const py::tuple& down, const py::object& shared, int threads, bool int8_activations) {
        const auto f = [&](int i) { return reinterpret_cast<float*>(tensors[i].cast<std::uintptr_t>()); };
        if (top_k < 1 || top_k > num_experts || router_rows != num_experts + (shared.is_none() ? 0 : 1)) {
          throw std::invalid_argument(
              "moe_layer: top_k in 1..num_experts and router rows num_experts (+ 1 shared gate)");
        }
        ExpertsCall call(tensors[0].cast<std::uintptr_t>(), tokens, top_k, num_experts, gate_up, down, shared, threads,
                         int8_activations);
        const ninfer::cpu::MoeLayerArgs a{call.args, f(1), f(2), f(3), f(4), eps, zero_centered, f(5), router_rows,
                                          renormalize, f(6), f(7), f(8), reinterpret_cast<std::int32_t*>(f(9))};
        py::gil_scoped_release released;
        ninfer::cpu::moe_layer(a);
      },
      py::arg("tensors"), py::arg("eps"), py::arg("zero_centered"), py::arg("router_rows"), py::arg("renormalize"),
      py::arg("tokens"), py::arg("top_k"), py::arg("num_experts"), py::arg("gate_up"), py::arg("down"),
      py::arg("shared"), py::arg("threads"), py::arg("int8_activations"),
      "A decode step's MoE layer (norm, router, top-k, experts) of fp32 rows. See csrc/cpu/moe_step.h.");
  // tensors: (x, residual, residual_out, out, input_norm, q_norm or 0, k_norm or 0, cos, sin, k_cache, v_cache,
  // slots, block_table, cache_lens) as pointers; shape: (heads, kv_heads, head_dim, rotary_dim, batch, num_new,
  // page_size, table_width); qkv / o as layer_linear takes them.
  m.def(
      "attention_mixer",
      [](const py::tuple& tensors, const py::tuple& shape, bool output_gate, float norm_eps, bool norm_zero_centered,
         float head_eps, bool head_zero_centered, float scale, int cache_type, const py::tuple& qkv,
         const py::tuple& o, int threads, bool int8_activations) {
        const auto p = [&](int i) { return tensors[i].cast<std::uintptr_t>(); };
        const auto f = [&](int i) { return reinterpret_cast<float*>(p(i)); };
        const auto n = [&](int i) { return shape[i].cast<std::int64_t>(); };
        ninfer::cpu::AttentionMixerArgs a{};
        a.qkv = layer_linear(qkv), a.o = layer_linear(o);
        a.heads = n(0), a.kv_heads = n(1), a.head_dim = n(2), a.rotary_dim = n(3);
        a.batch = n(4), a.num_new = n(5), a.page_size = n(6), a.table_width = n(7);
        using ninfer::cpu::layer_linear_inputs, ninfer::cpu::layer_linear_rows;
        const std::int64_t q_width = a.heads * a.head_dim, kv_width = a.kv_heads * a.head_dim;
        const std::int64_t hidden = layer_linear_inputs(a.qkv);
        if (a.heads < 1 || a.kv_heads < 1 || a.heads % a.kv_heads || a.head_dim < 1 || a.rotary_dim < 0 ||
            a.rotary_dim > a.head_dim || a.rotary_dim % 2 || a.num_new < 1 || a.num_new > 16 || cache_type < 0 ||
            cache_type > 2 || layer_linear_rows(a.qkv) != (output_gate ? 2 : 1) * q_width + 2 * kv_width ||
            layer_linear_inputs(a.o) != q_width || layer_linear_rows(a.o) != hidden || (p(5) == 0) != (p(6) == 0)) {
          throw std::invalid_argument("attention_mixer: heads a multiple of kv_heads, an even rotary_dim <= head_dim, "
                                      "1-16 new tokens, qkv [q (| gate) | k | v] of H inputs, o [H, heads head_dim]");
        }
        a.x = f(0), a.residual = f(1), a.residual_out = f(2), a.out = f(3), a.input_norm = f(4);
        a.q_norm = f(5), a.k_norm = f(6), a.cos = f(7), a.sin = f(8), a.k_cache = f(9), a.v_cache = f(10);
        a.slots = reinterpret_cast<const std::int64_t*>(p(11));
        a.block_table = reinterpret_cast<const std::int32_t*>(p(12));
        a.cache_lens = reinterpret_cast<const std::int64_t*>(p(13));
        a.output_gate = output_gate, a.norm_eps = norm_eps, a.norm_zero_centered = norm_zero_centered;
        a.head_eps = head_eps, a.head_zero_centered = head_zero_centered, a.scale = scale;
        a.cache = static_cast<ninfer::cpu::CacheType>(cache_type);
        a.threads = threads, a.int8_activations = int8_activations;
        py::gil_scoped_release released;
        ninfer::cpu::attention_mixer(a);
      },
      py::arg("tensors"), py::arg("shape"), py::arg("output_gate"), py::arg("norm_eps"),
      py::arg("norm_zero_centered"), py::arg("head_eps"), py::arg("head_zero_centered"), py::arg("scale"),
      py::arg("cache_type"), py::arg("qkv"), py::arg("o"), py::arg("threads"), py::arg("int8_activations"),
      "A decode step's gated-attention mixer of fp32 rows (norm to o_proj). See csrc/cpu/decode_layer.h.");
  // tensors: (x, residual, residual_out, out, norm weight, scratch) as pointers; gate_up / down as layer_linear
  // takes them.
  m.def(
      "mlp_block",
      [](const py::tuple& tensors, std::int64_t tokens, float eps, bool zero_centered, const py::tuple& gate_up,
         const py::tuple& down, int threads, bool int8_activations) {
        const auto f = [&](int i) { return reinterpret_cast<float*>(tensors[i].cast<std::uintptr_t>()); };
        ninfer::cpu::MlpBlockArgs a{};
        a.gate_up = layer_linear(gate_up), a.down = layer_linear(down);
        using ninfer::cpu::layer_linear_inputs, ninfer::cpu::layer_linear_rows;
        if (tokens < 1 || layer_linear_rows(a.gate_up) != 2 * layer_linear_inputs(a.down) ||
            layer_linear_inputs(a.gate_up) != layer_linear_rows(a.down)) {
          throw std::invalid_argument("mlp_block: 1 or more tokens, gate_up [2 I, H] and down [H, I]");
        }
        a.x = f(0), a.residual = f(1), a.residual_out = f(2), a.out = f(3), a.norm = f(4), a.scratch = f(5);
        a.eps = eps, a.zero_centered = zero_centered, a.tokens = tokens;
        a.threads = threads, a.int8_activations = int8_activations;
        py::gil_scoped_release released;
        ninfer::cpu::mlp_block(a);
      },
      py::arg("tensors"), py::arg("tokens"), py::arg("eps"), py::arg("zero_centered"), py::arg("gate_up"),
      py::arg("down"), py::arg("threads"), py::arg("int8_activations"),
      "A decode step's dense SwiGLU MLP block (add + norm, gate_up, silu * up, down) of fp32 rows. See "
      "csrc/cpu/decode_layer.h.");
  m.def("mlp_block_scratch", &ninfer::cpu::mlp_block_scratch, py::arg("tokens"), py::arg("hidden"),
        py::arg("intermediate"), "Floats of scratch mlp_block needs.");
  // A layer's constant arguments, made once per layer (ops/cpu_layer.py caches it): the step's fields are
  // filled in by decode_layers. layer: (input_norm, post_norm, q_norm, k_norm, eps, hidden, heads, kv_heads,
  // head_dim, scale); linears: (qkv, o, gate_up, down). Pointers as ints, 0 for none.
  py::class_<ninfer::cpu::DecodeLayerArgs>(m, "LayerPlan");
  m.def(
      "layer_plan",
      [](const py::tuple& layer, const py::tuple& linears) {
        const auto f = [](const py::handle& h) { return reinterpret_cast<float*>(h.cast<std::uintptr_t>()); };
        const auto i64 = [](const py::handle& h) { return h.cast<std::int64_t>(); };
        ninfer::cpu::DecodeLayerArgs a{};
        a.input_norm = f(layer[0]), a.post_norm = f(layer[1]), a.q_norm = f(layer[2]), a.k_norm = f(layer[3]);
        a.eps = layer[4].cast<float>();
        a.hidden = i64(layer[5]), a.heads = i64(layer[6]), a.kv_heads = i64(layer[7]), a.head_dim = i64(layer[8]);
        a.scale = layer[9].cast<float>();
        a.qkv = layer_linear(linears[0]), a.o = layer_linear(linears[1]);
        a.gate_up = layer_linear(linears[2]), a.down = layer_linear(linears[3]);
        return a;
      },
      py::arg("layer"), py::arg("linears"));
  m.def(
      "decode_layers",
      [](const std::vector<const ninfer::cpu::DecodeLayerArgs*>& plans, const std::vector<std::uintptr_t>& k_caches,
         const std::vector<std::uintptr_t>& v_caches, const py::tuple& step) {
        // step: (x, residual, out_a, residual_out_a, out_b, residual_out_b, cos, sin, slots, block_table,
        // cache_lens, batch, num_new, page_size, table_width, scratch, threads, int8_activations, rotary_dim,
        // cache_type).
        // Layer i reads the stream layer i - 1 wrote (layer 0: x, residual) and writes pair a (even i) or b.
        if (plans.empty() || k_caches.size() != plans.size() || v_caches.size() != plans.size()) {
          throw std::invalid_argument("decode_layers: one plan and one K / V cache per layer");
        }
        const auto f = [](const py::handle& h) { return reinterpret_cast<float*>(h.cast<std::uintptr_t>()); };
        const auto i64 = [](const py::handle& h) { return h.cast<std::int64_t>(); };
        ninfer::cpu::DecodeLayerArgs a{};
        const float* x = f(step[0]);
        const float* residual = f(step[1]);
        float* const out[2] = {f(step[2]), f(step[4])};
        float* const residual_out[2] = {f(step[3]), f(step[5])};
        a.cos = f(step[6]), a.sin = f(step[7]);
        a.slots = reinterpret_cast<const std::int64_t*>(step[8].cast<std::uintptr_t>());
        a.block_table = reinterpret_cast<const std::int32_t*>(step[9].cast<std::uintptr_t>());
        a.cache_lens = reinterpret_cast<const std::int64_t*>(step[10].cast<std::uintptr_t>());
        a.batch = i64(step[11]), a.num_new = i64(step[12]), a.page_size = i64(step[13]), a.table_width = i64(step[14]);
        a.scratch = f(step[15]), a.threads = step[16].cast<int>();
        a.int8_activations = step[17].cast<bool>(), a.rotary_dim = i64(step[18]), a.cache = cache_of(step[19].cast<int>());
        py::gil_scoped_release release;
        for (std::size_t i = 0; i < plans.size(); ++i) {
          ninfer::cpu::DecodeLayerArgs layer = *plans[i];
          layer.cos = a.cos, layer.sin = a.sin, layer.slots = a.slots, layer.block_table = a.block_table;
          layer.cache_lens = a.cache_lens, layer.batch = a.batch, layer.num_new = a.num_new;
          layer.page_size = a.page_size, layer.table_width = a.table_width, layer.scratch = a.scratch;
          layer.threads = a.threads, layer.int8_activations = a.int8_activations, layer.rotary_dim = a.rotary_dim;
          layer.cache = a.cache;
          layer.k_cache = reinterpret_cast<float*>(k_caches[i]), layer.v_cache = reinterpret_cast<float*>(v_caches[i]);
          layer.x = x, layer.residual = residual, layer.out = out[i % 2], layer.residual_out = residual_out[i % 2];
          ninfer::cpu::decode_layer(layer);
          x = layer.out, residual = layer.residual_out;
        }
      },
      py::arg("plans"), py::arg("k_caches"), py::arg("v_caches"), py::arg("step"),
      "Consecutive Llama-family attention layers' decode step (csrc/cpu/decode_layer.h), one call for all.");
  m.def("decode_layer_scratch", &ninfer::cpu::decode_layer_scratch, py::arg("tokens"), py::arg("hidden"),
        py::arg("intermediate"),
        "Floats of scratch decode_layer needs.");
  m.def("use_isa", &ninfer::cpu::use_isa, py::arg("name"),
        "Run the quant kernels with the best instruction set up to `name` (avx512bf16, avx512, avx2, generic) this CPU has; "
        "returns it. Not while a kernel runs.");
  m.def("isa", &ninfer::cpu::isa, "The instruction set the kernels run with: avx512bf16, avx512, avx2 or generic.");
}

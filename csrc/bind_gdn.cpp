// ninfer_core._C.gdn_steps / gdn_conv_prefill: the fused Gated DeltaNet steps (decode, verify,
// commit, a forked chunk's tail; gdn_decode.cu) and the prefill conv (gdn_conv.cu). The tensors
// arrive as torch.Tensors; every size and stride the kernels index by is read from them and
// checked against gdn_decode.h / gdn_conv.h before anything launches.
#include <algorithm>
#include <string>

#include "bind.h"
#include "gdn_conv.h"
#include "gdn_decode.h"
#include "tensor_arg.h"

namespace py = pybind11;

namespace ninfer {
namespace {

bool gdn_head_dim(std::int64_t d) { return d >= 32 && d <= kGdnMaxHeadDim && d % 32 == 0; }

// The stride between the token rows of t [B, R, X]: the kernels find token r of sequence b at row
// b * R + r, every row one stride from the last. Slices of a merged projection are laid out so; a
// view whose sequences are not R token strides apart is not.
std::int64_t token_stride(const ArgCheck& check, const char* name, const TensorArg& t) {
  if (t.size(1) == 1) return t.stride(0);
  if (t.size(0) == 1 || t.stride(0) == t.size(1) * t.stride(1)) return t.stride(1);
  check.fail(std::string(name) + " needs its tokens one stride apart across sequences (strides " +
             std::to_string(t.stride(0)) + ", " + std::to_string(t.stride(1)) + ")");
}

}  // namespace

void bind_gdn(py::module_& m) {
  // The tensors are GDNStepInputs' fields by name (ninfer_core/ops/gdn.py), then the layer's weights.
  m.def(
      "gdn_steps",
      [](TensorArg qkv, TensorArg a, TensorArg b, std::optional<TensorArg> z, TensorArg conv_pool,
         TensorArg state_pool, TensorArg slots, std::optional<TensorArg> counts, std::optional<TensorArg> offsets,
         std::optional<TensorArg> fork_slots, std::optional<int> width, std::optional<TensorArg> out,
         TensorArg scratch, TensorArg conv_weight, TensorArg A_log, TensorArg dt_bias, TensorArg norm_weight,
         bool write_state, float q_scale, float eps, std::uintptr_t stream, bool conv_done, bool act_ready) {
        ArgCheck check("gdn_steps");
        // The layer's sizes: heads and head dims from the state pool, the taps from the conv weight.
        check("state_pool", state_pool).shape({kAny, kAny, kAny, kAny}).dtype(ScalarType::F32).contiguous()
            .aligned(16);  // float4 loads
        const std::int64_t num_slots = state_pool.size(0), hv = state_pool.size(1), dk = state_pool.size(2),
                           dv = state_pool.size(3);
        check.require(gdn_head_dim(dk) && gdn_head_dim(dv), "state_pool's head dims ", dk, " / ", dv, " must be multiples of 32 to 256");
        check("qkv", qkv).shape({kAny, kAny, kAny}).unit_last_stride();
        const DType dtype = kernel_dtype(check, "qkv", qkv);
        const std::int64_t batch = qkv.size(0), seq_rows = qkv.size(1), channels = qkv.size(2);
        const std::int64_t key_width = channels - hv * dv;  // 2 Hk dk: q and k
        check.require(key_width > 0 && key_width % (2 * dk) == 0,
                      "qkv width ", channels, " is not 2 Hk ", dk, " + ", hv, " * ", dv, " (state_pool's heads)");
        const std::int64_t hk = key_width / (2 * dk);
        check.require(hv >= 1 && hv % hk == 0, hv, " value heads are not a multiple of ", hk, " key heads");
        check.require(batch <= 65535 && batch * seq_rows < (std::int64_t{1} << 31),
                      "qkv has ", batch, " x ", seq_rows, " rows, too many");
        // Without offsets a row's tokens are all of qkv's; with them `width` tokens from offsets[b] on.
        check.require(offsets.has_value() == width.has_value(), "offsets and width go together");
        const std::int64_t num_tokens = width.value_or(seq_rows);
        check.require(num_tokens >= 1 && num_tokens <= std::min<std::int64_t>(seq_rows, kGdnMaxStepTokens),
                      num_tokens, " tokens a row, expected 1..", std::min<std::int64_t>(seq_rows, kGdnMaxStepTokens));
        check("a", a).shape({batch, seq_rows, hv}).dtype(qkv.type).unit_last_stride();
        check("b", b).shape({batch, seq_rows, hv}).dtype(qkv.type).unit_last_stride();
        const std::int64_t qkv_stride = token_stride(check, "qkv", qkv), ab_stride = token_stride(check, "a", a),
                           b_stride = token_stride(check, "b", b);
        check.require(b_stride == ab_stride, "a and b need one token stride (the kernel reads both with it), not ", ab_stride, " and ", b_stride);
        // z is the output norm's gate: both or neither (a commit only advances the pools).
        check.require(z.has_value() == out.has_value(), "z and out go together");
        check.require(out.has_value() || write_state, "nothing to do: no out and no state write");
        check("z", z).shape({batch, seq_rows, hv * dv}).dtype(qkv.type).unit_last_stride();
        const std::int64_t z_stride = z ? token_stride(check, "z", *z) : 0;
        check("out", out).shape({batch, seq_rows, hv * dv}).dtype(qkv.type).contiguous();
        check("conv_weight", conv_weight).shape({channels, kAny}).dtype(qkv.type).contiguous();
        const std::int64_t taps = conv_weight.size(1);
        check.require(taps >= 2 && taps <= kGdnMaxTaps,
                      "conv_weight has ", taps, " taps, expected 2..", kGdnMaxTaps);
        check("conv_pool", conv_pool).shape({num_slots, channels, taps - 1}).dtype(qkv.type).contiguous();
        check("slots", slots).shape({batch}).dtype(ScalarType::I64).contiguous();
        check("counts", counts).shape({batch}).dtype(ScalarType::I64).contiguous();
        check("offsets", offsets).shape({batch}).dtype(ScalarType::I64).contiguous();
        check("fork_slots", fork_slots).shape({batch}).dtype(ScalarType::I64).contiguous();
        check("A_log", A_log).shape({hv}).dtype(qkv.type).contiguous();
        check("dt_bias", dt_bias).shape({hv}).dtype(qkv.type).contiguous();
        check("norm_weight", norm_weight).shape({dv}).dtype(qkv.type).contiguous();
        if (conv_done) {
          // The conv ran in in_proj's GEMV epilogue (quant_gemv's conv_pool): qkv holds its outputs, the
          // conv states have advanced; only the recurrence runs, a 16-bit decode step's, and scratch is
          // the B Hv int32 counters that GEMV zeroed (its `zeroed`).
          check.require(dtype != DType::F32, "conv_done needs fp16 / bf16 qkv (the conv ran in a 16-bit GEMV)");
          check.require(num_tokens == 1 && seq_rows == 1 && out && write_state && !counts && !offsets && !fork_slots &&
                            !act_ready,
                        "conv_done is a decode step's: 1 token, out, write_state, no counts, offsets, fork_slots or "
                        "act_ready");
          check("scratch", scratch).shape({batch * hv}).dtype(ScalarType::I32).contiguous().aligned(4);
        } else {
          // act_ready: scratch is the verify's over these tokens, its activations kept for this commit
          check.require(!act_ready || (write_state && !out && !offsets && !fork_slots),
                        "act_ready is a commit's: write_state, no out, offsets or fork_slots");
          // fp32 activations [B, T, C] (read as float4), then one counter per (sequence, value head)
          check("scratch", scratch).dtype(ScalarType::F32).contiguous().min_numel(batch * (num_tokens * channels + hv))
              .aligned(16);
        }
        const int device = check.device();
        gdn_steps({data_or_null(out), scratch.data, qkv.data, a.data, b.data, data_or_null(z), conv_pool.data,
                   state_pool.data, slots.data, data_or_null(counts), data_or_null(offsets), data_or_null(fork_slots),
                   conv_weight.data, A_log.data, dt_bias.data, norm_weight.data, qkv_stride, ab_stride, z_stride,
                   batch, seq_rows, static_cast<int>(num_tokens),
                   write_state, static_cast<int>(hk), static_cast<int>(hv), static_cast<int>(dk),
                   static_cast<int>(dv), static_cast<int>(taps), conv_done, act_ready, q_scale, eps, dtype, device,
                   stream});
      },
      py::arg("qkv"), py::arg("a"), py::arg("b"), py::arg("z"), py::arg("conv_pool"), py::arg("state_pool"),
      py::arg("slots"), py::arg("counts"), py::arg("offsets"), py::arg("fork_slots"), py::arg("width"),
      py::arg("out"), py::arg("scratch"), py::arg("conv_weight"), py::arg("A_log"), py::arg("dt_bias"),
      py::arg("norm_weight"), py::arg("write_state"), py::arg("q_scale"), py::arg("eps"), py::arg("stream"),
      py::arg("conv_done") = false, py::arg("act_ready") = false,
      "Fused GDN steps (conv, delta rule, gated RMSNorm over T tokens); None for an absent tensor; "
      "conv_done: the conv ran in in_proj's GEMV (quant_gemv's conv_pool), scratch its zeroed int32 "
      "counters [B * Hv]; act_ready: a commit whose scratch is its verify's (the activations kept). "
      "See csrc/gdn_decode.h.");
  m.def(
      "gdn_conv_prefill",
      [](TensorArg out, TensorArg qkv, TensorArg conv_pool, TensorArg slots, std::optional<TensorArg> valid,
         TensorArg weight, std::int64_t split, std::uintptr_t stream) {
        ArgCheck check("gdn_conv_prefill");
        check("qkv", qkv).shape({kAny, kAny, kAny}).unit_last_stride();  // any batch and token strides
        const DType dtype = kernel_dtype(check, "qkv", qkv);
        const std::int64_t batch = qkv.size(0), tokens = qkv.size(1), channels = qkv.size(2);
        check.require(batch >= 1 && batch <= 65535 && tokens >= 1 && tokens <= (1 << 30) && channels >= 1 &&
                          channels <= (1 << 24),
                      "qkv has shape ", qkv.shape_str(), ", out of the kernel's range");
        check("weight", weight).shape({channels, kAny}).dtype(qkv.type).contiguous();
        const std::int64_t taps = weight.size(1);
        check.require(taps >= 2 && taps <= kGdnMaxTaps, "weight has ", taps, " taps, expected 2..", kGdnMaxTaps);
        check.require(split >= 1 && 2 * split < channels, "split ", split, " leaves no v part of ", channels,
                      " channels");
        check("out", out).shape({batch * tokens * channels}).dtype(qkv.type).contiguous();
        check("conv_pool", conv_pool).shape({kAny, channels, taps - 1}).dtype(qkv.type).contiguous();
        check.require(conv_pool.size(0) >= 1, "conv_pool has no slots");
        check("slots", slots).shape({batch}).dtype(ScalarType::I64).contiguous();
        check("valid", valid).shape({batch}).dtype(ScalarType::I64).contiguous();
        const int device = check.device();
        gdn_conv_prefill({out.data, qkv.data, conv_pool.data, slots.data, data_or_null(valid), weight.data,
                          qkv.stride(0), qkv.stride(1), batch, tokens, channels, split, static_cast<int>(taps),
                          dtype, device, stream});
      },
      py::arg("out"), py::arg("qkv"), py::arg("conv_pool"), py::arg("slots"), py::arg("valid"), py::arg("weight"),
      py::arg("split"), py::arg("stream"),
      "GDN prefill conv + SiLU advancing the pooled conv state, out the q / k / v parts (split channels, "
      "split, the rest) one after another; qkv may be any view with a contiguous last axis, valid None "
      "for all tokens. See csrc/gdn_conv.h.");
}

}  // namespace ninfer

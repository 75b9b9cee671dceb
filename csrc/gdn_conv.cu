// Causal depthwise conv + SiLU of a GDN prefill chunk, reading and advancing the conv state in its
// pool (see gdn_conv.h). One thread per channel walks a span of tokens with the last K inputs in
// registers, so each input is read once from memory (plus K-1 at the span's start) and each output
// written once; the torch path instead concatenates state and inputs, converts them to fp32, runs a
// cuDNN depthwise conv, applies SiLU, converts back and gathers the new state (~8 kernels a layer).
// A span is 16 tokens whose inputs a thread requests all at once before its first sum: with spans of
// 64 walked a token (a load, then its sum) at a time, a short prompt's grid was 64 blocks of serial
// loads (H100, 37 tokens of the 35B: 16 us a layer for 0.6 MB in and out).
#include "common.cuh"
#include "gdn_conv.h"
#include "launch.cuh"

namespace ninfer {
namespace {

constexpr int kThreads = 128;  // channels per block
constexpr int kSpan = 16;      // tokens per block, their inputs in registers together
constexpr int kMaxTaps = kGdnConvMaxTaps;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    conv_prefill_kernel(T* __restrict__ out, const T* __restrict__ qkv, T* __restrict__ conv_pool,
                        const std::int64_t* __restrict__ slots,
                        const std::int64_t* __restrict__ valid, const T* __restrict__ weight,
                        std::int64_t stride_b, std::int64_t stride_t, int tokens, int channels,
                        int split, int taps) {
  enter_kernel();
  const int c = blockIdx.x * kThreads + threadIdx.x;
  if (c >= channels) return;
  const int b = blockIdx.z;
  const int t0 = blockIdx.y * kSpan;
  const T* x = qkv + b * stride_b + c;
  T* state = conv_pool + (slots[b] * channels + c) * (taps - 1);
  // input at position p of [state | tokens]: p < 0 is state entry p + K-1
  const auto input = [&](int p) { return to_float(p < 0 ? state[p + taps - 1] : x[p * stride_t]); };

  const int t1 = min(t0 + kSpan, tokens);
  float xs[kSpan];
#pragma unroll
  for (int i = 0; i < kSpan; ++i) xs[i] = t0 + i < t1 ? input(t0 + i) : 0.0f;
  // back[j]: the weight of input t - j and that input (back[0]: token t's, set per token); indexed
  // from the newest so that every index is a constant (a run-time index puts an array in local memory)
  float w_back[kMaxTaps], back[kMaxTaps];
#pragma unroll
  for (int j = 0; j < kMaxTaps; ++j) {
    w_back[j] = j < taps ? to_float(weight[c * taps + taps - 1 - j]) : 0.0f;
    back[j] = j >= 1 && j < taps ? input(t0 - j) : 0.0f;
  }
  // the channel's part (q: [0, split), k: [split, 2 split), v: the rest), each part [B, T, width] in
  // turn (gdn_conv.h)
  const int part = c < split ? 0 : c < 2 * split ? 1 : 2;
  const int width = part < 2 ? split : channels - 2 * split;
  const std::int64_t rows = static_cast<std::int64_t>(gridDim.z) * tokens;
  T* y = out + rows * (part * split) + (static_cast<std::int64_t>(b) * tokens) * width + (c - part * split);
#pragma unroll
  for (int i = 0; i < kSpan; ++i) {
    if (t0 + i >= t1) break;
    back[0] = xs[i];
    float acc = 0.0f;
#pragma unroll
    for (int j = kMaxTaps - 1; j >= 0; --j) {  // oldest input first, as the torch reference sums
      if (j < taps) acc = fmaf(w_back[j], back[j], acc);
    }
    y[static_cast<std::int64_t>(t0 + i) * width] = from_float<T>(acc / (1.0f + expf(-acc)));
#pragma unroll
    for (int j = kMaxTaps - 1; j >= 1; --j) back[j] = back[j - 1];
  }
  if (blockIdx.y == 0) {  // the new state: the K-1 inputs before position n (this thread's channel)
    const int n = valid != nullptr ? static_cast<int>(valid[b]) : tokens;
    float next[kMaxTaps - 1];
#pragma unroll
    for (int j = 0; j < kMaxTaps - 1; ++j) next[j] = j < taps - 1 ? input(n - (taps - 1) + j) : 0.0f;
#pragma unroll
    for (int j = 0; j < kMaxTaps - 1; ++j) {
      if (j < taps - 1) state[j] = from_float<T>(next[j]);
    }
  }
}

template <typename T>
void launch(const GdnConvArgs& a) {
  const dim3 grid(static_cast<unsigned>((a.channels + kThreads - 1) / kThreads),
                  static_cast<unsigned>((a.tokens + kSpan - 1) / kSpan),
                  static_cast<unsigned>(a.batch));
  launch_kernel("gdn conv prefill kernel launch", conv_prefill_kernel<T>, grid, kThreads, 0,
                as_stream(a.stream), reinterpret_cast<T*>(a.out), reinterpret_cast<const T*>(a.qkv),
                reinterpret_cast<T*>(a.conv_pool), reinterpret_cast<const std::int64_t*>(a.slots),
                reinterpret_cast<const std::int64_t*>(a.valid), reinterpret_cast<const T*>(a.weight),
                a.qkv_stride_b, a.qkv_stride_t, static_cast<int>(a.tokens), static_cast<int>(a.channels),
                static_cast<int>(a.split), a.taps);
}

}  // namespace

// Trusts its arguments: the binding (bind_gdn.cpp) checks them against gdn_conv.h.
void gdn_conv_prefill(const GdnConvArgs& a) {
  DeviceGuard guard(a.device);
  by_dtype(a.dtype, "gdn_conv_prefill", [&](auto t) { launch<decltype(t)>(a); });
}

}  // namespace ninfer

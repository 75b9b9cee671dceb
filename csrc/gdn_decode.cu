// Fused Gated DeltaNet steps over T <= 16 new tokens per sequence, two kernels on the caller's
// stream (decode: T = 1; speculative verify: T = K + 1, pools untouched; commit: the pools advance
// through the first counts[b] tokens, no output; a forked prefill chunk's tail: the first counts[b]
// tokens from row offsets[b] on, outputs written in place, the state before them copied to a fork slot):
//   1. conv: depthwise causal conv + SiLU of every qkv channel over [conv state | T inputs], q / k
//      l2-normalised per key head and token; the activations go to an fp32 scratch [B, T, C]; the
//      conv state becomes the last K-1 inputs up to token counts[b] (when written).
//   2. recurrence: the fp32 state is read once and written at most once (decay, delta-rule write,
//      read-out per token, all in registers), by blocks of 8-column strips of one (sequence, value
//      head). Blocks of 32 columns put batch 1 on B * Hv * dv / 32 SMs (128 for the 35B), the
//      state's reads spread wide; the last block of a head to finish applies the head's gated
//      RMSNorm to its T outputs (a fence, an atomic and a reload); on sm_90+ a head's blocks are one
//      thread block cluster instead, each normalising its own columns with the head's sum of squares
//      read from the others' shared memory. Where the batch's heads alone
//      fill every SM (and dk, dv <= 128), a block holds the whole head (dv / 8 warps) and
//      normalises each token's outputs itself, in shared memory: whole heads made a step of the
//      35B 1.7% faster at batch 8 and 1.1% slower at batch 1 (32 blocks where 128 read the state;
//      H200, twenty-third session).
// Two kernels because one key head's q / k feed Hv / Hk value heads: its conv state may only be
// shifted after every reader has read it, and the second launch orders that for free.
// A decode step whose conv ran in the in_proj GEMV's epilogue (conv_done, quant_gemv.h GemvConvArgs)
// runs kernel 2 alone: it reads q, k, v from qkv, the conv's outputs, and l2-normalises q / k itself
// (a key head's q / k lie in one block's reach, not in one GEMV tile's). A commit given its verify's
// activations (act_ready) runs kernel 2 alone too, which then also moves the conv states on (no kernel
// reads them in between).
// The fp32 formulas mirror the torch reference (ops/gdn.py) op for op, rounding where it rounds.
#include <algorithm>
#include <limits>

#include "common.cuh"
#include "launch.cuh"
#include "gdn_decode.h"
#include "mma.cuh"

namespace ninfer {
namespace {

constexpr int kMaxTaps = kGdnMaxTaps;
constexpr int kMaxHeadDim = kGdnMaxHeadDim;
constexpr int kMaxSteps = kGdnMaxStepTokens;
// Kernel 2 tiles the state in column strips: a warp owns kStripCols columns (2 lanes x float4,
// one 32-byte sector per row) and walks all dk rows with 16 lanes, kMaxRows float4 per lane in
// registers, so its column sums are warp shuffles only. A block is a head's dv / kStripCols strips
// (at most kHeadWarps: dv <= 128) or kWarps of them.
constexpr int kStripCols = 8;
constexpr int kRowLanes = 16;
constexpr int kWarps = 4;
constexpr int kHeadWarps = 16;
// Elements of a head vector (dk or dv) a thread of the recurrent kernel takes: the smallest block, 4
// warps, covers kMaxHeadDim in two.
constexpr int kPerThread = kMaxHeadDim / (kWarps * 32);

// Whether a recurrent-kernel block holds a whole head (dv / 8 warps) rather than 32 columns: where
// dk, dv <= 128 and the batch's B Hv heads fill the device's SMs.
bool whole_head_blocks(const GdnStepsArgs& a) {
  return a.head_k_dim <= 8 * kRowLanes && a.head_v_dim <= kHeadWarps * kStripCols &&
         a.batch * a.num_v_heads >= sm_count(a.device);
}

using F4 = Vec<float, 4>;

__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// Sum over the 16 row lanes of a strip (lane bits 1..4), keeping the two column lanes apart.
__device__ __forceinline__ void sum_rows(F4& x) {
#pragma unroll
  for (int offset = 2; offset < 32; offset <<= 1) {
#pragma unroll
    for (int c = 0; c < 4; ++c) x.v[c] += __shfl_xor_sync(0xffffffffu, x.v[c], offset);
  }
}

// The row of qkv / a / b / z / out holding token 0 of sequence b: sequences are seq_rows rows apart,
// and token 0 is at offsets[b] within its sequence (0 without offsets).
__device__ __forceinline__ std::int64_t first_row(const std::int64_t* offsets, int b, int seq_rows) {
  return static_cast<std::int64_t>(b) * seq_rows + (offsets == nullptr ? 0 : offsets[b]);
}

// Tokens of row b the state advances through: counts[b] (clamped to [0, T]), or all T.
__device__ __forceinline__ int advance_count(const std::int64_t* counts, int b, int num_tokens) {
  if (counts == nullptr) return num_tokens;
  return static_cast<int>(min(max(counts[b], std::int64_t{0}), static_cast<std::int64_t>(num_tokens)));
}

// grid (2 Hk + Hv segments, B), block max(dk, dv): a q head, a k head or a v head per block.
// Computes the activations of tokens 0..L-1, L = T with outputs and no counts, else counts[b].
template <typename T>
__global__ void __launch_bounds__(kMaxHeadDim)
    gdn_conv_kernel(float* __restrict__ act, unsigned* __restrict__ done, T* __restrict__ conv_pool,
                    const T* __restrict__ qkv, const T* __restrict__ weight,
                    const std::int64_t* __restrict__ slots, const std::int64_t* __restrict__ counts,
                    const std::int64_t* __restrict__ offsets, const std::int64_t* __restrict__ fork_slots,
                    std::int64_t qkv_stride, int seq_rows, int num_tokens, bool has_out, bool write_state, int num_k_heads,
                    int num_v_heads, int head_k_dim, int head_v_dim, int channels, int taps,
                    float q_scale) {
  const int seg = blockIdx.x;
  const int b = blockIdx.y;
  const bool is_key = seg < 2 * num_k_heads;  // block-uniform, so the barrier below is safe
  const int width = is_key ? head_k_dim : head_v_dim;
  const int base = is_key ? seg * head_k_dim
                          : 2 * num_k_heads * head_k_dim + (seg - 2 * num_k_heads) * head_v_dim;
  const int c = base + static_cast<int>(threadIdx.x);
  const bool active = static_cast<int>(threadIdx.x) < width;
  const int advance = advance_count(counts, b, num_tokens);
  const int steps = has_out && counts == nullptr ? num_tokens : advance;  // block-uniform
  T* state = conv_pool + (slots[b] * channels + (active ? c : 0)) * (taps - 1);
  const T* x = qkv + first_row(offsets, b, seq_rows) * qkv_stride + (active ? c : 0);
  // The conv state (last written by this layer's previous step), the weights and slots / counts /
  // offsets (the host's, or kernels two or more launches back: complete once this kernel runs, as
  // the kernel before it waited for them) load before the wait for qkv, the in_proj GEMV's output.
  T w[kMaxTaps];
  T old[kMaxTaps];    // the conv state as it was: the K-1 previous inputs, oldest first
  T window[kMaxTaps];  // the K-1 inputs before the current token
#pragma unroll
  for (int t = 0; t < kMaxTaps; ++t) {
    if (active && t < taps) w[t] = weight[static_cast<std::int64_t>(c) * taps + t];
    if (active && t < taps - 1) window[t] = old[t] = state[t];
  }
  enter_kernel();
  if (!is_key && threadIdx.x == 0) done[b * num_v_heads + seg - 2 * num_k_heads] = 0;  // for kernel 2
  if (fork_slots != nullptr && active) {
    T* fork = conv_pool + (fork_slots[b] * channels + c) * (taps - 1);
#pragma unroll
    for (int t = 0; t < kMaxTaps - 1; ++t) {
      if (t < taps - 1) fork[t] = old[t];
    }
  }
  // Every token's input loads at once (one round trip, not one a token), and the key heads' l2
  // norms take one barrier for all tokens (group_sum's order, token by token): a forked prompt's
  // tail windows and verify rounds are many tokens a launch.
  T xs[kMaxSteps];
#pragma unroll
  for (int t = 0; t < kMaxSteps; ++t) xs[t] = active && t < steps ? x[t * qkv_stride] : from_float<T>(0.0f);
  float ys[kMaxSteps];
#pragma unroll
  for (int t = 0; t < kMaxSteps; ++t) {
    if (t >= steps) break;  // block-uniform
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < kMaxTaps - 1; ++j) {
      if (j < taps - 1) acc += to_float(w[j]) * to_float(window[j]);
    }
#pragma unroll
    for (int j = 0; j < kMaxTaps; ++j) {  // w[taps - 1], kept in registers (a constant index)
      if (j == taps - 1) acc += to_float(w[j]) * to_float(xs[t]);
    }
#pragma unroll
    for (int j = 0; j < kMaxTaps - 1; ++j) {
      if (j < taps - 1) window[j] = j + 1 < taps - 1 ? window[j + 1] : xs[t];
    }
    ys[t] = active ? round_to<T>(silu(acc)) : 0.0f;  // the reference returns the conv output in the model dtype
  }
  if (is_key) {  // y / sqrt(sum of the head's y^2 + 1e-6), the sum in group_sum's order
    __shared__ float partial[kMaxSteps][32];
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
#pragma unroll
    for (int t = 0; t < kMaxSteps; ++t) {
      if (t >= steps) break;
      const float total = warp_sum(ys[t] * ys[t]);
      if (lane == 0) partial[t][threadIdx.x >> 5] = total;
      if (warps == 1) ys[t] = ys[t] * rsqrtf(total + 1e-6f);
    }
    if (warps > 1) {
      __syncthreads();
#pragma unroll
      for (int t = 0; t < kMaxSteps; ++t) {
        if (t >= steps) break;
        ys[t] = ys[t] * rsqrtf(warp_sum(lane < warps ? partial[t][lane] : 0.0f) + 1e-6f);
      }
    }
    if (seg < num_k_heads) {
#pragma unroll
      for (int t = 0; t < kMaxSteps; ++t) ys[t] = ys[t] * q_scale;
    }
  }
  if (active) {
#pragma unroll
    for (int t = 0; t < kMaxSteps; ++t) {
      if (t < steps) act[(static_cast<std::int64_t>(b) * num_tokens + t) * channels + c] = ys[t];
    }
  }
  if (active && write_state) {
    // The last K-1 entries of [old state | x_0 .. x_{advance-1}].
#pragma unroll
    for (int j = 0; j < kMaxTaps - 1; ++j) {
      if (j < taps - 1) {
        const int i = advance + j;  // index into the concatenation
        state[j] = i < taps - 1 ? old[i] : x[(i - (taps - 1)) * qkv_stride];
      }
    }
  }
}

// kConvDone: q and k of one key head (the conv's outputs, in T) into q_s / k_s, l2-normalised, q
// also scaled: gdn_conv_kernel's values bit for bit. That kernel adds element i's square in warp
// i / 32 of its block (an element a thread), then the warp totals, zero-padded to 32, with another
// warp_sum; here a thread holds elements i and i + threads (the block's), and their totals go to the
// same places.
template <typename T>
__device__ __forceinline__ void load_key_head(float* q_s, float* k_s, const T* q, const T* k, int head_k_dim,
                                              float q_scale, int threads) {
  constexpr int kGroups = kMaxHeadDim / 32;
  __shared__ float totals[2][kGroups];
  const int lane = threadIdx.x & 31;
  float qv[kPerThread], kv[kPerThread];
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int i = threadIdx.x + j * threads;
    qv[j] = i < head_k_dim ? to_float(q[i]) : 0.0f;
    kv[j] = i < head_k_dim ? to_float(k[i]) : 0.0f;
    const float q_total = warp_sum(qv[j] * qv[j]), k_total = warp_sum(kv[j] * kv[j]);
    const int group = j * (threads / 32) + (threadIdx.x >> 5);  // i / 32
    if (lane == 0 && group < kGroups) {  // warp-uniform
      totals[0][group] = q_total;
      totals[1][group] = k_total;
    }
  }
  __syncthreads();
  const float q_rstd = rsqrtf(warp_sum(lane < kGroups ? totals[0][lane] : 0.0f) + 1e-6f);
  const float k_rstd = rsqrtf(warp_sum(lane < kGroups ? totals[1][lane] : 0.0f) + 1e-6f);
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int i = threadIdx.x + j * threads;
    if (i < head_k_dim) {
      q_s[i] = qv[j] * q_rstd * q_scale;
      k_s[i] = kv[j] * k_rstd;
    }
  }
}

// One element of the gated RMSNorm: round(round(w * round(x * rstd)) * silu(z)).
template <typename T>
__device__ __forceinline__ T gated_norm_value(float x, float rstd, T w, T z) {
  const float scaled = round_to<T>(to_float(w) * round_to<T>(x * rstd));
  return from_float<T>(scaled * silu(to_float(z)));
}

// The gated RMSNorm of one token's head outputs x (rounded to T) into out_head: x, z and w of
// elements threadIdx.x + i threads (the block's), zeros past dv (kPer: enough of them for dv).
template <typename T, int kPer>
__device__ __forceinline__ void gated_norm(T* out_head, const float (&x)[kPer], const T (&zv)[kPer],
                                           const T (&w)[kPer], int head_v_dim, float eps, int threads) {
  float sumsq = 0.0f;
#pragma unroll
  for (int i = 0; i < kPer; ++i) sumsq += x[i] * x[i];
  __syncthreads();  // group_sum's shared partials are reused token after token
  const float rstd = rsqrtf(group_sum(sumsq) / static_cast<float>(head_v_dim) + eps);
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int j = threadIdx.x + i * threads;
    if (j < head_v_dim) out_head[j] = gated_norm_value(x[i], rstd, w[i], zv[i]);
  }
}

// The conv states of sequence b moved on through its first `advance` tokens: each channel's the last
// K-1 entries of [old state | x_0 .. x_{advance-1}], as gdn_conv_kernel writes them. Block `part` of
// the sequence's `parts` takes a share of the channels (a commit from its verify's activations: no
// conv kernel ran).
template <typename T>
__device__ void move_conv_states(T* conv_state, const T* x, std::int64_t qkv_stride, int channels, int taps,
                                 int advance, int part, int parts, int threads) {
  const int per = (channels + parts - 1) / parts;
  const int end = min(channels, (part + 1) * per);
  for (int c = part * per + static_cast<int>(threadIdx.x); c < end; c += threads) {
    T* state = conv_state + static_cast<std::int64_t>(c) * (taps - 1);
    T old[kMaxTaps];
#pragma unroll
    for (int j = 0; j < kMaxTaps - 1; ++j) {
      if (j < taps - 1) old[j] = state[j];
    }
#pragma unroll
    for (int j = 0; j < kMaxTaps - 1; ++j) {
      if (j < taps - 1) {
        const int i = advance + j;  // index into the concatenation
        state[j] = i < taps - 1 ? old[i] : x[(i - (taps - 1)) * qkv_stride + c];
      }
    }
  }
}

// grid B * Hv * splits, block dv / 8 warps (kWholeHead) or 4: each block owns dv / splits columns of one
// (sequence, value head) state, each warp one 8-column strip over all dk rows, kept in registers
// across the tokens. The state is stored after token counts[b] - 1 (if written). With outputs (`out`):
// a block holding the whole head (splits == 1) normalises each token's o in shared memory and writes
// the result; else a block writes its o columns (rounded to the model dtype) into `out`, and the
// head's last block to finish normalises the head's T outputs there in place (a fence, an atomic and
// a reload on the step's critical path). Products and sums of the state update are rounded separately
// (no fma), as torch's elementwise ops round them.
// 64 registers for dk <= 128 (at most 16 bytes spilled on sm_90, whole heads too): 8 blocks of 4
// warps an SM, or 2 whole-head blocks of the 35B, so batch 8's blocks are one wave (96 registers gave
// 1.55). kWholeHead: a block holds the whole head (a template parameter: the other kernels keep the
// registers they had). kCluster (sm_90+, dv <= 128, with outputs): the head's blocks are one thread
// block cluster and normalise their own columns, the head's sum of squares gathered from their shared
// memory (one cluster barrier a token) instead of by the last block. kConvDone: q / k / v come from
// qkv (T = 1: its row b, conv'd by the GEMV before) instead of act. conv_pool (act_ready: act is a
// verify's, kept for this commit; else null): the blocks also move the conv states on at the end.
template <typename T, int kMaxRows, bool kConvDone, bool kWholeHead, bool kCluster>
__global__ void __launch_bounds__(kWholeHead ? kHeadWarps * 32 : kWarps * 32, kWholeHead ? 2 : kMaxRows == 8 ? 8 : 1)
    gdn_recurrent_kernel(T* out, float* __restrict__ state_pool, const float* __restrict__ act,
                         const T* __restrict__ qkv, std::int64_t qkv_stride, float q_scale,
                         unsigned* __restrict__ done, const T* __restrict__ a,
                         const T* __restrict__ b_in, const T* __restrict__ z,
                         const T* __restrict__ A_log, const T* __restrict__ dt_bias,
                         const T* __restrict__ norm_weight, const std::int64_t* __restrict__ slots,
                         const std::int64_t* __restrict__ counts, const std::int64_t* __restrict__ offsets,
                         const std::int64_t* __restrict__ fork_slots, std::int64_t ab_stride,
                         std::int64_t z_stride, int seq_rows, int num_tokens, bool write_state,
                         int num_k_heads, int num_v_heads, int head_k_dim, int head_v_dim,
                         float eps, T* __restrict__ conv_pool, int taps) {
  __shared__ float q_s[kMaxHeadDim];
  __shared__ float k_s[kMaxHeadDim];
  __shared__ float o_s[kMaxHeadDim];  // a whole-head (cluster) block's o of the token (its columns), rounded to T
  __shared__ float sumsq_s[kGdnMaxStepTokens];  // kCluster: each token's sum of squares of the block's o
  // kCluster over a window (not kConvDone): every token's o (the block's columns), normed after the last
  __shared__ float o_steps[kCluster && !kConvDone ? kGdnMaxStepTokens : 1][kWarps * kStripCols];
  __shared__ bool last;
  // a constant for 4-warp blocks: a register fewer than blockDim.x, and their kernels kept theirs
  const int threads = kWholeHead ? static_cast<int>(blockDim.x) : kWarps * 32;
  const int block_cols = threads / 32 * kStripCols;
  const int splits = head_v_dim / block_cols;
  const int bh = blockIdx.x / splits;
  const int b = bh / num_v_heads;
  const int h = bh % num_v_heads;
  const int key_dim = num_k_heads * head_k_dim;
  const int value_dim = num_v_heads * head_v_dim;
  const int channels = 2 * key_dim + value_dim;
  const int key_head = h / (num_v_heads / num_k_heads);
  const int advance = advance_count(counts, b, num_tokens);
  const int steps = out != nullptr && counts == nullptr ? num_tokens : advance;  // block-uniform
  const std::int64_t row0 = first_row(offsets, b, seq_rows);  // token t's row: row0 + t
  // Constants load before the wait, with the state: after it every load is one more round trip on
  // the critical path (~0.5 us from L2).
  const float A = expf(to_float(A_log[h]));
  const T dt_bias_h = dt_bias[h];

  const int lane = threadIdx.x & 31;
  const int row_lane = lane >> 1;
  const int rows = head_k_dim / kRowLanes;
  const int col = (blockIdx.x % splits) * block_cols + (threadIdx.x >> 5) * kStripCols + (lane & 1) * 4;
  float* state = state_pool + (slots[b] * num_v_heads + h) * head_k_dim * head_v_dim + col;
  F4 s[kMaxRows];
#pragma unroll
  for (int r = 0; r < kMaxRows; ++r) {
    if (r < rows) s[r] = *reinterpret_cast<const F4*>(state + (row_lane + r * kRowLanes) * head_v_dim);
  }
  if (fork_slots != nullptr) {
    float* fork = state_pool + (fork_slots[b] * num_v_heads + h) * head_k_dim * head_v_dim + col;
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r) {
      if (r < rows) *reinterpret_cast<F4*>(fork + (row_lane + r * kRowLanes) * head_v_dim) = s[r];
    }
  }
  // The gated norm's weights, last read a decode step ago, so likely gone from L2: fetched into it
  // now, they are an L2 hit beside the outputs' reload there. Held in registers instead, they were
  // spilled at once, the spill store waiting here for their load.
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int j = threadIdx.x + i * threads;
    if (out != nullptr && j < head_v_dim) prefetch_l2(norm_weight + j);
  }
  // Only now wait for the conv kernel (or the GEMV that ran the conv) launched just before
  // (programmatic dependent launch): it writes act (qkv), never the recurrent state, and slots /
  // counts were written before it ran, so the state's loads (most of this kernel's DRAM traffic)
  // overlap its tail.
  enter_kernel();
  // From act (not kConvDone): every token's q, k (the key head's) and v (the block's columns) into
  // shared memory at once, copies without registers, and each token's decay and beta: one round trip
  // for the whole window instead of one a token (a forked prompt's tail windows of up to 16 tokens).
  extern __shared__ float4 window_raw[];  // launch(): [kMaxSteps][2] gates, then tokens x window_floats
  float* const gates_s = reinterpret_cast<float*>(window_raw);
  float* const window_s = gates_s + 2 * kMaxSteps;
  const int window_floats = 2 * head_k_dim + block_cols;
  if constexpr (!kConvDone) {
    const int first_col = (blockIdx.x % splits) * block_cols;
    for (int t = 0; t < steps; ++t) {
      const float* row = act + (static_cast<std::int64_t>(b) * num_tokens + t) * channels;
      for (int e = threadIdx.x; e < window_floats; e += threads) {
        cp_async4(window_s + t * window_floats + e,
                  e < 2 * head_k_dim ? row + (e < head_k_dim ? 0 : key_dim - head_k_dim) + key_head * head_k_dim + e
                                     : row + 2 * key_dim + h * head_v_dim + first_col + e - 2 * head_k_dim);
      }
    }
    for (int t = threadIdx.x; t < steps; t += threads) {
      const float g = -A * softplus(to_float(a[(row0 + t) * ab_stride + h]) + to_float(dt_bias_h));
      gates_s[2 * t] = expf(g);
      gates_s[2 * t + 1] = 1.0f / (1.0f + expf(-to_float(b_in[(row0 + t) * ab_stride + h])));
    }
    cp_async_wait_all();
    __syncthreads();
  }
  for (int t = 0; t < steps; ++t) {
    const T* qkv_row = qkv + (row0 + t) * qkv_stride;
    const float* q_t = q_s;  // the token's q and k in shared memory
    const float* k_t = k_s;
    F4 v;
    float decay, beta;
    if constexpr (kConvDone) {  // one token (a decode step): its loads, then the key head's l2norm
      // The token's loads all issue here, before the q / k reduction's barriers, so that their L2
      // round trips overlap instead of following one another. __ldcg: ptxas sinks ld.global.nc (what
      // plain loads of these read-only arguments become) past the barriers.
      const T a_t = __ldcg(a + (row0 + t) * ab_stride + h);
      const T b_t = __ldcg(b_in + (row0 + t) * ab_stride + h);
#pragma unroll  // element loads: qkv rows need not be 8-byte aligned
      for (int c = 0; c < 4; ++c) v.v[c] = to_float(__ldcg(qkv_row + 2 * key_dim + h * head_v_dim + col + c));
      if (t > 0) __syncthreads();  // the previous token's q / k are read
      load_key_head(q_s, k_s, qkv_row + key_head * head_k_dim, qkv_row + key_dim + key_head * head_k_dim,
                    head_k_dim, q_scale, threads);
      decay = expf(-A * softplus(to_float(a_t) + to_float(dt_bias_h)));
      beta = 1.0f / (1.0f + expf(-to_float(b_t)));
      __syncthreads();
    } else {
      q_t = window_s + t * window_floats;
      k_t = q_t + head_k_dim;
      v = *reinterpret_cast<const F4*>(k_t + head_k_dim + (threadIdx.x >> 5) * kStripCols + (lane & 1) * 4);
      decay = gates_s[2 * t];
      beta = gates_s[2 * t + 1];
    }

    F4 pred = {};
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r) {
      if (r < rows) {
        const float kr = k_t[row_lane + r * kRowLanes];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          s[r].v[c] = __fmul_rn(s[r].v[c], decay);
          pred.v[c] += s[r].v[c] * kr;
        }
      }
    }
    sum_rows(pred);
    F4 u;
#pragma unroll
    for (int c = 0; c < 4; ++c) u.v[c] = beta * (v.v[c] - pred.v[c]);
    F4 o = {};
    const bool store = write_state && t == advance - 1;  // block-uniform
    // The stores' row addresses come from an opaque copy of the row pitch, computed where they are
    // used: else they are those of the loads before the wait, 16 registers held (spilled) until now.
    int pitch = head_v_dim;
    asm volatile("" : "+r"(pitch));
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r) {
      if (r < rows) {
        const float kr = k_t[row_lane + r * kRowLanes];
        const float qr = q_t[row_lane + r * kRowLanes];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          s[r].v[c] = __fadd_rn(s[r].v[c], __fmul_rn(kr, u.v[c]));
          o.v[c] += s[r].v[c] * qr;
        }
        // stored as soon as the row is final: the writes overlap the remaining rows' math
        if (store) *reinterpret_cast<F4*>(state + (row_lane + r * kRowLanes) * pitch) = s[r];
      }
    }
    if (out != nullptr) {
      sum_rows(o);
      T* out_head = out + (row0 + t) * value_dim + h * head_v_dim;
      if constexpr (kWholeHead) {
        // the norm's inputs (the block's 4 dv threads take one element each, or none), in flight
        // over the barrier (loaded with the token's other inputs, they were held in spilled registers)
        const bool norms = static_cast<int>(threadIdx.x) < head_v_dim;
        const T zv[1] = {norms ? __ldcg(z + (row0 + t) * z_stride + h * head_v_dim + threadIdx.x) : from_float<T>(0.0f)};
        const T w[1] = {norms ? __ldcg(norm_weight + threadIdx.x) : from_float<T>(0.0f)};
        if (row_lane == 0) {
#pragma unroll
          for (int c = 0; c < 4; ++c) o_s[col + c] = round_to<T>(o.v[c]);  // o.to(model dtype)
        }
        __syncthreads();
        const float x[1] = {static_cast<int>(threadIdx.x) < head_v_dim ? o_s[threadIdx.x] : 0.0f};
        gated_norm(out_head, x, zv, w, head_v_dim, eps, threads);
      } else if constexpr (kCluster && !kConvDone) {
        if (row_lane == 0) {
#pragma unroll
          for (int c = 0; c < 4; ++c) o_steps[t][(threadIdx.x >> 5) * kStripCols + (lane & 1) * 4 + c] = round_to<T>(o.v[c]);
        }
      } else if constexpr (kCluster) {
        // The block's 32 columns go to warp 0, lane i taking column i as warp i of the head's last
        // block does below: the cluster's sums add up in that block's order, the outputs bit-equal.
        const int first_col = (blockIdx.x % splits) * block_cols;
        const bool norms = threadIdx.x < 32;
        const T zv = norms ? __ldcg(z + (row0 + t) * z_stride + h * head_v_dim + first_col + lane) : from_float<T>(0.0f);
        const T w = norms ? __ldcg(norm_weight + first_col + lane) : from_float<T>(0.0f);
        if (row_lane == 0) {
#pragma unroll
          for (int c = 0; c < 4; ++c) o_s[col - first_col + c] = round_to<T>(o.v[c]);  // o.to(model dtype)
        }
        __syncthreads();
        const float x = norms ? o_s[lane] : 0.0f;
        if (norms) {
          const float total = warp_sum(x * x);
          if (lane == 0) sumsq_s[t] = total;
        }
        cluster_sync();
        if (norms) {
          const float part = lane < splits ? load_from_cluster_block(&sumsq_s[t], lane) : 0.0f;
          const float rstd = rsqrtf(warp_sum(part) / static_cast<float>(head_v_dim) + eps);
          out_head[first_col + lane] = gated_norm_value(x, rstd, w, zv);
        }
      } else if (row_lane == 0) {
#pragma unroll
        for (int c = 0; c < 4; ++c) out_head[col + c] = from_float<T>(o.v[c]);  // o.to(model dtype)
      }
    }
  }
  if constexpr (kCluster && !kConvDone) {
    // A window's gated norms: one cluster barrier for all its tokens instead of one a token, each
    // token's sums added up as the one-token path above adds them (bit-equal); z and the weight load
    // before the barriers.
    if (out != nullptr) {
      const int first_col = (blockIdx.x % splits) * block_cols;
      const bool norms = threadIdx.x < 32;
      T zv[kMaxSteps];
#pragma unroll
      for (int t = 0; t < kMaxSteps; ++t) {
        zv[t] = norms && t < steps ? __ldcg(z + (row0 + t) * z_stride + h * head_v_dim + first_col + lane)
                                   : from_float<T>(0.0f);
      }
      const T w = norms ? __ldcg(norm_weight + first_col + lane) : from_float<T>(0.0f);
      __syncthreads();  // every token's o_steps
      if (norms) {
        for (int t = 0; t < steps; ++t) {
          const float total = warp_sum(o_steps[t][lane] * o_steps[t][lane]);
          if (lane == 0) sumsq_s[t] = total;
        }
      }
      cluster_sync();
      if (norms) {
#pragma unroll
        for (int t = 0; t < kMaxSteps; ++t) {
          if (t >= steps) break;
          const float part = lane < splits ? load_from_cluster_block(&sumsq_s[t], lane) : 0.0f;
          const float rstd = rsqrtf(warp_sum(part) / static_cast<float>(head_v_dim) + eps);
          out[(row0 + t) * value_dim + h * head_v_dim + first_col + lane] =
              gated_norm_value(o_steps[t][lane], rstd, w, zv[t]);
        }
      }
    }
  }
  if constexpr (kCluster) cluster_sync();  // the others' reads of this block's sums are done
  if constexpr (!kConvDone) {
    if (conv_pool != nullptr && advance > 0) {  // block-uniform
      move_conv_states(conv_pool + slots[b] * channels * (taps - 1), qkv + row0 * qkv_stride, qkv_stride, channels,
                       taps, advance, static_cast<int>(blockIdx.x) % (num_v_heads * splits), num_v_heads * splits,
                       threads);
    }
  }
  if (out == nullptr || kWholeHead || kCluster) return;
  if (row_lane == 0) __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(done + bh, 1u) == static_cast<unsigned>(splits - 1);
  __syncthreads();
  if (!last) return;

  // The head's last block: gated RMSNorm round(round(w * round(o * rstd)) * silu(z)) in place.
  __threadfence();
  for (int t = 0; t < steps; ++t) {
    T* out_head = out + (row0 + t) * value_dim + h * head_v_dim;
    const T* z_head = z + (row0 + t) * z_stride + h * head_v_dim;
    float x[kPerThread];
    T zv[kPerThread], w[kPerThread];  // loaded with x (L2 hits): the round trips overlap
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int j = threadIdx.x + i * threads;
      x[i] = j < head_v_dim ? to_float(__ldcg(out_head + j)) : 0.0f;  // L2: other blocks wrote it
      if (j < head_v_dim) {
        zv[i] = z_head[j];
        w[i] = norm_weight[j];
      }
    }
    gated_norm(out_head, x, zv, w, head_v_dim, eps, threads);
  }
}

template <typename T>
void launch(const GdnStepsArgs& a) {
  const cudaStream_t stream = as_stream(a.stream);
  const int key_dim = a.num_k_heads * a.head_k_dim;
  const int channels = 2 * key_dim + a.num_v_heads * a.head_v_dim;
  const auto* slots = reinterpret_cast<const std::int64_t*>(a.slots);
  const auto* counts = reinterpret_cast<const std::int64_t*>(a.counts);
  const auto* offsets = reinterpret_cast<const std::int64_t*>(a.offsets);
  const auto* fork_slots = reinterpret_cast<const std::int64_t*>(a.fork_slots);
  const auto* qkv = reinterpret_cast<const T*>(a.qkv);
  // scratch: act then the counters; with conv_done the counters alone (the GEMV zeroed them)
  auto* act = a.conv_done ? nullptr : reinterpret_cast<float*>(a.scratch);
  auto* done = a.conv_done ? reinterpret_cast<unsigned*>(a.scratch)
                           : reinterpret_cast<unsigned*>(act + a.batch * a.num_tokens * channels);

  if (!a.conv_done && !a.act_ready) {
    const dim3 conv_grid(2 * a.num_k_heads + a.num_v_heads, static_cast<unsigned>(a.batch));
    launch_kernel("gdn conv kernel launch", gdn_conv_kernel<T>, conv_grid, std::max(a.head_k_dim, a.head_v_dim), 0,
                  stream, act, done, reinterpret_cast<T*>(a.conv_pool), qkv,
                  reinterpret_cast<const T*>(a.conv_weight), slots, counts, offsets, fork_slots, a.qkv_stride,
                  static_cast<int>(a.seq_rows), a.num_tokens, a.out != 0,
                  a.write_state, a.num_k_heads, a.num_v_heads, a.head_k_dim, a.head_v_dim, channels, a.conv_kernel,
                  a.q_scale);
  }

  const bool whole = whole_head_blocks(a), narrow = a.head_k_dim <= 8 * kRowLanes;
  const int threads = whole ? a.head_v_dim / kStripCols * 32 : kWarps * 32;
  const int splits = a.head_v_dim / (threads / 32 * kStripCols);
  // A cluster's norm is bit-equal to the last block's where that block's 4 warps hold one column each.
  // Taken where the grid is one block an SM or less: the 35B's batch 1 (128 blocks) went 1.6758 ->
  // 1.6675 ms with clusters, the 27B's (192 blocks) 7.364 -> 7.392 ms (H200, twenty-seventh session).
  const bool cluster = !whole && narrow && splits > 1 && a.out != 0 && a.head_v_dim <= kWarps * 32 &&
                       a.batch * a.num_v_heads * splits <= sm_count(a.device) && clusters_supported();
  const dim3 grid(static_cast<unsigned>(a.batch * a.num_v_heads * splits));
  const auto pick = [&](auto conv_done) {
    constexpr bool kConvDone = decltype(conv_done)::value;
    return whole     ? gdn_recurrent_kernel<T, 8, kConvDone, true, false>
           : cluster ? gdn_recurrent_kernel<T, 8, kConvDone, false, true>
           : narrow  ? gdn_recurrent_kernel<T, 8, kConvDone, false, false>
                     : gdn_recurrent_kernel<T, 16, kConvDone, false, false>;
  };
  auto kernel = pick(std::false_type{});
  if constexpr (!std::is_same_v<T, float>) {  // conv_done: after a 16-bit GEMV only (the binding checks)
    if (a.conv_done) kernel = pick(std::true_type{});
  }
  // the window of act (not conv_done): each token's q, k and the block's v columns, and its gates;
  // at most 35 KB (16 tokens, dk 256), within the 48 KB a kernel gets unasked
  const std::size_t window =
      a.conv_done ? 0
                  : (2 * kMaxSteps + static_cast<std::size_t>(a.num_tokens) * (2 * a.head_k_dim + threads / 32 * kStripCols)) *
                        sizeof(float);
  launch_kernel_in_clusters("gdn recurrent kernel launch", kernel, grid, threads, window, stream,
                cluster ? static_cast<unsigned>(splits) : 1u, reinterpret_cast<T*>(a.out),
                reinterpret_cast<float*>(a.state_pool), act, qkv, a.qkv_stride, a.q_scale, done,
                reinterpret_cast<const T*>(a.a),
                reinterpret_cast<const T*>(a.b), reinterpret_cast<const T*>(a.z), reinterpret_cast<const T*>(a.A_log),
                reinterpret_cast<const T*>(a.dt_bias), reinterpret_cast<const T*>(a.norm_weight), slots, counts,
                offsets, fork_slots, a.ab_stride, a.z_stride, static_cast<int>(a.seq_rows), a.num_tokens, a.write_state, a.num_k_heads, a.num_v_heads, a.head_k_dim,
                a.head_v_dim, a.eps, a.act_ready ? reinterpret_cast<T*>(a.conv_pool) : nullptr, a.conv_kernel);
}

}  // namespace

// Trusts its arguments: the binding (bind_gdn.cpp) checks them against gdn_decode.h. Left here: the
// recurrent kernel's grid limit, at most one block per 32 value columns of a (sequence, value head).
void gdn_steps(const GdnStepsArgs& a) {
  if (a.batch * a.num_v_heads * (a.head_v_dim / (kWarps * kStripCols)) > std::numeric_limits<int>::max()) {
    throw std::invalid_argument("gdn_steps: too many (sequence, value head) blocks for the grid");
  }
  if (a.batch == 0) return;
  DeviceGuard guard(a.device);
  by_dtype(a.dtype, "gdn_steps", [&](auto t) { launch<decltype(t)>(a); });
}

}  // namespace ninfer

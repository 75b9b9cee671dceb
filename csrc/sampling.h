// Host entry point of the sampler kernel (csrc/sampling.cu). Plain C++, raw device pointers.
#pragma once

#include <cstdint>

#include "ops.h"

namespace ninfer {

inline constexpr int kSampleMaxCandidates = 4096;  // sampling.cu's candidate slots (32 KiB of shared memory)
inline constexpr int kSampleMaxSegments = 1024;    // a row's segments at most (ops/sampling.py mirrors it)

// Rows of fp32 logits [rows, vocab] (already penalised), each row with its own params; the rules
// are ninfer_core/engine/sampling.py's:
//   temperature 0 => greedy: argmax, the lowest id on ties (nothing else is read);
//   else x = (logit - max) / temperature, then three threshold filters whose ties are all kept:
//   top-k (0 < k < vocab): logit >= the k-th largest logit;
//   top-p (< 1): the mass of the top-k survivors strictly more likely than the token is
//                < top_p * their total mass;
//   min-p (> 0): exp(x) >= min_p (i.e. probability >= min_p * the largest probability);
//   then one inverse-CDF draw in token-id order: the first kept token whose cumulative mass
//   exceeds uniform * the kept mass.
// Filters run in fp32 (exp of fp32 x), their sums in 64-bit fixed point (exact and
// order-independent, so a row's result never depends on thread timing).
// A row holding a NaN or +inf, or no finite value, is rejected: token -1, probs all 0, threshold NaN.
// Outputs (each optional, 0 = not written):
//   tokens [rows] int64: the drawn token (argmax for greedy rows);
//   probs [rows, vocab] fp32: the filtered, normalised distribution (one-hot for greedy rows);
//   threshold [rows] fp32: the smallest kept logit (debug: kept = logits >= threshold).
// Inputs: columns [4, rows] fp64: temperature (<= 0 or NaN: greedy; a positive one below fp32's
// smallest normal counts as that normal), top_k (none outside 1..vocab - 1), top_p, min_p (both
// rounded to fp32); uniform [rows] fp64 in [0, 1) (read only when tokens != 0). max_candidates
// (0..4096) bounds the shared-memory candidate set of a row; 0 forces the full-vocabulary path
// (tests). Workspace: segments [rows * kSampleMaxSegments] 64-bit, any contents (the row's segment
// maxima between the two launches).
struct SamplingArgs {
  std::uintptr_t tokens;
  std::uintptr_t probs;
  std::uintptr_t threshold;
  std::uintptr_t logits;
  std::uintptr_t columns;
  std::uintptr_t uniform;
  std::uintptr_t segments;
  std::int64_t rows;
  std::int64_t vocab;
  int max_candidates;
  int device;
  std::uintptr_t stream;  // cudaStream_t as an integer (torch's Stream.cuda_stream)
};

void sample_rows(const SamplingArgs& args);

inline constexpr int kGreedyMaxChunks = 256;  // blocks per row at most (ops/sampling.py mirrors it)

// The plain greedy token of each row of logits [rows, vocab] (fp32 / fp16 / bf16): the argmax,
// the lowest id on ties; -1 for a row that holds a NaN or a +inf or no finite value (torch's
// argmax picks the NaN / +inf / -inf there, which the sampler rejects). tokens [rows] int64.
// A row is split over up to kGreedyMaxChunks blocks; the workspace:
//   partials [rows * kGreedyMaxChunks] 64-bit, any contents (each block's result);
//   counters [rows] uint32, 0 before the launch and 0 after it (the last block of a row resets
//   its counter), so a launch on a stream must not overlap another launch on the same counters.
struct GreedyArgs {
  std::uintptr_t tokens;
  std::uintptr_t logits;
  std::uintptr_t partials;
  std::uintptr_t counters;
  std::int64_t rows;
  std::int64_t vocab;
  DType dtype;  // logits
  int device;
  std::uintptr_t stream;
};

void greedy_rows(const GreedyArgs& args);

inline constexpr int kJudgeMaxDrafts = 32;  // drafts a sequence at most (a warp's lanes judge one each)

// Speculative rejection sampling of a round (engine/speculative/verify.py; torch reference:
// ninfer_core/ops/rejection.py `judge_ref`) for B sequences. Sequence b has k = meta[b, 0] <= W
// drafts drafts[b, :k], target rows p[meta[b, 1] + t] (t = 0..k) and, where meta[b, 2] >= 0, the
// drafter's q rows q[meta[b, 2] + t] (t < k; else every draft is one-hot); uniforms u[b, :k + 1].
// Draft t is accepted while u[b, t] * q_t(d) < p_t(d) (float64); at the first rejection n the last
// token is drawn from max(0, p_n - q_n), else (n = k) from p_k: the inverse CDF at u[b, k] in id
// order over 64-bit fixed-point masses (round(x * 2^(62 - ceil(log2 vocab)))), p_n's own where the
// residual's sum to 0. out [2B] int64: n per sequence, then the last token; where `finite` (P bool,
// optional) is false on a row t <= n of the sequence: 0 and -1. All contiguous: p [P, vocab], q
// [Q, vocab] fp32; drafts [B, W] int64; u [B, W + 1] fp64; meta [B, 3] int64 (rows inside p / q:
// not checked); workspace sums [B * kSampleMaxSegments * 2] 64-bit, any contents.
struct JudgeArgs {
  std::uintptr_t out;
  std::uintptr_t p;
  std::uintptr_t q;  // 0: no drawn drafts
  std::uintptr_t drafts;
  std::uintptr_t u;
  std::uintptr_t meta;
  std::uintptr_t finite;  // 0: every row finite
  std::uintptr_t sums;
  std::int64_t batch;
  std::int64_t width;
  std::int64_t vocab;
  int device;
  std::uintptr_t stream;
};

void judge_rows(const JudgeArgs& args);

}  // namespace ninfer

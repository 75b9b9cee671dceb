// Penalties in one pass, and the tables' update for generated tokens (csrc/penalties.h); torch
// references: ninfer_core/ops/penalties.py.
// Replaces about a dozen elementwise torch kernels over [rows, vocab] (and the tables' row copies)
// per sampling call with penalties: a plain sampled step, each step of the MTP sampling chain, the
// speculative judge's rows.
#include "common.cuh"
#include "launch.cuh"
#include "penalties.h"

namespace ninfer {
namespace {

constexpr int kThreads = 256;

__global__ void penalise_kernel(float* out, const float* logits, const bool* __restrict__ seen,
                                const int* __restrict__ counts, const std::int64_t* __restrict__ rows,
                                const float* __restrict__ repetition, const float* __restrict__ presence,
                                const float* __restrict__ frequency, std::int64_t vocab) {
  enter_kernel();
  const std::int64_t r = blockIdx.y;
  const std::int64_t t = rows != nullptr ? rows[r] : r;
  const float rep = repetition[r], pres = presence[r], freq = frequency[r];
  const float* x = logits + r * vocab;
  float* o = out + r * vocab;
  const bool* s = seen + t * vocab;
  const int* c = counts + t * vocab;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(kThreads) + threadIdx.x; i < vocab;
       i += static_cast<std::int64_t>(gridDim.x) * kThreads) {
    float v = x[i];
    const int n = c[i];
    if (s[i] && rep != 1.0f) v = v < 0.0f ? __fmul_rn(v, rep) : __fdiv_rn(v, rep);
    const float penalty = __fadd_rn(__fmul_rn(freq, static_cast<float>(n)), __fmul_rn(pres, n > 0 ? 1.0f : 0.0f));
    o[i] = __fsub_rn(v, penalty);
  }
}

// Thread i: entry i. One launch where torch's sync-free form took about ten (index_put with its
// bounds asserts and accumulation, a gather for the seen flags, the masks).
__global__ void record_kernel(bool* __restrict__ seen, int* __restrict__ counts, const std::int64_t* __restrict__ rows,
                              const std::int64_t* __restrict__ ids, std::int64_t n, std::int64_t table_rows,
                              std::int64_t vocab) {
  enter_kernel();  // the ids are the sampler's output
  const std::int64_t i = blockIdx.x * static_cast<std::int64_t>(kThreads) + threadIdx.x;
  if (i >= n) return;
  const std::int64_t id = ids[i], t = rows[i];
  if (id < 0 || id >= vocab || t < 0 || t >= table_rows) return;
  atomicAdd(counts + t * vocab + id, 1);
  seen[t * vocab + id] = true;
}

}  // namespace

// Trusts its arguments: the binding (bind_sampling.cpp) checks them against penalties.h.
void record_tokens(const RecordArgs& a) {
  if (a.n == 0) return;
  DeviceGuard guard(a.device);
  const auto blocks = static_cast<unsigned>((a.n + kThreads - 1) / kThreads);
  launch_kernel("record kernel launch", record_kernel, blocks, kThreads, 0, as_stream(a.stream),
                reinterpret_cast<bool*>(a.seen), reinterpret_cast<int*>(a.counts),
                reinterpret_cast<const std::int64_t*>(a.rows), reinterpret_cast<const std::int64_t*>(a.ids), a.n,
                a.table_rows, a.vocab);
}

// Trusts its arguments: the binding (bind_sampling.cpp) checks them against penalties.h.
void penalise(const PenaliseArgs& a) {
  DeviceGuard guard(a.device);
  // a row over about 32 blocks: a 248k vocabulary row is 1 MB of logits, 1.25 MB of tables
  const int per_row = static_cast<int>(std::min<std::int64_t>((a.vocab + kThreads * 32 - 1) / (kThreads * 32), 64));
  const dim3 grid(std::max(per_row, 1), static_cast<unsigned>(a.num_rows));
  launch_kernel("penalise kernel launch", penalise_kernel, grid, kThreads, 0, as_stream(a.stream),
                reinterpret_cast<float*>(a.out), reinterpret_cast<const float*>(a.logits),
                reinterpret_cast<const bool*>(a.seen), reinterpret_cast<const int*>(a.counts),
                reinterpret_cast<const std::int64_t*>(a.rows), reinterpret_cast<const float*>(a.repetition),
                reinterpret_cast<const float*>(a.presence), reinterpret_cast<const float*>(a.frequency), a.vocab);
}

}  // namespace ninfer

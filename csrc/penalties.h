// Repetition / presence / frequency penalties on fp32 logits in one pass, reading each row's
// history from the engine's per-slot tables (ninfer_core/engine/penalties.py). Plain C++ (no CUDA
// or torch types): tensors travel as raw device pointers.
#pragma once

#include <cstdint>

namespace ninfer {

// For r < num_rows, v < vocab, with t = rows[r] (rows == 0: t = r), n = counts[t, v]:
//   x = logits[r, v]; if (seen[t, v] && repetition[r] != 1) x = x < 0 ? x * repetition[r] : x / repetition[r];
//   out[r, v] = x - (frequency[r] * float(n) + presence[r] * (n > 0 ? 1 : 0))
// each product, quotient, sum and difference rounded on its own in fp32 (no fused multiply-add):
// the torch reference's `penalise`, bit for bit; a neutral row (1, 0, 0) comes back unchanged.
// logits, out [num_rows, vocab]; seen (bool), counts (int32) [table_rows, vocab]; rows int64
// [num_rows] in [0, table_rows); repetition, presence, frequency fp32 [num_rows]; all contiguous.
// out may alias logits.
struct PenaliseArgs {
  std::uintptr_t out;
  std::uintptr_t logits;
  std::uintptr_t seen;
  std::uintptr_t counts;
  std::uintptr_t rows;
  std::uintptr_t repetition;
  std::uintptr_t presence;
  std::uintptr_t frequency;
  std::int64_t num_rows;
  std::int64_t vocab;
  int device;
  std::uintptr_t stream;
};

void penalise(const PenaliseArgs& args);

// The tables' update for generated tokens: for i < n with id = ids[i] in [0, vocab) and row
// t = rows[i] in [0, table_rows): counts[t, id] += 1 (atomic: a pair may repeat) and seen[t, id] =
// true; any other entry (a -1: no token) is skipped. seen (bool), counts (int32) [table_rows, vocab];
// rows, ids int64 [n]; all contiguous. The torch reference: ninfer_core/ops/penalties.py `record_ref`.
struct RecordArgs {
  std::uintptr_t seen;
  std::uintptr_t counts;
  std::uintptr_t rows;
  std::uintptr_t ids;
  std::int64_t n;
  std::int64_t table_rows;
  std::int64_t vocab;
  int device;
  std::uintptr_t stream;
};

void record_tokens(const RecordArgs& args);

}  // namespace ninfer

// Host entry points of the per-forward tables a step derives from its inputs (step_tables.cu):
// the rotary cos / sin of the positions and the KV rows of the new tokens. Each is one launch
// where its torch expression (layers/rope.py, layers/attention.py) is ~7 and ~11 small kernels,
// serial at the head of every decode graph. Plain C++ like ops.h.
#pragma once

#include <cstdint>

#include "ops.h"

namespace ninfer {

// cos[n, i] = round(cosf(float(positions[n]) * inv_freq[i mod R/2])), sin likewise with sinf,
// for n < tokens, i < R: the fp32 angle of a rotate-half table, rounded once to `dtype` (the
// torch expression's values bit for bit). positions int64 [tokens]; inv_freq fp32 [R / 2];
// cos / sin contiguous [tokens, R].
struct RotaryTablesArgs {
  std::uintptr_t cos;
  std::uintptr_t sin;
  std::uintptr_t positions;
  std::uintptr_t inv_freq;
  std::int64_t tokens;
  int rotary_dim;
  DType dtype;
  int device;
  std::uintptr_t stream;
};

void rotary_tables(const RotaryTablesArgs& args);

// For a batch of B rows of T new tokens over a paged cache (pages of `page_size` rows):
//   table_out[b, p] = clamp(block_table[b, p], 0, num_pages - 1)        (int32 [B, P] contiguous)
//   i = cache_lens[b] + t;  page = table_out[b, min(floor(i / page_size), P - 1)]
//   slots[b, t] = page * page_size + (i mod page_size)                   (int64 [B, T] contiguous)
//               = pad_row instead where valid_tokens != 0 and t >= valid_tokens[b].
// block_table int32 or int64 (`table_int64`), row b at b * table_stride; cache_lens / valid_tokens
// int64 [B]. Floor division and modulo as Python's.
struct KVSlotsArgs {
  std::uintptr_t slots;
  std::uintptr_t table_out;
  std::uintptr_t block_table;
  std::uintptr_t cache_lens;
  std::uintptr_t valid_tokens;  // 0: every token is valid
  std::int64_t batch;
  std::int64_t tokens;
  std::int64_t table_width;
  std::int64_t table_stride;
  std::int64_t page_size;
  std::int64_t num_pages;
  std::int64_t pad_row;
  bool table_int64;
  int device;
  std::uintptr_t stream;
};

void kv_slots(const KVSlotsArgs& args);

}  // namespace ninfer

// Elementwise epilogues that would otherwise be 2-3 torch kernels each in every decode layer.
// Plain C++ (no CUDA or torch types): tensors travel as raw device pointers.
#pragma once

#include <cstdint>

#include "ops.h"

namespace ninfer {

// out[r, c] = round(round(silu(x[r, c])) * x[r, cols + c]) for x [rows, 2 * cols] (gate | up): torch's
// `F.silu(gate) * up` rounding, in one pass. out [rows, cols] contiguous.
struct SiluMulArgs {
  std::uintptr_t out;
  std::uintptr_t x;
  std::int64_t rows;
  std::int64_t cols;
  DType dtype;
  int device;
  std::uintptr_t stream;
};

// out[r, c] = round(round(x[r, c] * round(sigmoid(g))) [+ add[r, c]]) with g = gate[r * gate_stride + c]
// (gate_cols == cols) or gate[r * gate_stride] (gate_cols == 1, one gate per row): torch's
// `add + sigmoid(gate) * x` / `x * sigmoid(gate)` rounding. x, add, out [rows, cols] contiguous;
// add == 0 for none; out may alias x or add.
struct SigmoidMulArgs {
  std::uintptr_t out;
  std::uintptr_t x;
  std::uintptr_t gate;
  std::uintptr_t add;
  std::int64_t rows;
  std::int64_t cols;
  std::int64_t gate_stride;
  int gate_cols;
  DType dtype;
  int device;
  std::uintptr_t stream;
};

void silu_mul(const SiluMulArgs& args);
void sigmoid_mul(const SigmoidMulArgs& args);

}  // namespace ninfer

// The per-forward tables of step_tables.h, each in one launch. Tiny kernels: what they save is
// the launches of the torch expressions they replace, not bandwidth.
#include "common.cuh"
#include "launch.cuh"
#include "step_tables.h"

namespace ninfer {
namespace {

constexpr int kThreads = 256;

// One thread per (token, frequency): both halves of the rotate-half table take the same angle.
// cosf / sinf (not the fast intrinsics): the functions torch's cos / sin kernels call, so the
// tables equal the torch expression's bit for bit.
template <typename T>
__global__ void rotary_tables_kernel(T* __restrict__ cos, T* __restrict__ sin,
                                     const std::int64_t* __restrict__ positions,
                                     const float* __restrict__ inv_freq, std::int64_t tokens, int half) {
  enter_kernel();
  const std::int64_t total = tokens * half;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t token = i / half;
    const int slot = static_cast<int>(i - token * half);
    const float angle = __fmul_rn(static_cast<float>(positions[token]), inv_freq[slot]);
    const T c = from_float<T>(cosf(angle)), s = from_float<T>(sinf(angle));
    const std::int64_t at = token * 2 * half + slot;
    cos[at] = c;
    cos[at + half] = c;
    sin[at] = s;
    sin[at + half] = s;
  }
}

__device__ __forceinline__ std::int64_t floor_div(std::int64_t a, std::int64_t b) {
  const std::int64_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

// Grid (column chunks of the table, B): every block clamps its chunk of row b's table; the
// chunk-0 block also writes row b's slots (T is small: decode, verify, a prompt chunk).
template <typename Index>
__global__ void kv_slots_kernel(std::int64_t* __restrict__ slots, int* __restrict__ table_out,
                                const Index* __restrict__ block_table, const std::int64_t* __restrict__ cache_lens,
                                const std::int64_t* __restrict__ valid_tokens, std::int64_t tokens,
                                std::int64_t width, std::int64_t stride, std::int64_t page_size,
                                std::int64_t num_pages, std::int64_t pad_row) {
  enter_kernel();
  const std::int64_t b = blockIdx.y;
  const Index* row = block_table + b * stride;
  auto clamped = [&](std::int64_t p) {
    return static_cast<int>(min(max(static_cast<std::int64_t>(row[p]), std::int64_t{0}), num_pages - 1));
  };
  for (std::int64_t p = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; p < width;
       p += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    table_out[b * width + p] = clamped(p);
  }
  if (blockIdx.x != 0) return;
  const std::int64_t valid = valid_tokens == nullptr ? tokens : valid_tokens[b];
  for (std::int64_t t = threadIdx.x; t < tokens; t += blockDim.x) {
    const std::int64_t index = cache_lens[b] + t;
    const std::int64_t page_index = floor_div(index, page_size);
    const std::int64_t page = clamped(min(max(page_index, std::int64_t{0}), width - 1));
    const std::int64_t offset = index - page_index * page_size;
    slots[b * tokens + t] = t < valid ? page * page_size + offset : pad_row;
  }
}

template <typename T>
void launch_rotary(const RotaryTablesArgs& a, cudaStream_t stream) {
  const int half = a.rotary_dim / 2;
  const std::int64_t work = a.tokens * half;
  const int blocks = static_cast<int>(std::min<std::int64_t>((work + kThreads - 1) / kThreads, 4096));
  launch_kernel("rotary_tables kernel launch", rotary_tables_kernel<T>, blocks, kThreads, 0, stream,
                reinterpret_cast<T*>(a.cos), reinterpret_cast<T*>(a.sin),
                reinterpret_cast<const std::int64_t*>(a.positions), reinterpret_cast<const float*>(a.inv_freq),
                a.tokens, half);
}

}  // namespace

// Both trust their arguments: the bindings (bind_attention.cpp) check them against step_tables.h.
void rotary_tables(const RotaryTablesArgs& a) {
  DeviceGuard guard(a.device);
  by_dtype(a.dtype, "rotary_tables", [&](auto t) { launch_rotary<decltype(t)>(a, as_stream(a.stream)); });
}

void kv_slots(const KVSlotsArgs& a) {
  DeviceGuard guard(a.device);
  const dim3 grid(static_cast<unsigned>(std::min<std::int64_t>((a.table_width + kThreads - 1) / kThreads, 64)),
                  static_cast<unsigned>(a.batch));
  const auto launch = [&](auto index) {  // the block table's element type
    using Index = decltype(index);
    launch_kernel("kv_slots kernel launch", kv_slots_kernel<Index>, grid, kThreads, 0, as_stream(a.stream),
                  reinterpret_cast<std::int64_t*>(a.slots), reinterpret_cast<int*>(a.table_out),
                  reinterpret_cast<const Index*>(a.block_table), reinterpret_cast<const std::int64_t*>(a.cache_lens),
                  reinterpret_cast<const std::int64_t*>(a.valid_tokens), a.tokens, a.table_width, a.table_stride,
                  a.page_size, a.num_pages, a.pad_row);
  };
  a.table_int64 ? launch(std::int64_t{}) : launch(int{});
}

}  // namespace ninfer

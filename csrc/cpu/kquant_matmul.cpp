// Entry points of the K-quant kernels (kquant.h): argument checks, x quantized once per call, packs
// split over the thread pool.
#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "kquant_kernels.h"
#include "thread_pool.h"

namespace ninfer::cpu {
namespace {

// The parts of w resolved: first output row, first pack, data; checked.
std::vector<KQuantSpan> spans(const KQuantWeight& w) {
  if (w.k <= 0 || w.k % kSuperBlock) throw std::invalid_argument("kquant: k must be a positive multiple of 256");
  if (w.parts < 1 || w.parts > kMaxParts) throw std::invalid_argument("kquant: 1 to 8 parts");
  std::vector<KQuantSpan> out;
  const auto* data = reinterpret_cast<const std::uint8_t*>(w.data);
  std::int64_t row0 = 0, pack0 = 0;
  for (int i = 0; i < w.parts; ++i) {
    const KQuantPart& part = w.part[i];
    if (part.type != BlockType::Q4_K && part.type != BlockType::Q5_K && part.type != BlockType::Q6_K &&
        part.type != BlockType::Q8_0 && part.type != BlockType::Q4_0 && part.type != BlockType::Q4_1) {
      throw std::invalid_argument("kquant: block type " + std::to_string(static_cast<int>(part.type)));
    }
    if (part.rows <= 0) throw std::invalid_argument("kquant: a part without rows");
    const std::int64_t packs = (part.rows + kPackRows - 1) / kPackRows;
    out.push_back({part.type, part.rows, row0, pack0, data});
    data += packs * kPackRows * block_bytes(part.type) * (w.k / kSuperBlock);
    row0 += part.rows;
    pack0 += packs;
  }
  return out;
}

// Tasks of whole packs: about 8 per thread (balance on a busy machine), at least one pack.
std::int64_t packs_per_task(std::int64_t packs, int threads) {
  const std::int64_t tasks = 8 * static_cast<std::int64_t>(threads > 1 ? threads : 1);
  return (packs + tasks - 1) / tasks;
}

}  // namespace

void kquant_matmul(const KQuantMatmulArgs& a) {
  const std::vector<KQuantSpan> parts = spans(a.w);
  const IsaKernels& impl = active_kernels();
  const std::int64_t k = a.w.k, groups = k / kActivationBlock;
  std::vector<std::int8_t> q(a.m * k);
  std::vector<float> d(a.m * groups), sums32(a.m * groups);
  std::vector<std::int32_t> sums16(a.m * (k / 16));
  const auto* x = reinterpret_cast<const float*>(a.x);
  for (std::int64_t t = 0; t < a.m; ++t) {
    impl.kquant_quantize(x + t * k, k, q.data() + t * k, d.data() + t * groups, sums16.data() + t * (k / 16),
                         sums32.data() + t * groups);
  }
  const KQuantSpan& last = parts.back();
  const std::int64_t packs = last.pack0 + (last.rows + kPackRows - 1) / kPackRows;
  const PreparedKQ p{parts.data(), a.w.parts, k, last.row0 + last.rows, {q.data(), d.data(), sums16.data(), sums32.data()},
                     reinterpret_cast<float*>(a.out), reinterpret_cast<const float*>(a.bias), a.m};
  const std::int64_t per_task = packs_per_task(packs, a.threads), tasks = (packs + per_task - 1) / per_task;
  parallel_for(tasks, a.threads, [&](std::int64_t t) {
    impl.kquant_rows(p, t * per_task, t + 1 < tasks ? (t + 1) * per_task : packs);
  });
}

void kquant_dequantize(const KQuantWeight& w, std::int64_t first, std::int64_t count, std::uintptr_t out, bool bf16,
                       int threads) {
  const std::vector<KQuantSpan> parts = spans(w);
  const KQuantSpan& last = parts.back();
  if (first < 0 || count < 0 || first + count > last.row0 + last.rows) {
    throw std::invalid_argument("kquant_dequantize: rows out of range");
  }
  const IsaKernels& impl = active_kernels();
  auto* dst = reinterpret_cast<char*>(out);
  const std::int64_t row_bytes = w.k * (bf16 ? 2 : 4);
  // tasks of whole packs within one part
  struct Task {
    const KQuantSpan* part;
    std::int64_t r0, r1;  // rows of the part
  };
  std::vector<Task> tasks;
  for (const KQuantSpan& s : parts) {
    const std::int64_t r0 = std::max<std::int64_t>(first - s.row0, 0);
    const std::int64_t r1 = std::min<std::int64_t>(first + count - s.row0, s.rows);
    const std::int64_t step = std::max<std::int64_t>(kPackRows, (r1 - r0) / (8 * threads) / kPackRows * kPackRows);
    for (std::int64_t r = r0; r < r1;) {
      const std::int64_t end = std::min(r1, (r / kPackRows + step / kPackRows) * kPackRows);
      tasks.push_back({&s, r, end});
      r = end;
    }
  }
  parallel_for(static_cast<std::int64_t>(tasks.size()), threads, [&](std::int64_t i) {
    const Task& t = tasks[i];
    impl.kquant_dequantize_rows(*t.part, w.k, t.r0, t.r1, dst + (t.part->row0 + t.r0 - first) * row_bytes, bf16);
  });
}

}  // namespace ninfer::cpu

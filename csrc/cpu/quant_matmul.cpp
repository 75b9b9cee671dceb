// Entry points of the CPU quant kernels: argument checks, the instruction set picked once per
// process, x prepared once per call, rows of the weight split over the thread pool.
#include "quant_matmul.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "quant_kernels.h"
#include "thread_pool.h"

namespace ninfer::cpu {
namespace {

// Weight rows per task: about 8 tasks per thread, so that the threads stay balanced when one of
// them is descheduled for a while (a busy machine), and at least 16 rows, so that claiming a task
// (an atomic shared between cores) costs little next to it.
std::int64_t rows_per_task(std::int64_t rows, int threads) {
  const std::int64_t tasks = 8 * static_cast<std::int64_t>(threads > 1 ? threads : 1);
  return std::max<std::int64_t>(16, (rows + tasks - 1) / tasks + 15) / 16 * 16;
}

bool cpu_has(const char* feature) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  if (!std::strcmp(feature, "avx512")) return __builtin_cpu_supports("avx512f");
  if (!std::strcmp(feature, "avx2")) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }
#endif
  return false;
}

// The kernels of `name` ("" or "avx512": the best this CPU runs; "avx2"; "generic"): the
// instruction sets up to the one named that this CPU has.
const IsaKernels* pick(const std::string& name) {
#if defined(NINFER_CPU_X86)
  if ((name.empty() || name == "avx512") && cpu_has("avx512")) return &kAvx512Kernels;
  if ((name.empty() || name == "avx512" || name == "avx2") && cpu_has("avx2")) return &kAvx2Kernels;
#endif
  return &kGenericKernels;
}

std::atomic<const IsaKernels*> chosen{nullptr};

const IsaKernels& kernels() {
  const IsaKernels* k = chosen.load();
  if (!k) {
    const char* env = std::getenv("NINFER_CPU_ISA");
    k = pick(env ? env : "");
    chosen.store(k);
  }
  return *k;
}

void check(const QuantWeight& w) {
  if (w.n <= 0 || w.k <= 0 || w.group <= 0 || w.k % w.group) {
    throw std::invalid_argument("quant kernel: group " + std::to_string(w.group) + " does not divide k " +
                                std::to_string(w.k));
  }
  if (w.group % (w.int4 ? 32 : 16)) throw std::invalid_argument("quant kernel: group must be a multiple of 32 (int4) / 16 (int8)");
  if (w.k / w.group > kMaxGroups) throw std::invalid_argument("quant kernel: more than 4096 groups per row");
}

}  // namespace

void quant_matmul(const MatmulArgs& a) {
  const QuantWeight& w = a.w;
  check(w);
  const IsaKernels& impl = kernels();
  const auto* x = reinterpret_cast<const float*>(a.x);
  std::vector<float> arranged;
  if (w.int4) {
    arranged.resize(a.m * w.k);
    impl.arrange(x, a.m, w.k, arranged.data());
  }
  const std::int64_t groups = w.k / w.group;
  std::vector<float> xsum(a.m * groups, 0.0f);  // zeros: an int8 weight without offsets adds nothing
  if (w.int4 || w.offsets) {
    for (std::int64_t i = 0; i < a.m * groups; ++i) {
      float s = 0;
      for (std::int64_t j = 0; j < w.group; ++j) s += x[i * w.group + j];
      xsum[i] = s;
    }
  }
  const Prepared p{&w, reinterpret_cast<float*>(a.out), w.int4 ? arranged.data() : x, xsum.data(),
                   reinterpret_cast<const float*>(a.bias), a.m};
  const std::int64_t per_task = rows_per_task(w.n, a.threads), tasks = (w.n + per_task - 1) / per_task;
  parallel_for(tasks, a.threads, [&](std::int64_t t) {
    impl.rows(p, t * per_task, t + 1 < tasks ? (t + 1) * per_task : w.n);
  });
}

void dequantize(const QuantWeight& w, std::int64_t first, std::int64_t count, std::uintptr_t out, int threads) {
  check(w);
  if (first < 0 || count < 0 || first + count > w.n) throw std::invalid_argument("dequantize: rows out of range");
  const IsaKernels& impl = kernels();
  auto* dst = reinterpret_cast<float*>(out);
  const std::int64_t per_task = rows_per_task(count, threads), tasks = (count + per_task - 1) / per_task;
  parallel_for(tasks, threads, [&](std::int64_t t) {
    const std::int64_t n0 = first + t * per_task, n1 = t + 1 < tasks ? n0 + per_task : first + count;
    impl.dequantize_rows(w, dst + (n0 - first) * w.k, n0, n1);
  });
}

const char* isa() { return kernels().name; }

const char* use_isa(const char* name) {
  chosen.store(pick(name));
  return isa();
}

}  // namespace ninfer::cpu

// Entry points of the CPU quant kernels: argument checks, the instruction set picked once per
// process, x prepared once per call, rows of the weight split over the thread pool.
#include "quant_matmul.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "quant_kernels_a8.h"
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
  if (!std::strcmp(feature, "avx512")) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni");
  }
  if (!std::strcmp(feature, "avx512bf16")) {
    return cpu_has("avx512") && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512dq");
  }
  if (!std::strcmp(feature, "avx2")) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }
#endif
  return false;
}

#if defined(NINFER_CPU_AVX512BF16)
// The AVX-512 kernels with the AVX512-BF16 dequantizations.
const IsaKernels& avx512_bf16() {
  static const IsaKernels kernels = [] {
    IsaKernels k = kAvx512Kernels;
    k.name = "avx512bf16";
    k.dequantize_rows = kAvx512Bf16Dequantize;
    k.kquant_dequantize_rows = kAvx512Bf16KQuantDequantize;
    return k;
  }();
  return kernels;
}
#endif

// The kernels of `name` ("" or "avx512bf16": the best this CPU runs; "avx512"; "avx2"; "generic"):
// the instruction sets up to the one named that this CPU has.
const IsaKernels* pick(const std::string& name) {
#if defined(NINFER_CPU_AVX512BF16)
  if ((name.empty() || name == "avx512bf16") && cpu_has("avx512bf16")) return &avx512_bf16();
#endif
#if defined(NINFER_CPU_X86)
  const bool avx512_or_more = name.empty() || name == "avx512bf16" || name == "avx512";
  if (avx512_or_more && cpu_has("avx512")) return &kAvx512Kernels;
  if ((avx512_or_more || name == "avx2") && cpu_has("avx2")) return &kAvx2Kernels;
#endif
  return &kGenericKernels;
}

std::atomic<const IsaKernels*> chosen{nullptr};

void check(const QuantWeight& w) {
  if (w.n <= 0 || w.k <= 0 || w.group <= 0 || w.k % w.group) {
    throw std::invalid_argument("quant kernel: group " + std::to_string(w.group) + " does not divide k " +
                                std::to_string(w.k));
  }
  if (w.group % (w.int4 ? 32 : 16)) throw std::invalid_argument("quant kernel: group must be a multiple of 32 (int4) / 16 (int8)");
  if (w.k / w.group > kMaxGroups) throw std::invalid_argument("quant kernel: more than 4096 groups per row");
}

// Exact fp32 sums of x per weight group (the offsets multiply them); zeros where w has none.
std::vector<float> group_sums(const QuantWeight& w, const float* x, std::int64_t m) {
  const std::int64_t groups = w.k / w.group;
  std::vector<float> xsum(m * groups, 0.0f);
  if (w.int4 || w.offsets) {
    for (std::int64_t i = 0; i < m * groups; ++i) {
      float s = 0;
      for (std::int64_t j = 0; j < w.group; ++j) s += x[i * w.group + j];
      xsum[i] = s;
    }
  }
  return xsum;
}

// x quantized for the int8-activation kernels (quant_kernels_a8.h describes the layout).
struct ActivationsA8 {
  std::int64_t kpad;
  std::vector<std::int8_t> xq;
  std::vector<float> xlane;
  std::vector<std::int32_t> corr;
  std::vector<std::int32_t> lane_group;
};

constexpr std::int64_t kActivationBlock = 32;

// Whether the int8-activation kernels run w with `lanes` lanes: whole activation blocks, and
// groups that a chunk holds whole or that hold whole chunks (a lane then lies in one group).
bool a8_covers(const QuantWeight& w, int lanes) {
  const std::int64_t chunk = (w.int4 ? 8 : 4) * lanes;
  return w.k % kActivationBlock == 0 && (w.group % chunk == 0 || chunk % w.group == 0);
}

ActivationsA8 quantize_activations(const QuantWeight& w, const float* x, std::int64_t m, int lanes) {
  const std::int64_t span = w.int4 ? 8 : 4, chunk = span * lanes, k = w.k;
  ActivationsA8 a;
  a.kpad = (k + chunk - 1) / chunk * chunk;
  const std::int64_t lanes_per_row = a.kpad / span;
  a.xq.assign(m * a.kpad, 0);
  a.xlane.assign(m * lanes_per_row, 0.0f);
  a.corr.assign(m * lanes_per_row, 0);
  std::vector<std::int8_t> q(k);
  std::vector<float> block_scale(k / kActivationBlock);
  for (std::int64_t t = 0; t < m; ++t) {
    const float* xt = x + t * k;
    for (std::int64_t b = 0; b < k / kActivationBlock; ++b) {
      float amax = 0;
      for (std::int64_t j = 0; j < kActivationBlock; ++j) amax = std::max(amax, std::fabs(xt[b * kActivationBlock + j]));
      const float inv = amax > 0 ? 127.0f / amax : 0.0f;  // ops/quant.py quantize_activations_ref: the same
      block_scale[b] = amax / 127.0f;
      for (std::int64_t j = 0; j < kActivationBlock; ++j) {
        q[b * kActivationBlock + j] = static_cast<std::int8_t>(std::nearbyint(xt[b * kActivationBlock + j] * inv));
      }
    }
    std::int8_t* dst = a.xq.data() + t * a.kpad;
    for (std::int64_t i = 0; i < k; ++i) {
      const std::int64_t c = i / chunk, j = i % chunk;  // int4: even inputs first, then odd (per chunk)
      dst[w.int4 ? c * chunk + (j % 2) * (chunk / 2) + j / 2 : i] = q[i];
    }
    for (std::int64_t lane = 0; lane < lanes_per_row; ++lane) {
      const std::int64_t first = lane / lanes * chunk + span * (lane % lanes);  // the lane's first input
      if (first < k) a.xlane[t * lanes_per_row + lane] = block_scale[first / kActivationBlock];
      if (!w.int4) {  // the biased int8 dot products: the 4 bytes lane reads
        std::int32_t sum = 0;
        for (std::int64_t j = 0; j < 4; ++j) sum += dst[4 * lane + j];
        a.corr[t * lanes_per_row + lane] = -128 * sum;
      }
    }
  }
  for (int i = 0; i < lanes; ++i) {
    a.lane_group.push_back(static_cast<std::int32_t>(w.group < chunk ? span * i / w.group : 0));
  }
  return a;
}

template <class Rows>
void over_rows(const QuantWeight& w, int threads, const Rows& rows) {
  const std::int64_t per_task = rows_per_task(w.n, threads), tasks = (w.n + per_task - 1) / per_task;
  parallel_for(tasks, threads, [&](std::int64_t t) { rows(t * per_task, t + 1 < tasks ? (t + 1) * per_task : w.n); });
}

}  // namespace

void quant_matmul(const MatmulArgs& a) {
  const QuantWeight& w = a.w;
  check(w);
  const IsaKernels& impl = active_kernels();
  const auto* x = reinterpret_cast<const float*>(a.x);
  const std::vector<float> xsum = group_sums(w, x, a.m);
  auto* out = reinterpret_cast<float*>(a.out);
  const auto* bias = reinterpret_cast<const float*>(a.bias);
  if (a.int8_activations && a8_covers(w, impl.lanes)) {
    const ActivationsA8 q = quantize_activations(w, x, a.m, impl.lanes);
    const PreparedA8 p{&w, out, q.xq.data(), q.kpad, q.xlane.data(), q.corr.data(), q.lane_group.data(),
                       xsum.data(), bias, a.m};
    over_rows(w, a.threads, [&](std::int64_t n0, std::int64_t n1) { impl.rows_a8(p, n0, n1); });
    return;
  }
  std::vector<float> arranged;
  if (w.int4) {
    arranged.resize(a.m * w.k);
    impl.arrange(x, a.m, w.k, arranged.data());
  }
  const Prepared p{&w, out, w.int4 ? arranged.data() : x, xsum.data(), bias, a.m};
  over_rows(w, a.threads, [&](std::int64_t n0, std::int64_t n1) { impl.rows(p, n0, n1); });
}

void dequantize(const QuantWeight& w, std::int64_t first, std::int64_t count, std::uintptr_t out, bool bf16,
                int threads) {
  check(w);
  if (first < 0 || count < 0 || first + count > w.n) throw std::invalid_argument("dequantize: rows out of range");
  const IsaKernels& impl = active_kernels();
  auto* dst = reinterpret_cast<char*>(out);
  const std::int64_t row_bytes = w.k * (bf16 ? 2 : 4);
  const std::int64_t per_task = rows_per_task(count, threads), tasks = (count + per_task - 1) / per_task;
  parallel_for(tasks, threads, [&](std::int64_t t) {
    const std::int64_t n0 = first + t * per_task, n1 = t + 1 < tasks ? n0 + per_task : first + count;
    impl.dequantize_rows(w, dst + (n0 - first) * row_bytes, bf16, n0, n1);
  });
}

const IsaKernels& active_kernels() {
  const IsaKernels* k = chosen.load();
  if (!k) {
    const char* env = std::getenv("NINFER_CPU_ISA");
    k = pick(env ? env : "");
    chosen.store(k);
  }
  return *k;
}

const char* isa() { return active_kernels().name; }

const char* use_isa(const char* name) {
  chosen.store(pick(name));
  return isa();
}

}  // namespace ninfer::cpu

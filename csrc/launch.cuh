// Kernel launches with programmatic dependent launch (PDL, sm_90+). A decode step is hundreds of
// kernels of a few microseconds each; with PDL the next kernel is scheduled while the current one
// still runs, reads what no kernel writes (weights) ahead, and waits only for its real inputs, so
// its launch latency and the first loads' latency hide behind the current kernel's work.
// The contract, for every kernel started with `launch_kernel`: before it reads anything the kernel
// just before it wrote, and before it writes anything (an earlier kernel may still read it), it
// calls `wait_for_inputs()`; `enter_kernel()` does that first thing. What kernels two or more
// launches back wrote may be read before: the kernel before this one let it start only after its
// own wait, so those have finished. Without PDL (older GPUs,
// NINFER_PDL=0) both are no-ops and launches are ordinary. Inside CUDA graphs the dependency
// becomes a programmatic edge (CUDA 12.3+).
#pragma once

#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include "common.cuh"

namespace ninfer {

// Blocks until the previous kernel in the stream has finished and its writes are visible.
__device__ __forceinline__ void wait_for_inputs() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next kernel in the stream be scheduled (it still waits for this one to finish).
__device__ __forceinline__ void start_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The first statement of a kernel that needs its inputs at once.
__device__ __forceinline__ void enter_kernel() {
  wait_for_inputs();
  start_dependents();
}

// enter_kernel() for a kernel that issues loads before it (weights, constants, what kernels two or
// more launches back wrote). ptxas floats griddepcontrol.wait up past loads of its own basic block
// (an acquire lets earlier loads sink below it: in the SASS every one of the router's weight loads
// came after the wait), so the wait goes behind a branch on a value neither compiler knows, the
// grid's width (never 0): a block boundary that ptxas keeps.
__device__ __forceinline__ void enter_kernel_after_loads() {
  unsigned blocks;
  asm volatile("mov.u32 %0, %%nctaid.x;" : "=r"(blocks));
  if (blocks != 0) enter_kernel();
}

// enter_kernel_after_loads() that lets the next kernel start before this one waits: it may then run
// while the kernel before this one still does, so only for a kernel whose successor reads before its
// own wait nothing that kernel writes (what kernels three or more launches back wrote is complete:
// the kernel before this one started only after its own wait). norm_rotary_write_kv's successor,
// decode attention, reads older keys and host tables there, so it launches while the q|k|v
// projection runs.
__device__ __forceinline__ void start_dependents_then_wait_after_loads() {
  unsigned blocks;
  asm volatile("mov.u32 %0, %%nctaid.x;" : "=r"(blocks));
  if (blocks != 0) {
    start_dependents();
    wait_for_inputs();
  }
}

// SMs of a device, queried once per process (so graph captures after a warm-up query nothing).
inline int sm_count(int device) {
  static std::array<std::atomic<int>, 256> counts{};
  if (device < 0 || device >= static_cast<int>(counts.size())) {
    throw std::invalid_argument("sm_count: bad device " + std::to_string(device));
  }
  int sms = counts[device].load(std::memory_order_relaxed);
  if (sms == 0) {
    check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
               "cudaDeviceGetAttribute");
    counts[device].store(sms, std::memory_order_relaxed);
  }
  return sms;
}

// Compute capability major of the current device (queried once per device).
inline int current_major() {
  static std::array<std::atomic<int>, 64> majors{};  // compute capability major + 1; 0: not asked
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  if (device < 0 || device >= static_cast<int>(majors.size())) return 0;
  int major = majors[device].load(std::memory_order_relaxed) - 1;
  if (major < 0) {
    check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
               "cudaDeviceGetAttribute");
    majors[device].store(major + 1, std::memory_order_relaxed);
  }
  return major;
}

// PDL on the current device: sm_90+ unless NINFER_PDL=0 (read once per process).
inline bool pdl_enabled() {
  static const bool allowed = [] {
    const char* value = std::getenv("NINFER_PDL");
    return value == nullptr || std::strcmp(value, "0") != 0;
  }();
  return allowed && current_major() >= 9;
}

// Thread block clusters (blocks that share their shared memory): sm_90+.
inline bool clusters_supported() { return current_major() >= 9; }

// For timing only: a launch whose `what` contains one of the '+'-separated names in NINFER_ABLATE
// is skipped (its outputs are then garbage). Graph replays with a kernel left out give its share
// of a decode step with PDL overlap, which per-kernel profiles cannot (scripts/ab_replays.py).
// Read at every launch, so that one process can capture graphs under several settings.
inline bool ablated(const char* what) {
  const char* names = std::getenv("NINFER_ABLATE");
  if (names == nullptr) return false;
  for (const char* start = names; *start != '\0';) {
    const char* end = std::strchr(start, '+');
    const std::size_t length = end == nullptr ? std::strlen(start) : static_cast<std::size_t>(end - start);
    if (length > 0 && std::string_view(what).find(std::string_view(start, length)) != std::string_view::npos) return true;
    if (end == nullptr) break;
    start = end + 1;
  }
  return false;
}

// kernel<<<grid, block, smem, stream>>>(args...) in clusters of `cluster` blocks along x (1: no
// clusters; more only where clusters_supported()), with PDL where it is on; errors raise, naming
// `what`.
template <typename... Params, typename... Args>
void launch_kernel_in_clusters(const char* what, void (*kernel)(Params...), dim3 grid, dim3 block,
                               std::size_t smem, cudaStream_t stream, unsigned cluster, Args&&... args) {
  if (ablated(what)) return;
  std::array<cudaLaunchAttribute, 2> attributes{};
  unsigned count = 0;
  if (pdl_enabled()) {
    attributes[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[count++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster > 1) {
    attributes[count].id = cudaLaunchAttributeClusterDimension;
    attributes[count++].val.clusterDim = {cluster, 1, 1};
  }
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = count > 0 ? attributes.data() : nullptr;
  config.numAttrs = count;
  check_cuda(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...), what);
}

// kernel<<<grid, block, smem, stream>>>(args...), with PDL where it is on.
template <typename... Params, typename... Args>
void launch_kernel(const char* what, void (*kernel)(Params...), dim3 grid, dim3 block,
                   std::size_t smem, cudaStream_t stream, Args&&... args) {
  launch_kernel_in_clusters(what, kernel, grid, block, smem, stream, 1u, std::forward<Args>(args)...);
}

}  // namespace ninfer

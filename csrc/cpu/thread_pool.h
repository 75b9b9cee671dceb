// A small pool for the CPU kernels. Why not OpenMP: a second OpenMP runtime beside torch's bundled
// one would give the process two spinning thread pools; and torch's own pool is out of reach
// without building against libtorch. The caller works too, and tasks are claimed one at a time,
// so a worker the OS does not schedule (a busy machine) costs its share of the work, not a stall.
#pragma once

#include <cstdint>
#include <functional>

namespace ninfer::cpu {

// fn(i) for every i in [0, count), on up to `threads` threads (the caller is one of them).
void parallel_for(std::int64_t count, int threads, const std::function<void(std::int64_t)>& fn);

}  // namespace ninfer::cpu

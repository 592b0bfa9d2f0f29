// The CPU backend's one thread pool: OpenMP (shared with OpenBLAS and oneDNN,
// which are built against the same OpenMP runtime, so the machine is never
// oversubscribed by two pools).
//   parallel_for(n, grain, [&](int64_t begin, int64_t end) { ... });
// splits [0, n) into contiguous chunks; runs inline when n <= grain or when
// already inside a parallel region.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>

namespace tessera {

template <typename Fn>
void parallel_for(int64_t n, int64_t grain, Fn&& fn) {
  if (n <= 0) return;
  if (n <= grain || omp_in_parallel() || omp_get_max_threads() == 1) {
    fn(int64_t{0}, n);
    return;
  }
  const int64_t max_chunks = (n + grain - 1) / std::max<int64_t>(grain, 1);
  const int threads = int(std::min<int64_t>(omp_get_max_threads(), max_chunks));
#pragma omp parallel num_threads(threads)
  {
    const int64_t team = omp_get_num_threads();
    const int64_t id = omp_get_thread_num();
    const int64_t chunk = (n + team - 1) / team;
    const int64_t begin = std::min(n, id * chunk);
    const int64_t end = std::min(n, begin + chunk);
    if (begin < end) fn(begin, end);
  }
}

// Runs `op(i)` for every i in [0, n): the CPU launcher of index functors
// (see kernels/functors/). `grain` is the least work worth a thread.
template <typename Op>
void cpu_for_each_index(int64_t n, const Op& op, int64_t grain = 1 << 15) {
  parallel_for(n, grain, [&](int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) op(i);
  });
}

}  // namespace tessera

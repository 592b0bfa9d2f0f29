// Building blocks of the row-wise functors (kernels/functors/rowwise.h),
// besides exp_f32 (kernels/functors/float_math.h):
//   - TESSERA_SIMD / TESSERA_SIMD_REDUCTION(op : vars): `omp simd` on a
//     functor's lane loop, so SerialGroup loops vectorise (reductions may be
//     reordered). They vanish under nvcc, where a warp runs the loop.
//   - for_each_lane_index_prefetching: a lane loop with software prefetch on
//     the host, for loops the hardware prefetcher cannot keep fed.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/half.h"
#include "core/host_device.h"
#include "kernels/functors/float_math.h"

#if defined(_OPENMP) && !defined(__CUDACC__)
#define TESSERA_PRAGMA(text) _Pragma(#text)
#define TESSERA_SIMD TESSERA_PRAGMA(omp simd)
#define TESSERA_SIMD_REDUCTION(...) TESSERA_PRAGMA(omp simd reduction(__VA_ARGS__))
#else
#define TESSERA_SIMD
#define TESSERA_SIMD_REDUCTION(...)
#endif

namespace tessera {

// Host only: asks for the cache lines of [address, address + bytes) (a hint:
// no fault past the end of an allocation). Nothing on a GPU.
TESSERA_HD_INLINE void prefetch_bytes(uintptr_t address, int64_t bytes, bool for_write) {
#if !TESSERA_ON_DEVICE
  constexpr int64_t kCacheLine = 64;
  for (int64_t offset = 0; offset < bytes; offset += kCacheLine) {
    const void* line = reinterpret_cast<const void*>(address + uintptr_t(offset));
    if (for_write) {
      __builtin_prefetch(line, 1);
    } else {
      __builtin_prefetch(line, 0);
    }
  }
#else
  (void)address, (void)bytes, (void)for_write;
#endif
}

// Runs body(i) for i = lane, lane + lanes, ... below n (the plain lane loop),
// in blocks of kPrefetchBlock per lane; before each block the host prefetches
// the input and output rows kPrefetchAheadBytes ahead. For compute-heavy loops
// over rows that are not in cache (the cross-entropy backward over a
// vocabulary): the hardware prefetcher falls behind them, and the loop then
// waits on memory (2.4x slower measured on [256, 50257] f32, in place).
inline constexpr int64_t kPrefetchBlock = 64;
inline constexpr int64_t kPrefetchAheadBytes = 2048;

template <int64_t kLanes, typename In, typename Out, typename Body>
TESSERA_HD_INLINE void for_each_lane_index_prefetching(int lane, int64_t n, const In* in, const Out* out,
                                                       const Body& body) {
  constexpr int64_t kBlock = kPrefetchBlock * kLanes;
  for (int64_t begin = 0; begin < n; begin += kBlock) {
    prefetch_bytes(reinterpret_cast<uintptr_t>(in + begin) + kPrefetchAheadBytes, kBlock * int64_t(sizeof(In)), false);
    if (static_cast<const void*>(out) != static_cast<const void*>(in))
      prefetch_bytes(reinterpret_cast<uintptr_t>(out + begin) + kPrefetchAheadBytes, kBlock * int64_t(sizeof(Out)),
                     true);
    if (begin + kBlock <= n) {  // a whole block: a constant trip count, no vector remainder
      TESSERA_SIMD
      for (int64_t j = lane; j < kBlock; j += kLanes) body(begin + j);
    } else {
      TESSERA_SIMD
      for (int64_t i = begin + lane; i < n; i += kLanes) body(i);
    }
  }
}

}  // namespace tessera

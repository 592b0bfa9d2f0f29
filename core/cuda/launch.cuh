// The CUDA launcher of index functors: a grid-stride loop that calls op(i) for
// every i in [0, n) on the given stream. The CPU counterpart is
// cpu_for_each_index in core/parallel_for.h; the functor (the math) is the same.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "core/cuda/cuda_check.h"

namespace tessera::cuda {

template <typename Op>
__global__ void for_each_index_kernel(int64_t n, Op op) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) op(i);
}

template <typename Op>
void for_each_index(int64_t n, const Op& op, cudaStream_t stream) {
  if (n <= 0) return;
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, int64_t(65535) * 8);
  for_each_index_kernel<<<unsigned(blocks), kThreads, 0, stream>>>(n, op);
  TESSERA_CUDA_CHECK_LAUNCH();
}

}  // namespace tessera::cuda

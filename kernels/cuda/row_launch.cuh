// The CUDA launcher of row functors (see kernels/functors/row_group.h): one
// warp per row, the 32 lanes reducing with shuffles. The CPU runs the same
// functors with SerialGroup, one row per loop iteration.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "core/cuda/cuda_check.h"
#include "core/host_device.h"

namespace tessera::cuda {

struct WarpGroup {
  static TESSERA_HD constexpr int size() { return 32; }
  // Host bodies exist only so the functors' __host__ __device__ templates
  // compile for the host too; a WarpGroup is only ever used on the device.
  TESSERA_HD int lane() const {
#if TESSERA_ON_DEVICE
    return int(threadIdx.x & 31u);
#else
    return 0;
#endif
  }
  TESSERA_HD float sum(float v) const {
#if TESSERA_ON_DEVICE
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
#endif
    return v;
  }
  TESSERA_HD float max(float v) const {
#if TESSERA_ON_DEVICE
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
#endif
    return v;
  }
};

template <typename Op>
__global__ void for_each_row_kernel(int64_t rows, Op op) {
  const int64_t warps_per_block = blockDim.x / 32;
  const int64_t stride = int64_t(gridDim.x) * warps_per_block;
  for (int64_t row = int64_t(blockIdx.x) * warps_per_block + threadIdx.x / 32; row < rows; row += stride)
    op(WarpGroup{}, row);
}

// Runs op(group, row) for every row in [0, rows), one warp per row.
template <typename Op>
void for_each_row(int64_t rows, const Op& op, cudaStream_t stream) {
  if (rows <= 0) return;
  constexpr int kWarpsPerBlock = 8;
  const int64_t blocks = std::min<int64_t>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock, int64_t(65535) * 4);
  for_each_row_kernel<<<unsigned(blocks), kWarpsPerBlock * 32, 0, stream>>>(rows, op);
  TESSERA_CUDA_CHECK_LAUNCH();
}

}  // namespace tessera::cuda

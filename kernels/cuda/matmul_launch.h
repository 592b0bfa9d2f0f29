// Launchers of the matmul family's functors (kernels/functors/matmul.h) on a
// CUDA stream, defined in kernels/cuda/matmul.cu and called by the cuBLASLt
// host code in kernels/cuda/matmul.cpp around its GEMMs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.h"
#include "kernels/ops.h"

namespace tessera::cuda {

// y = act(x + beta·y + bias) over `rows` rows of `cols` (x f32, may be y when
// y is f32; y, bias and pre of y_dtype; bias and pre may be null).
void launch_matmul_epilogue(const float* x, void* y, DType y_dtype, const void* bias, void* pre,
                            ops::Activation activation, float beta, int64_t rows, int64_t cols, cudaStream_t stream);
// y[i] = x[i] rounded to `dtype` (f32 → bf16/f16, or a copy for f32).
void launch_narrow_f32(const float* x, void* y, DType dtype, int64_t numel, cudaStream_t stream);
// y[i] = beta·y[i] (0 when beta is 0).
void launch_scale(void* y, DType dtype, int64_t numel, float beta, cudaStream_t stream);

}  // namespace tessera::cuda

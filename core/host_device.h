// Marks functions that compile for both the host compiler and nvcc. The math
// of every elementwise, row-wise and optimizer operator is written once with
// these markers; CPU loops and CUDA kernels both call it.
#pragma once

#if defined(__CUDACC__)
#define TESSERA_HD __host__ __device__ __forceinline__
#define TESSERA_DEVICE_CODE 1
#else
#define TESSERA_HD inline
#define TESSERA_DEVICE_CODE 0
#endif

// True while nvcc compiles the device side of a translation unit.
#if defined(__CUDA_ARCH__)
#define TESSERA_ON_DEVICE 1
#else
#define TESSERA_ON_DEVICE 0
#endif

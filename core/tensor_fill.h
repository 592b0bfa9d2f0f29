// Fill launchers for the CUDA backend, called by Tensor::fill_ and the random
// initialisers; implemented by core/cuda/tensor_fill.cu (or throwing stubs in
// core/no_cuda/ when the backend is not built). The CPU versions live in
// core/tensor.cpp; both run the functors of core/fill_functors.h.
#pragma once

#include <cstdint>

#include "core/dtype.h"

namespace tessera::detail {

void cuda_fill_constant(void* data, DType dtype, int64_t count, double value, int device, void* stream);
void cuda_fill_uniform(void* data, DType dtype, int64_t count, uint64_t seed, uint64_t rng_stream, uint64_t first_index,
                       float low, float high, int device, void* stream);
void cuda_fill_normal(void* data, DType dtype, int64_t count, uint64_t seed, uint64_t rng_stream, uint64_t first_index,
                      float mean, float stddev, int device, void* stream);

}  // namespace tessera::detail

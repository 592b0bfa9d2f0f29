// CUDA launchers for Tensor::fill_ and the random initialisers (the functors
// are in core/fill_functors.h, shared with the CPU).
#include "core/cuda/launch.cuh"
#include "core/cuda_runtime.h"
#include "core/fill_functors.h"
#include "core/tensor_fill.h"

namespace tessera::detail {

void cuda_fill_constant(void* data, DType dtype, int64_t count, double value, int device, void* stream) {
  cuda_runtime::set_device(device);
  auto s = static_cast<cudaStream_t>(stream);
  dispatch_any(dtype, [&](auto tag) {
    using T = decltype(tag);
    cuda::for_each_index(count, FillConstant<T>{static_cast<T*>(data), scalar_as<T>(value)}, s);
  });
}

void cuda_fill_uniform(void* data, DType dtype, int64_t count, uint64_t seed, uint64_t rng_stream, uint64_t first_index,
                       float low, float high, int device, void* stream) {
  cuda_runtime::set_device(device);
  dispatch_float(dtype, "uniform_", [&](auto tag) {
    using T = decltype(tag);
    cuda::for_each_index(count, FillUniform<T>{static_cast<T*>(data), seed, rng_stream, first_index, low, high},
                         static_cast<cudaStream_t>(stream));
  });
}

void cuda_fill_normal(void* data, DType dtype, int64_t count, uint64_t seed, uint64_t rng_stream, uint64_t first_index,
                      float mean, float stddev, int device, void* stream) {
  cuda_runtime::set_device(device);
  dispatch_float(dtype, "normal_", [&](auto tag) {
    using T = decltype(tag);
    cuda::for_each_index(count, FillNormal<T>{static_cast<T*>(data), seed, rng_stream, first_index, mean, stddev},
                         static_cast<cudaStream_t>(stream));
  });
}

}  // namespace tessera::detail

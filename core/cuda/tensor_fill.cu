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
  auto run = [&](auto tag) {
    using T = decltype(tag);
    T converted;
    if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, f16>)
      converted = T(float(value));
    else
      converted = T(value);
    cuda::for_each_index(count, FillConstant<T>{static_cast<T*>(data), converted}, s);
  };
  switch (dtype) {
    case DType::f32:
      run(float{});
      break;
    case DType::bf16:
      run(bf16{});
      break;
    case DType::f16:
      run(f16{});
      break;
    case DType::i32:
      run(int32_t{});
      break;
    case DType::i64:
      run(int64_t{});
      break;
    case DType::u8:
      run(uint8_t{});
      break;
  }
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

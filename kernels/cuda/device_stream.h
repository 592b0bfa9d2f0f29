// Helpers for CUDA launchers: make the tensor's device current and return its
// context's compute stream, where all of an operator's work is queued.
#pragma once

#include <cuda_runtime.h>

#include "core/context.h"
#include "core/cuda/launch.cuh"
#include "core/cuda_runtime.h"
#include "core/tensor.h"

namespace tessera::cuda {

inline cudaStream_t device_stream(const Tensor& t) {
  const Device device = t.device();
  cuda_runtime::set_device(device.index);
  return static_cast<cudaStream_t>(t.context().compute_stream(device).native_handle());
}

}  // namespace tessera::cuda

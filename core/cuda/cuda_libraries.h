// CudaLibraries: the library handles of one GPU, owned by the Context and
// created on first use: cuBLAS, cuBLASLt (with its workspace) and cuDNN, all
// bound to the device's compute stream. RAII: destroyed with the context.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cudnn.h>

#include <cstddef>

#include "core/tensor.h"

namespace tessera {

class Context;

class CudaLibraries {
 public:
  CudaLibraries(Context& context, int device);
  ~CudaLibraries();
  CudaLibraries(const CudaLibraries&) = delete;
  CudaLibraries& operator=(const CudaLibraries&) = delete;

  int device() const { return device_; }
  cudaStream_t stream() const { return stream_; }
  cublasHandle_t cublas();
  cublasLtHandle_t cublaslt();
  cudnnHandle_t cudnn();
  // A scratch buffer of at least `bytes` on this device (grown on demand; one
  // per device, so callers on the compute stream may reuse it freely).
  void* workspace(size_t bytes);
  size_t workspace_bytes() const { return workspace_.nbytes(); }

 private:
  Context& context_;
  int device_;
  cudaStream_t stream_;
  cublasHandle_t cublas_ = nullptr;
  cublasLtHandle_t cublaslt_ = nullptr;
  cudnnHandle_t cudnn_ = nullptr;
  Tensor workspace_;
};

}  // namespace tessera

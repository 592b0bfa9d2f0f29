// CudaLibraries: the library handles of one GPU, owned by the Context and
// created on first use: cuBLAS, cuBLASLt (with its workspace) and cuDNN, all
// bound to the device's compute stream, and the cache of cuBLASLt's algorithm
// choices (core/gemm_algorithm_cache.h). RAII: destroyed with the context.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cudnn.h>

#include <cstddef>

#include "core/gemm_algorithm_cache.h"
#include "core/tensor.h"

namespace tessera {

class Context;

// cuBLASLt's answer for one GEMM: its algorithm, or found == false with the
// heuristic's status when it had none.
struct LtMatmulAlgorithm {
  cublasLtMatmulAlgo_t algo{};
  bool found = false;
  cublasStatus_t status = CUBLAS_STATUS_SUCCESS;
};

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
  // The heuristic's choices on this device so far, by GEMM (kernels/cuda/matmul.cpp).
  GemmAlgorithmCache<LtMatmulAlgorithm>& gemm_algorithms() { return gemm_algorithms_; }

 private:
  Context& context_;
  int device_;
  cudaStream_t stream_;
  cublasHandle_t cublas_ = nullptr;
  cublasLtHandle_t cublaslt_ = nullptr;
  cudnnHandle_t cudnn_ = nullptr;
  Tensor workspace_;
  GemmAlgorithmCache<LtMatmulAlgorithm> gemm_algorithms_;
};

}  // namespace tessera

// Check macros for the CUDA runtime, cuBLAS/cuBLASLt and cuDNN: on failure they
// throw tessera::Error naming the library, the status, the statement,
// file:line and the current device. Only for files compiled in CUDA builds.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <cudnn.h>

#include <optional>
#include <string>

#include "core/error.h"

namespace tessera::detail {

inline std::optional<Device> current_cuda_device() {
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) return std::nullopt;
  return Device::cuda(device);
}

const char* cublas_status_name(cublasStatus_t status);

}  // namespace tessera::detail

#define TESSERA_CUDA_CHECK(expr)                                                                                     \
  do {                                                                                                               \
    const cudaError_t tessera_status_ = (expr);                                                                      \
    if (tessera_status_ != cudaSuccess) [[unlikely]] {                                                               \
      (void)cudaGetLastError(); /* clear a non-sticky error so the next call does not see it */                      \
      ::tessera::throw_error(::tessera::ErrorSite{"CUDA", tessera_status_, cudaGetErrorName(tessera_status_), #expr, \
                                                  __FILE__, __LINE__, ::tessera::detail::current_cuda_device()},     \
                             cudaGetErrorString(tessera_status_));                                                   \
    }                                                                                                                \
  } while (0)

// After a kernel launch: reports launch-configuration errors at the launch site.
#define TESSERA_CUDA_CHECK_LAUNCH() TESSERA_CUDA_CHECK(cudaPeekAtLastError())

#define TESSERA_CUBLAS_CHECK(expr)                                                                                \
  do {                                                                                                            \
    const cublasStatus_t tessera_status_ = (expr);                                                                \
    if (tessera_status_ != CUBLAS_STATUS_SUCCESS) [[unlikely]]                                                    \
      ::tessera::throw_error(                                                                                     \
          ::tessera::ErrorSite{"cuBLAS", tessera_status_, ::tessera::detail::cublas_status_name(tessera_status_), \
                               #expr, __FILE__, __LINE__, ::tessera::detail::current_cuda_device()},              \
          "cuBLAS call failed");                                                                                  \
  } while (0)

#define TESSERA_CUDNN_CHECK(expr)                                                                               \
  do {                                                                                                          \
    const cudnnStatus_t tessera_status_ = (expr);                                                               \
    if (tessera_status_ != CUDNN_STATUS_SUCCESS) [[unlikely]] {                                                 \
      char tessera_detail_[512] = {0};                                                                          \
      cudnnGetLastErrorString(tessera_detail_, sizeof tessera_detail_);                                         \
      ::tessera::throw_error(                                                                                   \
          ::tessera::ErrorSite{"cuDNN", tessera_status_, cudnnGetErrorString(tessera_status_), #expr, __FILE__, \
                               __LINE__, ::tessera::detail::current_cuda_device()},                             \
          tessera_detail_[0] ? std::string(tessera_detail_) : std::string("cuDNN call failed"));                \
    }                                                                                                           \
  } while (0)

// TESSERA_NCCL_CHECK: throws tessera::Error with NCCL's error name and its
// last error message when an NCCL call fails. CUDA builds only.
#pragma once

#include <nccl.h>

#include <string>

#include "core/cuda/cuda_check.h"

#define TESSERA_NCCL_CHECK(expr)                                                                              \
  do {                                                                                                        \
    const ncclResult_t tessera_status_ = (expr);                                                              \
    if (tessera_status_ != ncclSuccess && tessera_status_ != ncclInProgress) [[unlikely]] {                   \
      const char* tessera_last_ = ncclGetLastError(nullptr);                                                  \
      ::tessera::throw_error(                                                                                 \
          ::tessera::ErrorSite{"NCCL", tessera_status_, ncclGetErrorString(tessera_status_), #expr, __FILE__, \
                               __LINE__, ::tessera::detail::current_cuda_device()},                           \
          (tessera_last_ && *tessera_last_) ? std::string(tessera_last_) : std::string("NCCL call failed"));  \
    }                                                                                                         \
  } while (0)

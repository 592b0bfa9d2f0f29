// CudaLibraries: lazily created cuBLAS/cuBLASLt/cuDNN handles and workspace.
#include "core/cuda/cuda_libraries.h"

#include <sstream>
#include <string>

#include "core/context.h"
#include "core/cuda/cuda_check.h"
#include "core/cuda_runtime.h"

namespace tessera {

CudaLibraries::CudaLibraries(Context& context, int device)
    : context_(context),
      device_(device),
      stream_(static_cast<cudaStream_t>(context.compute_stream(Device::cuda(device)).native_handle())) {}

CudaLibraries::~CudaLibraries() {
  // Destructors never throw: failures here can only be reported, not handled.
  if (cudaSetDevice(device_) != cudaSuccess) return;
  if (cudnn_) (void)cudnnDestroy(cudnn_);
  if (cublaslt_) (void)cublasLtDestroy(cublaslt_);
  if (cublas_) (void)cublasDestroy(cublas_);
}

cublasHandle_t CudaLibraries::cublas() {
  if (!cublas_) {
    cuda_runtime::set_device(device_);
    TESSERA_CUBLAS_CHECK(cublasCreate(&cublas_));
    TESSERA_CUBLAS_CHECK(cublasSetStream(cublas_, stream_));
  }
  return cublas_;
}

cublasLtHandle_t CudaLibraries::cublaslt() {
  if (!cublaslt_) {
    cuda_runtime::set_device(device_);
    TESSERA_CUBLAS_CHECK(cublasLtCreate(&cublaslt_));
  }
  return cublaslt_;
}

cudnnHandle_t CudaLibraries::cudnn() {
  if (!cudnn_) {
    cuda_runtime::set_device(device_);
    TESSERA_CUDNN_CHECK(cudnnCreate(&cudnn_));
    TESSERA_CUDNN_CHECK(cudnnSetStream(cudnn_, stream_));
  }
  return cudnn_;
}

void* CudaLibraries::workspace(size_t bytes) {
  if (!workspace_.defined() || workspace_.nbytes() < bytes)
    workspace_ = context_.empty(Shape{int64_t(bytes)}, DType::u8, Device::cuda(device_));
  return workspace_.data_ptr();
}

namespace detail {

const char* cublas_status_name(cublasStatus_t status) {
  return cublasGetStatusName(status);
}

CudaLibraries* create_cuda_libraries(Context& context, int device) {
  return new CudaLibraries(context, device);
}

void destroy_cuda_libraries(CudaLibraries* libraries) noexcept {
  delete libraries;
}

std::string describe_cuda_libraries() {
  std::ostringstream out;
  int cublas_version = 0;
  cublasGetProperty(MAJOR_VERSION, &cublas_version);
  int minor = 0;
  cublasGetProperty(MINOR_VERSION, &minor);
  const size_t cudnn = cudnnGetVersion();
  out << "cuBLAS " << cublas_version << "." << minor << ", cuDNN " << cudnn / 10000 << "." << (cudnn % 10000) / 100
      << "." << cudnn % 100;
  return out.str();
}

}  // namespace detail
}  // namespace tessera

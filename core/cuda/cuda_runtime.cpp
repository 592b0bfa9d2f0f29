// core/cuda_runtime.h on the real CUDA runtime (core/device_runtime.cpp adapts
// it to the DeviceRuntime interface).
#include "core/cuda_runtime.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <sstream>

#include "core/cuda/cuda_check.h"

namespace tessera {
namespace cuda_runtime {

bool compiled() {
  return true;
}

int device_count() {
  int count = 0;
  // No driver, or a driver without devices, means zero usable devices: that
  // is an answer, not an error.
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}

std::optional<std::array<unsigned char, 16>> uuid(int device) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return std::nullopt;
  }
  std::array<unsigned char, 16> bytes{};
  std::memcpy(bytes.data(), prop.uuid.bytes, bytes.size());
  return bytes;
}

std::string describe() {
  int runtime = 0, driver = 0;
  cudaRuntimeGetVersion(&runtime);
  if (cudaDriverGetVersion(&driver) != cudaSuccess) driver = 0;
  (void)cudaGetLastError();
  std::ostringstream out;
  out << "runtime " << runtime / 1000 << "." << (runtime % 1000) / 10 << ", driver ";
  if (driver)
    out << driver / 1000 << "." << (driver % 1000) / 10;
  else
    out << "none";
  const int count = device_count();
  out << ", " << count << " device(s)";
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) == cudaSuccess)
      out << "; cuda:" << i << " " << prop.name << " sm_" << prop.major << prop.minor << " "
          << prop.totalGlobalMem / (1 << 20) << " MiB";
  }
  return out.str();
}

void set_device(int device) {
  TESSERA_CUDA_CHECK(cudaSetDevice(device));
}

void* stream_create(int device) {
  set_device(device);
  cudaStream_t stream = nullptr;
  TESSERA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  return stream;
}

void stream_destroy(void* stream) noexcept {
  (void)cudaStreamDestroy(static_cast<cudaStream_t>(stream));
}

void stream_synchronize(void* stream) {
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
}

void* event_create(int device, bool timing) {
  set_device(device);
  cudaEvent_t event = nullptr;
  TESSERA_CUDA_CHECK(cudaEventCreateWithFlags(&event, timing ? cudaEventDefault : cudaEventDisableTiming));
  return event;
}

void event_destroy(void* event) noexcept {
  (void)cudaEventDestroy(static_cast<cudaEvent_t>(event));
}

void event_record(void* event, void* stream) {
  TESSERA_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream)));
}

void stream_wait_event(void* stream, void* event) {
  TESSERA_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event), 0));
}

void event_synchronize(void* event) {
  TESSERA_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event)));
}

bool event_query(void* event) {
  const cudaError_t status = cudaEventQuery(static_cast<cudaEvent_t>(event));
  if (status == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  TESSERA_CUDA_CHECK(status);
  return true;
}

float event_elapsed_ms(void* start, void* end) {
  float ms = 0;
  TESSERA_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start), static_cast<cudaEvent_t>(end)));
  return ms;
}

void* device_malloc(int device, size_t bytes) {
  set_device(device);
  void* ptr = nullptr;
  const cudaError_t status = cudaMalloc(&ptr, bytes);
  if (status == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    return nullptr;
  }
  TESSERA_CUDA_CHECK(status);
  return ptr;
}

void device_free(int device, void* ptr) noexcept {
  if (cudaSetDevice(device) == cudaSuccess) (void)cudaFree(ptr);
}

void* pinned_malloc(size_t bytes) {
  void* ptr = nullptr;
  const cudaError_t status = cudaHostAlloc(&ptr, bytes, cudaHostAllocPortable);
  if (status == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    return nullptr;
  }
  TESSERA_CUDA_CHECK(status);
  return ptr;
}

void pinned_free(void* ptr) noexcept {
  (void)cudaFreeHost(ptr);
}

void memcpy_async(void* dst, const void* src, size_t bytes, void* stream) {
  TESSERA_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream)));
}

}  // namespace cuda_runtime
}  // namespace tessera

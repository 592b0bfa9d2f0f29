// Context: the one object that owns the process's compute resources (devices,
// their compute streams, allocators, and library handles: oneDNN on the CPU,
// cuBLAS/cuBLASLt/cuDNN on each GPU; the emulated accelerator's devices, whose
// kernels are the CPU's, core/device.h). There is no other global mutable state:
// everything that needs a resource gets it from a Context, passed by
// reference or reached through a tensor (tensor.context()).
//
// Resources are created on first use, so a Context is cheap to make and never
// touches a GPU it is not asked for.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "core/device.h"
#include "core/dtype.h"
#include "core/shape.h"
#include "core/stream.h"
#include "core/tensor.h"

namespace tessera {

class CpuLibraries;   // core/cpu_libraries.h
class CudaLibraries;  // core/cuda/cuda_libraries.h (CUDA builds only)

struct ContextOptions {
  int cpu_threads = 0;         // CPU worker threads; 0 leaves OpenMP's default (OMP_NUM_THREADS, else all cores)
  size_t host_alignment = 64;  // bytes; a cache line, and an AVX-512 vector
  CachingOptions caching;      // the caching allocators' policy (host and devices)
  // How long teardown waits for a device's queued work before leaving it
  // (and that device's memory, device and pinned, unreturned: freeing either
  // waits for the device).
  std::chrono::milliseconds drain_timeout{60'000};
};

class Context {
 public:
  explicit Context(ContextOptions options = {});
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  // Tensor factories.
  Tensor empty(const Shape& shape, DType dtype, Device device = Device::cpu());
  Tensor zeros(const Shape& shape, DType dtype, Device device = Device::cpu());
  Tensor full(const Shape& shape, DType dtype, double value, Device device = Device::cpu());
  // A tensor holding a copy of `values` (converted element by element to `dtype`).
  Tensor from_doubles(const Shape& shape, DType dtype, std::span<const double> values, Device device = Device::cpu());
  template <typename T>
  Tensor from_vector(const Shape& shape, const std::vector<T>& values, Device device = Device::cpu());

  // Resources, created on first use.
  Allocator& allocator(Device device) { return *shared_allocator(device); }
  std::shared_ptr<Allocator> shared_allocator(Device device);
  // Page-locked host memory for copies to and from devices of `device`'s kind.
  Allocator& pinned_allocator(Device device);
  const Stream& compute_stream(Device device);
  void synchronize(Device device);  // waits for all work queued on the device's compute stream
  CpuLibraries& cpu_libraries();
  CudaLibraries& cuda_libraries(int device);

  int cuda_device_count() const { return cuda_device_count_; }
  // Devices of `device`'s kind that this process can use (1 for the CPU).
  int device_count(Device device) const;

  // The name of the last operation dispatched to `device` (kernels/ops), for
  // reports of asynchronous device faults; "" when none.
  void note_operation(Device device, const char* name);
  std::string last_operation(Device device) const;
  int cpu_threads() const;
  const ContextOptions& options() const { return options_; }
  std::string describe() const;  // one line per device and library, for start-up logs

 private:
  struct DeviceSlot;
  DeviceSlot& slot(Device device);
  DeviceSlot* find_slot(Device device) const;
  // At teardown: waits (at most options_.drain_timeout) for the device's queued work;
  // false when it left it (timed out, or a device fault), its memory abandoned.
  bool drain(Device device, DeviceSlot& slot) noexcept;

  ContextOptions options_;
  int cuda_device_count_ = 0;
  mutable std::mutex mutex_;
  std::unique_ptr<DeviceSlot> cpu_slot_;
  std::vector<std::unique_ptr<DeviceSlot>> cuda_slots_, emulated_slots_;
  std::shared_ptr<Allocator> cuda_pinned_, emulated_pinned_;
  std::unique_ptr<CpuLibraries> cpu_libraries_;
};

template <typename T>
Tensor Context::from_vector(const Shape& shape, const std::vector<T>& values, Device device) {
  TESSERA_CHECK(int64_t(values.size()) == shape.numel(), "from_vector: ", values.size(), " values for shape ",
                shape.to_string());
  Tensor host = empty(shape, dtype_v<T>, Device::cpu());
  std::copy(values.begin(), values.end(), host.data<T>());
  return device.is_cpu() ? host : host.to(device);
}

}  // namespace tessera

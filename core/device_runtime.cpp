// device_runtime(): the runtime of each accelerator kind. CUDA's is the thin
// adapter below over core/cuda_runtime.h (the real runtime in CUDA builds, the
// throwing stand-ins otherwise); the emulated one is core/emulated_runtime.cpp.
#include "core/device_runtime.h"

#include "core/cuda_runtime.h"
#include "core/emulated_runtime.h"
#include "core/error.h"

namespace tessera {
namespace {

class CudaRuntime final : public DeviceRuntime {
 public:
  int device_count() override { return cuda_runtime::device_count(); }
  std::string describe() override { return cuda_runtime::describe(); }
  void set_device(int device) override { cuda_runtime::set_device(device); }
  void* stream_create(int device) override { return cuda_runtime::stream_create(device); }
  void stream_destroy(void* stream) noexcept override { cuda_runtime::stream_destroy(stream); }
  void stream_synchronize(void* stream) override { cuda_runtime::stream_synchronize(stream); }
  void* event_create(int device, bool timing) override { return cuda_runtime::event_create(device, timing); }
  void event_destroy(void* event) noexcept override { cuda_runtime::event_destroy(event); }
  void event_record(void* event, void* stream) override { cuda_runtime::event_record(event, stream); }
  void stream_wait_event(void* stream, void* event) override { cuda_runtime::stream_wait_event(stream, event); }
  void event_synchronize(void* event) override { cuda_runtime::event_synchronize(event); }
  bool event_query(void* event) override { return cuda_runtime::event_query(event); }
  float event_elapsed_ms(void* start, void* end) override { return cuda_runtime::event_elapsed_ms(start, end); }
  void* device_malloc(int device, size_t bytes) override { return cuda_runtime::device_malloc(device, bytes); }
  void device_free(int device, void* ptr) noexcept override { cuda_runtime::device_free(device, ptr); }
  void* pinned_malloc(size_t bytes) override { return cuda_runtime::pinned_malloc(bytes); }
  void pinned_free(void* ptr) noexcept override { cuda_runtime::pinned_free(ptr); }
  void memcpy_async(void* dst, const void* src, size_t bytes, void* stream) override {
    cuda_runtime::memcpy_async(dst, src, bytes, stream);
  }
};

}  // namespace

DeviceRuntime& device_runtime(Device device) {
  static CudaRuntime cuda;
  switch (device.type) {
    case DeviceType::cuda:
      return cuda;
    case DeviceType::emulated:
      return emulated::runtime();
    case DeviceType::cpu:
      break;
  }
  TESSERA_THROW("device_runtime: the CPU has no device runtime (work on it runs inline)");
}

bool is_device_fault(const Error& error) {
  if (error.library() == emulated::kLibrary) return error.code() == 700;
  if (error.library() != "CUDA") return false;
  // cudaErrorECCUncorrectable, IllegalAddress, LaunchTimeout, Assert,
  // HardwareStackError, IllegalInstruction, MisalignedAddress,
  // InvalidAddressSpace, InvalidPc, LaunchFailure (driver_types.h).
  for (const long long sticky : {214, 700, 702, 710, 714, 715, 716, 717, 718, 719})
    if (error.code() == sticky) return true;
  return false;
}

void bind_thread_to_device(Device device) {
  if (device.is_accelerator()) device_runtime(device).set_device(device.index);
}

}  // namespace tessera

// Context: lazily created per-device resources and tensor factories.
#include "core/context.h"

#include <omp.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <exception>
#include <sstream>
#include <thread>

#include "core/cpu_libraries.h"
#include "core/cuda_runtime.h"
#include "core/device_runtime.h"
#include "core/emulated_runtime.h"
#include "core/error.h"

namespace tessera {

// Defined by core/cuda/cuda_libraries.cpp, or by core/no_cuda/ when the CUDA
// backend is not built.
namespace detail {
CudaLibraries* create_cuda_libraries(Context& context, int device);
void destroy_cuda_libraries(CudaLibraries* libraries) noexcept;
std::string describe_cuda_libraries();
}  // namespace detail

struct Context::DeviceSlot {
  explicit DeviceSlot(Stream s) : stream(std::move(s)) {}
  ~DeviceSlot() {
    if (libraries) detail::destroy_cuda_libraries(libraries);
  }
  Stream stream;
  std::shared_ptr<Allocator> allocator;
  CudaLibraries* libraries = nullptr;
  std::atomic<const char*> last_operation{nullptr};
};

Context::Context(ContextOptions options) : options_(options) {
  if (options_.cpu_threads > 0) omp_set_num_threads(options_.cpu_threads);
  cuda_device_count_ = cuda_runtime::device_count();
  cuda_slots_.resize(size_t(cuda_device_count_));
  emulated_slots_.resize(size_t(emulated::kDeviceCount));
}

// Queued device work is drained (bounded, see drain()) before streams and
// memory go away. A context destroyed while an exception unwinds the stack
// belongs to a failing process: it waits for nothing and returns no device
// memory (freeing waits for the device), so the error reaches main() and the
// launcher instead of hanging here.
Context::~Context() {
  const bool failing = std::uncaught_exceptions() > 0;
  bool cuda_left = false, emulated_left = false;  // a device whose queued work was left behind
  for (auto* slots : {&cuda_slots_, &emulated_slots_}) {
    for (size_t index = 0; index < slots->size(); ++index) {
      DeviceSlot* s = (*slots)[index].get();
      if (!s) continue;
      const bool left = failing ? (s->allocator->abandon(), true) : !drain(s->stream.device(), *s);
      if (left) (s->stream.device().is_cuda() ? cuda_left : emulated_left) = true;
    }
  }
  // Pinned host memory goes with its devices: cudaFreeHost waits for the
  // device, so after work was left queued (or a fault) it is not returned
  // either, and the process reaches MPI_Finalize instead of hanging here.
  if (cuda_left && cuda_pinned_) cuda_pinned_->abandon();
  if (emulated_left && emulated_pinned_) emulated_pinned_->abandon();
}

bool Context::drain(Device device, DeviceSlot& s) noexcept {
  try {
    bind_thread_to_device(device);
    Event done(device);
    done.record(s.stream);
    const auto deadline = std::chrono::steady_clock::now() + options_.drain_timeout;
    while (!done.ready()) {
      if (std::chrono::steady_clock::now() > deadline) {
        std::fprintf(stderr,
                     "tessera: %s still had work queued %.0f s after the program ended (a communication that never "
                     "finished?); leaving it\n",
                     device.to_string().c_str(), std::chrono::duration<double>(options_.drain_timeout).count());
        s.allocator->abandon();
        return false;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return true;
  } catch (const std::exception& error) {  // a device fault: its memory cannot be freed either
    std::fprintf(stderr, "tessera: %s failed at teardown: %s\n", device.to_string().c_str(), error.what());
    s.allocator->abandon();
    return false;
  }
}

int Context::device_count(Device device) const {
  switch (device.type) {
    case DeviceType::cpu:
      return 1;
    case DeviceType::cuda:
      return cuda_device_count_;
    case DeviceType::emulated:
      return emulated::kDeviceCount;
  }
  return 0;
}

Context::DeviceSlot& Context::slot(Device device) {
  std::lock_guard lock(mutex_);
  if (device.is_cpu()) {
    if (!cpu_slot_) {
      cpu_slot_ = std::make_unique<DeviceSlot>(Stream::cpu());
      cpu_slot_->allocator = std::make_shared<CachingAllocator>(
          device, make_aligned_host_memory(options_.host_alignment), options_.caching);
    }
    return *cpu_slot_;
  }
  if (device.is_cuda())
    TESSERA_CHECK_ON(device, cuda_runtime::compiled(), "tensor on ", device.to_string(),
                     " but this Tessera was built without the CUDA backend; rebuild with -DTESSERA_CUDA=ON");
  const int count = device_count(device);
  TESSERA_CHECK_ON(device, device.index >= 0 && device.index < count, "no device ", device.to_string(),
                   ": this machine has ", count, device.is_cuda() ? " CUDA device(s)" : " emulated device(s)");
  auto& entry = (device.is_cuda() ? cuda_slots_ : emulated_slots_)[size_t(device.index)];
  if (!entry) {
    entry = std::make_unique<DeviceSlot>(Stream::create(device));
    entry->allocator = std::make_shared<CachingAllocator>(device, make_device_memory(device), options_.caching);
  }
  return *entry;
}

Context::DeviceSlot* Context::find_slot(Device device) const {
  std::lock_guard lock(mutex_);
  if (device.is_cpu()) return cpu_slot_.get();
  const auto& slots = device.is_cuda() ? cuda_slots_ : emulated_slots_;
  if (device.index < 0 || size_t(device.index) >= slots.size()) return nullptr;
  return slots[size_t(device.index)].get();
}

std::shared_ptr<Allocator> Context::shared_allocator(Device device) {
  return slot(device).allocator;
}

Allocator& Context::pinned_allocator(Device device) {
  TESSERA_CHECK(device.is_accelerator(), "pinned_allocator: pinned host memory serves copies to devices, not to ",
                device.to_string());
  std::lock_guard lock(mutex_);
  std::shared_ptr<Allocator>& pinned = device.is_cuda() ? cuda_pinned_ : emulated_pinned_;
  if (!pinned)
    pinned = std::make_shared<CachingAllocator>(Device::cpu(), make_pinned_host_memory(device), options_.caching);
  return *pinned;
}

const Stream& Context::compute_stream(Device device) {
  return slot(device).stream;
}

void Context::synchronize(Device device) {
  slot(device).stream.synchronize();
}

void Context::note_operation(Device device, const char* name) {
  if (DeviceSlot* s = find_slot(device)) s->last_operation.store(name, std::memory_order_relaxed);
}

std::string Context::last_operation(Device device) const {
  const DeviceSlot* s = find_slot(device);
  const char* name = s ? s->last_operation.load(std::memory_order_relaxed) : nullptr;
  return name ? name : "";
}

CpuLibraries& Context::cpu_libraries() {
  std::lock_guard lock(mutex_);
  if (!cpu_libraries_) cpu_libraries_ = std::make_unique<CpuLibraries>();
  return *cpu_libraries_;
}

CudaLibraries& Context::cuda_libraries(int device) {
  DeviceSlot& s = slot(Device::cuda(device));
  std::lock_guard lock(mutex_);
  if (!s.libraries) s.libraries = detail::create_cuda_libraries(*this, device);
  return *s.libraries;
}

int Context::cpu_threads() const {
  return omp_get_max_threads();
}

std::string Context::describe() const {
  std::ostringstream out;
  out << "cpu: " << omp_get_max_threads() << " OpenMP threads";
  out << "; cuda: " << cuda_runtime::describe();
  if (cuda_runtime::compiled()) out << "; " << detail::describe_cuda_libraries();
  return out.str();
}

Tensor Context::empty(const Shape& shape, DType dtype, Device device) {
  DeviceSlot& s = slot(device);
  const size_t bytes = size_t(shape.numel()) * dtype_size(dtype);
  auto storage = std::make_shared<Storage>(*this, s.allocator, bytes, s.stream.native_handle());
  return Tensor(std::move(storage), 0, shape, dtype);
}

Tensor Context::zeros(const Shape& shape, DType dtype, Device device) {
  return full(shape, dtype, 0.0, device);
}

Tensor Context::full(const Shape& shape, DType dtype, double value, Device device) {
  Tensor t = empty(shape, dtype, device);
  t.fill_(value);
  return t;
}

Tensor Context::from_doubles(const Shape& shape, DType dtype, std::span<const double> values, Device device) {
  TESSERA_CHECK(int64_t(values.size()) == shape.numel(), "from_doubles: ", values.size(), " values for shape ",
                shape.to_string());
  Tensor host = empty(shape, dtype, Device::cpu());
  dispatch_any(dtype, [&](auto tag) {
    using T = decltype(tag);
    T* data = host.data<T>();
    for (size_t i = 0; i < values.size(); ++i) data[i] = scalar_as<T>(values[i]);
  });
  return device.is_cpu() ? host : host.to(device);
}

}  // namespace tessera

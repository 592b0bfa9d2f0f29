// Context: lazily created per-device resources and tensor factories.
#include "core/context.h"

#include <omp.h>

#include <sstream>

#include "core/cpu_libraries.h"
#include "core/cuda_runtime.h"
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
};

Context::Context(ContextOptions options) : options_(options) {
  if (options_.cpu_threads > 0) omp_set_num_threads(options_.cpu_threads);
  cuda_device_count_ = cuda_runtime::device_count();
  cuda_slots_.resize(size_t(cuda_device_count_));
}

Context::~Context() {
  // Drain queued GPU work before streams and memory go away.
  for (auto& slot : cuda_slots_)
    if (slot) {
      try {
        slot->stream.synchronize();
      } catch (...) {  // destructors never throw; the error was already reported by the work that failed
      }
    }
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
  TESSERA_CHECK_ON(device, cuda_runtime::compiled(), "tensor on ", device.to_string(),
                   " but this Tessera was built without the CUDA backend; rebuild with -DTESSERA_CUDA=ON");
  TESSERA_CHECK_ON(device, device.index >= 0 && device.index < cuda_device_count_, "no device ", device.to_string(),
                   ": this machine has ", cuda_device_count_, " CUDA device(s)");
  auto& entry = cuda_slots_[size_t(device.index)];
  if (!entry) {
    entry = std::make_unique<DeviceSlot>(Stream::create(device));
    entry->allocator =
        std::make_shared<CachingAllocator>(device, make_cuda_device_memory(device.index), options_.caching);
  }
  return *entry;
}

std::shared_ptr<Allocator> Context::shared_allocator(Device device) {
  return slot(device).allocator;
}

Allocator& Context::pinned_allocator() {
  std::lock_guard lock(mutex_);
  if (!pinned_allocator_)
    pinned_allocator_ = std::make_shared<CachingAllocator>(Device::cpu(), make_pinned_host_memory(), options_.caching);
  return *pinned_allocator_;
}

const Stream& Context::compute_stream(Device device) {
  return slot(device).stream;
}

void Context::synchronize(Device device) {
  slot(device).stream.synchronize();
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

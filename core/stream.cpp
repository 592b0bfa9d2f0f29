// Stream and Event: CPU versions inline, CUDA versions through core/cuda_runtime.h.
#include "core/stream.h"

#include <utility>

#include "core/cuda_runtime.h"

namespace tessera {

Stream Stream::create(Device device) {
  if (device.is_cpu()) return cpu();
  return Stream(device, cuda_runtime::stream_create(device.index));
}

Stream::Stream(Stream&& other) noexcept : device_(other.device_), handle_(std::exchange(other.handle_, nullptr)) {}

Stream& Stream::operator=(Stream&& other) noexcept {
  if (this != &other) {
    if (handle_) cuda_runtime::stream_destroy(handle_);
    device_ = other.device_;
    handle_ = std::exchange(other.handle_, nullptr);
  }
  return *this;
}

Stream::~Stream() {
  if (handle_) cuda_runtime::stream_destroy(handle_);
}

void Stream::synchronize() const {
  if (device_.is_cuda()) cuda_runtime::stream_synchronize(handle_);
}

Event::Event(Device device, bool timing) : device_(device) {
  if (device.is_cuda()) handle_ = cuda_runtime::event_create(device.index, timing);
}

Event::Event(Event&& other) noexcept
    : device_(other.device_), handle_(std::exchange(other.handle_, nullptr)), host_time_(other.host_time_) {}

Event& Event::operator=(Event&& other) noexcept {
  if (this != &other) {
    if (handle_) cuda_runtime::event_destroy(handle_);
    device_ = other.device_;
    handle_ = std::exchange(other.handle_, nullptr);
    host_time_ = other.host_time_;
  }
  return *this;
}

Event::~Event() {
  if (handle_) cuda_runtime::event_destroy(handle_);
}

void Event::record(const Stream& stream) {
  if (device_.is_cuda())
    cuda_runtime::event_record(handle_, stream.native_handle());
  else
    host_time_ = std::chrono::steady_clock::now();
}

void Event::wait(const Stream& stream) const {
  if (device_.is_cuda() && stream.device().is_cuda())
    cuda_runtime::stream_wait_event(stream.native_handle(), handle_);
  else if (device_.is_cuda())
    synchronize();  // a CPU stream waits for GPU work on the host
}

void Event::synchronize() const {
  if (device_.is_cuda()) cuda_runtime::event_synchronize(handle_);
}

bool Event::ready() const {
  return device_.is_cpu() || cuda_runtime::event_query(handle_);
}

float Event::elapsed_ms(const Event& later) const {
  if (device_.is_cuda()) return cuda_runtime::event_elapsed_ms(handle_, later.handle_);
  return std::chrono::duration<float, std::milli>(later.host_time_ - host_time_).count();
}

}  // namespace tessera

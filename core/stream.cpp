// Stream and Event: CPU versions inline, accelerator versions (CUDA, emulated)
// through their DeviceRuntime (core/device_runtime.h).
#include "core/stream.h"

#include <utility>

#include "core/device_runtime.h"

namespace tessera {

Stream Stream::create(Device device) {
  if (device.is_cpu()) return cpu();
  return Stream(device, device_runtime(device).stream_create(device.index));
}

Stream::Stream(Stream&& other) noexcept : device_(other.device_), handle_(std::exchange(other.handle_, nullptr)) {}

Stream& Stream::operator=(Stream&& other) noexcept {
  if (this != &other) {
    if (handle_) device_runtime(device_).stream_destroy(handle_);
    device_ = other.device_;
    handle_ = std::exchange(other.handle_, nullptr);
  }
  return *this;
}

Stream::~Stream() {
  if (handle_) device_runtime(device_).stream_destroy(handle_);
}

void Stream::synchronize() const {
  if (device_.is_accelerator()) device_runtime(device_).stream_synchronize(handle_);
}

Event::Event(Device device, bool timing) : device_(device) {
  if (device.is_accelerator()) handle_ = device_runtime(device).event_create(device.index, timing);
}

Event::Event(Event&& other) noexcept
    : device_(other.device_), handle_(std::exchange(other.handle_, nullptr)), host_time_(other.host_time_) {}

Event& Event::operator=(Event&& other) noexcept {
  if (this != &other) {
    if (handle_) device_runtime(device_).event_destroy(handle_);
    device_ = other.device_;
    handle_ = std::exchange(other.handle_, nullptr);
    host_time_ = other.host_time_;
  }
  return *this;
}

Event::~Event() {
  if (handle_) device_runtime(device_).event_destroy(handle_);
}

void Event::record(const Stream& stream) {
  if (device_.is_accelerator())
    device_runtime(device_).event_record(handle_, stream.native_handle());
  else
    host_time_ = std::chrono::steady_clock::now();
}

void Event::wait(const Stream& stream) const {
  if (device_.is_accelerator() && stream.device().type == device_.type)
    device_runtime(device_).stream_wait_event(stream.native_handle(), handle_);
  else if (device_.is_accelerator())
    synchronize();  // a CPU stream (or another kind's) waits for the device on the host
}

void Event::synchronize() const {
  if (device_.is_accelerator()) device_runtime(device_).event_synchronize(handle_);
}

bool Event::ready() const {
  return device_.is_cpu() || device_runtime(device_).event_query(handle_);
}

float Event::elapsed_ms(const Event& later) const {
  if (device_.is_accelerator()) return device_runtime(device_).event_elapsed_ms(handle_, later.handle_);
  return std::chrono::duration<float, std::milli>(later.host_time_ - host_time_).count();
}

}  // namespace tessera

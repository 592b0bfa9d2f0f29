// Streams and events: the order in which work runs on a device. On the CPU,
// work runs inline in the calling thread, so a CPU stream is a no-op object and
// a CPU event is a timestamp. On an accelerator they own its runtime's handles
// (cudaStream_t / cudaEvent_t on CUDA; see core/device_runtime.h).
#pragma once

#include <chrono>

#include "core/device.h"

namespace tessera {

class Stream {
 public:
  static Stream cpu() { return Stream(Device::cpu(), nullptr); }
  static Stream create(Device device);  // a new stream on an accelerator, or the inline CPU stream

  Stream(Stream&& other) noexcept;
  Stream& operator=(Stream&& other) noexcept;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream();

  Device device() const { return device_; }
  void* native_handle() const { return handle_; }  // the runtime's handle (cudaStream_t), nullptr on the CPU
  void synchronize() const;                        // wait until all work queued so far is done

 private:
  Stream(Device device, void* handle) : device_(device), handle_(handle) {}
  Device device_;
  void* handle_ = nullptr;
};

class Event {
 public:
  explicit Event(Device device, bool timing = false);
  Event(Event&& other) noexcept;
  Event& operator=(Event&& other) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  ~Event();

  void record(const Stream& stream);      // marks the point after the work queued so far
  void wait(const Stream& stream) const;  // `stream` waits for this event (no host sync)
  void synchronize() const;               // the host waits for this event
  bool ready() const;
  float elapsed_ms(const Event& later) const;  // needs timing = true on both

 private:
  Device device_;
  void* handle_ = nullptr;
  std::chrono::steady_clock::time_point host_time_{};
};

}  // namespace tessera

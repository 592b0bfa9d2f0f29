// DeviceRuntime: what core/ needs from an accelerator's runtime (the calling
// thread's device, streams, events, device and pinned memory, copies), behind
// one interface with two implementations:
//   - CUDA (core/cuda/cuda_runtime.cpp through core/cuda_runtime.h);
//   - the emulated accelerator (core/emulated_runtime.cpp), which follows the
//     same rules on host memory so that the CPU tests run the GPU code paths.
// Streams and events are opaque handles (cudaStream_t / cudaEvent_t on CUDA).
//
// The calling thread's device: like CUDA, every thread has a current device
// (0 until it chooses one), and a runtime call made from a thread whose
// current device is not the one the call is about makes the runtime create a
// context on the current one: hundreds of MiB on GPU 0 for every rank of a
// node. Every thread that touches a device calls bind_thread_to_device() first
// (the loader's worker, the communicators' watchdogs, the main thread).
#pragma once

#include <cstddef>
#include <string>

#include "core/device.h"

namespace tessera {

class Error;

class DeviceRuntime {
 public:
  virtual ~DeviceRuntime() = default;

  virtual int device_count() = 0;
  virtual std::string describe() = 0;  // versions and devices, for logs

  virtual void set_device(int device) = 0;  // the calling thread's current device

  virtual void* stream_create(int device) = 0;  // a non-blocking stream on `device`
  virtual void stream_destroy(void* stream) noexcept = 0;
  virtual void stream_synchronize(void* stream) = 0;

  virtual void* event_create(int device, bool timing) = 0;
  virtual void event_destroy(void* event) noexcept = 0;
  virtual void event_record(void* event, void* stream) = 0;
  virtual void stream_wait_event(void* stream, void* event) = 0;
  virtual void event_synchronize(void* event) = 0;
  virtual bool event_query(void* event) = 0;
  virtual float event_elapsed_ms(void* start, void* end) = 0;

  // nullptr when the device is out of memory (the caching allocator then frees
  // its cache and retries); throws on any other failure.
  virtual void* device_malloc(int device, size_t bytes) = 0;
  virtual void device_free(int device, void* ptr) noexcept = 0;
  // Page-locked host memory for copies to and from this kind of device.
  virtual void* pinned_malloc(size_t bytes) = 0;
  virtual void pinned_free(void* ptr) noexcept = 0;

  // Copies between host and device pointers, ordered on `stream`.
  virtual void memcpy_async(void* dst, const void* src, size_t bytes, void* stream) = 0;
};

// The runtime of an accelerator's kind; throws for the CPU.
DeviceRuntime& device_runtime(Device device);

// Whether `error` is a device's sticky asynchronous fault (an illegal address,
// a kernel that trapped or asserted, an uncorrectable ECC error): the device is
// unusable from then on, and the call that reported it only found it.
bool is_device_fault(const Error& error);

// Makes `device` the calling thread's current device (cudaSetDevice); nothing
// for the CPU. Every thread that touches a device calls it before anything else.
void bind_thread_to_device(Device device);

}  // namespace tessera

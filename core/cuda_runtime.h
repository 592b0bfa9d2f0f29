// The slice of the CUDA runtime that core/ needs (devices, streams, events,
// device and pinned memory, copies), behind plain C++ types so that no public
// header includes cuda_runtime.h. Implemented by core/cuda/cuda_runtime.cpp
// when the CUDA backend is built and by core/no_cuda/cuda_runtime.cpp (which
// reports zero devices and throws on use) when it is not.
#pragma once

#include <array>
#include <cstddef>
#include <optional>
#include <string>

namespace tessera::cuda_runtime {

bool compiled();         // was the CUDA backend built into this library?
int device_count();      // usable devices; 0 without a driver, a device, or the backend
std::string describe();  // runtime/driver versions and devices, for logs

void set_device(int device);
// The device's 16-byte UUID (cudaDeviceProp::uuid: a whole GPU's or, under
// MIG, the slice's; not its PCI address, which a slice shares with its
// parent), for finding it in NVML; nothing when it cannot be had (or without
// the backend).
std::optional<std::array<unsigned char, 16>> uuid(int device);

void* stream_create(int device);  // a non-blocking stream on `device`
void stream_destroy(void* stream) noexcept;
void stream_synchronize(void* stream);

void* event_create(int device, bool timing);
void event_destroy(void* event) noexcept;
void event_record(void* event, void* stream);
void stream_wait_event(void* stream, void* event);
void event_synchronize(void* event);
bool event_query(void* event);
float event_elapsed_ms(void* start, void* end);

// Returns nullptr when the device is out of memory (the caching allocator then
// frees its cache and retries); throws on any other failure.
void* device_malloc(int device, size_t bytes);
void device_free(int device, void* ptr) noexcept;
void* pinned_malloc(size_t bytes);
void pinned_free(void* ptr) noexcept;

// Copies between any host and device pointers (unified addressing), ordered on `stream`.
void memcpy_async(void* dst, const void* src, size_t bytes, void* stream);

}  // namespace tessera::cuda_runtime

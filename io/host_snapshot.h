// HostSnapshot: host copies of a rank's checkpoint pieces, taken as a save
// begins (an asynchronous save writes them while training overwrites the
// pieces). A device piece is copied through one reusable pinned staging
// buffer of at most kSnapshotStagingBytes: pieces are packed into it, copied
// device-to-host as one batch per fill (one stream synchronisation, not one
// per piece), then moved into ordinary pageable host memory. So the pinned
// (page-locked) memory a rank holds for its saves is the buffer alone,
// whatever its shard's size, kept from one save to the next (the second save
// pins nothing new); CPU pieces are copied host to host.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/device.h"
#include "core/tensor.h"

namespace tessera::io {

inline constexpr int64_t kSnapshotStagingBytes = int64_t(64) << 20;

class HostSnapshot {
 public:
  HostSnapshot() = default;
  HostSnapshot(const HostSnapshot&) = delete;
  HostSnapshot& operator=(const HostSnapshot&) = delete;

  // Host copies of `tensors` (same shapes and dtypes), made now; a tensor
  // already on the host is copied too (the caller may overwrite it next).
  std::vector<Tensor> copy(const std::vector<Tensor>& tensors);

  // The pinned staging buffer (undefined before the first device piece).
  const Tensor& staging() const { return staging_; }

 private:
  struct Pending {
    const std::byte* device = nullptr;  // source bytes on the device
    std::byte* host = nullptr;          // destination in pageable host memory
    int64_t bytes = 0, offset = 0;      // and where they sit in the staging buffer
  };
  void stage(const Tensor& device_tensor, Tensor& host);
  void flush();

  Tensor staging_;  // pinned host memory for copies from staging_device_
  Device staging_device_;
  std::vector<Pending> pending_;
  int64_t used_ = 0;  // bytes of staging_ holding pending copies
};

}  // namespace tessera::io

// Storage: one allocation of bytes on one device, shared by every tensor that
// views it. Returns its block to the allocator when the last view goes away.
#pragma once

#include <cstddef>
#include <memory>

#include "core/allocator.h"
#include "core/device.h"

namespace tessera {

class Context;

class Storage {
 public:
  // Allocates `bytes` from `allocator` for use on `stream`.
  Storage(Context& context, std::shared_ptr<Allocator> allocator, size_t bytes, StreamKey stream);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }
  Device device() const { return allocator_->device(); }
  Context& context() const { return *context_; }

 private:
  Context* context_;
  std::shared_ptr<Allocator> allocator_;
  void* data_ = nullptr;
  size_t nbytes_ = 0;
};

}  // namespace tessera

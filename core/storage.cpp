// Storage: allocation and release through the owning allocator.
#include "core/storage.h"

namespace tessera {

Storage::Storage(Context& context, std::shared_ptr<Allocator> allocator, size_t bytes, StreamKey stream)
    : context_(&context), allocator_(std::move(allocator)), nbytes_(bytes) {
  data_ = allocator_->allocate(bytes, stream);
}

Storage::~Storage() {
  allocator_->deallocate(data_);
}

}  // namespace tessera

// CachingAllocator and its memory sources: aligned host memory, and device and
// pinned memory through an accelerator's runtime.
#include "core/allocator.h"

#include <algorithm>
#include <cstdlib>
#include <new>
#include <sstream>
#include <tuple>

#include "core/device_runtime.h"
#include "core/error.h"

namespace tessera {

namespace {
thread_local MemoryUse current_memory_use = MemoryUse::other;
}  // namespace

const char* memory_use_name(MemoryUse use) {
  switch (use) {
    case MemoryUse::parameters:
      return "parameters";
    case MemoryUse::gradients:
      return "gradients";
    case MemoryUse::optimizer:
      return "optimizer";
    case MemoryUse::other:
      break;
  }
  return "other";
}

MemoryUseScope::MemoryUseScope(MemoryUse use) : previous_(current_memory_use) { current_memory_use = use; }
MemoryUseScope::~MemoryUseScope() { current_memory_use = previous_; }
MemoryUse MemoryUseScope::current() { return current_memory_use; }

namespace {

size_t round_up(size_t value, size_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

class AlignedHostMemory final : public MemorySource {
 public:
  explicit AlignedHostMemory(size_t alignment) : alignment_(alignment) {}
  void* allocate(size_t bytes) override { return std::aligned_alloc(alignment_, round_up(bytes, alignment_)); }
  void release(void* ptr, size_t) noexcept override { std::free(ptr); }
  std::string describe() const override { return "host memory aligned to " + std::to_string(alignment_) + " bytes"; }

 private:
  size_t alignment_;
};

class DeviceMemory final : public MemorySource {
 public:
  explicit DeviceMemory(Device device) : device_(device), runtime_(device_runtime(device)) {}
  void* allocate(size_t bytes) override { return runtime_.device_malloc(device_.index, bytes); }
  void release(void* ptr, size_t) noexcept override { runtime_.device_free(device_.index, ptr); }
  std::string describe() const override { return "device memory on " + device_.to_string(); }

 private:
  Device device_;
  DeviceRuntime& runtime_;
};

class PinnedHostMemory final : public MemorySource {
 public:
  explicit PinnedHostMemory(Device kind) : kind_(kind), runtime_(device_runtime(kind)) {}
  void* allocate(size_t bytes) override { return runtime_.pinned_malloc(bytes); }
  void release(void* ptr, size_t) noexcept override { runtime_.pinned_free(ptr); }
  std::string describe() const override {
    return std::string("pinned host memory for ") + (kind_.is_cuda() ? "CUDA (cudaHostAlloc)" : "the emulated device");
  }

 private:
  Device kind_;
  DeviceRuntime& runtime_;
};

}  // namespace

std::unique_ptr<MemorySource> make_device_memory(Device device) {
  return std::make_unique<DeviceMemory>(device);
}

std::unique_ptr<MemorySource> make_pinned_host_memory(Device device) {
  return std::make_unique<PinnedHostMemory>(device);
}

std::unique_ptr<MemorySource> make_aligned_host_memory(size_t alignment) {
  TESSERA_CHECK(alignment >= alignof(std::max_align_t) && (alignment & (alignment - 1)) == 0,
                "host alignment must be a power of two >= ", alignof(std::max_align_t), ", got ", alignment);
  return std::make_unique<AlignedHostMemory>(alignment);
}

bool CachingAllocator::FreeOrder::operator()(const Block* a, const Block* b) const {
  return std::tie(a->small_pool, a->stream, a->size, a->ptr) < std::tie(b->small_pool, b->stream, b->size, b->ptr);
}

CachingAllocator::CachingAllocator(Device device, std::unique_ptr<MemorySource> source, CachingOptions options)
    : device_(device), source_(std::move(source)), options_(options) {
  TESSERA_CHECK(source_ != nullptr, "a caching allocator needs a memory source");
  TESSERA_CHECK(options_.round_bytes > 0 && options_.small_segment_bytes >= options_.small_request_bytes,
                "inconsistent caching allocator options");
}

CachingAllocator::~CachingAllocator() {
  // Blocks still in use at this point belong to tensors that outlived the
  // context; their memory is released with the segments (the tensors must not
  // be used afterwards).
  std::map<char*, size_t> sizes;
  for (Block* block : free_blocks_) sizes[block->segment] = block->segment_size;
  for (auto& [ptr, block] : live_blocks_) sizes[block->segment] = block->segment_size;
  for (Block* block : free_blocks_) delete block;
  for (auto& [ptr, block] : live_blocks_) delete block;
  if (!abandoned_)
    for (auto& [segment, size] : sizes) source_->release(segment, size);
}

void CachingAllocator::abandon() noexcept {
  std::lock_guard lock(mutex_);
  abandoned_ = true;
}

void* CachingAllocator::allocate(size_t bytes, StreamKey stream) {
  const size_t size = round_up(bytes == 0 ? 1 : bytes, options_.round_bytes);
  std::lock_guard lock(mutex_);
  ++stats_.allocations;
  Block* block = take_cached(size, stream);
  if (block) {
    ++stats_.cache_hits;
  } else {
    block = new_segment(size, stream);
  }
  // Split off the tail if what is left is worth keeping as its own block.
  if (block->size - size >= options_.min_split_remainder) {
    auto* rest = new Block(*block);
    rest->ptr = block->ptr + size;
    rest->size = block->size - size;
    rest->prev = block;
    rest->next = block->next;
    if (block->next) block->next->prev = rest;
    block->next = rest;
    block->size = size;
    free_blocks_.insert(rest);
  }
  block->in_use = true;
  block->use = MemoryUseScope::current();
  live_blocks_.emplace(block->ptr, block);
  stats_.allocated_bytes += block->size;
  stats_.allocated_by_use[int(block->use)] += block->size;
  update_peaks();
  return block->ptr;
}

CachingAllocator::Block* CachingAllocator::take_cached(size_t size, StreamKey stream) {
  // Small and large requests live in separate pools, so small tensors do not
  // fragment the segments that large ones need.
  Block probe;
  probe.small_pool = size <= options_.small_request_bytes;
  probe.stream = stream;
  probe.size = size;
  auto it = free_blocks_.lower_bound(&probe);
  if (it == free_blocks_.end() || (*it)->small_pool != probe.small_pool || (*it)->stream != stream) return nullptr;
  Block* block = *it;
  free_blocks_.erase(it);
  return block;
}

CachingAllocator::Block* CachingAllocator::new_segment(size_t size, StreamKey stream) {
  const bool small = size <= options_.small_request_bytes;
  const size_t segment_size = small ? options_.small_segment_bytes : round_up(size, options_.large_segment_round);
  void* ptr = source_->allocate(segment_size);
  if (!ptr) {
    release_unused_segments();
    ptr = source_->allocate(segment_size);
  }
  if (!ptr) {
    std::ostringstream detail;
    detail << "out of memory on " << device_.to_string() << ": tried to allocate " << segment_size << " bytes from "
           << source_->describe() << " with " << stats_.allocated_bytes << " bytes allocated and "
           << stats_.reserved_bytes << " reserved; reduce the batch size or the model, or enable recomputation";
    throw_error(ErrorSite{"tessera", 0, {}, "allocate", __FILE__, __LINE__, device_}, detail.str());
  }
  auto* block = new Block;
  block->ptr = static_cast<char*>(ptr);
  block->size = segment_size;
  block->stream = stream;
  block->small_pool = small;
  block->segment = block->ptr;
  block->segment_size = segment_size;
  stats_.reserved_bytes += segment_size;
  ++stats_.segments;
  return block;
}

void CachingAllocator::deallocate(void* ptr) noexcept {
  if (!ptr) return;
  std::lock_guard lock(mutex_);
  auto it = live_blocks_.find(ptr);
  if (it == live_blocks_.end()) return;  // not ours: nothing sane to do in a noexcept path
  Block* block = it->second;
  live_blocks_.erase(it);
  stats_.allocated_bytes -= block->size;
  stats_.allocated_by_use[int(block->use)] -= block->size;
  block->in_use = false;
  // Merge with free neighbours of the same segment.
  if (Block* next = block->next; next && !next->in_use) {
    free_blocks_.erase(next);
    block->size += next->size;
    block->next = next->next;
    if (next->next) next->next->prev = block;
    delete next;
  }
  if (Block* prev = block->prev; prev && !prev->in_use) {
    free_blocks_.erase(prev);
    prev->size += block->size;
    prev->next = block->next;
    if (block->next) block->next->prev = prev;
    delete block;
    block = prev;
  }
  free_blocks_.insert(block);
}

void CachingAllocator::release_unused_segments() {
  if (abandoned_) return;
  for (auto it = free_blocks_.begin(); it != free_blocks_.end();) {
    Block* block = *it;
    if (block->prev == nullptr && block->next == nullptr) {  // the whole segment is free
      source_->release(block->segment, block->segment_size);
      stats_.reserved_bytes -= block->segment_size;
      --stats_.segments;
      delete block;
      it = free_blocks_.erase(it);
    } else {
      ++it;
    }
  }
}

void CachingAllocator::empty_cache() {
  std::lock_guard lock(mutex_);
  release_unused_segments();
}

AllocatorStats CachingAllocator::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

void CachingAllocator::reset_peak_stats() {
  std::lock_guard lock(mutex_);
  stats_.peak_allocated_bytes = stats_.allocated_bytes;
  stats_.peak_reserved_bytes = stats_.reserved_bytes;
  for (int use = 0; use < kMemoryUses; ++use) stats_.peak_by_use[use] = stats_.allocated_by_use[use];
  stats_.peak_model_state_bytes = stats_.model_state_bytes();
  stats_.allocations = 0;
  stats_.cache_hits = 0;
}

void CachingAllocator::update_peaks() {
  if (stats_.allocated_bytes > stats_.peak_allocated_bytes) stats_.peak_allocated_bytes = stats_.allocated_bytes;
  if (stats_.reserved_bytes > stats_.peak_reserved_bytes) stats_.peak_reserved_bytes = stats_.reserved_bytes;
  for (int use = 0; use < kMemoryUses; ++use)
    stats_.peak_by_use[use] = std::max(stats_.peak_by_use[use], stats_.allocated_by_use[use]);
  stats_.peak_model_state_bytes = std::max(stats_.peak_model_state_bytes, stats_.model_state_bytes());
}

size_t CachingAllocator::block_size(void* ptr) const {
  std::lock_guard lock(mutex_);
  auto it = live_blocks_.find(ptr);
  TESSERA_CHECK(it != live_blocks_.end(), "pointer was not allocated by this allocator");
  return it->second->size;
}

}  // namespace tessera

// Memory allocators. Every tensor's bytes come from an Allocator owned by the
// Context. The main implementation, CachingAllocator, sits on a MemorySource
// (aligned host memory, pinned host memory, or one device's memory) and
// keeps freed blocks for reuse:
//   - blocks are reused only by allocations on the stream they were freed on
//     (a freed block may still be read by queued work on that stream);
//   - a larger cached block is split, and a freed block is merged with free
//     neighbours from the same segment (one MemorySource allocation);
//   - allocated / reserved / peak byte counters, with a reset of the peaks;
//   - the same counters per use (parameters, gradients, optimizer state, the
//     rest: activations and workspaces), the use set by a MemoryUseScope on
//     the allocating thread, and the peak of the model state (parameters +
//     gradients + optimizer state together), which ZeRO's memory tests and
//     metrics read;
//   - when the source runs out, unused segments are released and the request
//     retried before an out-of-memory error is thrown.
// Because the source is an interface, the whole caching policy is tested on
// the host, with the same code that manages device memory on a GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>

#include "core/device.h"

namespace tessera {

// Identifies the stream an allocation is used on (cudaStream_t, or nullptr on the CPU).
using StreamKey = const void*;

// What an allocation holds. Set for a thread by MemoryUseScope; everything
// else (activations, workspaces, communication scratch) counts as `other`.
enum class MemoryUse : uint8_t { other = 0, parameters, gradients, optimizer };
inline constexpr int kMemoryUses = 4;
const char* memory_use_name(MemoryUse use);  // "other", "parameters", "gradients", "optimizer"

// Marks the allocations this thread makes while it lives as `use` (nested
// scopes restore the outer use).
class MemoryUseScope {
 public:
  explicit MemoryUseScope(MemoryUse use);
  ~MemoryUseScope();
  MemoryUseScope(const MemoryUseScope&) = delete;
  MemoryUseScope& operator=(const MemoryUseScope&) = delete;
  static MemoryUse current();

 private:
  MemoryUse previous_;
};

struct AllocatorStats {
  size_t allocated_bytes = 0;       // bytes in blocks handed out and not yet freed
  size_t reserved_bytes = 0;        // bytes obtained from the memory source
  size_t peak_allocated_bytes = 0;  // highest allocated_bytes since the last reset
  size_t peak_reserved_bytes = 0;
  uint64_t allocations = 0;  // allocate() calls since the last reset
  uint64_t cache_hits = 0;   // of which served from cached blocks
  uint64_t segments = 0;     // live allocations from the memory source
  // Per MemoryUse (indexed by its value): bytes allocated now, and the peak
  // of each since the last reset.
  size_t allocated_by_use[kMemoryUses] = {};
  size_t peak_by_use[kMemoryUses] = {};
  // The highest parameters + gradients + optimizer bytes held at one time
  // since the last reset (not the sum of the three peaks).
  size_t peak_model_state_bytes = 0;
  size_t model_state_bytes() const {
    return allocated_by_use[int(MemoryUse::parameters)] + allocated_by_use[int(MemoryUse::gradients)] +
           allocated_by_use[int(MemoryUse::optimizer)];
  }
};

class MemorySource {
 public:
  virtual ~MemorySource() = default;
  virtual void* allocate(size_t bytes) = 0;  // nullptr when out of memory
  virtual void release(void* ptr, size_t bytes) noexcept = 0;
  virtual std::string describe() const = 0;
};

std::unique_ptr<MemorySource> make_aligned_host_memory(size_t alignment = 64);
// Through the device runtime of `device`'s kind (core/device_runtime.h):
// memory on `device`, and page-locked host memory for copies to devices of its kind.
std::unique_ptr<MemorySource> make_device_memory(Device device);
std::unique_ptr<MemorySource> make_pinned_host_memory(Device device);

class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual void* allocate(size_t bytes, StreamKey stream) = 0;
  virtual void deallocate(void* ptr) noexcept = 0;
  virtual AllocatorStats stats() const = 0;
  virtual void reset_peak_stats() = 0;
  virtual void empty_cache() = 0;  // returns unused segments to the source
  virtual Device device() const = 0;
  // Never return memory to the source from now on (a failing process whose
  // device may never drain: freeing device memory waits for the device).
  virtual void abandon() noexcept = 0;
};

struct CachingOptions {
  size_t round_bytes = 512;              // every request is rounded up to this
  size_t small_request_bytes = 1 << 20;  // requests up to this share small segments
  size_t small_segment_bytes = 2 << 20;  // segment size for small requests
  size_t large_segment_round = 2 << 20;  // large requests get segments rounded to this
  size_t min_split_remainder = 512;      // split a cached block only if this much is left
};

class CachingAllocator final : public Allocator {
 public:
  CachingAllocator(Device device, std::unique_ptr<MemorySource> source, CachingOptions options = {});
  ~CachingAllocator() override;
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  void* allocate(size_t bytes, StreamKey stream) override;
  void deallocate(void* ptr) noexcept override;
  AllocatorStats stats() const override;
  void reset_peak_stats() override;
  void empty_cache() override;
  Device device() const override { return device_; }
  void abandon() noexcept override;

  // Size of the block behind `ptr` (after rounding and any unsplit slack).
  size_t block_size(void* ptr) const;

 private:
  struct Block {
    char* ptr = nullptr;
    size_t size = 0;
    StreamKey stream = nullptr;
    bool small_pool = false;  // cut from a small segment (small requests only)
    bool in_use = false;
    MemoryUse use = MemoryUse::other;  // while in use
    Block* prev = nullptr;  // neighbours in the same segment
    Block* next = nullptr;
    char* segment = nullptr;  // base of the segment this block was cut from
    size_t segment_size = 0;
  };
  struct FreeOrder {
    bool operator()(const Block* a, const Block* b) const;
  };

  Block* take_cached(size_t size, StreamKey stream);
  Block* new_segment(size_t size, StreamKey stream);
  void release_unused_segments();
  void update_peaks();

  Device device_;
  std::unique_ptr<MemorySource> source_;
  CachingOptions options_;
  mutable std::mutex mutex_;
  std::set<Block*, FreeOrder> free_blocks_;        // ordered by (pool, stream, size, address)
  std::unordered_map<void*, Block*> live_blocks_;  // handed-out blocks by address
  AllocatorStats stats_;
  bool abandoned_ = false;
};

}  // namespace tessera

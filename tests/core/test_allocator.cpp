// The caching allocator's policy, exercised on host memory (the same code
// manages GPU memory): reuse per stream, splitting, coalescing, counters,
// releasing the cache when the source runs dry.
#include <gtest/gtest.h>

#include <random>
#include <set>

#include "core/allocator.h"
#include "core/context.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

// Real host memory with a byte limit, counting what it hands out.
class LimitedHostMemory final : public MemorySource {
 public:
  explicit LimitedHostMemory(size_t limit) : limit_(limit), inner_(make_aligned_host_memory(64)) {}
  void* allocate(size_t bytes) override {
    if (in_use_ + bytes > limit_) return nullptr;
    in_use_ += bytes;
    ++calls_;
    return inner_->allocate(bytes);
  }
  void release(void* ptr, size_t bytes) noexcept override {
    in_use_ -= bytes;
    inner_->release(ptr, bytes);
  }
  std::string describe() const override { return "limited host memory"; }
  size_t in_use() const { return in_use_; }
  int calls() const { return calls_; }

 private:
  size_t limit_, in_use_ = 0;
  int calls_ = 0;
  std::unique_ptr<MemorySource> inner_;
};

struct Fixture {
  explicit Fixture(size_t limit = size_t(1) << 30) {
    auto src = std::make_unique<LimitedHostMemory>(limit);
    source = src.get();
    allocator = std::make_unique<CachingAllocator>(Device::cpu(), std::move(src));
  }
  LimitedHostMemory* source;
  std::unique_ptr<CachingAllocator> allocator;
};

const StreamKey kStreamA = reinterpret_cast<StreamKey>(0x10);
const StreamKey kStreamB = reinterpret_cast<StreamKey>(0x20);

TEST(CachingAllocator, ReusesFreedBlocksOnTheSameStreamOnly) {
  Fixture f;
  void* a = f.allocator->allocate(3 << 20, kStreamA);
  f.allocator->deallocate(a);
  void* b = f.allocator->allocate(3 << 20, kStreamB);  // other stream: a new segment
  EXPECT_NE(a, b);
  EXPECT_EQ(f.source->calls(), 2);
  void* c = f.allocator->allocate(3 << 20, kStreamA);  // same stream: the cached block
  EXPECT_EQ(a, c);
  EXPECT_EQ(f.source->calls(), 2);
  EXPECT_EQ(f.allocator->stats().cache_hits, 1u);
  f.allocator->deallocate(b);
  f.allocator->deallocate(c);
}

TEST(CachingAllocator, SplitsSmallRequestsOutOfOneSegmentAndCoalescesThem) {
  Fixture f;
  std::vector<void*> blocks;
  for (int i = 0; i < 8; ++i) blocks.push_back(f.allocator->allocate(1000, kStreamA));
  EXPECT_EQ(f.source->calls(), 1);  // all from one 2 MiB segment
  std::set<void*> distinct(blocks.begin(), blocks.end());
  EXPECT_EQ(distinct.size(), blocks.size());
  for (size_t i = 1; i < blocks.size(); ++i)  // adjacent, 1024 bytes apart (rounded to 512)
    EXPECT_EQ(static_cast<char*>(blocks[i]) - static_cast<char*>(blocks[i - 1]), 1024);
  // Free in a scattered order; everything must merge back into one block.
  for (int i : {3, 0, 7, 5, 1, 6, 2, 4}) f.allocator->deallocate(blocks[size_t(i)]);
  // The largest small request fits only if the eight blocks merged back into one.
  void* again = f.allocator->allocate(1 << 20, kStreamA);
  EXPECT_EQ(again, blocks[0]);
  EXPECT_EQ(f.source->calls(), 1);
  f.allocator->deallocate(again);
}

TEST(CachingAllocator, CountsAllocatedReservedAndPeak) {
  Fixture f;
  void* a = f.allocator->allocate(4 << 20, kStreamA);
  void* b = f.allocator->allocate(1000, kStreamA);
  AllocatorStats s = f.allocator->stats();
  EXPECT_EQ(s.allocated_bytes, size_t(4 << 20) + 1024);
  EXPECT_EQ(s.reserved_bytes, size_t(4 << 20) + (2 << 20));
  EXPECT_EQ(s.peak_allocated_bytes, s.allocated_bytes);
  f.allocator->deallocate(a);
  s = f.allocator->stats();
  EXPECT_EQ(s.allocated_bytes, 1024u);
  EXPECT_EQ(s.peak_allocated_bytes, size_t(4 << 20) + 1024);
  EXPECT_EQ(s.reserved_bytes, size_t(6 << 20));  // cached, not returned
  f.allocator->reset_peak_stats();
  EXPECT_EQ(f.allocator->stats().peak_allocated_bytes, 1024u);
  f.allocator->empty_cache();
  EXPECT_EQ(f.allocator->stats().reserved_bytes, size_t(2 << 20));  // the segment still holding b stays
  EXPECT_EQ(f.source->in_use(), size_t(2 << 20));
  f.allocator->deallocate(b);
  f.allocator->empty_cache();
  EXPECT_EQ(f.source->in_use(), 0u);
  EXPECT_EQ(f.allocator->stats().segments, 0u);
}

TEST(CachingAllocator, FreesItsCacheAndRetriesBeforeRunningOutOfMemory) {
  Fixture f(10 << 20);
  void* a = f.allocator->allocate(6 << 20, kStreamA);
  f.allocator->deallocate(a);                          // cached: 6 MiB reserved
  void* b = f.allocator->allocate(8 << 20, kStreamB);  // needs the cache released first
  EXPECT_NE(b, nullptr);
  EXPECT_EQ(f.allocator->stats().reserved_bytes, size_t(8 << 20));
  try {
    f.allocator->allocate(4 << 20, kStreamB);
    FAIL() << "expected out of memory";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("out of memory"), std::string::npos) << error.what();
    EXPECT_NE(std::string(error.what()).find("reduce the batch size"), std::string::npos) << error.what();
  }
  f.allocator->deallocate(b);
}

TEST(CachingAllocator, RandomWorkloadKeepsBlocksDisjointAndCountersExact) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  Fixture f;
  struct Live {
    char* ptr;
    size_t size;
    StreamKey stream;
    unsigned char tag;
  };
  std::vector<Live> live;
  std::uniform_int_distribution<int> coin(0, 2);
  std::uniform_int_distribution<size_t> small(1, 200000), large(1 << 20, 9 << 20);
  size_t expected_allocated = 0;
  for (int step = 0; step < 3000; ++step) {
    if (live.empty() || (live.size() < 64 && coin(rng) != 0)) {
      const size_t bytes = coin(rng) == 0 ? large(rng) : small(rng);
      const StreamKey stream = coin(rng) == 0 ? kStreamB : kStreamA;
      char* p = static_cast<char*>(f.allocator->allocate(bytes, stream));
      const unsigned char tag = static_cast<unsigned char>(step);
      std::memset(p, tag, bytes);  // blocks must not overlap: tags are checked on free
      live.push_back({p, bytes, stream, tag});
      expected_allocated += f.allocator->block_size(p);
    } else {
      const size_t i = size_t(rng() % live.size());
      const Live l = live[i];
      for (size_t k = 0; k < l.size; k += 4093) ASSERT_EQ(static_cast<unsigned char>(l.ptr[k]), l.tag);
      expected_allocated -= f.allocator->block_size(l.ptr);
      f.allocator->deallocate(l.ptr);
      live.erase(live.begin() + long(i));
    }
    ASSERT_EQ(f.allocator->stats().allocated_bytes, expected_allocated);
  }
  for (const Live& l : live) f.allocator->deallocate(l.ptr);
  EXPECT_EQ(f.allocator->stats().allocated_bytes, 0u);
  f.allocator->empty_cache();
  EXPECT_EQ(f.source->in_use(), 0u);  // everything coalesced back into whole segments
}

TEST(CachingAllocator, ContextTensorsReportThroughTheHostAllocator) {
  Context ctx;
  Allocator& host = ctx.allocator(Device::cpu());
  const size_t before = host.stats().allocated_bytes;
  {
    Tensor t = ctx.empty(Shape{1000, 1000}, DType::f32);
    EXPECT_GE(host.stats().allocated_bytes, before + 4000000);
  }
  EXPECT_EQ(host.stats().allocated_bytes, before);
}

}  // namespace
}  // namespace tessera::testing

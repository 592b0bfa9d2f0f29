// The emulated accelerator (core/device.h, core/emulated_runtime.h): tensors
// on it round-trip through copies and count in its own allocator; streams hold
// enqueued work that events cover and that only the enqueuing thread
// advances; a thread that touches a device this process does not use is
// refused (the extra-context bug of GPU nodes), in every call that can make a
// context; an injected fault is sticky and counts as a device fault; and a
// Context torn down while an exception unwinds does not wait for work that
// will never finish.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <stdexcept>
#include <thread>

#include "core/context.h"
#include "core/device_runtime.h"
#include "core/emulated_runtime.h"
#include "core/error.h"
#include "core/stream.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

// Every test starts as a fresh process would: no device chosen, no fault.
class EmulatedDevice : public ::testing::Test {
 protected:
  void SetUp() override { emulated::reset_for_tests(); }
  void TearDown() override { emulated::reset_for_tests(); }
};

// The message of the tessera::Error `run` throws ("" when none).
std::string error_of(const std::function<void()>& run) {
  try {
    run();
  } catch (const Error& error) {
    return error.what();
  }
  return "";
}

// Runs `run` on a new thread that chooses no device; returns its error text.
std::string error_on_unbound_thread(const std::function<void()>& run) {
  std::string text;
  std::thread([&] { text = error_of(run); }).join();
  return text;
}

TEST_F(EmulatedDevice, ParsesAndPrints) {
  EXPECT_EQ(parse_device("emu"), Device::emulated(0));
  EXPECT_EQ(parse_device("emu:3"), Device::emulated(3));
  EXPECT_EQ(Device::emulated(5).to_string(), "emu:5");
  EXPECT_TRUE(Device::emulated(0).is_accelerator());
  EXPECT_FALSE(Device::emulated(0).is_cuda());
  EXPECT_NE(error_of([] { parse_device("emu:x"); }).find("unknown device 'emu:x'"), std::string::npos);
}

TEST_F(EmulatedDevice, TensorsRoundTripAndCountInTheDevicesAllocator) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  const Device device = Device::emulated(2);
  bind_thread_to_device(device);
  Context ctx;
  for (DType dtype : {DType::f32, DType::bf16, DType::i64, DType::u8}) {
    const RandomTensor host = random_tensor(ctx, Shape{37, 3}, dtype, rng, dtype == DType::u8 ? 0 : -100, 100);
    const size_t before = ctx.allocator(device).stats().allocated_bytes;
    Tensor on_device = host.tensor.to(device);
    EXPECT_EQ(on_device.device(), device);
    EXPECT_NE(on_device.data_ptr(), host.tensor.data_ptr());
    EXPECT_EQ(ctx.allocator(device).stats().allocated_bytes, before + 512 * ((on_device.nbytes() + 511) / 512));
    Tensor other = on_device.to(Device::emulated(3));  // device to device
    bind_thread_to_device(device);
    EXPECT_TRUE(all_close(other.to(Device::cpu()), host.values, {0, 0}));
    EXPECT_TRUE(all_close(on_device, host.values, {0, 0}));
  }
  EXPECT_NE(error_of([&] {
              ctx.empty(Shape{1}, DType::f32, Device::emulated(emulated::kDeviceCount));
            }).find("no device emu:8"),
            std::string::npos);
}

TEST_F(EmulatedDevice, EventsCoverEnqueuedWorkThatOnlyTheEnqueuingThreadAdvances) {
  const Device device = Device::emulated(0);
  bind_thread_to_device(device);
  Stream stream = Stream::create(device);
  std::atomic<int> polls{0};
  std::atomic<bool> may_finish{false};
  emulated::enqueue_work(stream.native_handle(), [&] {
    ++polls;
    return may_finish.load();
  });
  Event after(device);
  after.record(stream);
  EXPECT_FALSE(after.ready());
  EXPECT_EQ(polls.load(), 1);
  int seen_elsewhere = -1;
  bool ready_elsewhere = true;
  std::thread([&] {
    bind_thread_to_device(device);
    ready_elsewhere = after.ready();  // reads the last answer; MPI-like work is not advanced here
    seen_elsewhere = polls.load();
  }).join();
  EXPECT_FALSE(ready_elsewhere);
  EXPECT_EQ(seen_elsewhere, 1);
  may_finish = true;
  after.synchronize();
  EXPECT_TRUE(after.ready());
  EXPECT_EQ(emulated::pending_work(stream.native_handle()), 0u);
  Event later(device);
  later.record(stream);  // nothing unfinished is left to cover
  EXPECT_TRUE(later.ready());
}

TEST_F(EmulatedDevice, AbandonedWorkCountsAsFinishedAndIsNotPolledAgain) {
  const Device device = Device::emulated(0);
  bind_thread_to_device(device);
  Stream stream = Stream::create(device);
  std::atomic<int> polls{0};
  emulated::enqueue_work(stream.native_handle(), [&] {
    ++polls;
    return false;
  });
  Event event(device);
  event.record(stream);
  EXPECT_FALSE(event.ready());
  emulated::abandon_work(stream.native_handle());
  const int before = polls.load();
  EXPECT_TRUE(event.ready());
  stream.synchronize();
  EXPECT_EQ(polls.load(), before);
}

// CUDA gives every thread device 0 until it chooses one, and a runtime call
// uses the current device's context: on rank 1 of a node (GPU 1) a thread that
// never chose makes a context on GPU 0. Each call that can do so is refused
// on a device this process does not use, and allowed after binding.
TEST_F(EmulatedDevice, AThreadThatNeverChoseItsDeviceIsRefusedInEveryCall) {
  const Device device = Device::emulated(1);
  bind_thread_to_device(device);
  Context ctx;
  Stream stream = Stream::create(device);
  Event event(device);
  event.record(stream);
  Tensor on_device = ctx.full(Shape{16}, DType::f32, 1.0, device);
  Tensor host = ctx.empty(Shape{16}, DType::f32);
  const std::vector<std::pair<const char*, std::function<void()>>> calls = {
      {"event_query", [&] { (void)event.ready(); }},
      {"event_synchronize", [&] { event.synchronize(); }},
      {"stream_synchronize", [&] { stream.synchronize(); }},
      {"event_record", [&] { event.record(stream); }},
      {"pinned_malloc",
       [&] {
         Allocator& pinned = ctx.pinned_allocator(device);
         pinned.deallocate(pinned.allocate(1 << 20, nullptr));
       }},
  };
  for (const auto& [name, call] : calls) {
    SCOPED_TRACE(name);
    const std::string text = error_on_unbound_thread(call);
    EXPECT_NE(text.find(name), std::string::npos) << text;
    EXPECT_NE(text.find("current device is emu:0, a device this process does not use"), std::string::npos) << text;
    EXPECT_NE(text.find("bind_thread_to_device"), std::string::npos) << text;
    std::string bound_text = "not run";
    std::thread([&] {
      bind_thread_to_device(device);
      bound_text = error_of(call);
    }).join();
    EXPECT_EQ(bound_text, "");
  }
  // A copy through the runtime from an unbound thread: Tensor::copy_ binds the
  // calling thread itself (as cudaSetDevice before cudaMemcpyAsync), so it works.
  EXPECT_EQ(error_on_unbound_thread([&] { host.copy_(on_device); }), "");
  EXPECT_EQ(host.to_vector<float>(), std::vector<float>(16, 1.0f));
}

TEST_F(EmulatedDevice, AnInjectedFaultIsStickyAndIsADeviceFault) {
  const Device device = Device::emulated(0);
  bind_thread_to_device(device);
  Context ctx;
  Tensor t = ctx.full(Shape{4}, DType::f32, 2.0, device);
  emulated::inject_fault(0, "an illegal memory access was encountered");
  for (int attempt = 0; attempt < 2; ++attempt) {
    try {
      (void)t.to_vector<float>();
      ADD_FAILURE() << "no error";
    } catch (const Error& error) {
      EXPECT_TRUE(is_device_fault(error)) << error.what();
      EXPECT_EQ(error.library(), emulated::kLibrary);
      EXPECT_NE(std::string(error.what()).find("an illegal memory access was encountered"), std::string::npos);
      EXPECT_NE(std::string(error.what()).find("on emu:0"), std::string::npos) << error.what();
    }
  }
  // Other devices are unaffected.
  Tensor elsewhere = ctx.full(Shape{2}, DType::f32, 3.0, Device::emulated(1));
  EXPECT_EQ(elsewhere.to_vector<float>(), std::vector<float>(2, 3.0f));
}

// A Context destroyed while an exception unwinds belongs to a failing
// process: it must not wait for device work that never finishes (a
// communication whose peer died), and returns promptly. The same Context
// destroyed normally would wait for it (bounded, 60 s), which is not run here.
TEST_F(EmulatedDevice, AContextTornDownByAnExceptionDoesNotWaitForTheDevice) {
  const Device device = Device::emulated(0);
  bind_thread_to_device(device);
  const auto start = std::chrono::steady_clock::now();
  try {
    Context ctx;
    Tensor t = ctx.zeros(Shape{8}, DType::f32, device);
    emulated::enqueue_work(ctx.compute_stream(device).native_handle(), [] { return false; });
    throw std::runtime_error("a rank failed");
  } catch (const std::runtime_error&) {
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
}

// Freeing pinned host memory waits for the device (cudaFreeHost
// synchronises; the emulated runtime does too). A Context destroyed normally
// whose device never drains (work that never finishes, a communication whose
// peer died) leaves that device's memory after its drain deadline: its
// pinned memory too, or the teardown would wait for good in the pinned free
// and the process never reach MPI_Finalize. The teardown runs on a thread of
// its own, watched from here with a deadline.
TEST_F(EmulatedDevice, ATeardownWhoseDeviceNeverDrainsEndsWithinTheDrainDeadline) {
  const Device device = Device::emulated(0);
  std::promise<void> ended;
  std::future<void> teardown_done = ended.get_future();
  std::thread([device, ended = std::move(ended)]() mutable {
    bind_thread_to_device(device);
    {
      ContextOptions options;
      options.drain_timeout = std::chrono::milliseconds(300);
      Context ctx(options);
      Allocator& pinned = ctx.pinned_allocator(device);
      pinned.deallocate(pinned.allocate(1 << 16, nullptr));  // a cached pinned segment, freed at teardown
      Tensor t = ctx.zeros(Shape{8}, DType::f32, device);
      emulated::enqueue_work(ctx.compute_stream(device).native_handle(), [] { return false; });
    }
    ended.set_value();
  }).detach();
  ASSERT_EQ(teardown_done.wait_for(std::chrono::seconds(20)), std::future_status::ready)
      << "the teardown is still waiting 20 s later (a pinned free waiting for a device that never drains)";
}

// The emulated pinned free does wait for queued work (what the test above
// relies on): it returns once the work it waits for finishes.
TEST_F(EmulatedDevice, FreeingPinnedMemoryWaitsForQueuedWork) {
  const Device device = Device::emulated(0);
  bind_thread_to_device(device);
  Context ctx;
  const Stream& stream = ctx.compute_stream(device);
  int polls = 0;
  emulated::enqueue_work(stream.native_handle(), [&polls] { return ++polls >= 5; });
  DeviceRuntime& runtime = emulated::runtime();
  void* bytes = runtime.pinned_malloc(64);
  runtime.pinned_free(bytes);
  EXPECT_GE(polls, 5) << "the pinned free returned before the queued work finished";
  EXPECT_EQ(emulated::pending_work(stream.native_handle()), 0u);
}

}  // namespace
}  // namespace tessera::testing

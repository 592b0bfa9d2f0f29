// OperationWatchdog (the NCCL communicator's deadline and asynchronous-error
// watcher) with plain probes standing in for CUDA events and
// ncclCommGetAsyncError, which cannot run here: finished operations are
// forgotten, a late one is reported once after (never before) its deadline
// with the communicator, sequence number, operation and timeout, a health
// error (or a probe that throws) is reported at once naming what was
// pending, a device fault is reported as the device's, operations without a
// deadline are never late, the destructor stops the thread quietly, and the
// thread binds to the device before its probes touch it (emulated events).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

#include "core/device_runtime.h"
#include "core/emulated_runtime.h"
#include "core/stream.h"
#include "parallel/operation_watchdog.h"

namespace tessera::parallel {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// What on_failure saw: how often it ran, the kind of failure and the report.
struct Failures {
  std::mutex mutex;
  int calls = 0;
  OperationWatchdog::Failure::Kind kind{};
  std::string report;
  OperationWatchdog::FailureHandler handler() {
    return [this](const OperationWatchdog::Failure& failure) {
      std::lock_guard lock(mutex);
      ++calls;
      kind = failure.kind;
      report = failure.report;
    };
  }
  int count() {
    std::lock_guard lock(mutex);
    return calls;
  }
  OperationWatchdog::Failure::Kind last_kind() {
    std::lock_guard lock(mutex);
    return kind;
  }
};

using Kind = OperationWatchdog::Failure::Kind;

// Waits up to `limit` for `condition`.
template <typename Condition>
bool eventually(Condition condition, std::chrono::milliseconds limit = 10000ms) {
  const auto deadline = Clock::now() + limit;
  while (Clock::now() < deadline) {
    if (condition()) return true;
    std::this_thread::sleep_for(2ms);
  }
  return condition();
}

TEST(OperationWatchdog, FinishedOperationsAreForgottenAndNeverReported) {
  Failures failures;
  OperationWatchdog watchdog("dp", nullptr, failures.handler(), 5ms);
  std::atomic<bool> first{false}, second{false};
  watchdog.watch("all_reduce sum of 64 bytes", 1, 0.5, [&] { return first.load(); });
  watchdog.watch("all_gather of 128 bytes", 2, 0.5, [&] { return second.load(); });
  EXPECT_EQ(watchdog.pending(), 2u);
  second = true;  // finishing out of order is fine
  EXPECT_TRUE(eventually([&] { return watchdog.pending() == 1; }));
  first = true;
  EXPECT_TRUE(eventually([&] { return watchdog.pending() == 0; }));
  std::this_thread::sleep_for(700ms);  // past both deadlines
  EXPECT_FALSE(watchdog.failed());
  EXPECT_EQ(failures.count(), 0);
}

TEST(OperationWatchdog, ALateOperationIsReportedOnceAfterItsDeadline) {
  Failures failures;
  OperationWatchdog watchdog("tp", nullptr, failures.handler(), 5ms);
  std::atomic<bool> done_early{false};
  watchdog.watch("all_gather of 32 bytes", 5, 0.3, [] { return true; });               // finished at once
  watchdog.watch("broadcast of 16 bytes", 6, 0.0, [&] { return done_early.load(); });  // no deadline
  const auto start = Clock::now();
  watchdog.watch("all_reduce sum of 4096 bytes", 7, 0.3, [] { return false; });
  watchdog.watch("reduce_scatter sum of 8192 bytes", 8, 30.0, [] { return false; });
  ASSERT_TRUE(eventually([&] { return failures.count() > 0; }));
  const double waited = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_GE(waited, 0.3);
  EXPECT_TRUE(watchdog.failed());
  EXPECT_EQ(failures.last_kind(), Kind::late);
  const std::string report = watchdog.report();
  EXPECT_EQ(report, failures.report);
  EXPECT_NE(report.find("communicator 'tp': operation 7 (all_reduce sum of 4096 bytes) did not complete within 0.3 s "
                        "(--comm-timeout)"),
            std::string::npos)
      << report;
  EXPECT_NE(report.find("Every rank of 'tp' must enqueue operation 7"), std::string::npos) << report;
  EXPECT_NE(report.find("the last operation seen completing on this rank was 5"), std::string::npos) << report;
  EXPECT_NE(report.find("3 operations pending on this rank, the newest is operation 8"), std::string::npos) << report;
  // Once only, and nothing is watched after a failure.
  watchdog.watch("all_reduce sum of 4 bytes", 9, 0.01, [] { return false; });
  std::this_thread::sleep_for(200ms);
  EXPECT_EQ(failures.count(), 1);
  EXPECT_EQ(watchdog.pending(), 0u);
}

TEST(OperationWatchdog, AnAsynchronousErrorIsReportedAtOnceNamingWhatWasPending) {
  Failures failures;
  std::atomic<bool> broken{false};
  OperationWatchdog watchdog(
      "pp", [&] { return broken ? std::string("remote process exited or there was a network error") : std::string(); },
      failures.handler(), 5ms);
  watchdog.watch("send of 1024 bytes to rank 1", 3, 600.0, [] { return false; });
  std::this_thread::sleep_for(50ms);
  EXPECT_FALSE(watchdog.failed());
  broken = true;
  ASSERT_TRUE(eventually([&] { return failures.count() > 0; }));
  EXPECT_EQ(failures.last_kind(), Kind::communication);
  const std::string report = watchdog.report();
  EXPECT_NE(report.find("communicator 'pp': asynchronous error: remote process exited or there was a network error"),
            std::string::npos)
      << report;
  EXPECT_NE(report.find("pending on this rank: operation 3 (send of 1024 bytes to rank 1)"), std::string::npos)
      << report;
}

TEST(OperationWatchdog, AProbeThatThrowsIsAFailure) {
  Failures failures;
  OperationWatchdog watchdog("dp", nullptr, failures.handler(), 5ms);
  watchdog.watch("all_reduce sum of 8 bytes", 11, 600.0, []() -> bool {
    throw std::runtime_error("cudaEventQuery: an illegal memory access was encountered");
  });
  ASSERT_TRUE(eventually([&] { return failures.count() > 0; }));
  EXPECT_EQ(failures.last_kind(), Kind::communication);
  EXPECT_NE(watchdog.report().find("asynchronous error: cudaEventQuery: an illegal memory access was encountered; "
                                   "pending on this rank: operation 11"),
            std::string::npos)
      << watchdog.report();
}

// A probe that finds the device itself failed (DeviceFault) is reported as
// the device's failure, not the communication's.
TEST(OperationWatchdog, ADeviceFaultIsReportedAsTheDevicesFailure) {
  Failures failures;
  OperationWatchdog watchdog("tp", nullptr, failures.handler(), 5ms);
  watchdog.watch("all_reduce sum of 8 bytes", 4, 600.0,
                 []() -> bool { throw OperationWatchdog::DeviceFault("an illegal memory access was encountered"); });
  ASSERT_TRUE(eventually([&] { return failures.count() > 0; }));
  EXPECT_EQ(failures.last_kind(), Kind::device);
  EXPECT_NE(watchdog.report().find("communicator 'tp': the device failed: an illegal memory access was encountered; "
                                   "pending on this rank: operation 4"),
            std::string::npos)
      << watchdog.report();
  EXPECT_EQ(watchdog.report().find("asynchronous error"), std::string::npos) << watchdog.report();
}

// The probes query device events from the watchdog's own thread, so the
// thread binds to the device first (thread_setup). On the emulated device a
// thread that does not is refused, as it would create a context on device 0 of
// a GPU node; a process using emu:1 only shows both sides.
TEST(OperationWatchdog, ItsThreadBindsToTheDeviceBeforeTheProbesTouchIt) {
  emulated::reset_for_tests();
  const Device device = Device::emulated(1);
  bind_thread_to_device(device);
  Stream stream = Stream::create(device);
  Event done(device);
  done.record(stream);
  {
    Failures failures;
    OperationWatchdog watchdog("dp", nullptr, failures.handler(), 5ms, [device] { bind_thread_to_device(device); });
    watchdog.watch("all_reduce sum of 8 bytes", 1, 600.0, [&] { return done.ready(); });
    EXPECT_TRUE(eventually([&] { return watchdog.pending() == 0; }));
    EXPECT_EQ(failures.count(), 0) << failures.report;
  }
  {
    Failures failures;
    OperationWatchdog unbound("dp", nullptr, failures.handler(), 5ms);
    unbound.watch("all_reduce sum of 8 bytes", 1, 600.0, [&] { return done.ready(); });
    ASSERT_TRUE(eventually([&] { return failures.count() > 0; }));
    EXPECT_NE(unbound.report().find("event_query (about emu:1) ran on a thread whose current device is emu:0, a "
                                    "device this process does not use"),
              std::string::npos)
        << unbound.report();
  }
  emulated::reset_for_tests();
}

TEST(OperationWatchdog, AThreadSetupThatThrowsIsReported) {
  Failures failures;
  OperationWatchdog watchdog("pp", nullptr, failures.handler(), 5ms,
                             [] { throw std::runtime_error("no such device emu:9"); });
  ASSERT_TRUE(eventually([&] { return failures.count() > 0; }));
  EXPECT_NE(failures.report.find("the watchdog thread could not start: no such device emu:9"), std::string::npos)
      << failures.report;
}

TEST(OperationWatchdog, StopsQuietlyWithOperationsPending) {
  Failures failures;
  {
    OperationWatchdog watchdog(
        "world", [] { return std::string(); }, failures.handler(), 5ms);
    watchdog.watch("barrier", 1, 100.0, [] { return false; });
  }
  EXPECT_EQ(failures.count(), 0);
}

}  // namespace
}  // namespace tessera::parallel

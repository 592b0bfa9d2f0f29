// OperationWatchdog: deadlines for operations the host enqueues but never
// waits for, the NCCL case. An NCCL collective runs on a CUDA stream; the
// host only queues it, so a peer that never arrives shows up much later as a
// stream synchronisation that never returns, where no host-side deadline can
// act. Like PyTorch's NCCL watchdog, a thread of this object polls, every
// `poll_interval`:
//   - each watched operation's `done` probe (an event query): finished
//     operations are forgotten; one older than its deadline is a failure;
//   - the `health` probe (ncclCommGetAsyncError): a non-empty answer is a
//     failure (a peer died, the network failed);
//   - a probe that throws is a failure, reported with its message; one that
//     throws DeviceFault is the device's own failure (a kernel that faulted,
//     found by the event query), reported as such rather than blamed on the
//     communication.
// On the first failure it calls `on_failure` once, on its own thread, with
// the kind of failure and a report naming the communicator, the operation
// (kind, bytes, sequence number), how long it has been pending, the last
// operation seen completing (compare it across the ranks' reports) and what
// is still queued behind it, then stops watching; failed() and report() let
// the host thread raise the same report the next time it touches the
// communicator. The stream communicator's on_failure aborts the communicator
// and ends the process (parallel/stream_communicator.cpp).
//
// The thread runs `thread_setup` first: the probes touch the device, so it
// binds to the communicator's device (core/device_runtime.h) before anything.
//
// Backend-neutral (probes are plain functions) so the CPU tests can run it.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>

namespace tessera::parallel {

class OperationWatchdog {
 public:
  using Clock = std::chrono::steady_clock;
  using DoneProbe = std::function<bool()>;           // whether the operation has finished
  using HealthProbe = std::function<std::string()>;  // "" while healthy, else what failed

  // Thrown by a probe when the device itself has failed (not the communication).
  struct DeviceFault : std::runtime_error {
    using std::runtime_error::runtime_error;
  };
  struct Failure {
    enum class Kind {
      late,           // an operation passed its deadline
      communication,  // the health probe, or a probe that threw something else
      device,         // a probe threw DeviceFault
    };
    Kind kind = Kind::late;
    std::string report;
  };
  using FailureHandler = std::function<void(const Failure& failure)>;

  // `communicator` names the group in reports ("dp", "tp", ...). `health`
  // may be empty (no health probe); `thread_setup` runs first on the thread
  // (a throw is a failure of kind communication).
  OperationWatchdog(std::string communicator, HealthProbe health, FailureHandler on_failure,
                    std::chrono::milliseconds poll_interval = std::chrono::milliseconds(100),
                    std::function<void()> thread_setup = {});
  ~OperationWatchdog();  // stops and joins the thread; operations still pending are not reported
  OperationWatchdog(const OperationWatchdog&) = delete;
  OperationWatchdog& operator=(const OperationWatchdog&) = delete;

  // Watches one operation, just enqueued: `what` ("all_reduce sum of 4194304
  // bytes"), its sequence number on the communicator, and its deadline
  // `timeout_s` from now (0: no deadline, but it is still listed in reports).
  void watch(std::string what, uint64_t sequence, double timeout_s, DoneProbe done);

  bool failed() const;
  std::string report() const;  // "" until failed()
  size_t pending() const;      // operations not yet seen finished

 private:
  struct Operation {
    std::string what;
    uint64_t sequence = 0;
    Clock::time_point enqueued;
    Clock::time_point deadline;  // max() when none
    DoneProbe done;
  };

  void run();
  void fail(Failure failure, std::unique_lock<std::mutex>& lock);
  // One pass over the probes (the thread's loop body); the failure, if any.
  std::optional<Failure> inspect();
  std::string describe_failure(const std::string& cause, const Operation* late,
                               const char* cause_label = "asynchronous error: ") const;

  std::string communicator_;
  HealthProbe health_;
  FailureHandler on_failure_;
  std::chrono::milliseconds poll_interval_;
  std::function<void()> thread_setup_;

  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Operation> operations_;  // in enqueue order
  bool stop_ = false;
  uint64_t last_completed_ = 0;  // the highest sequence number seen finished (0: none)
  std::string report_;           // set once, on failure
  std::thread thread_;           // last: started after everything it reads
};

}  // namespace tessera::parallel

// OperationWatchdog: the polling thread and its reports (see
// operation_watchdog.h).
#include "parallel/operation_watchdog.h"

#include <algorithm>
#include <cstdio>
#include <exception>
#include <utility>

namespace tessera::parallel {
namespace {

std::string seconds_text(OperationWatchdog::Clock::duration duration) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f", std::chrono::duration<double>(duration).count());
  return text;
}

}  // namespace

OperationWatchdog::OperationWatchdog(std::string communicator, HealthProbe health, FailureHandler on_failure,
                                     std::chrono::milliseconds poll_interval, std::function<void()> thread_setup)
    : communicator_(std::move(communicator)),
      health_(std::move(health)),
      on_failure_(std::move(on_failure)),
      poll_interval_(poll_interval),
      thread_setup_(std::move(thread_setup)),
      thread_([this] { run(); }) {}

OperationWatchdog::~OperationWatchdog() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void OperationWatchdog::watch(std::string what, uint64_t sequence, double timeout_s, DoneProbe done) {
  const Clock::time_point now = Clock::now();
  const Clock::time_point deadline =
      timeout_s > 0.0 ? now + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s))
                      : Clock::time_point::max();
  std::lock_guard lock(mutex_);
  if (!report_.empty()) return;  // already failed: nothing is watched any more
  operations_.push_back(Operation{std::move(what), sequence, now, deadline, std::move(done)});
}

bool OperationWatchdog::failed() const {
  std::lock_guard lock(mutex_);
  return !report_.empty();
}

std::string OperationWatchdog::report() const {
  std::lock_guard lock(mutex_);
  return report_;
}

size_t OperationWatchdog::pending() const {
  std::lock_guard lock(mutex_);
  return operations_.size();
}

void OperationWatchdog::run() {
  std::unique_lock lock(mutex_);
  if (thread_setup_) {
    try {
      thread_setup_();
    } catch (const std::exception& error) {
      fail({Failure::Kind::communication,
            "communicator '" + communicator_ + "': the watchdog thread could not start: " + error.what()},
           lock);
      return;
    }
  }
  while (!stop_) {
    wake_.wait_for(lock, poll_interval_, [this] { return stop_; });
    if (stop_) return;
    std::optional<Failure> failure = inspect();
    if (!failure) continue;
    fail(std::move(*failure), lock);
    return;
  }
}

void OperationWatchdog::fail(Failure failure, std::unique_lock<std::mutex>& lock) {
  report_ = failure.report;
  operations_.clear();
  lock.unlock();
  on_failure_(failure);
}

std::optional<OperationWatchdog::Failure> OperationWatchdog::inspect() {
  // A probe that throws (a CUDA error on the event query) is a failure too.
  for (auto op = operations_.begin(); op != operations_.end();) {
    try {
      if (op->done()) {
        last_completed_ = std::max(last_completed_, op->sequence);
        op = operations_.erase(op);
      } else {
        ++op;
      }
    } catch (const DeviceFault& fault) {
      return Failure{Failure::Kind::device, describe_failure(fault.what(), &*op, "the device failed: ")};
    } catch (const std::exception& error) {
      return Failure{Failure::Kind::communication, describe_failure(error.what(), &*op)};
    }
  }
  const Operation* oldest = operations_.empty() ? nullptr : &operations_.front();
  if (health_) {
    std::string error;
    try {
      error = health_();
    } catch (const std::exception& failure) {
      error = failure.what();
    }
    if (!error.empty()) return Failure{Failure::Kind::communication, describe_failure(error, oldest)};
  }
  const Clock::time_point now = Clock::now();
  for (const Operation& op : operations_)
    if (now >= op.deadline) return Failure{Failure::Kind::late, describe_failure("", &op)};
  return std::nullopt;
}

std::string OperationWatchdog::describe_failure(const std::string& cause, const Operation* late,
                                                const char* cause_label) const {
  const Clock::time_point now = Clock::now();
  std::string text = "communicator '" + communicator_ + "': ";
  if (!cause.empty()) {
    text += cause_label + cause;
    if (late)
      text += "; pending on this rank: operation " + std::to_string(late->sequence) + " (" + late->what +
              "), enqueued " + seconds_text(now - late->enqueued) + " s ago";
  } else {
    text += "operation " + std::to_string(late->sequence) + " (" + late->what + ") did not complete within " +
            seconds_text(late->deadline - late->enqueued) + " s (--comm-timeout); enqueued " +
            seconds_text(now - late->enqueued) + " s ago on this rank. Every rank of '" + communicator_ +
            "' must enqueue operation " + std::to_string(late->sequence) +
            ": a rank that has not is stalled or dead (its log stops before it; with NCCL >= 2.24 `ncclras` on any "
            "node of the job lists the ranks missing from a collective)";
  }
  if (last_completed_ > 0)
    text += "; the last operation seen completing on this rank was " + std::to_string(last_completed_);
  if (operations_.size() > 1) {
    text += "; " + std::to_string(operations_.size()) + " operations pending on this rank, the newest is operation " +
            std::to_string(operations_.back().sequence) + " (" + operations_.back().what + ")";
  }
  return text;
}

}  // namespace tessera::parallel

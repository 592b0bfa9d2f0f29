// PreemptionSignals: the process-wide flag its signal handler sets (see the
// header for why this one global exists) and the install/restore of the
// SIGTERM and SIGUSR1 handlers.
#include "apps/preemption.h"

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstring>

#include "core/error.h"

namespace tessera::app {
namespace {

constexpr int kSignals[] = {SIGTERM, SIGUSR1};
constexpr size_t kSignalCount = sizeof kSignals / sizeof kSignals[0];

// The first preemption signal received (0: none). Lock-free, so the handler
// may store into it.
std::atomic<int> received_signal{0};
static_assert(std::atomic<int>::is_always_lock_free, "the signal flag must be lock-free to be async-signal-safe");
// Whether a guard is alive (installs are not nested).
std::atomic<bool> installed{false};

void on_preemption_signal(int signal) {
  int none = 0;
  received_signal.compare_exchange_strong(none, signal);  // keep the first one
}

}  // namespace

PreemptionSignals::PreemptionSignals() {
  static_assert(kSignalCount == sizeof previous_ / sizeof previous_[0]);
  TESSERA_CHECK(!installed.exchange(true), "preemption signals: another training run in this process already ",
                "handles SIGTERM and SIGUSR1; run one train() at a time");
  received_signal.store(0);
  struct sigaction action {};
  action.sa_handler = on_preemption_signal;
  sigemptyset(&action.sa_mask);
  for (int signal : kSignals) sigaddset(&action.sa_mask, signal);
  action.sa_flags = SA_RESTART;
  for (size_t i = 0; i < kSignalCount; ++i) {
    if (sigaction(kSignals[i], &action, &previous_[i]) != 0) {
      const int error = errno;
      for (size_t j = 0; j < i; ++j) sigaction(kSignals[j], &previous_[j], nullptr);
      installed.store(false);
      TESSERA_THROW("preemption signals: cannot install a handler for ", signal_name(kSignals[i]), ": ",
                    std::strerror(error));
    }
  }
}

PreemptionSignals::~PreemptionSignals() {
  for (size_t i = 0; i < kSignalCount; ++i) sigaction(kSignals[i], &previous_[i], nullptr);
  installed.store(false);
}

int PreemptionSignals::received() const {
  return received_signal.load();
}

const char* signal_name(int signal) {
  switch (signal) {
    case SIGTERM:
      return "SIGTERM";
    case SIGUSR1:
      return "SIGUSR1";
    case SIGINT:
      return "SIGINT";
    default:
      return "a signal";
  }
}

}  // namespace tessera::app

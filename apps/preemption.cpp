// PreemptionSignals: the process-wide flags its signal handler reads and sets
// (see the header for why these globals exist), its messages, and the
// install/restore of the SIGTERM, SIGINT and SIGUSR1 handlers.
#include "apps/preemption.h"

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>

#include <unistd.h>

#include "core/error.h"

namespace tessera::app {
namespace {

constexpr int kSignals[] = {SIGTERM, SIGINT, SIGUSR1};
constexpr size_t kSignalCount = sizeof kSignals / sizeof kSignals[0];

// The first preemption signal received (0: none). Lock-free, so the handler
// may store into it.
std::atomic<int> received_signal{0};
static_assert(std::atomic<int>::is_always_lock_free, "the signal flag must be lock-free to be async-signal-safe");
// Whether a guard is alive (installs are not nested).
std::atomic<bool> installed{false};
// Whether the first step has begun (before it, SIGTERM and SIGINT end the process).
std::atomic<bool> training{false};

// The messages the handler writes before it ends the process, made when the
// guard is installed (formatting is not async-signal-safe; write(2) is).
struct EndMessages {
  char start_up[2][160];  // SIGTERM's, SIGINT's
  char interrupted_again[200];
};
EndMessages messages;

void write_and_end(const char* message, int signal) {
  const ssize_t ignored = ::write(STDERR_FILENO, message, std::strlen(message));
  (void)ignored;  // nothing to do if stderr is gone
  ::_exit(128 + signal);
}

void on_preemption_signal(int signal) {
  const bool stopping = signal != SIGUSR1;
  if (stopping && !training.load()) write_and_end(messages.start_up[signal == SIGINT ? 1 : 0], signal);
  if (signal == SIGINT && received_signal.load() != 0) write_and_end(messages.interrupted_again, signal);
  int none = 0;
  received_signal.compare_exchange_strong(none, signal);  // keep the first one
}

void prepare_messages() {
  const int rank = launcher_rank();
  char who[32] = "tessera";
  if (rank >= 0) std::snprintf(who, sizeof who, "tessera: rank %d", rank);
  for (int i = 0; i < 2; ++i)
    std::snprintf(messages.start_up[i], sizeof messages.start_up[i],
                  "\n%s: %s before the first training step: nothing to save yet, ending now\n", who,
                  i ? "SIGINT (Ctrl-C)" : "SIGTERM");
  std::snprintf(messages.interrupted_again, sizeof messages.interrupted_again,
                "\n%s: a second SIGINT (Ctrl-C): ending now without waiting for the step boundary (the newest "
                "complete checkpoint stays)\n",
                who);
}

}  // namespace

PreemptionSignals::PreemptionSignals() {
  static_assert(kSignalCount == sizeof previous_ / sizeof previous_[0]);
  TESSERA_CHECK(!installed.exchange(true), "preemption signals: another training run in this process already ",
                "handles SIGTERM and SIGUSR1; run one train() at a time");
  received_signal.store(0);
  training.store(false);
  prepare_messages();
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
  training.store(false);
}

int PreemptionSignals::received() const {
  return received_signal.load();
}

void PreemptionSignals::training_started() const {
  training.store(true);
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

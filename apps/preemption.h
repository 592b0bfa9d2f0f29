// Preemption signals: SIGTERM (Kubernetes' termination notice, Slurm's time
// limit and preemption, `scancel`, `kill`) and SIGUSR1 (Slurm's
// `--signal=USR1@T` warning, spot-eviction hooks) ask a training run to write
// a checkpoint and stop at the next step boundary.
//
// The handler only stores the signal's number in a process-wide
// std::atomic<int> (lock-free, so async-signal-safe); the training loop reads
// it at every step boundary and the ranks agree on it with one tiny
// all-reduce. That flag (with the atomic that keeps two guards from
// installing at once) is the one exception to "no globals": a POSIX signal
// handler receives no context pointer, so whatever it writes must live at
// namespace scope. Both stay private to preemption.cpp, and PreemptionSignals
// is the only way in: an RAII guard that installs the handlers (SA_RESTART,
// so system calls in flight, e.g. a checkpoint's writes, resume instead of
// failing with EINTR) and restores the previous ones when it goes away. A
// second signal while a checkpoint is being written only stores a number
// again: the save completes untouched.
#pragma once

#include <csignal>

namespace tessera::app {

class PreemptionSignals {
 public:
  // Clears the flag and installs the handlers for SIGTERM and SIGUSR1. One
  // guard at a time per process (train() holds one for its duration); a
  // second throws tessera::Error.
  PreemptionSignals();
  // Restores the handlers that were installed before (the defaults for the
  // `tessera` program).
  ~PreemptionSignals();
  PreemptionSignals(const PreemptionSignals&) = delete;
  PreemptionSignals& operator=(const PreemptionSignals&) = delete;

  // The first signal received since construction, or 0.
  int received() const;

 private:
  struct sigaction previous_[2];  // SIGTERM's and SIGUSR1's handlers before ours
};

// "SIGTERM", "SIGUSR1", "SIGINT", or "a signal".
const char* signal_name(int signal);

}  // namespace tessera::app

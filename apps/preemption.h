// Preemption signals: SIGTERM (Kubernetes' termination notice, Slurm's time
// limit and preemption, `scancel`, `kill`), SIGINT (Ctrl-C) and SIGUSR1
// (Slurm's `--signal=USR1@T` warning, spot-eviction hooks) ask a training run
// to write a checkpoint and stop at the next step boundary.
//
// Before the first step (validation, data checks, building the model,
// loading a checkpoint or --init-from weights) there is nothing to save:
// SIGTERM and SIGINT end the process at once, saying so (SIGUSR1, a warning,
// is kept for the first boundary). Once training runs, a second SIGINT ends
// it at once too (the newest complete checkpoint stays; a half-written one is
// never published); a second SIGTERM does not, so a scheduler's repeated
// notice cannot cut a checkpoint short.
//
// The handler only stores the signal's number in a process-wide
// std::atomic<int> (lock-free, so async-signal-safe), or writes a message
// made beforehand and calls _exit; the training loop reads the number at
// every step boundary and the ranks agree on it with one tiny all-reduce.
// Those atomics (with the one that keeps two guards from installing at once)
// are the one exception to "no globals": a POSIX signal handler receives no
// context pointer, so whatever it reads or writes must live at namespace
// scope. They stay private to preemption.cpp, and PreemptionSignals is the
// only way in: an RAII guard that installs the handlers (SA_RESTART, so
// system calls in flight, e.g. a checkpoint's writes, resume instead of
// failing with EINTR) and restores the previous ones when it goes away.
#pragma once

#include <csignal>

namespace tessera::app {

class PreemptionSignals {
 public:
  // Clears the flag and installs the handlers for SIGTERM, SIGINT and SIGUSR1. One
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

  // The first step is about to run: from now on SIGTERM and SIGINT ask for a
  // checkpoint at the next step boundary instead of ending the process.
  void training_started() const;

 private:
  struct sigaction previous_[3];  // SIGTERM's, SIGINT's and SIGUSR1's handlers before ours
};

// "SIGTERM", "SIGUSR1", "SIGINT", or "a signal".
const char* signal_name(int signal);

}  // namespace tessera::app

// The stop decisions of the training loop, as components of it
// (io/training_events.h): a preemption signal on any rank (apps/preemption.h)
// and --exit-interval. Each asks the step boundary to stop; the boundary
// saves first when --save is set, and a signal that arrives while a
// checkpoint is written stops the run with that checkpoint.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "apps/preemption.h"
#include "apps/train_config.h"
#include "io/training_events.h"
#include "parallel/communicator.h"

namespace tessera::app {

// SIGTERM, SIGINT or SIGUSR1 on any rank: every rank stops at the same step
// boundary. From the run's start a signal asks for this (before it, SIGTERM
// and SIGINT end the process: there is nothing to save). The ranks agree on
// the first signal any rank received and the highest rank that got one.
class PreemptionStop : public io::TrainingComponent {
 public:
  PreemptionStop(const PreemptionSignals& signals, int world_rank) : signals_(signals), rank_(world_rank) {}
  void on_run_start(const io::RunStart&) override;
  void boundary_flags(const io::BoundaryRound&, std::vector<int32_t>& flags) override;
  void on_boundary(const io::BoundaryRound& round, std::span<const int32_t> agreed,
                   io::BoundaryDecision& decision) override;

 private:
  const PreemptionSignals& signals_;
  int rank_;
};

// --exit-interval N: stop after every N-th step (the same on every rank, so
// nothing to agree on).
class ExitInterval : public io::TrainingComponent {
 public:
  explicit ExitInterval(const TrainConfig& config) : config_(config) {}
  void on_boundary(const io::BoundaryRound& round, std::span<const int32_t> agreed,
                   io::BoundaryDecision& decision) override;

 private:
  const TrainConfig& config_;
};

}  // namespace tessera::app

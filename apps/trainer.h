// The training loop behind `tessera train`: builds the model, optimizer,
// schedule and loaders from a TrainConfig, runs the steps (micro-batches with
// gradient accumulation, global-norm clipping, loss scaling for fp16,
// skipping non-finite steps), evaluates, and reports progress, metrics and a
// trace. One process for now; data-parallel ranks arrive with the parallel
// runtime.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "apps/train_config.h"

namespace tessera::app {

struct EvalResult {
  double loss = 0.0;                     // mean over the evaluated targets (nats)
  std::optional<double> accuracy;        // classifiers
  int64_t count = 0;                     // targets evaluated
};

struct TrainResult {
  int64_t steps = 0;                     // optimizer steps run (skipped ones included)
  int64_t skipped_steps = 0;
  double last_loss = 0.0;                // training loss of the last step
  std::optional<EvalResult> final_eval;  // when --eval-data was given
  double median_ms_per_step = 0.0;
};

// Runs the whole training; throws tessera::Error for bad configurations,
// data, or a run that cannot go on (e.g. non-finite gradients K steps in a row).
TrainResult train(const TrainConfig& config);

}  // namespace tessera::app

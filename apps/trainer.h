// The training loop behind `tessera train`: builds the model, optimizer,
// schedule and loaders from a TrainConfig, runs the steps (micro-batches with
// gradient accumulation, global-norm clipping, loss scaling for fp16,
// skipping non-finite steps), evaluates, and reports progress, metrics and a
// trace, on every rank of the MPI world (data parallelism: parallel/data_parallel.h).
//
// MPI: train() runs on the ranks of MPI_COMM_WORLD when MPI is initialised
// (`tessera train` initialises it in main() for the life of the process; MPI
// test harnesses do it themselves), and as a single process with no MPI call
// otherwise (in-process tests). It never initialises or finalises MPI itself,
// so it can be called several times in one process.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "apps/train_config.h"
#include "core/dtype.h"
#include "nn/models.h"
#include "nn/optimizer.h"
#include "parallel/communicator.h"

namespace tessera::app {

struct EvalResult {
  double loss = 0.0;               // mean over the evaluated targets (nats)
  std::optional<double> accuracy;  // classifiers
  int64_t count = 0;               // targets evaluated
};

struct TrainResult {
  int64_t steps = 0;  // optimizer steps run by this call (skipped ones included)
  int64_t skipped_steps = 0;
  double last_loss = 0.0;                // training loss of the last step
  std::optional<EvalResult> final_eval;  // when --eval-data was given
  double median_ms_per_step = 0.0;
  std::vector<double> losses;         // every step's training loss, averaged over the ranks (same on all)
  int data_parallel_size = 1;         // ranks that trained the model together
  int64_t optimizer_state_bytes = 0;  // this rank's optimizer state (1/dp of it under --zero 1-3)
  // This rank's peak bytes over the steps, by the allocator's counters per
  // MemoryUse: parameters, gradients, optimizer state, the rest (activations,
  // workspaces, batches), and parameters + gradients + optimizer at one time.
  struct PeakMemory {
    int64_t parameters = 0, gradients = 0, optimizer = 0, activations = 0, model_state = 0;
  } peak_memory;
  // --estimate-memory: every rank's predicted parameters, gradients and
  // optimizer bytes (parallel/memory_plan.h), in rank order; no steps run.
  std::vector<std::array<int64_t, 3>> memory_estimate;

  // Checkpoints and resuming.
  int64_t start_step = 0;    // the step this call began at (the checkpoint's when resumed, else 0)
  int64_t final_step = 0;    // the step it reached
  std::string resumed_from;  // the checkpoint it resumed from (empty: a fresh start)
  std::string checkpoint;    // the last checkpoint it wrote (empty: none)
  double checkpoint_stall_ms = 0.0;  // time the step loop waited for saves, all together
  int stop_signal = 0;       // SIGTERM or SIGUSR1 that stopped the run before the end (0: none)
  // The process's exit status: 0, or 128 + the signal when a signal stopped a
  // run that had no --save directory (so the job is not mistaken for done).
  int exit_code() const { return stop_signal != 0 && checkpoint.empty() ? 128 + stop_signal : 0; }
};

// Runs the whole training; throws tessera::Error for bad configurations,
// data, or a run that cannot go on (e.g. non-finite gradients K steps in a row).
//
// Checkpoints (apps/train_checkpoint.h): with --save DIR it writes one every
// --save-interval steps and at the end; --resume auto|PATH goes on from one
// (bit for bit as if never stopped, on any dp size and --zero setting).
// While it runs, SIGTERM and SIGUSR1 (apps/preemption.h) make every rank stop
// at the next step boundary, writing a checkpoint first when --save is set;
// the result says which signal (stop_signal) and exit_code() what the
// process should return.
TrainResult train(const TrainConfig& config);
// The same on the ranks of `world` (e.g. a group of one for a single-rank
// reference run inside an MPI job); --device cuda means cuda:0 here.
TrainResult train(const TrainConfig& config, parallel::Communicator& world);

// What `train` would build from `config`, without data (the vocabulary is
// --vocab-size's): the model, the compute dtype (--precision) and the
// optimizer. `tessera plan` sizes its predictions by them.
nn::ModelConfig model_of(const TrainConfig& config);
DType dtype_of(const TrainConfig& config);
nn::OptimizerConfig optimizer_of(const TrainConfig& config);

}  // namespace tessera::app

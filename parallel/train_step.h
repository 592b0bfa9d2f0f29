// TrainStep: one optimizer step of training on this rank, the same code for
// every layout (data, tensor and pipeline parallelism, ZeRO-1, gradient
// accumulation, fp16 loss scaling). Given this rank's stage of the model (a
// pipeline stage, split over its tensor-parallel group: parallel/
// tensor_parallel.h), the loss, the data-parallel replica and the loss
// scaler, run() does, in order:
//   1. the micro-batches' forwards and backwards through the pipeline
//      schedule (PipelineEngine; one stage is the degenerate pipeline, F0 B0
//      F1 B1 ..., with no exchanges), gradients accumulated; the
//      data-parallel buckets of the last micro-batch reduced as backward
//      completes them (when no tied embedding waits for its sum);
//   2. the tied embedding's gradient summed between the first and last stage;
//   3. the data-parallel reduction finished (every bucket averaged);
//   4. the loss: the last stage's, shared over the pipeline, averaged over
//      the replicas;
//   5. the global gradient norm, the loss scaler's update and the
//      non-finite check (skip the step), clipping, and the optimizer step.
// The caller (apps/trainer.cpp) fetches the micro-batches, keeps the
// learning-rate schedule, metrics, evaluation and checkpoints.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "nn/grad_scaler.h"
#include "nn/loss.h"
#include "nn/module.h"
#include "nn/optimizer.h"
#include "parallel/communicator.h"
#include "parallel/data_parallel.h"
#include "parallel/pipeline.h"

namespace tessera::parallel {

// What one rank's step is made of. Every pointer must outlive the TrainStep.
struct TrainStepParts {
  Context* context = nullptr;   // where the loss is averaged
  Device device;                // the training device
  nn::Module* model = nullptr;  // this rank's stage (the whole model when pp = 1)
  // Interleaved 1F1B: this rank's model chunks in local order (StageModel::chunks);
  // empty: `model` is the stage's one chunk.
  std::vector<nn::Module*> chunks{};
  const nn::Loss* loss = nullptr;         // used on the last stage
  DataParallel* replica = nullptr;        // the stage's parameters over the data-parallel ranks
  nn::GradScaler* scaler = nullptr;       // fp16 dynamic loss scaling (disabled for f32/bf16)
  Communicator* pipeline = nullptr;       // the pipeline axis (rank = stage); a group of one when pp = 1
  Communicator* data_parallel = nullptr;  // the replicas the loss is averaged over (dp, or dp × cp)
  // The ranks that read different samples (the dp axis): each draws its own
  // dropout masks, micro-batch index micro·size + rank; null: data_parallel.
  // (Context-parallel ranks share their samples, and so their masks.)
  Communicator* samples = nullptr;
  // pp > 1: the first and last stage of one tensor-parallel rank, and this
  // stage's copy of the tied embedding table (null on middle stages), whose
  // gradients are summed after the flush. Null when pp = 1.
  Communicator* embedding_group = nullptr;
  nn::Parameter* tied_table = nullptr;
  // The schedule, and the clock and event callback that trace the step: the
  // engine's forwards, backwards and exchanges, and the driver's
  // "embedding_grad_sync", "grad_sync" (comm) and "optimizer" (compute).
  PipelineOptions pipeline_options{};
  uint64_t seed = 0;       // dropout streams: Pass{seed, step, micro·dp + dp rank}
  double clip_grad = 0.0;  // global gradient-norm clipping (0: none)
};

// One step's micro-batches, as this rank needs them.
struct StepBatches {
  std::vector<Tensor> inputs;   // first stage: each micro-batch's model input
  std::vector<Tensor> targets;  // last stage: each micro-batch's targets
  Shape stage_input_shape;      // stages after the first: the activation they receive
  DType activation_dtype = DType::f32;
};

struct StepResult {
  double loss = 0.0;        // the mean loss of the step's micro-batches, averaged over the replicas
  double grad_norm = 0.0;   // the global gradient norm before clipping (loss scale removed)
  bool finite = true;       // every gradient was finite
  bool skipped = false;     // no update: non-finite gradients (fp16: the scale backs off)
  float loss_scale = 1.0f;  // the scale this step's gradients carried
  PipelineStepStats pipeline;
  ReductionStats reduction;
};

// Values only the stage with the loss computes (the step's loss,
// evaluation's sums and counts), made the same on every rank: broadcast from
// `loss_stage` (PipelineEngine::loss_stage(); -1: the last stage) over
// `pipeline` (what the other stages held is overwritten), then reduced with
// `op` over the data-parallel replicas (all launched, then awaited).
void share_last_stage_values(std::vector<Tensor> values, Communicator& pipeline, Communicator& data_parallel,
                             ReduceOp op, int loss_stage = -1);

class TrainStep {
 public:
  explicit TrainStep(TrainStepParts parts);

  // Step `step` (0-based) at learning rate `lr`. `poison_gradients` makes
  // this rank's gradients NaN (TESSERA_FAULT=nan_grad), to test the skip.
  StepResult run(int64_t step, const StepBatches& batches, double lr, bool poison_gradients = false);

  PipelineEngine& engine() { return engine_; }
  // Whether the last micro-batch's buckets are reduced during backward.
  bool reduces_in_backward() const { return !tied_table_ || parts_.replica->reduced_after_backward(*tied_table_); }

 private:
  TrainStepParts parts_;
  PipelineEngine engine_;
  nn::Parameter* tied_table_ = nullptr;  // non-null when its gradient must be summed first
};

}  // namespace tessera::parallel

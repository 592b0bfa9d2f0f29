// Evaluation during training (--eval-data): the sharded evaluation pass, and
// the component of the training loop (io/training_events.h) that runs it
// every --eval-interval steps (0: once per epoch of the training data) and
// after the last step, and announces each to the other components (the
// metrics file, MLflow, the progress line, the monitor).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>

#include "apps/train_config.h"
#include "apps/trainer.h"
#include "core/context.h"
#include "io/dataset.h"
#include "io/trace.h"
#include "io/training_events.h"
#include "nn/loss.h"
#include "nn/module.h"
#include "parallel/communicator.h"
#include "parallel/pipeline.h"

namespace tessera::app {

// What evaluation runs on: this rank's stage of the model and its loss, its
// data-parallel group, and under pipeline parallelism (`engine` non-null)
// how batches flow through the stages.
struct EvalModel {
  Context& context;
  nn::Module& model;
  const nn::Loss& loss;
  Device device;
  DType dtype;
  parallel::Communicator& data_parallel;             // the batches are shared out over its ranks
  parallel::Communicator& replicas;                  // the sums are summed over it: dp, or dp × cp
  parallel::PipelineEngine* engine = nullptr;
  parallel::Communicator* stages = nullptr;         // the pipeline axis
  std::function<Shape(const Tensor&)> input_shape;  // what a stage after the first receives for a batch's inputs
  // Under context parallelism the positions of each sequence this rank
  // holds (its zigzag share of the tokens); empty: all of them.
  std::vector<int64_t> token_positions{};
};

// Collective over the data-parallel (and pipeline) ranks: --eval-data's
// loss (and a classifier's accuracy) over --eval-iters global batches (0:
// all of it).
EvalResult evaluate(const TrainConfig& config, const EvalModel& model, io::TraceWriter& trace);

// The evaluation data's tokens per byte of text (a language model's, when
// the file knows its text's bytes: io::DatasetInfo::text_bytes).
std::optional<double> tokens_per_byte(const std::optional<io::DatasetInfo>& eval_data, bool tokens);

class EvaluationCadence : public io::TrainingComponent {
 public:
  // `batches_per_epoch`: the training data's micro-batches per epoch (0:
  // synthetic data, no epochs), `micro_batches` a step's; `events`: where
  // evaluations are announced.
  EvaluationCadence(const TrainConfig& config, EvalModel model, io::TraceWriter& trace,
                    std::optional<double> tokens_per_byte, int64_t batches_per_epoch, int64_t micro_batches,
                    io::TrainingEvents& events, TrainResult& result);
  void on_step_end(io::StepEnd& end) override;

 private:
  bool due(int64_t step, bool last) const;

  const TrainConfig& config_;
  EvalModel model_;
  io::TraceWriter& trace_;
  std::optional<double> tokens_per_byte_;
  int64_t steps_per_epoch_ = 0;  // evaluating once per epoch: its steps (0: not per epoch)
  io::TrainingEvents& events_;
  TrainResult& result_;
};

}  // namespace tessera::app

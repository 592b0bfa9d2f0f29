// Pipeline parallelism: a model's layers split into `pp` consecutive stages
// on the ranks of the pipeline axis, micro-batches streamed through them.
//
//   partition_layers       which layers each stage holds: balanced by
//                          parameter count (the embedding counting on the
//                          first stage, the head on the last) or given
//                          (--pipeline-split 0,5,9,12)
//   PipelineEngine         runs one optimizer step's schedule
//                          (parallel/pipeline_schedule.h) on this stage:
//                          forwards and backwards of its stage Module,
//                          activations and gradients exchanged with the
//                          neighbour stages by grouped send/recv (shapes
//                          agreed up front: no metadata travels), the loss
//                          on the last stage
//
// A micro-batch's saved activations are freed as soon as its backward is
// done, so under 1F1B a stage holds at most `pp` micro-batches' activations.
// Under interleaving (Megatron's virtual pipeline stages) a rank holds V
// chunks of the model (pipeline_schedule.h), and the engine runs the units
// (micro-batch, chunk) in the interleaved order, the last stage sending to the
// first between rounds.
// What comes after the flush — summing the tied embedding's gradient between
// the first and last stage, the data-parallel reduction, the optimizer — is
// TrainStep's (parallel/train_step.h), which runs every layout through this
// engine (one stage: F0 B0 F1 B1 ..., no exchanges).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "nn/loss.h"
#include "nn/module.h"
#include "parallel/communicator.h"
#include "parallel/pipeline_schedule.h"

namespace tessera::parallel {

// Stage boundaries over `costs.size()` layers: a list of stages + 1 layer
// indices, 0 first and the layer count last, stage s holding layers
// [bounds[s], bounds[s + 1]), each at least one layer. Minimises the
// largest stage cost, the first stage also paying `first_extra` and the last
// `last_extra` (embedding and head). Throws naming the numbers when there are
// fewer layers than stages.
std::vector<int64_t> partition_layers(const std::vector<int64_t>& costs, int64_t first_extra, int64_t last_extra,
                                      int stages);

// --pipeline-split "0,5,9,12": the boundaries for `stages` stages over
// `layers` layers, checked (starts at 0, ends at `layers`, increasing, one
// more entry than stages) with a message that names what is wrong.
std::vector<int64_t> parse_pipeline_split(std::string_view text, int64_t layers, int stages);

// Timings of one step on this stage, on the caller's clock (nanoseconds).
struct PipelineStepStats {
  int64_t start_ns = 0, end_ns = 0;
  int64_t compute_ns = 0;  // forwards, backwards and the loss
  int max_in_flight = 0;   // units (micro-batch, chunk) forwarded and not yet backwarded, at most
  double loss_sum = 0.0;   // the last stage: the micro-batches' mean losses, summed; 0 elsewhere
  int64_t idle_ns() const { return end_ns - start_ns - compute_ns; }
};

struct PipelineOptions {
  PipelineScheduleKind schedule = PipelineScheduleKind::one_f_one_b;
  // Nanoseconds on the caller's timeline; empty: the steady clock.
  std::function<int64_t()> clock{};
  // Called after each forward ("forward 3"), backward and exchange ("p2p"),
  // e.g. to write a trace event; empty: nothing.
  std::function<void(const std::string& name, const std::string& category, int64_t start_ns, int64_t end_ns)>
      on_event{};
};

// The micro-batches of one step and what the schedule needs per micro-batch.
struct PipelineStep {
  int micro_batches = 1;
  std::vector<Tensor> inputs;   // first stage: each micro-batch's model input
  std::vector<Tensor> targets;  // last stage: each micro-batch's targets
  Shape input_shape;            // every chunk but the model's first: the activation received (agreed up front)
  DType activation_dtype = DType::f32;
  float loss_scale = 1.0f;                  // the loss gradient is loss_scale / micro_batches
  std::function<nn::Pass(int micro)> pass;  // the Pass of micro-batch m (dropout streams)
  // Before each backward unit, e.g. DataParallel::begin_micro_batch; `last`:
  // the stage's last backward of the step (its gradients are then complete
  // once it ends). May be empty.
  std::function<void(int micro, bool last)> before_backward;
};

class PipelineEngine {
 public:
  // `stage` is this rank's stage of the model; `pipeline` the pipeline axis's
  // communicator (rank = stage index); `loss` is used on the last stage.
  PipelineEngine(nn::Module& stage, Communicator& pipeline, const nn::Loss& loss, PipelineOptions options = {});
  // Interleaved: this rank's `chunks` (local chunk v is the model's chunk
  // v·P + stage); the loss is used after the model's last chunk.
  PipelineEngine(std::vector<nn::Module*> chunks, Communicator& pipeline, const nn::Loss& loss,
                 PipelineOptions options = {});

  // Runs the schedule for one step: every micro-batch forward and backward
  // through the pipeline, gradients accumulated into the stage's parameters.
  PipelineStepStats run(const PipelineStep& step);

  // Forward only (evaluation): `input` (read on the first stage) through
  // every stage, each stage after the first receiving `input_shape` from
  // its predecessor; returns the output of the model's last chunk (the
  // logits) on loss_stage(), an undefined Tensor on the other stages.
  Tensor forward_only(const Tensor& input, const Shape& input_shape, DType activation_dtype, const nn::Pass& pass);

  // The stage that holds the model's last chunk and computes the loss (the
  // last stage; the first under a V-shaped schedule, zbv).
  int loss_stage() const;
  int stage() const { return pipeline_.rank(); }
  int stages() const { return pipeline_.size(); }
  int chunks() const { return int(chunks_.size()); }

 private:
  class StepRun;
  int64_t now() const;
  std::vector<nn::Module*> chunks_;
  Communicator& pipeline_;
  const nn::Loss& loss_;
  PipelineOptions options_;
};

}  // namespace tessera::parallel

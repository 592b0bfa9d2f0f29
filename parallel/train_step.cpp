// TrainStep: one optimizer step for every layout (see train_step.h).
#include "parallel/train_step.h"

#include <chrono>
#include <limits>
#include <utility>

#include "core/context.h"
#include "core/error.h"

namespace tessera::parallel {
namespace {

// Reports [construction, destruction) as one event through the options' clock and callback.
class StepEvent {
 public:
  StepEvent(const PipelineOptions& options, const char* name, const char* category)
      : options_(options), name_(name), category_(category), start_(now()) {}
  ~StepEvent() {
    if (options_.on_event) options_.on_event(name_, category_, start_, now());
  }
  StepEvent(const StepEvent&) = delete;
  StepEvent& operator=(const StepEvent&) = delete;

 private:
  int64_t now() const {
    if (options_.clock) return options_.clock();
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  const PipelineOptions& options_;
  const char* name_;
  const char* category_;
  int64_t start_;
};

TrainStepParts checked(TrainStepParts parts) {
  TESSERA_CHECK(parts.context && parts.model && parts.loss && parts.replica && parts.scaler && parts.pipeline &&
                    parts.data_parallel,
                "TrainStep: the context, model, loss, replica, scaler, pipeline and data-parallel communicators are "
                "required");
  return parts;
}

}  // namespace

void share_last_stage_values(std::vector<Tensor> values, Communicator& pipeline, Communicator& data_parallel,
                             ReduceOp op, int loss_stage) {
  if (pipeline.size() > 1)
    for (Tensor& value : values) pipeline.broadcast(value, loss_stage < 0 ? pipeline.size() - 1 : loss_stage)->wait();
  if (data_parallel.size() == 1) return;
  std::vector<CommHandle> reductions;
  for (Tensor& value : values) reductions.push_back(data_parallel.all_reduce(value, op));
  for (CommHandle& reduction : reductions) reduction->wait();
}

TrainStep::TrainStep(TrainStepParts parts)
    : parts_(checked(std::move(parts))),
      engine_(parts_.chunks.empty() ? std::vector<nn::Module*>{parts_.model} : parts_.chunks, *parts_.pipeline,
              *parts_.loss, parts_.pipeline_options),
      tied_table_(parts_.embedding_group && parts_.embedding_group->size() > 1 ? parts_.tied_table : nullptr) {}

StepResult TrainStep::run(int64_t step, const StepBatches& batches, double lr, bool poison_gradients) {
  DataParallel& replica = *parts_.replica;
  Communicator& dp = *parts_.data_parallel;
  Communicator& pipeline = *parts_.pipeline;
  const int micro_batches = int(std::max(batches.inputs.size(), batches.targets.size()));
  TESSERA_CHECK(micro_batches > 0, "TrainStep::run: step ", step + 1, " has no micro-batches");
  StepResult result;
  result.loss_scale = poison_gradients ? std::numeric_limits<float>::quiet_NaN() : parts_.scaler->scale();

  // 1. Forwards and backwards. The last micro-batch's buckets are reduced as
  //    its backward completes them, except a tied table's: unless the replica
  //    holds it back (DataParallelOptions::reduced_after_backward), every
  //    bucket waits for the sum below.
  replica.begin_step();
  PipelineStep schedule;
  schedule.micro_batches = micro_batches;
  schedule.inputs = batches.inputs;
  schedule.targets = batches.targets;
  schedule.input_shape = batches.stage_input_shape;
  schedule.activation_dtype = batches.activation_dtype;
  schedule.loss_scale = result.loss_scale;
  const Communicator& samples = parts_.samples ? *parts_.samples : dp;
  const uint64_t dp_size = uint64_t(samples.size()), dp_rank = uint64_t(samples.rank()), seed = parts_.seed;
  const float gradient_scale = result.loss_scale / float(micro_batches);  // the loss's, as the pipeline applies it
  schedule.pass = [seed, step, dp_size, dp_rank, gradient_scale](int micro) {
    // Each replica draws its own dropout masks: micro-batch index micro·dp + rank.
    return nn::Pass{seed, uint64_t(step), uint64_t(micro) * dp_size + dp_rank, nullptr, gradient_scale};
  };
  const bool in_backward = reduces_in_backward();
  // Only the stage's last backward unit completes gradients (under
  // interleaving, the other chunks' last units come earlier; their buckets
  // start in finish_backward()).
  schedule.before_backward = [&replica, in_backward](int, bool last) {
    replica.begin_micro_batch(in_backward && last);
  };
  result.pipeline = engine_.run(schedule);

  // 2. The first stage's table and the last stage's tied copy: one gradient.
  if (tied_table_) {
    StepEvent event(parts_.pipeline_options, "embedding_grad_sync", "comm");
    parts_.embedding_group->all_reduce(tied_table_->grad, ReduceOp::sum)->wait();
  }
  // 3. The data-parallel reduction: the buckets not yet launched, then all awaited.
  {
    StepEvent event(parts_.pipeline_options, "grad_sync", "comm");
    if (!in_backward) replica.begin_micro_batch(true);
    replica.finish_backward();
  }
  result.reduction = replica.last_reduction();

  // 4. The loss is the last stage's: shared over the pipeline, averaged over the replicas.
  Tensor loss =
      parts_.context->from_vector(Shape{1}, std::vector<float>{float(result.pipeline.loss_sum)}, parts_.device);
  share_last_stage_values({loss}, pipeline, dp, ReduceOp::avg, engine_.loss_stage());
  result.loss = double(loss.to_vector<float>()[0]) / double(micro_batches);

  // 5. Norm, loss scale, skip, clip, update.
  StepEvent event(parts_.pipeline_options, "optimizer", "compute");
  const nn::GradNorm norm = replica.grad_norm();  // global over the ranks, the same on each
  result.finite = norm.finite;
  result.grad_norm = norm.norm / result.loss_scale;
  result.skipped = parts_.scaler->update(!norm.finite) || !norm.finite;
  if (!result.skipped)
    replica.step(lr, nn::clip_coefficient(norm.norm / result.loss_scale, parts_.clip_grad) / result.loss_scale);
  return result;
}

}  // namespace tessera::parallel

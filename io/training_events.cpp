// TrainingEvents (io/training_events.h): the events handed to the
// components in registration order, and the step boundary's rounds of
// agreement (one all-reduce each), save and stop.
#include "io/training_events.h"

namespace tessera::io {

void BoundaryDecision::request_stop(StopRequest request) {
  if (last_ || stop_) return;
  stop_ = std::move(request);
}

TrainingEvents::TrainingEvents(parallel::Communicator& world, Context& context, Device device)
    : world_(world), context_(context), device_(device) {}

TrainingEvents::~TrainingEvents() {
  while (!components_.empty()) components_.pop_back();
}

void TrainingEvents::run_start(const RunStart& event) {
  for (const auto& component : components_) component->on_run_start(event);
}

void TrainingEvents::step_begin(const StepBegin& event) {
  for (const auto& component : components_) component->on_step_begin(event);
}

void TrainingEvents::step_end(StepEnd& event) {
  for (const auto& component : components_) component->on_step_end(event);
}

void TrainingEvents::evaluation(const EvalEnd& event) {
  for (const auto& component : components_) component->on_evaluation(event);
}

void TrainingEvents::save(Save& event) {
  for (const auto& component : components_) component->on_save(event);
}

void TrainingEvents::stop(const Stop& event) {
  for (const auto& component : components_) component->on_stop(event);
}

void TrainingEvents::run_end(const RunEnd& event) {
  for (const auto& component : components_) component->on_run_end(event);
}

// Every component's flags, agreed as their maximum over the world in one
// all-reduce (issued by every rank at the same point: the same components
// give as many flags on every rank), then every component's decision.
BoundaryDecision TrainingEvents::agree(const BoundaryRound& round) {
  std::vector<int32_t> flags;
  std::vector<size_t> ends;  // where each component's flags end
  for (const auto& component : components_) {
    component->boundary_flags(round, flags);
    ends.push_back(flags.size());
  }
  if (world_.size() > 1 && !flags.empty()) {
    Tensor agreed = context_.from_vector(Shape{int64_t(flags.size())}, flags, device_);
    world_.all_reduce(agreed, parallel::ReduceOp::max)->wait();
    flags = agreed.to_vector<int32_t>();
  }
  BoundaryDecision decision(round.last);
  size_t begin = 0;
  for (size_t i = 0; i < components_.size(); ++i) {
    components_[i]->on_boundary(round, std::span<const int32_t>(flags.data() + begin, ends[i] - begin), decision);
    begin = ends[i];
  }
  return decision;
}

// Round 1, then the save when one is due (a stop's and the last step's are
// final); after a save that was not final, round 2 asks once more, so that a
// stop asked while it was written (a signal) is served by that checkpoint.
std::optional<StopRequest> TrainingEvents::step_boundary(int64_t step, bool last) {
  const BoundaryDecision decision = agree(BoundaryRound{step, last, false});
  std::optional<StopRequest> stop = decision.stop();
  if (last || stop || decision.save()) {
    Save checkpoint{step, last || stop.has_value()};
    save(checkpoint);
    if (checkpoint.written && !checkpoint.final) stop = agree(BoundaryRound{step, last, true}).stop();
  }
  if (stop) this->stop(Stop{step, *stop, false});
  return stop;
}

}  // namespace tessera::io

// The training loop's events, and the components that attach to them: a run
// feature (the metrics file, the progress line, Prometheus, MLflow, samples,
// evaluation, checkpoint cadence, stop decisions) is a TrainingComponent
// registered once with TrainingEvents, never code in the loop. The loop
// (apps/trainer.cpp) raises the events; TrainingEvents hands each to every
// component in registration order, and runs the step boundary's collective
// protocol (agree, save, stop) so that every rank decides alike.
//
// Events of a run, in order:
//   on_run_start                       once, before the first step
//   per step:
//     on_step_begin                    before the step's data is read
//     on_step_end                      the step's record: components add
//                                      figures to it, then log or show it
//       on_evaluation                  when a component evaluated (it
//                                      announces it through evaluation())
//     the step boundary (step_boundary()):
//       boundary_flags / on_boundary   round 1: each component's flags
//                                      agreed over the world (one all-reduce,
//                                      max), then its decision: stop, save
//       on_save                        a checkpoint is due (the run's end, a
//                                      stop, or a component asked)
//       boundary_flags / on_boundary   round 2 (after_save), only after a
//                                      save that was not final: a stop asked
//                                      during the save (the checkpoint serves)
//       on_stop                        the run stops before its last step
//   on_run_end                         the run reached its end or stopped
// An error ends the run by an exception: no on_run_end (components release
// what they hold in their destructors); an error the loop raises itself
// (too many non-finite steps) is preceded by on_stop with Stop::error, so a
// background checkpoint is published first.
//
// Order: registration order is dispatch order for every event, and it
// matters where one component's output feeds another's: figures added to
// the record in on_step_end (memory, checkpoint figures, the straggler
// exchange) must come from components registered before the ones that log
// the record (metrics, MLflow, the progress line); a stop asked earlier wins
// over one asked later (a signal over --exit-interval). The registration
// list in apps/trainer.cpp (register_components) says the order and why.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/context.h"
#include "core/device.h"
#include "io/metrics.h"
#include "parallel/communicator.h"

namespace tessera::io {

// The run is about to take its first step.
struct RunStart {
  int64_t start_step = 0;   // steps already done (a resumed checkpoint's)
  int64_t total_steps = 0;  // the step the run ends at
};

// Step `step` (1-based: the steps done once it ends) begins.
struct StepBegin {
  int64_t step = 0;
};

// Step `step` ended. `record` is what the metrics file, MLflow and the
// progress line log: components that measure add to record.extra.
struct StepEnd {
  int64_t step = 0;   // 1-based
  bool last = false;  // the run's last step
  StepRecord& record;
  double seconds = 0.0;            // the whole step, injected faults included
  double data_wait_seconds = 0.0;  // waiting for the loader's batches
  double sync_seconds = 0.0;       // gradient synchronisation after backward (exposed communication)
};

// An evaluation after step record.step.
struct EvalEnd {
  EvalRecord record;
  int64_t count = 0;  // targets evaluated
  bool last = false;  // after the run's last step
};

// One round of agreement at the boundary after step `step`.
struct BoundaryRound {
  int64_t step = 0;
  bool last = false;
  bool after_save = false;  // round 2: right after a save this boundary made (not a final one)
};

// Why the run stops before its last step, in words for the user
// ("SIGTERM received by rank 1; stopped after step 12"), and the signal that
// asked (0: none), which decides the process's exit status.
struct StopRequest {
  std::string why;
  int signal = 0;
};

// What a round decided, from every component's on_boundary.
class BoundaryDecision {
 public:
  explicit BoundaryDecision(bool last) : last_(last) {}
  // Stop after this step. The first request wins; at the last step a
  // request changes nothing (the run ends there anyway).
  void request_stop(StopRequest request);
  // A checkpoint at this boundary (the run's end and a stop have one anyway).
  void request_save() { save_ = true; }

  const std::optional<StopRequest>& stop() const { return stop_; }
  bool save() const { return save_; }

 private:
  bool last_;
  std::optional<StopRequest> stop_;
  bool save_ = false;
};

// A checkpoint is due after step `step` (0: the run ends before its first
// step, --train-steps 0). The component that writes checkpoints writes it
// and sets `written`; without one (no --save) nothing is written.
struct Save {
  int64_t step = 0;
  bool final = false;  // the run ends after it (its end, a stop): published before the loop goes on
  bool written = false;
};

// The run stops after step `step`, before its last.
struct Stop {
  int64_t step = 0;
  StopRequest request;
  bool error = false;  // the loop is about to throw (e.g. too many non-finite steps in a row)
};

// The run ended after step `final_step`; `stop_reason` says why it stopped
// early and how to go on (empty: it reached its last step).
struct RunEnd {
  int64_t final_step = 0;
  std::string stop_reason;
};

// A run feature. Every event has a body that does nothing: override those
// the feature needs. Collective work in an event (a component's own
// exchange, a save) must be done alike on every rank: every rank registers
// the same components in the same order and receives the same events.
class TrainingComponent {
 public:
  virtual ~TrainingComponent() = default;

  virtual void on_run_start(const RunStart&) {}
  virtual void on_step_begin(const StepBegin&) {}
  virtual void on_step_end(StepEnd&) {}
  virtual void on_evaluation(const EvalEnd&) {}
  // Appends this component's flags for the round (as many on every rank,
  // each round; 0 and 1, a signal's number, a rank...). They are agreed as
  // their maximum over the world ranks.
  virtual void boundary_flags(const BoundaryRound&, std::vector<int32_t>&) {}
  // `agreed`: this component's flags after the agreement (the same on every
  // rank). May act (collectively) and ask the decision to stop or save.
  virtual void on_boundary(const BoundaryRound&, std::span<const int32_t> /*agreed*/, BoundaryDecision&) {}
  virtual void on_save(Save&) {}
  virtual void on_stop(const Stop&) {}
  virtual void on_run_end(const RunEnd&) {}
};

class TrainingEvents {
 public:
  // The boundary's flags are agreed over `world` as a tensor on `device`
  // (which every communicator backend moves).
  TrainingEvents(parallel::Communicator& world, Context& context, Device device);
  ~TrainingEvents();  // the components, last registered first
  TrainingEvents(const TrainingEvents&) = delete;
  TrainingEvents& operator=(const TrainingEvents&) = delete;

  // Registers `component` after those registered before it; returns it.
  template <class Component>
  Component& add(std::unique_ptr<Component> component) {
    Component& added = *component;
    components_.push_back(std::move(component));
    return added;
  }

  void run_start(const RunStart& event);
  void step_begin(const StepBegin& event);
  void step_end(StepEnd& event);
  // Called by a component that evaluated (during its on_step_end).
  void evaluation(const EvalEnd& event);
  // Collective: the boundary after step `step` (its rounds, the save, the
  // stop). Returns the stop, if the run stops here.
  std::optional<StopRequest> step_boundary(int64_t step, bool last);
  // Collective: a checkpoint outside a boundary (the run's end at step 0).
  void save(Save& event);
  // Collective where the components publish: the run stops (the loop's own
  // error: Stop::error, before it throws).
  void stop(const Stop& event);
  void run_end(const RunEnd& event);

 private:
  BoundaryDecision agree(const BoundaryRound& round);

  parallel::Communicator& world_;
  Context& context_;
  Device device_;
  std::vector<std::unique_ptr<TrainingComponent>> components_;
};

}  // namespace tessera::io

// What a running `tessera train` shows the outside besides its own output:
// every --log-interval steps (and at the last) the ranks all-gather a few
// figures of the steps since the last exchange (one small collective of
// host doubles), and rank 0
//   - names a straggler: the rank whose compute time per step (the step less
//     its data wait and its exposed gradient synchronisation) exceeds the
//     median of all ranks' by more than --straggler-threshold, as Megatron's
//     straggler detector does; in a synchronous job the others spend that
//     time waiting in communication, so step times alone would not show it;
//   - renders every rank's series (label rank="r") in the Prometheus text
//     format for --metrics-port (served by rank 0: one scrape target per job)
//     and --metrics-push (a Pushgateway).
// The straggler figures also go into the metrics record of that step.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "apps/train_config.h"
#include "core/allocator.h"
#include "core/context.h"
#include "io/metrics.h"
#include "io/prometheus.h"
#include "parallel/process_grid.h"

namespace tessera::app {

// One step as this rank saw it.
struct StepFigures {
  double step_seconds = 0.0;       // the whole step, injected faults included
  double data_wait_seconds = 0.0;  // waiting for the loader's batches
  double sync_seconds = 0.0;       // gradient synchronisation after backward (exposed communication)
  double checkpoint_stall_seconds = 0.0;
};

// A straggler found at an exchange.
struct Straggler {
  int rank = -1;
  double compute_seconds = 0.0, median_seconds = 0.0;  // per step, over the window
  double slowdown() const { return median_seconds > 0.0 ? compute_seconds / median_seconds : 0.0; }
};

class TrainingMonitor {
 public:
  // Starts rank 0's endpoint (--metrics-port) and pusher (--metrics-push);
  // `say` prints a line for people (rank 0's progress output).
  TrainingMonitor(const TrainConfig& config, parallel::ProcessGrid& grid, Context& context, Device device,
                  std::function<void(const std::string&)> say);
  ~TrainingMonitor();

  void record_step(const io::StepRecord& record, const StepFigures& figures);
  void record_eval(double eval_loss) { eval_loss_ = eval_loss; }
  // Collective over the world when due (every --log-interval steps and the
  // last step): exchanges, reports a straggler, publishes to Prometheus;
  // returns what to add to the step's metrics record (straggler_rank,
  // straggler_slowdown).
  std::vector<std::pair<std::string, double>> exchange(int64_t step, bool last);

  const std::vector<Straggler>& stragglers() const { return stragglers_; }
  int metrics_port() const;  // the bound port (0: none)

 private:
  std::vector<double> local_figures() const;
  std::optional<Straggler> find_straggler(const std::vector<std::vector<double>>& ranks) const;
  std::string prometheus(const std::vector<std::vector<double>>& ranks,
                         const std::optional<Straggler>& straggler) const;

  const TrainConfig& config_;
  parallel::ProcessGrid& grid_;
  Context& context_;
  Device device_;
  std::function<void(const std::string&)> say_;
  std::unique_ptr<io::MetricsEndpoint> endpoint_;
  std::unique_ptr<io::GatewayPusher> pusher_;
  // The window since the last exchange, and totals.
  io::StepRecord last_record_;
  double window_steps_ = 0, window_step_s_ = 0, window_data_s_ = 0, window_sync_s_ = 0;
  double skipped_total_ = 0, checkpoint_stall_total_ = 0;
  double eval_loss_ = NAN;
  std::vector<Straggler> stragglers_;
};

}  // namespace tessera::app

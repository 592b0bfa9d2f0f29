// What a running `tessera train` shows the outside besides its own output:
// every --log-interval steps (and at the last) the ranks all-gather a few
// figures of the steps since the last exchange (one small collective of
// host doubles), and rank 0
//   - names a straggler: the rank whose compute time per step (the step less
//     its data wait and its exposed gradient synchronisation) exceeds the
//     median of all ranks' by more than --straggler-threshold, as Megatron's
//     straggler detector does; in a synchronous job the others spend that
//     time waiting in communication, so step times alone would not show it;
//   - renders every rank's series (labels rank="r" and node="<its host>") in
//     the Prometheus text format for --metrics-port (served by rank 0: one
//     scrape target per job) and --metrics-push (a Pushgateway), with its
//     GPU's readings through NVML (GpuMonitor) where the rank trains on one.
// The straggler figures also go into the metrics record of that step. It is
// a component of the training loop (io/training_events.h): each step's
// record and timings in, the exchange's figures out into the record, which
// is why it is registered before the components that log the record.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "apps/train_config.h"
#include "core/allocator.h"
#include "core/context.h"
#include "io/metrics.h"
#include "io/prometheus.h"
#include "io/training_events.h"
#include "parallel/nvml.h"
#include "parallel/layout.h"

namespace tessera::app {

// One step as this rank saw it.
struct StepFigures {
  double step_seconds = 0.0;       // the whole step, injected faults included
  double data_wait_seconds = 0.0;  // waiting for the loader's batches
  double sync_seconds = 0.0;       // gradient synchronisation after backward (exposed communication)
  double checkpoint_stall_seconds = 0.0;
  std::optional<double> checkpoint_write_seconds;  // a checkpoint published in this step: its write time
};

// The GPU part of an exchange: this rank's CUDA device (a whole GPU or a MIG
// slice, found in NVML by its UUID) read through NVML when the exchange is
// due (a few cheap queries), carried as kFigures doubles (NaN: no GPU, no
// NVML, not a slice, or a query that failed), and rendered by rank 0 as the
// tessera_gpu_* families (DCGM exporter's quantities in base units).
class GpuMonitor {
 public:
  // The GPU's NVML index, the slice's GPU and compute instance ids, then
  // GpuSample's fields in their order.
  static constexpr size_t kFigures = 10;

  // No GPU: figures() are all NaN.
  GpuMonitor() = default;
  // The GPU or MIG slice whose UUID is `uuid` (CUDA's, parallel::uuid_text;
  // empty when CUDA gave none), through `library` (NVML's; a stand-in in
  // tests). No NVML or no such device: as no GPU, without an error.
  explicit GpuMonitor(const std::string& uuid, const std::string& library = parallel::Nvml::kLibrary);

  bool available() const { return gpu_.has_value(); }
  std::vector<double> figures() const;
  // What a user should know about this rank's GPU series, for the log: a MIG
  // slice and the fields it cannot report, or a device NVML does not list;
  // "" for a whole GPU, or without NVML.
  const std::string& note() const { return note_; }

  // One family per quantity that at least one rank has, one series per such
  // rank (labels rank, node, gpu, and for a slice gpu_instance and
  // compute_instance); ranks[r][offset...] are rank r's figures.
  static std::vector<io::PrometheusFamily> families(const std::vector<std::vector<double>>& ranks, size_t offset,
                                                    const std::vector<std::string>& nodes);

 private:
  std::unique_ptr<parallel::Nvml> nvml_;
  std::optional<parallel::GpuLocation> gpu_;
  std::string note_;
};

// A straggler found at an exchange.
struct Straggler {
  int rank = -1;
  double compute_seconds = 0.0, median_seconds = 0.0;  // per step, over the window
  double slowdown() const { return median_seconds > 0.0 ? compute_seconds / median_seconds : 0.0; }
};

class TrainingMonitor : public io::TrainingComponent {
 public:
  // Collective over the world: gathers every rank's host name (the `node`
  // label); starts rank 0's endpoint (--metrics-port), saying where
  // Prometheus scrapes it (http://`endpoint_host`:port/metrics), and pusher
  // (--metrics-push); `say` prints a line for people (rank 0's progress
  // output). A rank training on a CUDA device reads it through NVML.
  TrainingMonitor(const TrainConfig& config, parallel::Layout& layout, Context& context, Device device,
                  std::function<void(const std::string&)> say, const std::string& endpoint_host = "localhost");
  ~TrainingMonitor() override;

  // The loop's events: record_step and exchange (its figures into the
  // record), record_eval.
  void on_step_end(io::StepEnd& end) override;
  void on_evaluation(const io::EvalEnd& eval) override { record_eval(eval.record.eval_loss); }

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
  parallel::Layout& layout_;
  Context& context_;
  Device device_;
  std::function<void(const std::string&)> say_;
  std::unique_ptr<io::MetricsEndpoint> endpoint_;
  std::unique_ptr<io::GatewayPusher> pusher_;
  std::vector<std::string> nodes_;  // every rank's host name, by world rank (rank 0)
  std::string job_id_;              // the launcher's job id (tessera_info's job_id)
  GpuMonitor gpu_;
  // The window since the last exchange, and totals.
  io::StepRecord last_record_;
  double window_steps_ = 0, window_step_s_ = 0, window_data_s_ = 0, window_sync_s_ = 0;
  double skipped_total_ = 0, checkpoint_stall_total_ = 0, checkpoint_write_s_ = NAN;
  double eval_loss_ = NAN;
  std::vector<Straggler> stragglers_;
};

}  // namespace tessera::app

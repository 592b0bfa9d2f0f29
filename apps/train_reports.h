// Components of the training loop (io/training_events.h) that measure a
// step and report it: the memory peaks and the tensor-parallel traffic the
// step's record carries, the metrics file with its Katib lines, and rank 0's
// progress line, evaluation lines and closing summary. apps/trainer.cpp
// registers them; the order there puts the measuring ones first.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "apps/train_config.h"
#include "apps/trainer.h"
#include "core/context.h"
#include "io/metrics.h"
#include "io/progress.h"
#include "io/trace.h"
#include "io/training_events.h"
#include "parallel/layout.h"

namespace tessera::app {

// Each step's peaks (the allocator's counters since the step began) by use
// into the record (mem_*_bytes) and the run's peaks (TrainResult::peak_memory);
// on an accelerator the page-locked host memory too (the loader's and the
// checkpoints' staging).
class StepMemory : public io::TrainingComponent {
 public:
  StepMemory(Context& context, Device device, TrainResult& result)
      : context_(context), device_(device), result_(result) {}
  void on_step_begin(const io::StepBegin&) override;
  void on_step_end(io::StepEnd& end) override;

 private:
  Context& context_;
  Device device_;
  TrainResult& result_;
};

// Under tensor parallelism: the bytes this rank's tensor-parallel group
// moved in the step (tp_comm_bytes, counted by the communicator).
class TensorParallelTraffic : public io::TrainingComponent {
 public:
  explicit TensorParallelTraffic(parallel::Layout& layout) : layout_(layout) {}
  void on_step_begin(const io::StepBegin&) override;
  void on_step_end(io::StepEnd& end) override;

 private:
  parallel::Layout& layout_;
  int64_t bytes_before_ = 0;
};

// Rank 0's metrics (--metrics, io/METRICS.md): what the run is, every step's
// record and every evaluation, one JSON line each (a resumed run appends to
// the file), and the Katib lines (--katib-metrics, or when Katib reads
// stdout) above the progress line every --log-interval steps and at each
// evaluation. Opens the file when made.
class MetricsLog : public io::TrainingComponent {
 public:
  MetricsLog(const TrainConfig& config, bool root, bool resumed, Device device, int data_parallel,
             io::ProgressLine& progress);
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;
  void on_run_start(const io::RunStart&) override;
  void on_step_end(io::StepEnd& end) override;
  void on_evaluation(const io::EvalEnd& eval) override;

 private:
  const TrainConfig& config_;
  std::string device_;
  int data_parallel_;
  io::ProgressLine& progress_;
  bool katib_due_ = true;
  io::MetricsWriter metrics_;
};

// Rank 0's progress line, a line for each evaluation, and the run's last
// lines: why it stopped early (if it did), steps, loss and median step time,
// the memory peaks, and where the metrics and traces are.
class ProgressReport : public io::TrainingComponent {
 public:
  ProgressReport(const TrainConfig& config, bool root, io::ProgressLine& progress, const TrainResult& result,
                 const io::TraceWriter& trace, int world_size)
      : config_(config), root_(root), progress_(progress), result_(result), trace_(trace), world_size_(world_size) {}
  void on_step_end(io::StepEnd& end) override;
  void on_evaluation(const io::EvalEnd& eval) override;
  void on_run_end(const io::RunEnd& end) override;

 private:
  const TrainConfig& config_;
  bool root_;
  io::ProgressLine& progress_;
  const TrainResult& result_;
  const io::TraceWriter& trace_;
  int world_size_;
};

}  // namespace tessera::app

// The measuring and reporting components of the training loop
// (apps/train_reports.h): memory peaks, tensor-parallel traffic, the metrics
// file and Katib lines, rank 0's progress, evaluation and summary lines.
#include "apps/train_reports.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "core/allocator.h"
#include "parallel/memory_plan.h"

namespace tessera::app {
namespace {

// This step's peaks (the allocator's counters since the step began) into
// the metrics record and the run's peaks.
void record_memory(const AllocatorStats& stats, io::StepRecord& record, TrainResult::PeakMemory& peak) {
  const auto bytes = [&](MemoryUse use) { return int64_t(stats.peak_by_use[int(use)]); };
  const int64_t values[5] = {bytes(MemoryUse::parameters), bytes(MemoryUse::gradients), bytes(MemoryUse::optimizer),
                             bytes(MemoryUse::other), int64_t(stats.peak_model_state_bytes)};
  const char* names[5] = {"mem_parameters_bytes", "mem_gradients_bytes", "mem_optimizer_bytes", "mem_activations_bytes",
                          "mem_model_state_bytes"};
  int64_t* peaks[5] = {&peak.parameters, &peak.gradients, &peak.optimizer, &peak.activations, &peak.model_state};
  for (int i = 0; i < 5; ++i) {
    record.extra.emplace_back(names[i], double(values[i]));
    *peaks[i] = std::max(*peaks[i], values[i]);
  }
}

// "eval step 250: loss 1.2345 nats/token (1.781 bits) over 8192 tokens", or a classifier's accuracy.
std::string eval_line(const io::EvalEnd& eval) {
  const io::EvalRecord& r = eval.record;
  char line[160];
  if (r.eval_accuracy)
    std::snprintf(line, sizeof line, "eval step %lld: loss %.4f, accuracy %.2f%% (%lld samples)",
                  static_cast<long long>(r.step), r.eval_loss, 100.0 * *r.eval_accuracy,
                  static_cast<long long>(eval.count));
  else
    std::snprintf(line, sizeof line, "eval step %lld: loss %.4f nats/token (%.3f bits) over %lld tokens",
                  static_cast<long long>(r.step), r.eval_loss, r.eval_loss / std::log(2.0),
                  static_cast<long long>(eval.count));
  return line;
}

// Rank 0's last lines: why it stopped early (if it did), steps, loss and
// median step time, and where the metrics and traces are.
void print_summary(const TrainConfig& c, const TrainResult& result, const std::string& stop_reason,
                   const std::string& trace_path, int world_size) {
  if (!stop_reason.empty()) std::printf("stopping: %s\n", stop_reason.c_str());
  std::printf("done: %lld steps, last loss %.4f, median %.1f ms/step", static_cast<long long>(result.steps),
              result.last_loss, result.median_ms_per_step);
  if (result.skipped_steps) std::printf(", %lld skipped", static_cast<long long>(result.skipped_steps));
  std::printf("\n");
  const TrainResult::PeakMemory& m = result.peak_memory;
  std::printf(
      "memory (rank 0, peak of a step): parameters %s, gradients %s, optimizer state %s (together %s), "
      "activations and workspaces %s\n",
      parallel::byte_text(m.parameters).c_str(), parallel::byte_text(m.gradients).c_str(),
      parallel::byte_text(m.optimizer).c_str(), parallel::byte_text(m.model_state).c_str(),
      parallel::byte_text(m.activations).c_str());
  if (!c.metrics.empty())
    std::printf("metrics: %s (plot with: tessera plot %s -o curves.svg)\n", c.metrics.c_str(), c.metrics.c_str());
  if (!c.trace.empty())
    std::printf("trace: %s (open in https://ui.perfetto.dev)%s\n", trace_path.c_str(),
                world_size > 1 ? ", one file per rank" : "");
  std::fflush(stdout);
}

}  // namespace

void StepMemory::on_step_begin(const io::StepBegin&) {
  context_.allocator(device_).reset_peak_stats();
}

void StepMemory::on_step_end(io::StepEnd& end) {
  record_memory(context_.allocator(device_).stats(), end.record, result_.peak_memory);
  if (device_.is_accelerator())  // page-locked host memory: the loader's and the checkpoints' staging
    end.record.extra.emplace_back("mem_pinned_bytes",
                                  double(context_.pinned_allocator(device_).stats().reserved_bytes));
}

void TensorParallelTraffic::on_step_begin(const io::StepBegin&) {
  bytes_before_ = layout_.group("tp").counters().total_bytes();
}

void TensorParallelTraffic::on_step_end(io::StepEnd& end) {
  if (layout_.size("tp") > 1)
    end.record.extra.emplace_back("tp_comm_bytes", double(layout_.group("tp").counters().total_bytes() - bytes_before_));
}

MetricsLog::MetricsLog(const TrainConfig& c, bool root, bool resumed, Device device, int data_parallel,
                       io::ProgressLine& progress)
    : config_(c), device_(device.to_string()), data_parallel_(data_parallel), progress_(progress) {
  if (!root) return;
  io::MetricsOptions options;
  options.path = c.metrics;
  options.append = resumed;  // a resumed run goes on with the same file
  if (c.katib_metrics || io::stdout_read_by_katib())
    options.katib = [this](std::string_view line) {
      if (katib_due_) progress_.print_above(line);
    };
  else
    options.katib = nullptr;
  metrics_ = io::MetricsWriter(options);
}

void MetricsLog::on_run_start(const io::RunStart&) {
  metrics_.log_run({{"model", std::string(nn::model_name(config_.model))},
                    {"precision", config_.precision},
                    {"device", device_},
                    {"data_parallel", std::to_string(data_parallel_)},
                    {"zero", std::to_string(config_.zero)}});
}

void MetricsLog::on_step_end(io::StepEnd& end) {
  katib_due_ = end.step % config_.log_interval == 0 || end.last;
  metrics_.log_step(end.record);
}

void MetricsLog::on_evaluation(const io::EvalEnd& eval) {
  katib_due_ = true;  // an evaluation's Katib line is always printed
  metrics_.log_eval(eval.record);
}

void ProgressReport::on_step_end(io::StepEnd& end) {
  progress_.update(end.record);
}

void ProgressReport::on_evaluation(const io::EvalEnd& eval) {
  if (root_) progress_.print_above(eval_line(eval));
}

void ProgressReport::on_run_end(const io::RunEnd& end) {
  progress_.finish();
  if (root_) print_summary(config_, result_, end.stop_reason, trace_.path(), world_size_);
}

}  // namespace tessera::app

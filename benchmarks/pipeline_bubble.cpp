// Pipeline bubble benchmark, run under mpirun with P ranks (one stage each):
// the idle share of a step on every stage, measured through the real
// PipelineEngine, schedule and MPI exchanges, beside the theoretical
// (P − 1)/(V·M + P − 1), for each M of --micro-batches and each V of
// --virtual-stages (V > 1: interleaved 1F1B, V chunks per stage each taking
// 1/V of the stage's time).
//
// A stage's compute is modelled by sleeping (--forward-ms per micro-batch,
// twice that for backward) on a small activation that really travels: on
// this 2-core machine P ranks computing for real would share the cores and
// measure the machine, not the schedule. What is measured is what the
// pipeline adds: waiting for neighbours, exchange latency, engine overhead.
//
// Each step starts after a barrier; its span is from the earliest start to
// the latest end over the stages; a stage's idle time is the span minus its
// own compute; the step's bubble is the stages' mean idle time over the span;
// the figure is the median over --repeats steps (after one untimed step).
// Prints machine-readable lines (rank 0 only):
//   pipeline_bubble stages=4 micro_batches=8 virtual_stages=1 schedule=1f1b forward_ms=10 measured=0.2801
//       theory=0.2727 diff_pp=0.74
#include <mpi.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/context.h"
#include "nn/loss.h"
#include "parallel/mpi_communicator.h"
#include "parallel/mpi_env.h"
#include "parallel/pipeline.h"

namespace {

using namespace tessera;

// A stage that takes a fixed time: forward and backward sleep, and pass
// their input through (copied, as a layer would produce a new tensor).
class SleepingStage : public nn::Module {
 public:
  SleepingStage(const nn::ModelSpec& spec, std::chrono::microseconds forward)
      : Module(spec, "sleeping"), forward_(forward) {}
  Tensor forward_impl(const Tensor& input, nn::Saved& saved, const nn::Pass&) override {
    std::this_thread::sleep_for(forward_);
    saved.scalars = {1};
    return input.clone();
  }
  Tensor backward_impl(const Tensor& grad_output, nn::Saved& saved) override {
    saved.clear();
    std::this_thread::sleep_for(2 * forward_);
    return grad_output.clone();
  }

 private:
  std::chrono::microseconds forward_;
};

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t mid = values.size() / 2;
  return values.size() % 2 ? values[mid] : 0.5 * (values[mid - 1] + values[mid]);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Pipeline bubble: measured idle share of a step against (P - 1)/(V*M + P - 1)"};
  std::vector<int> micro_batches{4, 8, 16};
  double forward_ms = 10.0;
  int repeats = 5;
  std::string schedule = "1f1b";
  std::vector<int> virtual_stages{1};
  app.add_option("--micro-batches", micro_batches, "Micro-batches per step (several: one line each)");
  app.add_option("--forward-ms", forward_ms, "Modelled forward time per micro-batch (backward: twice)");
  app.add_option("--repeats", repeats, "Timed steps per figure (median)");
  app.add_option("--schedule", schedule, "gpipe or 1f1b")->check(CLI::IsMember({"gpipe", "1f1b"}));
  app.add_option("--virtual-stages", virtual_stages,
                 "Chunks per stage (several: one line each; > 1: interleaved 1F1B)");
  CLI11_PARSE(app, argc, argv);

  parallel::MpiEnv env;
  ContextOptions options;
  options.cpu_threads = 1;
  Context ctx(options);
  const auto pipeline = parallel::make_mpi_communicator(MPI_COMM_WORLD, "pp");
  const int stage = pipeline->rank(), stages = pipeline->size();
  const nn::ModelSpec spec{&ctx, Device::cpu(), DType::f32, 1};
  const nn::CrossEntropyLoss loss;
  parallel::PipelineOptions pipeline_options;
  pipeline_options.schedule = parallel::parse_pipeline_schedule(schedule);

  const int64_t batch = 4, width = 64;
  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> label(0, int32_t(width) - 1);
  for (const int v : virtual_stages)
    for (const int m : micro_batches) {
      if (v > 1 && m % stages != 0) continue;  // interleaving needs M a multiple of P
      std::vector<std::unique_ptr<SleepingStage>> chunks;
      std::vector<nn::Module*> views;
      const auto chunk_forward = std::chrono::microseconds(int64_t(forward_ms * 1000.0 / v));
      for (int c = 0; c < v; ++c) {
        chunks.push_back(std::make_unique<SleepingStage>(spec, chunk_forward));
        views.push_back(chunks.back().get());
      }
      parallel::PipelineEngine engine(views, *pipeline, loss, pipeline_options);
      parallel::PipelineStep step;
      step.micro_batches = m;
      step.input_shape = Shape{batch, width};
      for (int i = 0; i < m; ++i) {
        step.inputs.push_back(ctx.full(Shape{batch, width}, DType::f32, 0.5));
        std::vector<int32_t> targets(static_cast<size_t>(batch));
        for (auto& t : targets) t = label(rng);
        step.targets.push_back(ctx.from_vector(Shape{batch}, targets));
      }
      std::vector<double> bubbles;
      for (int r = 0; r <= repeats; ++r) {
        MPI_Barrier(MPI_COMM_WORLD);
        const parallel::PipelineStepStats stats = engine.run(step);
        // The span over stages (one clock: the same host's steady clock), and the mean idle share.
        int64_t first = stats.start_ns, last = stats.end_ns, compute = stats.compute_ns;
        MPI_Allreduce(MPI_IN_PLACE, &first, 1, MPI_INT64_T, MPI_MIN, MPI_COMM_WORLD);
        MPI_Allreduce(MPI_IN_PLACE, &last, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
        MPI_Allreduce(MPI_IN_PLACE, &compute, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
        const double span = double(last - first);
        const double idle = span - double(compute) / double(stages);
        if (r > 0) bubbles.push_back(idle / span);
      }
      const double measured = median(bubbles), theory = double(stages - 1) / double(v * m + stages - 1);
      if (stage == 0)
        std::printf(
            "pipeline_bubble stages=%d micro_batches=%d virtual_stages=%d schedule=%s forward_ms=%g measured=%.4f "
            "theory=%.4f diff_pp=%.2f\n",
            stages, m, v, schedule.c_str(), forward_ms, measured, theory, 100.0 * (measured - theory));
      std::fflush(stdout);
    }
  return 0;
}

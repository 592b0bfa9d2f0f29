// Pipeline bubble benchmark, run under mpirun with P ranks (one stage each):
// the idle share of a step on every stage, measured through the real
// PipelineEngine, schedule and MPI exchanges, for each schedule of
// --schedule (gpipe, 1f1b, zb-h1, zbv), each M of --micro-batches and, for
// 1f1b, each V of --virtual-stages (V > 1: interleaved 1F1B, V chunks per
// stage each taking 1/V of the stage's time; zbv always runs 2 chunks per
// stage in a V, each taking half of it), beside theory.
//
// A stage's compute is modelled by sleeping on a small activation that
// really travels: per micro-batch --forward-ms forward, --backward-ms for
// the input gradient (B) and --weight-ms for the weight gradient (W; both
// default to the forward's, so a whole backward is twice the forward). The
// W sleep goes to add_weight_gradients, so the zero-bubble schedules run it
// in their W instruction and the others inside the backward. On this 2-core
// machine P ranks computing for real would share the cores and measure the
// machine, not the schedule. What is measured is what the pipeline adds:
// waiting for neighbours, exchange latency, engine overhead.
//
// Each step starts after a barrier; its span is from the earliest start to
// the latest end over the stages; a stage's idle time is the span minus its
// own compute (its F, B and W instructions as the engine timed them: the
// sleeps and a copy each); the step's bubble is the stages' mean idle time
// over the span; the figure is the median over --repeats steps (after one
// untimed step). Beside it:
//   simulated  parallel::simulate_pipeline's idle share of the same
//              schedule lists at unit costs (F = B = W = 1, a whole
//              backward 2: the default timing)
//   theory     the closed form at the timed costs, where there is one:
//              (P − 1)/(V·M + P − 1) for gpipe and (interleaved) 1f1b,
//              (P − 1)(F + B − W)/(M(F + B + W) + (P − 1)(F + B − W)) for
//              zb-h1 (Qi et al., ICLR 2024); none for zbv
//   diff_pp    measured minus theory (zbv: minus simulated), in points
// Prints machine-readable lines (rank 0 only), a first line starting "#"
// saying the above, then one per configuration:
//   pipeline_bubble stages=4 micro_batches=8 virtual_stages=1 schedule=zb-h1 forward_ms=10 backward_ms=10
//       weight_ms=10 measured=0.0940 simulated=0.0909 theory=0.0909 diff_pp=0.31
#include <mpi.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>
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

// What one micro-batch costs a chunk, in sleep.
struct ChunkTimes {
  std::chrono::microseconds forward, input_gradient, weight_gradient;
};

// A stage that takes a fixed time: forward and the backward's two halves
// sleep, and pass their input through (copied, as a layer would produce a new
// tensor). The W half is weight-gradient work, deferred under the zero-bubble
// schedules.
class SleepingStage : public nn::Module {
 public:
  SleepingStage(const nn::ModelSpec& spec, ChunkTimes times) : Module(spec, "sleeping"), times_(times) {}
  Tensor forward_impl(const Tensor& input, nn::Saved& saved, const nn::Pass&) override {
    std::this_thread::sleep_for(times_.forward);
    saved.scalars = {1};
    return input.clone();
  }
  Tensor backward_impl(const Tensor& grad_output, nn::Saved& saved) override {
    saved.clear();
    std::this_thread::sleep_for(times_.input_gradient);
    add_weight_gradients([weight = times_.weight_gradient] { std::this_thread::sleep_for(weight); });
    return grad_output.clone();
  }

 protected:
  bool splits_backward() const override { return true; }

 private:
  ChunkTimes times_;
};

// One measured line: a schedule with its chunks per stage (1f1b: V; zbv: 2).
struct Configuration {
  std::string schedule;
  int chunks = 1;
};

std::vector<Configuration> configurations(const std::vector<std::string>& schedules,
                                          const std::vector<int>& virtual_stages) {
  std::vector<Configuration> out;
  for (const std::string& schedule : schedules) {
    if (schedule == "1f1b")
      for (const int v : virtual_stages) out.push_back({schedule, v});
    else
      out.push_back({schedule, schedule == "zbv" ? 2 : 1});
  }
  return out;
}

// Per-micro-batch stage costs, for the closed forms.
struct StageCosts {
  double forward, input_gradient, weight_gradient;
};

// The closed-form bubble where one is known (none for zbv).
std::optional<double> closed_form_bubble(const Configuration& c, int stages, int micro_batches, StageCosts t) {
  const double p = stages, m = micro_batches;
  if (c.schedule == "zbv") return std::nullopt;
  if (c.schedule == "zb-h1") {
    const double idle = (p - 1) * (t.forward + t.input_gradient - t.weight_gradient);
    return idle / (m * (t.forward + t.input_gradient + t.weight_gradient) + idle);
  }
  return (p - 1) / (c.chunks * m + p - 1);
}

// The simulator's idle share of the schedule at unit costs.
double simulated_bubble(parallel::PipelineScheduleKind kind, int stages, int micro_batches, int chunks) {
  std::vector<std::vector<parallel::PipeInstruction>> lists;
  for (int s = 0; s < stages; ++s) lists.push_back(parallel::pipeline_schedule(kind, stages, s, micro_batches, chunks));
  const parallel::PipelineSimulation sim = parallel::simulate_pipeline(lists, micro_batches, chunk_placement(kind));
  TESSERA_CHECK(sim.completed, "pipeline_bubble: the simulator did not complete the schedule: ", sim.problem);
  const int span = *std::max_element(sim.finish_time.begin(), sim.finish_time.end());
  double idle = 0.0;
  for (const int stage_idle : sim.idle_time) idle += stage_idle;
  return idle / (double(span) * double(stages));
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t mid = values.size() / 2;
  return values.size() % 2 ? values[mid] : 0.5 * (values[mid - 1] + values[mid]);
}

std::chrono::microseconds microseconds(double ms) {
  return std::chrono::microseconds(int64_t(ms * 1000.0));
}

// The engine's measured bubble of one configuration: the median over `repeats` timed steps.
double measured_bubble(parallel::PipelineEngine& engine, const parallel::PipelineStep& step, int stages, int repeats) {
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
  return median(bubbles);
}

// M micro-batches of a [4, 64] activation with random class targets.
parallel::PipelineStep make_step(Context& ctx, int micro_batches, std::mt19937& rng) {
  const int64_t batch = 4, width = 64;
  std::uniform_int_distribution<int32_t> label(0, int32_t(width) - 1);
  parallel::PipelineStep step;
  step.micro_batches = micro_batches;
  step.input_shape = Shape{batch, width};
  for (int i = 0; i < micro_batches; ++i) {
    step.inputs.push_back(ctx.full(Shape{batch, width}, DType::f32, 0.5));
    std::vector<int32_t> targets(static_cast<size_t>(batch));
    for (auto& t : targets) t = label(rng);
    step.targets.push_back(ctx.from_vector(Shape{batch}, targets));
  }
  return step;
}

// What every configuration shares: the flags and this rank's pipeline.
struct Bench {
  StageCosts costs;  // per micro-batch and stage, ms
  int repeats = 5;
  parallel::Communicator* pipeline = nullptr;
  nn::ModelSpec spec;
  const nn::Loss* loss = nullptr;
};

// Runs one configuration at M micro-batches through the engine on sleeping
// chunks (each 1/chunks of the stage's time); returns the measured bubble.
double measure(const Bench& bench, const Configuration& c, int micro_batches, std::mt19937& rng) {
  parallel::PipelineOptions options;
  options.schedule = parallel::parse_pipeline_schedule(c.schedule);
  const ChunkTimes times{microseconds(bench.costs.forward / c.chunks),
                         microseconds(bench.costs.input_gradient / c.chunks),
                         microseconds(bench.costs.weight_gradient / c.chunks)};
  std::vector<std::unique_ptr<SleepingStage>> chunks;
  std::vector<nn::Module*> views;
  for (int k = 0; k < c.chunks; ++k) {
    chunks.push_back(std::make_unique<SleepingStage>(bench.spec, times));
    views.push_back(chunks.back().get());
  }
  parallel::PipelineEngine engine(views, *bench.pipeline, *bench.loss, options);
  const parallel::PipelineStep step = make_step(*bench.spec.context, micro_batches, rng);
  return measured_bubble(engine, step, bench.pipeline->size(), bench.repeats);
}

void print_line(const Bench& bench, const Configuration& c, int micro_batches, double measured) {
  const int stages = bench.pipeline->size();
  const double simulated =
      simulated_bubble(parallel::parse_pipeline_schedule(c.schedule), stages, micro_batches, c.chunks);
  const std::optional<double> theory = closed_form_bubble(c, stages, micro_batches, bench.costs);
  std::printf(
      "pipeline_bubble stages=%d micro_batches=%d virtual_stages=%d schedule=%s forward_ms=%g backward_ms=%g "
      "weight_ms=%g measured=%.4f simulated=%.4f",
      stages, micro_batches, c.chunks, c.schedule.c_str(), bench.costs.forward, bench.costs.input_gradient,
      bench.costs.weight_gradient, measured, simulated);
  if (theory) std::printf(" theory=%.4f", *theory);
  std::printf(" diff_pp=%.2f\n", 100.0 * (measured - theory.value_or(simulated)));
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Pipeline bubble: measured idle share of a step per schedule, beside the simulator and closed forms"};
  std::vector<int> micro_batches{4, 8, 16};
  double forward_ms = 10.0, backward_ms = 0.0, weight_ms = 0.0;
  int repeats = 5;
  std::vector<std::string> schedules{"1f1b"};
  std::vector<int> virtual_stages{1};
  app.add_option("--micro-batches", micro_batches, "Micro-batches per step (several: one line each)");
  app.add_option("--forward-ms", forward_ms, "Modelled forward time per micro-batch and stage");
  auto* backward_flag =
      app.add_option("--backward-ms", backward_ms, "Modelled input-gradient (B) time (default: --forward-ms)");
  auto* weight_flag =
      app.add_option("--weight-ms", weight_ms, "Modelled weight-gradient (W) time (default: --forward-ms)");
  app.add_option("--repeats", repeats, "Timed steps per figure (median)");
  app.add_option("--schedule", schedules, "gpipe, 1f1b, zb-h1 or zbv (several: one line each)")
      ->check(CLI::IsMember({"gpipe", "1f1b", "zb-h1", "zbv"}));
  app.add_option("--virtual-stages", virtual_stages,
                 "Chunks per stage under 1f1b (several: one line each; > 1: interleaved 1F1B)");
  CLI11_PARSE(app, argc, argv);
  if (backward_flag->count() == 0) backward_ms = forward_ms;
  if (weight_flag->count() == 0) weight_ms = forward_ms;

  parallel::MpiEnv env;
  ContextOptions options;
  options.cpu_threads = 1;
  Context ctx(options);
  const auto pipeline = parallel::make_mpi_communicator(MPI_COMM_WORLD, "pp");
  const nn::CrossEntropyLoss loss;
  const Bench bench{{forward_ms, backward_ms, weight_ms},
                    repeats,
                    pipeline.get(),
                    nn::ModelSpec{&ctx, Device::cpu(), DType::f32, 1},
                    &loss};
  const bool prints = pipeline->rank() == 0;
  if (prints)
    std::printf(
        "# pipeline_bubble: measured = the stages' mean idle share of a step (median of %d); simulated = "
        "parallel::simulate_pipeline at unit costs F = B = W = 1 (a whole backward 2), not the timed ones; theory = "
        "the closed form at the timed costs (none for zbv); diff_pp = measured - theory (zbv: - simulated)\n",
        repeats);
  std::mt19937 rng(7);
  for (const Configuration& c : configurations(schedules, virtual_stages))
    for (const int m : micro_batches) {
      // Interleaving needs M a multiple of P.
      if (c.chunks > 1 && c.schedule == "1f1b" && m % pipeline->size() != 0) continue;
      const double measured = measure(bench, c, m, rng);
      if (prints) print_line(bench, c, m, measured);
    }
  return 0;
}

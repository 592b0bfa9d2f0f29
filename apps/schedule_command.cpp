// The `schedule` subcommand: the stages' instruction lists of a pipeline
// schedule, simulated together and drawn one row per stage.
#include "apps/schedule_command.h"

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "parallel/pipeline_schedule.h"

namespace tessera::app {
namespace {

struct ScheduleOptions {
  std::string schedule = "1f1b";
  int stages = 4;
  int micro_batches = 8;
  int virtual_stages = 1;
};

void print_schedule(const ScheduleOptions& o) {
  const parallel::PipelineScheduleKind kind = parallel::parse_pipeline_schedule(o.schedule);
  const int chunks = kind == parallel::PipelineScheduleKind::zbv ? 2 : o.virtual_stages;
  TESSERA_CHECK(
      kind != parallel::PipelineScheduleKind::zbv || o.virtual_stages <= 2,
      "--pipeline-schedule zbv runs two chunks per stage in a V; use --virtual-pipeline-stages 2 (or leave it "
      "out), not ",
      o.virtual_stages);
  std::vector<std::vector<parallel::PipeInstruction>> lists;
  for (int s = 0; s < o.stages; ++s)
    lists.push_back(parallel::pipeline_schedule(kind, o.stages, s, o.micro_batches, chunks));
  std::printf("%s: %d stages, %d micro-batches%s; F = 1, B = %s, W = 1 time unit per chunk\n", o.schedule.c_str(),
              o.stages, o.micro_batches,
              chunks > 1 ? (", " + std::to_string(chunks) + " chunks per stage").c_str() : "",
              parallel::splits_backward(kind) ? "1 (input gradient)" : "2 (whole backward, no W)");
  std::printf("%s", parallel::describe_schedule(lists, o.micro_batches, parallel::chunk_placement(kind)).c_str());
}

}  // namespace

void register_schedule_command(CLI::App& app, int& exit_code) {
  auto options = std::make_shared<ScheduleOptions>();
  auto* schedule = app.add_subcommand(
      "schedule", "Draw what each pipeline stage runs in one step of a schedule, with its bubble and peaks");
  schedule->add_option("--pipeline-schedule", options->schedule, "gpipe, 1f1b, zb-h1 or zbv")
      ->check(CLI::IsMember({"gpipe", "1f1b", "zb-h1", "zbv"}))
      ->capture_default_str();
  schedule->add_option("--pipeline-parallel,--pp", options->stages, "Pipeline stages P")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  schedule->add_option("--micro-batches", options->micro_batches, "Micro-batches per step M")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  schedule
      ->add_option("--virtual-pipeline-stages", options->virtual_stages,
                   "Model chunks per stage (interleaved 1F1B; M a multiple of P)")
      ->check(CLI::Range(1, 16))
      ->capture_default_str();
  schedule->callback([options, &exit_code] {
    print_schedule(*options);
    exit_code = 0;
  });
}

}  // namespace tessera::app

// `tessera schedule`: the drawing of each schedule is the simulation's (one
// row per stage, each time unit a cell), its bubble line agrees with the
// simulator's idle time, and flags that make no schedule are refused naming
// the flag.
#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

#include "apps/schedule_command.h"
#include "core/error.h"
#include "parallel/pipeline_schedule.h"
#include "tests/support/cli_capture.h"

namespace tessera::testing {
namespace {

std::string run_schedule(std::vector<std::string> args, int& exit_code) {
  CLI::App app;
  app::register_schedule_command(app, exit_code);
  args.insert(args.begin(), "schedule");
  return parse_capturing_stdout(app, args);
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// Each stage's row holds its F, B and W units (a whole backward two cells),
// and the bubble printed is the simulator's mean idle share.
TEST(ScheduleCommand, DrawsEveryStageOfEverySchedule) {
  struct Case {
    std::string schedule;
    int stages, micro_batches, chunks;
  };
  for (const Case& c : {Case{"gpipe", 2, 4, 1}, Case{"1f1b", 4, 8, 1}, Case{"zb-h1", 4, 8, 1}, Case{"zbv", 3, 6, 2}}) {
    SCOPED_TRACE(c.schedule);
    int exit_code = -1;
    const std::vector<std::string> lines =
        lines_of(run_schedule({"--pipeline-schedule", c.schedule, "--pp", std::to_string(c.stages), "--micro-batches",
                               std::to_string(c.micro_batches)},
                              exit_code));
    EXPECT_EQ(exit_code, 0);
    ASSERT_EQ(lines.size(), size_t(c.stages) + 2) << "a title, a row per stage, the bubble";
    const auto kind = parallel::parse_pipeline_schedule(c.schedule);
    std::vector<std::vector<parallel::PipeInstruction>> lists;
    for (int s = 0; s < c.stages; ++s)
      lists.push_back(parallel::pipeline_schedule(kind, c.stages, s, c.micro_batches, c.chunks));
    const parallel::PipelineSimulation sim =
        parallel::simulate_pipeline(lists, c.micro_batches, parallel::chunk_placement(kind));
    ASSERT_TRUE(sim.completed) << sim.problem;
    const int work = c.chunks * c.micro_batches * 3;  // F + B + W, or F + a whole backward of two
    for (int s = 0; s < c.stages; ++s) {
      const std::string& row = lines[size_t(s) + 1];
      EXPECT_EQ(row.rfind("stage " + std::to_string(s) + ":", 0), 0u) << row;
      std::istringstream cells(row.substr(row.find(':') + 1));
      int busy = 0, idle = 0;
      for (std::string cell; cells >> cell;) (cell == "." ? idle : busy) += 1;
      EXPECT_EQ(busy, work) << row;
      EXPECT_EQ(idle, sim.idle_time[size_t(s)]) << row;
    }
    double idle_share = 0;
    for (int s = 0; s < c.stages; ++s)
      idle_share += double(sim.idle_time[size_t(s)]) / double(sim.idle_time[0] + work) / c.stages;
    std::ostringstream expected;
    expected.precision(1);
    expected << std::fixed << "bubble " << 100.0 * idle_share << "%";
    EXPECT_EQ(lines.back().rfind(expected.str(), 0), 0u) << lines.back() << " (expected " << expected.str() << ")";
  }
}

TEST(ScheduleCommand, RefusesFlagsThatMakeNoSchedule) {
  int exit_code = -1;
  EXPECT_THROW(run_schedule({"--pipeline-schedule", "zb-h2"}, exit_code), CLI::ValidationError);
  try {
    run_schedule({"--pipeline-schedule", "zbv", "--virtual-pipeline-stages", "3"}, exit_code);
    ADD_FAILURE() << "zbv with 3 chunks per stage was drawn";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("use --virtual-pipeline-stages 2"), std::string::npos) << e.what();
  }
  try {
    run_schedule({"--pipeline-schedule", "1f1b", "--pp", "4", "--micro-batches", "6", "--virtual-pipeline-stages", "2"},
                 exit_code);
    ADD_FAILURE() << "interleaving with 6 micro-batches on 4 stages was drawn";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("must be a multiple of the 4"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tessera::testing

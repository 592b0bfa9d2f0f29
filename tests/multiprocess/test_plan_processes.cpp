// `tessera train --plan` as a job runs it: the real program under mpiexec on
// 4 ranks with --cluster 4xcpu:shm picks, on every rank, the layout the
// planner ranks first for that world (computed here by the library), says
// which on rank 0 only, and trains with it (the ranks line shows its dp, pp
// and tp); a cluster of another size is refused on every rank, non-zero.
#include <gtest/gtest.h>

#include <string>

#include "plan/planner.h"
#include "tests/support/process_job.h"
#include "tests/support/resume_support.h"

namespace tessera::testing {
namespace {

const char* kModel =
    "--model gpt --vocab-size 128 --seq-length 32 --num-layers 4 --num-heads 4 --hidden-size 64 --global-batch-size 8 "
    "--synthetic --threads 1 --train-steps 2 --log-interval 1000";

plan::PlanModel the_model() {
  plan::PlanModel pm;
  pm.model.kind = nn::ModelKind::gpt;
  pm.model.vocab_size = 128;
  pm.model.seq_length = 32;
  pm.model.num_layers = 4;
  pm.model.num_heads = 4;
  pm.model.hidden_size = 64;
  pm.global_batch = 8;
  pm.dtype = DType::f32;
  pm.optimizer.kind = nn::OptimizerKind::adamw;
  return pm;
}

size_t count(const std::string& text, const std::string& part) {
  size_t n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

TEST(TrainPlan, FourRanksTrainWithThePlansLayout) {
  ScratchDirectory dir("tessera_plan_");
  const plan::SearchResult found = plan::search_layouts(the_model(), plan::parse_cluster("4xcpu:shm"), {});
  ASSERT_FALSE(found.ranked.empty());
  const plan::PlanLayout& best = found.ranked.front().layout;
  const Outcome outcome = run_command(tessera_command(4, joined(words(kModel), {"--plan", "--cluster", "4xcpu:shm"})),
                                      dir / "plan.log", seconds(150));
  const std::string& output = outcome.output;
  ASSERT_EQ(outcome.status, 0) << output;
  EXPECT_EQ(count(output, "plan: " + best.describe() + " (" + best.flags() + ")"), 1u) << output;
  EXPECT_TRUE(contains(
      output, "dp=" + std::to_string(best.dp) + " pp=" + std::to_string(best.pp) + " tp=" + std::to_string(best.tp)))
      << output;
  EXPECT_TRUE(contains(output, "done: 2 steps")) << output;

  const Outcome wrong = run_command(tessera_command(4, joined(words(kModel), {"--plan", "--cluster", "2xcpu:shm"})),
                                    dir / "wrong.log", seconds(60));
  EXPECT_NE(wrong.status, 0) << wrong.output;
  EXPECT_NE(wrong.status, -1) << "the job did not end: " << wrong.output;
  EXPECT_TRUE(contains(wrong.output, "has 2 accelerators but this job has 4 ranks")) << wrong.output;
}

}  // namespace
}  // namespace tessera::testing

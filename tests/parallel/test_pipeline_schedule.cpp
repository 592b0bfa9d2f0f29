// Pipeline schedules without a model: for P stages and M micro-batches the
// generated instruction lists, run against each other by the rendezvous
// simulator, complete (no deadlock), pair every send with a receive of the
// same micro-batch in order, run every forward before its backward, keep at
// most P − s micro-batches in flight on stage s under 1F1B (M under GPipe),
// and leave the ideal bubble (P − 1)/(M + P − 1); interleaved (V chunks per
// stage) likewise, with the bubble (P − 1)/(V·M + P − 1). The simulator
// itself is checked on lists that must fail.
#include <gtest/gtest.h>

#include <algorithm>

#include "core/error.h"
#include "parallel/pipeline_schedule.h"

namespace tessera::testing {
namespace {

using parallel::PipeInstruction;
using parallel::PipelineScheduleKind;
using parallel::PipeTransfer;

std::vector<std::vector<PipeInstruction>> all_stages(PipelineScheduleKind kind, int stages, int micro) {
  std::vector<std::vector<PipeInstruction>> lists;
  for (int s = 0; s < stages; ++s) lists.push_back(parallel::pipeline_schedule(kind, stages, s, micro));
  return lists;
}

TEST(PipelineSchedule, EverySchedulePairsCompletesAndBoundsMicroBatchesInFlight) {
  for (const PipelineScheduleKind kind : {PipelineScheduleKind::gpipe, PipelineScheduleKind::one_f_one_b})
    for (int p = 1; p <= 8; ++p)
      for (const int m : {1, 2, 3, p - 1, p, p + 1, 2 * p, 4 * p + 3}) {
        if (m < 1) continue;
        SCOPED_TRACE(std::string(parallel::pipeline_schedule_name(kind)) + " P=" + std::to_string(p) +
                     " M=" + std::to_string(m));
        const auto lists = all_stages(kind, p, m);
        const parallel::PipelineSimulation sim = parallel::simulate_pipeline(lists, m);
        ASSERT_TRUE(sim.completed) << sim.problem;
        for (int s = 0; s < p; ++s) {
          // Each stage runs each micro-batch forward once and backward once.
          int forwards = 0, backwards = 0;
          for (const PipeInstruction& in : lists[size_t(s)]) {
            forwards += in.op == PipeInstruction::Op::forward;
            backwards += in.op == PipeInstruction::Op::backward;
          }
          EXPECT_EQ(forwards, m);
          EXPECT_EQ(backwards, m);
          const int bound = kind == PipelineScheduleKind::gpipe ? m : std::min(p - s, m);
          EXPECT_EQ(sim.max_in_flight[size_t(s)], bound) << "stage " << s;
          EXPECT_LE(sim.max_in_flight[size_t(s)], kind == PipelineScheduleKind::gpipe ? m : p);
          // The ideal bubble: P − 1 slots of a forward and a backward out of M + P − 1.
          const int span = *std::max_element(sim.finish_time.begin(), sim.finish_time.end());
          EXPECT_EQ(span, 3 * (m + p - 1)) << "stage " << s;
          EXPECT_EQ(sim.idle_time[size_t(s)], 3 * (p - 1));
        }
      }
}

TEST(PipelineSchedule, OneFOneBOnFourStagesReadsAsMegatrons) {
  // Stage 1 of 4 with 6 micro-batches: 2 warm-up forwards, steady 1F1B, 2 cool-down backwards.
  const auto list = parallel::pipeline_schedule(PipelineScheduleKind::one_f_one_b, 4, 1, 6);
  std::string text;
  for (const PipeInstruction& in : list) text += in.to_string() + " ";
  EXPECT_EQ(text,
            "X[recv act 0] F0 X[send act 0] X[recv act 1] F1 X[send act 1] X[recv act 2] "
            "F2 X[send act 2, recv grad 0] B0 X[send grad 0, recv act 3] "
            "F3 X[send act 3, recv grad 1] B1 X[send grad 1, recv act 4] "
            "F4 X[send act 4, recv grad 2] B2 X[send grad 2, recv act 5] "
            "F5 X[send act 5, recv grad 3] B3 X[send grad 3] "
            "X[recv grad 4] B4 X[send grad 4] X[recv grad 5] B5 X[send grad 5] ");
}

TEST(PipelineSchedule, SimulatorCatchesDeadlocksMismatchesAndEarlyWork) {
  const int m = 3;
  // Deadlock: both stages of a pair receive before they send.
  auto lists = all_stages(PipelineScheduleKind::one_f_one_b, 2, m);
  PipeInstruction wait_for_gradient;
  wait_for_gradient.op = PipeInstruction::Op::exchange;
  wait_for_gradient.transfers = {{PipeTransfer::Kind::recv_gradient, 0}};
  lists[0].insert(lists[0].begin(), wait_for_gradient);
  parallel::PipelineSimulation sim = parallel::simulate_pipeline(lists, m);
  EXPECT_FALSE(sim.completed);
  EXPECT_NE(sim.problem.find("deadlock"), std::string::npos) << sim.problem;

  // Out of order: stage 1 receives micro-batch 1 where 0 is sent.
  lists = all_stages(PipelineScheduleKind::gpipe, 2, m);
  for (PipeInstruction& in : lists[1])
    if (in.op == PipeInstruction::Op::exchange && in.transfers[0].kind == PipeTransfer::Kind::recv_activation) {
      in.transfers[0].micro = 1;
      break;
    }
  sim = parallel::simulate_pipeline(lists, m);
  EXPECT_FALSE(sim.completed);
  EXPECT_NE(sim.problem.find("pairs with micro-batch"), std::string::npos) << sim.problem;

  // A backward before its forward.
  lists = all_stages(PipelineScheduleKind::gpipe, 1, m);
  std::swap(lists[0][0], lists[0].back());
  sim = parallel::simulate_pipeline(lists, m);
  EXPECT_FALSE(sim.completed);
  EXPECT_NE(sim.problem.find("before its forward"), std::string::npos) << sim.problem;

  // A forward before its activation arrived (the receive dropped).
  lists = all_stages(PipelineScheduleKind::gpipe, 2, m);
  lists[1].erase(lists[1].begin());
  sim = parallel::simulate_pipeline(lists, m);
  EXPECT_FALSE(sim.completed);
}

// Interleaved 1F1B (V chunks per stage): every unit (micro-batch, chunk) runs
// forward and backward once, in order, with every transfer paired (the last
// stage sending round to the first between chunks), and the bubble is the
// theory's (P − 1)/(V·M + P − 1): P − 1 chunk slots of a forward and a backward.
TEST(PipelineSchedule, InterleavedCompletesAndShrinksTheBubbleByV) {
  for (int p = 2; p <= 6; ++p)
    for (int v = 2; v <= 4; ++v)
      for (const int m : {p, 2 * p, 3 * p, 4 * p}) {
        SCOPED_TRACE("P=" + std::to_string(p) + " V=" + std::to_string(v) + " M=" + std::to_string(m));
        std::vector<std::vector<PipeInstruction>> lists;
        for (int s = 0; s < p; ++s)
          lists.push_back(parallel::pipeline_schedule(PipelineScheduleKind::one_f_one_b, p, s, m, v));
        const parallel::PipelineSimulation sim = parallel::simulate_pipeline(lists, m);
        ASSERT_TRUE(sim.completed) << sim.problem;
        for (int s = 0; s < p; ++s) {
          std::vector<int> forwards(static_cast<size_t>(v), 0), backwards(static_cast<size_t>(v), 0);
          for (const PipeInstruction& in : lists[size_t(s)]) {
            if (in.op == PipeInstruction::Op::forward) ++forwards[size_t(in.chunk)];
            if (in.op == PipeInstruction::Op::backward) ++backwards[size_t(in.chunk)];
          }
          for (int c = 0; c < v; ++c) {
            EXPECT_EQ(forwards[size_t(c)], m) << "stage " << s << " chunk " << c;
            EXPECT_EQ(backwards[size_t(c)], m) << "stage " << s << " chunk " << c;
          }
          // Megatron's warm-up bound on units in flight.
          EXPECT_LE(sim.max_in_flight[size_t(s)], std::min(2 * (p - s - 1) + (v - 1) * p + 1, m * v)) << "stage " << s;
        }
        const int span = *std::max_element(sim.finish_time.begin(), sim.finish_time.end());
        EXPECT_EQ(span, 3 * (v * m + p - 1));
        for (int s = 0; s < p; ++s) EXPECT_EQ(sim.idle_time[size_t(s)], 3 * (p - 1)) << "stage " << s;
      }
}

TEST(PipelineSchedule, InterleavedTwoStagesTwoChunksReadsAsMegatrons) {
  // Stage 1 of 2 with 2 chunks (the model's chunks 1 and 3) and 4 micro-batches: 2·(P − 1 − 1) + (V − 1)·P = 2
  // warm-up forwards of chunk 0, then groups of one forward and one backward, each followed by one exchange of
  // what it produced and what the next group needs; chunk 1 is the model's last (the loss: no activation to send,
  // no gradient to receive); chunk 0's output goes round to stage 0's chunk 1.
  std::string text;
  for (const PipeInstruction& in : parallel::pipeline_schedule(PipelineScheduleKind::one_f_one_b, 2, 1, 4, 2))
    text += in.to_string() + " ";
  EXPECT_EQ(text,
            "X[recv act 0] F0 X[send act 0, recv act 1] F1 X[send act 1, recv act 0.1] F0.1 B0.1 "
            "X[send grad 0.1, recv act 1.1] F1.1 B1.1 X[send grad 1.1, recv act 2, recv grad 0] F2 B0 "
            "X[send act 2, send grad 0, recv act 3, recv grad 1] F3 B1 X[send act 3, send grad 1, recv act 2.1] "
            "F2.1 B2.1 X[send grad 2.1, recv act 3.1] F3.1 B3.1 X[send grad 3.1, recv grad 2] B2 "
            "X[send grad 2, recv grad 3] B3 X[send grad 3] ");
}

TEST(PipelineSchedule, NamesAndBadArguments) {
  EXPECT_EQ(parallel::parse_pipeline_schedule("1f1b"), PipelineScheduleKind::one_f_one_b);
  EXPECT_EQ(parallel::parse_pipeline_schedule("gpipe"), PipelineScheduleKind::gpipe);
  try {
    parallel::parse_pipeline_schedule("interleaved");
    ADD_FAILURE() << "no error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("--pipeline-schedule 'interleaved'"), std::string::npos);
  }
  EXPECT_THROW(parallel::pipeline_schedule(PipelineScheduleKind::gpipe, 2, 2, 4), Error);
  EXPECT_THROW(parallel::pipeline_schedule(PipelineScheduleKind::gpipe, 2, 0, 0), Error);
  // Interleaving: 1F1B only, and micro-batches a multiple of the stages.
  try {
    parallel::pipeline_schedule(PipelineScheduleKind::gpipe, 2, 0, 4, 2);
    ADD_FAILURE() << "no error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("--pipeline-schedule 1f1b"), std::string::npos) << error.what();
  }
  try {
    parallel::pipeline_schedule(PipelineScheduleKind::one_f_one_b, 4, 0, 6, 2);
    ADD_FAILURE() << "no error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("multiple of the 4 pipeline stages"), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace tessera::testing

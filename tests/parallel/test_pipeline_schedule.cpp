// Pipeline schedules without a model: for P stages and M micro-batches the
// generated instruction lists, run against each other by the rendezvous
// simulator, complete (no deadlock), pair every send with a receive of the
// same micro-batch in order, run every forward before its backward, keep at
// most P − s micro-batches in flight on stage s under 1F1B (M under GPipe),
// and leave the ideal bubble (P − 1)/(M + P − 1); interleaved (V chunks per
// stage) likewise, with the bubble (P − 1)/(V·M + P − 1); the zero-bubble
// ZB-H1 and ZBV (each backward split into B and W) with their bubbles and
// peaks from the paper, W's in micro-batch order. The simulator itself is
// checked on lists that must fail, and the printed timeline against it.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <sstream>

#include "core/error.h"
#include "parallel/pipeline_schedule.h"

namespace tessera::testing {
namespace {

using parallel::ChunkPlacement;
using parallel::PipeInstruction;
using parallel::PipelineScheduleKind;
using parallel::PipeTransfer;
using Op = PipeInstruction::Op;

std::vector<std::vector<PipeInstruction>> all_stages(PipelineScheduleKind kind, int stages, int micro, int chunks = 1) {
  std::vector<std::vector<PipeInstruction>> lists;
  for (int s = 0; s < stages; ++s) lists.push_back(parallel::pipeline_schedule(kind, stages, s, micro, chunks));
  return lists;
}

int chunks_of(PipelineScheduleKind kind) {
  return kind == PipelineScheduleKind::zbv ? 2 : 1;
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
  wait_for_gradient.transfers = {{PipeTransfer::Kind::recv_gradient, 0, 0, /*peer=*/1}};
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

std::string trace_of(PipelineScheduleKind kind, int p, int m, int chunks) {
  return std::string(parallel::pipeline_schedule_name(kind)) + " P=" + std::to_string(p) + " M=" + std::to_string(m) +
         (chunks > 1 ? " V=" + std::to_string(chunks) : "");
}

// Each unit (micro-batch, local chunk) of a stage's list appears once as F and
// B, and once as W when the schedule splits backwards.
void expect_each_unit_once(const std::vector<PipeInstruction>& list, int micro, int chunks, bool split) {
  std::map<std::tuple<Op, int, int>, int> counts;
  for (const PipeInstruction& in : list)
    if (in.op != Op::exchange) ++counts[{in.op, in.micro, in.chunk}];
  for (int c = 0; c < chunks; ++c)
    for (int i = 0; i < micro; ++i) {
      EXPECT_EQ((counts[{Op::forward, i, c}]), 1) << "F" << i << "." << c;
      EXPECT_EQ((counts[{Op::backward, i, c}]), 1) << "B" << i << "." << c;
      EXPECT_EQ((counts[{Op::weight, i, c}]), split ? 1 : 0) << "W" << i << "." << c;
    }
}

// For P = 2..6 and M = P..4P every schedule completes under rendezvous, and
// its idle time and peaks are the theory's, in time units of a chunk's
// forward, B and W 1 each and a whole backward 2 (F = B = W):
//   GPipe, 1F1B, interleaved 1F1B: 3(P − 1) on every stage (P − 1 slots of a
//     forward and a whole backward); 1F1B holds min(P − s, M) micro-batches.
//   ZB-H1: (P − 1)(F + B − W) = P − 1, a third of 1F1B's, at 1F1B's
//     min(P − s, M) micro-batches before their B and min(P, M) before their W.
//   ZBV: P − 1 chunk-units for M ≥ 2P − 1. That is the least any schedule can
//     have: every stage has the same work, so its idle time is the span minus
//     that work, and the last stage's first forward waits for the P − 1
//     forwards before it. With fewer micro-batches the V is never full: the
//     share is still at most 1F1B's, and the layout idles 2(2P − 1 − M) (the
//     value the Python prototype and this simulator both give; pinned here).
TEST(PipelineSchedule, EveryScheduleCompletesWithItsBubbleAndPeaks) {
  struct Case {
    PipelineScheduleKind kind;
    int chunks;
  };
  for (int p = 2; p <= 6; ++p)
    for (int m = p; m <= 4 * p; ++m) {
      std::vector<Case> cases = {{PipelineScheduleKind::gpipe, 1},
                                 {PipelineScheduleKind::one_f_one_b, 1},
                                 {PipelineScheduleKind::zb_h1, 1},
                                 {PipelineScheduleKind::zbv, 2}};
      if (m % p == 0) cases.push_back({PipelineScheduleKind::one_f_one_b, 2});
      for (const Case& c : cases) {
        SCOPED_TRACE(trace_of(c.kind, p, m, c.chunks));
        const auto lists = all_stages(c.kind, p, m, c.chunks);
        const parallel::PipelineSimulation sim =
            parallel::simulate_pipeline(lists, m, parallel::chunk_placement(c.kind));
        ASSERT_TRUE(sim.completed) << sim.problem;
        const int span = *std::max_element(sim.finish_time.begin(), sim.finish_time.end());
        for (int s = 0; s < p; ++s) {
          SCOPED_TRACE("stage " + std::to_string(s));
          const size_t st = size_t(s);
          expect_each_unit_once(lists[st], m, c.chunks, parallel::splits_backward(c.kind));
          switch (c.kind) {
            case PipelineScheduleKind::gpipe:
            case PipelineScheduleKind::one_f_one_b:
              EXPECT_EQ(sim.idle_time[st], 3 * (p - 1));
              if (c.chunks == 1) {
                EXPECT_EQ(sim.max_in_flight[st], c.kind == PipelineScheduleKind::gpipe ? m : std::min(p - s, m));
              }
              // Without W's a unit stops awaiting anything at its backward.
              EXPECT_EQ(sim.max_awaiting_weight[st], sim.max_in_flight[st]);
              break;
            case PipelineScheduleKind::zb_h1:
              EXPECT_EQ(sim.idle_time[st], p - 1);
              EXPECT_EQ(sim.max_in_flight[st], std::min(p - s, m));
              EXPECT_EQ(sim.max_awaiting_weight[st], std::min(p, m));
              break;
            case PipelineScheduleKind::zbv:
              if (m >= 2 * p - 1) {
                EXPECT_EQ(sim.idle_time[st], p - 1);
              }
              // Idle share at most 1F1B's, (P − 1)/(M + P − 1), in integers.
              EXPECT_LE(int64_t(sim.idle_time[st]) * (m + p - 1), int64_t(p - 1) * span);
              EXPECT_EQ(sim.idle_time[st], std::max(p - 1, 2 * (2 * p - 1 - m)));
              // Chunk units held (a chunk holds half a stage's activations). Before
              // stage s's first B it has run 2(P − s) − 1 + s = 2P − s − 1
              // forwards of chunk 0 (M at most) and s + 1 of chunk 1 (the
              // warm-up's pairs and the first F of its F-B-W groups); from then
              // on every F is followed by a B before the next F, and the
              // cool-down has no F: the peak is min(2P − s − 1, M) + s + 1, 2P
              // (1F1B's P stage-units) once M ≥ 2P − s − 1.
              EXPECT_EQ(sim.max_in_flight[st], std::min(2 * p - s - 1, m) + s + 1);
              EXPECT_LE(sim.max_in_flight[st], 2 * p);
              // Each W follows its B at once until the cool-down, which runs no F.
              EXPECT_EQ(sim.max_awaiting_weight[st], sim.max_in_flight[st]);
              break;
          }
        }
      }
    }
}

// Fewer micro-batches than stages, and one stage: the zero-bubble schedules
// still complete, never idler than 1F1B.
TEST(PipelineSchedule, ZeroBubbleSchedulesCompleteWithFewMicroBatches) {
  for (const PipelineScheduleKind kind : {PipelineScheduleKind::zb_h1, PipelineScheduleKind::zbv})
    for (int p = 1; p <= 6; ++p)
      for (int m = 1; m <= p; ++m) {
        SCOPED_TRACE(trace_of(kind, p, m, chunks_of(kind)));
        const auto lists = all_stages(kind, p, m, chunks_of(kind));
        const parallel::PipelineSimulation sim = parallel::simulate_pipeline(lists, m, parallel::chunk_placement(kind));
        ASSERT_TRUE(sim.completed) << sim.problem;
        const int span = *std::max_element(sim.finish_time.begin(), sim.finish_time.end());
        for (int s = 0; s < p; ++s) {
          expect_each_unit_once(lists[size_t(s)], m, chunks_of(kind), true);
          EXPECT_LE(int64_t(sim.idle_time[size_t(s)]) * (m + p - 1), int64_t(p - 1) * span) << "stage " << s;
        }
      }
}

// The engine adds each W's weight gradients as it runs; in micro-batch order
// per chunk, the sums are those of the one-call backward's order bit for bit.
TEST(PipelineSchedule, WeightGradientsRunInMicroBatchOrderPerChunk) {
  for (const PipelineScheduleKind kind : {PipelineScheduleKind::zb_h1, PipelineScheduleKind::zbv})
    for (int p = 1; p <= 6; ++p)
      for (int m = 1; m <= 4 * p; ++m) {
        SCOPED_TRACE(trace_of(kind, p, m, chunks_of(kind)));
        for (int s = 0; s < p; ++s) {
          std::vector<std::vector<int>> order(size_t(chunks_of(kind)));
          for (const PipeInstruction& in : parallel::pipeline_schedule(kind, p, s, m, chunks_of(kind)))
            if (in.op == Op::weight) order[size_t(in.chunk)].push_back(in.micro);
          for (const std::vector<int>& micros : order) {
            ASSERT_EQ(int(micros.size()), m) << "stage " << s;
            for (int i = 0; i < m; ++i) EXPECT_EQ(micros[size_t(i)], i) << "stage " << s;
          }
        }
      }
}

TEST(PipelineSchedule, ZeroBubbleH1OnTwoStagesReadsAsDesigned) {
  // Stage 0 of 2, 3 micro-batches: 1 warm-up forward; F1 B0 W0, F2 B1 W1; B2 W2. Stage 1 (W's held back by 1):
  // F0 B0, F1 B1 W0, F2 B2 W1; W2. Each exchange holds the transfers produced at one time of the unit-cost
  // timeline (stage 0: F0 F1 . B0 W0 F2 B1 W1 B2 W2; stage 1: . F0 B0 F1 B1 W0 F2 B2 W1 W2), placed after the ops
  // that finish by then: stage 0 receives B1's gradient (time 5) after W0, before F2.
  std::string text;
  for (int s = 0; s < 2; ++s) {
    for (const PipeInstruction& in : parallel::pipeline_schedule(PipelineScheduleKind::zb_h1, 2, s, 3))
      text += in.to_string() + " ";
    text += "| ";
  }
  EXPECT_EQ(text,
            "F0 X[send act 0] F1 X[send act 1] X[recv grad 0] B0 W0 X[recv grad 1] F2 X[send act 2] B1 W1 "
            "X[recv grad 2] B2 W2 | "
            "X[recv act 0] F0 X[recv act 1] B0 X[send grad 0] F1 B1 X[send grad 1] W0 X[recv act 2] F2 B2 "
            "X[send grad 2] W1 W2 | ");
}

// Under the V the last stage hands chunk P − 1's output to chunk P itself
// (and the gradient back): no exchange names its own stage, and every
// transfer names the stage that holds the neighbouring model chunk.
TEST(PipelineSchedule, ZbvTurnsOnTheLastStageWithoutATransfer) {
  for (int p = 1; p <= 6; ++p) {
    const int m = 2 * p;
    const parallel::ChunkMap map{p, 2, ChunkPlacement::v_shape};
    for (int s = 0; s < p; ++s)
      for (const PipeInstruction& in : parallel::pipeline_schedule(PipelineScheduleKind::zbv, p, s, m, 2))
        for (const PipeTransfer& t : in.transfers) {
          const int model_chunk = map.model_chunk(s, t.chunk), neighbour = model_chunk + (t.to_next() ? 1 : -1);
          EXPECT_NE(t.peer, s) << in.to_string();
          EXPECT_EQ(t.peer, map.stage_of(neighbour)) << "P=" << p << " stage " << s << " " << in.to_string();
        }
  }
}

TEST(PipelineSchedule, ChunkMapsRoundTheRingAndInAV) {
  for (int p = 1; p <= 6; ++p)
    for (const ChunkPlacement placement : {ChunkPlacement::loop, ChunkPlacement::v_shape})
      for (int v = 1; v <= 3; ++v) {
        const parallel::ChunkMap map{p, v, placement};
        std::vector<int> seen(size_t(p * v), 0);
        for (int s = 0; s < p; ++s)
          for (int l = 0; l < v; ++l) {
            const int g = map.model_chunk(s, l);
            ASSERT_GE(g, 0);
            ASSERT_LT(g, p * v);
            ++seen[size_t(g)];
            EXPECT_EQ(map.stage_of(g), s);
            EXPECT_EQ(map.local_of(g), l);
            EXPECT_EQ(map.first(s, l), g == 0);
            EXPECT_EQ(map.last(s, l), g == p * v - 1);
            // Round the ring chunk l of stage s is l·P + s; in the V its odd chunks come back down.
            EXPECT_EQ(g, placement == ChunkPlacement::loop || l % 2 == 0 ? l * p + s : (l + 1) * p - 1 - s);
          }
        EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), p * v) << "every model chunk on one stage";
      }
  // The V of 4 stages: stage 0 holds the first and the last chunk (it computes the loss), stage 3 the turn.
  const parallel::ChunkMap v_shape{4, 2, ChunkPlacement::v_shape};
  EXPECT_EQ(v_shape.model_chunk(0, 1), 7);
  EXPECT_TRUE(v_shape.last(0, 1));
  EXPECT_EQ(v_shape.model_chunk(3, 0), 3);
  EXPECT_EQ(v_shape.model_chunk(3, 1), 4);
}

// Finds the first compute instruction `label` ("W0", "F0.1") in a list.
size_t find_op(const std::vector<PipeInstruction>& list, const std::string& label) {
  for (size_t k = 0; k < list.size(); ++k)
    if (list[k].op != Op::exchange && list[k].to_string() == label) return k;
  ADD_FAILURE() << label << " not in the list";
  return 0;
}

void expect_problem(const std::vector<std::vector<PipeInstruction>>& lists, int m, ChunkPlacement placement,
                    const std::string& expected) {
  const parallel::PipelineSimulation sim = parallel::simulate_pipeline(lists, m, placement);
  EXPECT_FALSE(sim.completed) << expected;
  EXPECT_NE(sim.problem.find(expected), std::string::npos) << sim.problem;
}

TEST(PipelineSchedule, SimulatorCatchesBrokenZeroBubbleLists) {
  const int m = 3;
  const auto h1 = all_stages(PipelineScheduleKind::zb_h1, 2, m);
  ASSERT_TRUE(parallel::simulate_pipeline(h1, m).completed);

  auto lists = h1;  // a W before its B
  std::swap(lists[1][find_op(lists[1], "B1")], lists[1][find_op(lists[1], "W1")]);
  expect_problem(lists, m, ChunkPlacement::loop, "stage 1: W1 runs before its backward (B1)");

  lists = h1;  // a W twice
  lists[0].insert(lists[0].begin() + std::ptrdiff_t(find_op(lists[0], "W0")), lists[0][find_op(lists[0], "W0")]);
  expect_problem(lists, m, ChunkPlacement::loop, "stage 0: W0 runs twice");

  lists = h1;  // a W missing
  lists[1].erase(lists[1].begin() + std::ptrdiff_t(find_op(lists[1], "W2")));
  expect_problem(lists, m, ChunkPlacement::loop, "stage 1: micro-batch 2 has no W");

  lists = h1;  // a W of a unit that is never backwarded (its micro-batch is past the step's)
  lists[0][find_op(lists[0], "W2")].micro = m;
  expect_problem(lists, m, ChunkPlacement::loop, "stage 0: W3 names no micro-batch");

  // The V's turn on the last stage out of order: chunk P's forward before chunk P − 1's, chunk P − 1's B before
  // chunk P's.
  const int p = 3, mv = 6;
  const auto zbv = all_stages(PipelineScheduleKind::zbv, p, mv, 2);
  ASSERT_TRUE(parallel::simulate_pipeline(zbv, mv, ChunkPlacement::v_shape).completed);
  lists = zbv;
  std::swap(lists[2][find_op(lists[2], "F0")], lists[2][find_op(lists[2], "F0.1")]);
  expect_problem(lists, mv, ChunkPlacement::v_shape, "stage 2: F0.1 runs before F0, which hands it its input");
  lists = zbv;
  std::swap(lists[2][find_op(lists[2], "B0.1")], lists[2][find_op(lists[2], "B0")]);
  expect_problem(lists, mv, ChunkPlacement::v_shape, "stage 2: B0 runs before B0.1, which hands it its gradient");
  // The same lists read round the ring name the wrong stages.
  expect_problem(zbv, mv, ChunkPlacement::loop, "addresses stage");

  // A transfer to the wrong stage, and one to the stage itself.
  lists = zbv;
  for (PipeInstruction& in : lists[0])
    if (!in.transfers.empty()) {
      in.transfers[0].peer = 2;  // stage 0's chunk 0 talks to stage 1
      break;
    }
  expect_problem(lists, mv, ChunkPlacement::v_shape, "stage 0: X[send act 0] addresses stage 2, but model chunk 1");
  lists = zbv;
  PipeInstruction to_itself;
  to_itself.op = Op::exchange;
  to_itself.transfers = {{PipeTransfer::Kind::send_activation, 0, 0, /*peer=*/2}};
  lists[2].insert(lists[2].begin() + std::ptrdiff_t(find_op(lists[2], "F0") + 1), to_itself);
  expect_problem(lists, mv, ChunkPlacement::v_shape, "to its own stage, where it is handed over locally");
}

// The printed timeline is the simulation's: each stage's row has one cell per
// time unit of the span, each op in as many cells as it costs (a whole
// backward 2, F, B and W 1), idle cells as many as its idle time, columns
// aligned; the last line gives the bubble and the peaks.
TEST(PipelineSchedule, DescribeScheduleDrawsTheSimulatedTimeline) {
  struct Case {
    PipelineScheduleKind kind;
    int p, m, chunks;
  };
  for (const Case c : {Case{PipelineScheduleKind::one_f_one_b, 4, 6, 1}, Case{PipelineScheduleKind::gpipe, 2, 3, 1},
                       Case{PipelineScheduleKind::one_f_one_b, 2, 4, 2}, Case{PipelineScheduleKind::zb_h1, 4, 6, 1},
                       Case{PipelineScheduleKind::zbv, 3, 7, 2}}) {
    SCOPED_TRACE(trace_of(c.kind, c.p, c.m, c.chunks));
    const auto lists = all_stages(c.kind, c.p, c.m, c.chunks);
    const ChunkPlacement placement = parallel::chunk_placement(c.kind);
    const parallel::PipelineSimulation sim = parallel::simulate_pipeline(lists, c.m, placement);
    ASSERT_TRUE(sim.completed) << sim.problem;
    const int span = *std::max_element(sim.finish_time.begin(), sim.finish_time.end());
    std::istringstream text(parallel::describe_schedule(lists, c.m, placement));
    std::string line;
    size_t first_cell = 0, cell_step = 0;
    for (int s = 0; s < c.p; ++s) {
      ASSERT_TRUE(std::getline(text, line));
      const std::string name = "stage " + std::to_string(s) + ":";
      ASSERT_EQ(line.rfind(name, 0), 0u) << line;
      // The cells and where they start.
      std::vector<std::string> cells;
      std::vector<size_t> starts;
      for (size_t at = line.find_first_not_of(' ', name.size()); at != std::string::npos;
           at = line.find_first_not_of(' ', at)) {
        const size_t end = std::min(line.find(' ', at), line.size());
        cells.push_back(line.substr(at, end - at));
        starts.push_back(at);
        at = end;
      }
      ASSERT_EQ(int(cells.size()), span) << line;
      if (s == 0) first_cell = starts[0], cell_step = starts[1] - starts[0];
      for (size_t k = 0; k < starts.size(); ++k) EXPECT_EQ(starts[k], first_cell + k * cell_step) << line;
      // Each op's cells: its cost, from the list (a backward costs 2 unless the list has its W).
      std::map<std::string, int> expected, drawn;
      for (const PipeInstruction& in : lists[size_t(s)]) {
        if (in.op == Op::exchange) continue;
        int cost = 1;
        if (in.op == Op::backward) {
          PipeInstruction weight = in;
          weight.op = Op::weight;
          cost = find_if(lists[size_t(s)].begin(), lists[size_t(s)].end(),
                         [&](const PipeInstruction& other) { return other.to_string() == weight.to_string(); }) ==
                         lists[size_t(s)].end()
                     ? 2
                     : 1;
        }
        expected[in.to_string()] += cost;
      }
      expected["."] = sim.idle_time[size_t(s)];
      if (expected["."] == 0) expected.erase(".");
      for (const std::string& cell : cells) ++drawn[cell];
      EXPECT_EQ(drawn, expected) << line;
    }
    ASSERT_TRUE(std::getline(text, line));
    int idle = 0;
    std::string in_flight, awaiting;
    for (int s = 0; s < c.p; ++s) {
      idle += sim.idle_time[size_t(s)];
      in_flight += " " + std::to_string(sim.max_in_flight[size_t(s)]);
      awaiting += " " + std::to_string(sim.max_awaiting_weight[size_t(s)]);
    }
    std::ostringstream bubble;
    bubble.setf(std::ios::fixed);
    bubble.precision(1);
    bubble << "bubble " << 100.0 * idle / (c.p * span) << "%";
    EXPECT_EQ(line.rfind(bubble.str(), 0), 0u) << line;
    EXPECT_NE(line.find("per stage" + in_flight + ";"), std::string::npos) << line;
    EXPECT_NE(line.find("awaiting their W" + awaiting), std::string::npos) << line;
    EXPECT_FALSE(std::getline(text, line));
  }
  // Lists that do not complete are refused with the simulator's reason.
  auto broken = all_stages(PipelineScheduleKind::gpipe, 2, 2);
  broken[1].erase(broken[1].begin());
  EXPECT_THROW(parallel::describe_schedule(broken, 2), Error);
}

// The message of the Error that `call` throws, or "no error".
template <class Call>
std::string error_of(Call call) {
  try {
    call();
  } catch (const Error& error) {
    return error.what();
  }
  return "no error";
}

TEST(PipelineSchedule, ZeroBubbleNamesAndChunkChecks) {
  for (const PipelineScheduleKind kind : {PipelineScheduleKind::gpipe, PipelineScheduleKind::one_f_one_b,
                                          PipelineScheduleKind::zb_h1, PipelineScheduleKind::zbv})
    EXPECT_EQ(parallel::parse_pipeline_schedule(parallel::pipeline_schedule_name(kind)), kind);
  EXPECT_EQ(parallel::parse_pipeline_schedule("zb-h1"), PipelineScheduleKind::zb_h1);
  EXPECT_EQ(parallel::parse_pipeline_schedule("zbv"), PipelineScheduleKind::zbv);
  EXPECT_NE(error_of([] { parallel::parse_pipeline_schedule("zb-h2"); }).find("use gpipe, 1f1b, zb-h1 or zbv"),
            std::string::npos);
  EXPECT_TRUE(parallel::splits_backward(PipelineScheduleKind::zb_h1));
  EXPECT_TRUE(parallel::splits_backward(PipelineScheduleKind::zbv));
  EXPECT_FALSE(parallel::splits_backward(PipelineScheduleKind::one_f_one_b));
  EXPECT_FALSE(parallel::splits_backward(PipelineScheduleKind::gpipe));
  EXPECT_EQ(parallel::chunk_placement(PipelineScheduleKind::zbv), ChunkPlacement::v_shape);
  EXPECT_EQ(parallel::chunk_placement(PipelineScheduleKind::zb_h1), ChunkPlacement::loop);
  EXPECT_EQ(parallel::chunk_placement(PipelineScheduleKind::one_f_one_b), ChunkPlacement::loop);
  const auto schedule_error = [](PipelineScheduleKind kind, int micro, int chunks) {
    return error_of([=] { parallel::pipeline_schedule(kind, 4, 0, micro, chunks); });
  };
  EXPECT_NE(schedule_error(PipelineScheduleKind::zb_h1, 8, 2).find("--pipeline-schedule zb-h1 runs one model chunk"),
            std::string::npos);
  EXPECT_NE(schedule_error(PipelineScheduleKind::zb_h1, 8, 2).find("use --virtual-pipeline-stages 1"),
            std::string::npos);
  EXPECT_NE(schedule_error(PipelineScheduleKind::zbv, 8, 1).find("use --virtual-pipeline-stages 2"), std::string::npos);
  EXPECT_NE(schedule_error(PipelineScheduleKind::zbv, 8, 3).find("use --virtual-pipeline-stages 2"), std::string::npos);
  // ZBV takes any number of micro-batches, not only multiples of the stages.
  EXPECT_EQ(schedule_error(PipelineScheduleKind::zbv, 6, 2), "no error");
  EXPECT_EQ(schedule_error(PipelineScheduleKind::zb_h1, 6, 1), "no error");
}

}  // namespace
}  // namespace tessera::testing

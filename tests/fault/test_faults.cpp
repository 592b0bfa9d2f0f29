// Faults under real mpirun (label `fault`): TESSERA_FAULT makes one rank
// hang, crash, slow down or produce NaN gradients, and the job must end the
// way a user needs: a hang named (which rank, which collective) by the
// watchdog within --comm-timeout, every process gone within the timeout +
// 10 s, a crash ending the job with the last complete checkpoint intact and
// resumable, NaN steps skipped and the run stopped naming the step and the
// tensor after --max-skipped-steps, and a slow rank tolerated.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "io/checkpoint.h"
#include "tests/support/process_job.h"
#include "tests/support/resume_support.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

// TESSERA_FAULT for the jobs a test starts (removed at the end of the test).
struct FaultEnvironment {
  explicit FaultEnvironment(const std::string& value) { ::setenv("TESSERA_FAULT", value.c_str(), 1); }
  ~FaultEnvironment() { ::unsetenv("TESSERA_FAULT"); }
};

std::vector<std::string> gpt_args() {
  return words(
      "--model gpt --synthetic --vocab-size 32 --seq-length 8 --num-layers 2 --num-heads 4 --hidden-size 16 "
      "--micro-batch-size 2 --threads 1 --lr 1e-3");
}

// Runs `tessera train` on `ranks` ranks to its end (bounded); returns {status, seconds, output}.
struct Outcome {
  int status = 0;
  double seconds = 0.0;
  std::string output;
  bool left = false;  // processes of the job still there after it ended
};

Outcome run_job(int ranks, const std::vector<std::string>& args, const std::string& log, seconds limit) {
  const auto start = Clock::now();
  Job job(tessera_command(ranks, args), log);
  Outcome out;
  out.status = job.wait(limit);
  out.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  out.left = job.anything_left();
  out.output = job.output();
  return out;
}

TEST(Faults, HangOnOneRankOfDpTwoTpTwoIsNamedAndEndsTheJob) {
  ScratchDirectory dir("tessera_faults_");
  const FaultEnvironment fault("hang@3:2");  // world rank 2 stops as step 3 begins
  const double timeout = 4.0;
  const Outcome out = run_job(
      4, joined(gpt_args(), {"--tp", "2", "--train-steps", "6", "--comm-timeout", "4"}), dir / "hang.log",
      seconds(60));
  EXPECT_NE(out.status, 0) << out.output;
  EXPECT_LT(out.seconds, timeout + 10.0) << out.output;
  EXPECT_FALSE(out.left) << "processes left after the job ended";
  EXPECT_TRUE(contains(out.output, "TESSERA_FAULT: hang at step 3 on rank 2")) << out.output;
  EXPECT_TRUE(contains(out.output, "did not complete within 4 s (--comm-timeout")) << out.output;
  EXPECT_TRUE(contains(out.output, "all_reduce on communicator")) << out.output;
  // The stalled rank is named by world rank, as not having reached the collective and idle.
  EXPECT_TRUE(contains(out.output, "(world rank 2): has NOT reached it")) << out.output;
  EXPECT_TRUE(contains(out.output, "<- STALLED")) << out.output;
}

TEST(Faults, CrashOfOneRankEndsTheJobAndTheLastCheckpointResumes) {
  ScratchDirectory dir("tessera_faults_");
  const auto args =
      joined(gpt_args(), {"--train-steps", "8", "--save", dir / "ckpt", "--save-interval", "2", "--resume", "auto"});
  {
    const FaultEnvironment fault("crash@5:1");  // rank 1 dies as step 5 begins, after the step-4 checkpoint
    const Outcome out = run_job(2, args, dir / "crash.log", seconds(60));
    EXPECT_NE(out.status, 0) << out.output;
    EXPECT_LT(out.seconds, 300.0 + 10.0) << out.output;  // the default --comm-timeout at most; mpirun is faster
    EXPECT_FALSE(out.left) << "processes left after the job ended";
    EXPECT_TRUE(contains(out.output, "TESSERA_FAULT: crash at step 5 on rank 1")) << out.output;
  }
  const std::optional<std::string> latest = io::find_latest_checkpoint(dir / "ckpt");
  ASSERT_TRUE(latest.has_value());
  const io::CheckpointReader reader(*latest);
  EXPECT_EQ(reader.step(), 4);
  EXPECT_TRUE(reader.verify().empty());
  const Outcome resumed = run_job(2, args, dir / "resumed.log", seconds(60));
  EXPECT_EQ(resumed.status, 0) << resumed.output;
  EXPECT_TRUE(contains(resumed.output, "resumed from " + *latest)) << resumed.output;
  EXPECT_EQ(io::CheckpointReader(*io::find_latest_checkpoint(dir / "ckpt")).step(), 8);
}

TEST(Faults, NanGradientsAreSkippedThenTheRunStopsNamingStepAndTensor) {
  ScratchDirectory dir("tessera_faults_");
  {
    // One bad step on one rank: skipped everywhere, the run goes on.
    const FaultEnvironment fault("nan_grad@2:1");
    const Outcome out = run_job(2, joined(gpt_args(), {"--train-steps", "4", "--max-skipped-steps", "3"}),
                                dir / "one.log", seconds(60));
    EXPECT_EQ(out.status, 0) << out.output;
    EXPECT_TRUE(contains(out.output, "1 skipped")) << out.output;
  }
  // Every step bad: the run stops after 3 in a row, naming the step and the first non-finite gradient.
  const FaultEnvironment fault("nan_grad:0");
  const Outcome out = run_job(2, joined(gpt_args(), {"--train-steps", "8", "--max-skipped-steps", "3"}),
                              dir / "all.log", seconds(60));
  EXPECT_NE(out.status, 0) << out.output;
  EXPECT_FALSE(out.left);
  EXPECT_TRUE(contains(out.output, "step 3: non-finite gradients in 3 consecutive steps")) << out.output;
  EXPECT_TRUE(contains(out.output, "first non-finite gradient: ")) << out.output;
}

TEST(Faults, ASlowRankWithinTheTimeoutIsWaitedFor) {
  ScratchDirectory dir("tessera_faults_");
  const FaultEnvironment fault("slow@2:1");  // 2 s, under a 6 s timeout
  const Outcome out =
      run_job(2, joined(gpt_args(), {"--train-steps", "3", "--comm-timeout", "6"}), dir / "slow.log", seconds(60));
  EXPECT_EQ(out.status, 0) << out.output;
  EXPECT_TRUE(contains(out.output, "TESSERA_FAULT: slow at step 2 on rank 1")) << out.output;
  EXPECT_TRUE(contains(out.output, "done: 3 steps")) << out.output;
}

}  // namespace
}  // namespace tessera::testing

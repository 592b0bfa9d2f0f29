// GPU runs as the CPU can run them: `tessera train --device emu` under mpiexec
// puts every rank's model, optimizer state, batches and activations on its
// own emulated device (core/device.h), so they take every path a GPU run
// takes: device tensors through the device channel (the stream communicator
// that NCCL uses, with MPI requests in place of NCCL calls), host tensors
// through MPI, pinned staging, the loader's copy stream, the watchdog thread
// bound to the rank's device, device-to-host copies for checkpoints. A
// transfer whose two sides disagree on where the tensor lives (a device piece
// sent to rank 0's host buffer: the checkpoint deadlock of a GPU job) never
// matches and fails at the deadline here, in CI.
//
// For each layout (data parallel with ZeRO-1 and ZeRO-2 and gradient
// accumulation, pipeline, tensor parallel with sequence parallelism, dp × tp,
// tp × pp, dp × pp with ZeRO-3 (units gathered over the device channel),
// 16-bit precisions, and the zero-bubble ZB-H1 schedule with ZeRO-3 and with
// tp × sequence parallelism × pp: weight gradients in W steps): the emulated run saves, evaluates and resumes, its
// checkpoints equal the CPU run's bit for bit (the kernels are the same, only
// the paths differ), and 4 steps + a new job resuming for 4 more equal 8
// straight steps. A device fault on one rank is reported as that device's
// failure, with the last operation dispatched to it, not blamed on the
// communication.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "io/checkpoint.h"
#include "tests/support/process_job.h"
#include "tests/support/resume_support.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

struct Layout {
  const char* name;
  int ranks;
  std::vector<std::string> flags;
};

std::string layout_name(const ::testing::TestParamInfo<Layout>& info) {
  return info.param.name;
}

class EmulatedDeviceRun : public ::testing::TestWithParam<Layout> {};

TEST_P(EmulatedDeviceRun, SavesResumesAndEqualsTheCpuRun) {
  TESSERA_SEED_TRACE();
  const Layout& layout = GetParam();
  ScratchDirectory dir("tessera_emulated_");
  std::mt19937_64 rng = make_rng();
  const std::string data = write_text_dataset(dir.path, 6000, rng);
  // ZeRO-2/3 reduce per unit (and refuse a bucket size); the others get small buckets.
  bool units = false;
  for (size_t i = 0; i + 1 < layout.flags.size(); ++i)
    units |= layout.flags[i] == "--zero" && (layout.flags[i + 1] == "2" || layout.flags[i + 1] == "3");
  const auto args =
      joined(joined(words("--model gpt --vocab-size 256 --seq-length 16 --num-layers 2 --num-heads 2 --hidden-size 32 "
                          "--hidden-dropout 0.1 --micro-batch-size 2 --lr 2e-3 --warmup-steps 2 --weight-decay 0.1 "
                          "--clip-grad 1.0 --threads 1 --train-steps 8 --save-interval 4 "
                          "--eval-interval 4 --eval-iters 2 --comm-timeout 60"),
                    {"--data", data, "--eval-data", data, "--seed", std::to_string(rng())}),
             joined(units ? std::vector<std::string>{} : words("--bucket-size-mb 0.01"), layout.flags));
  run_training(layout.ranks, joined(args, {"--device", "cpu", "--save", dir / "cpu"}), dir / "cpu.log");
  const std::string straight =
      run_training(layout.ranks, joined(args, {"--device", "emu", "--save", dir / "emu"}), dir / "emu.log");
  EXPECT_TRUE(contains(straight, "on emu:0")) << straight;
  EXPECT_TRUE(contains(straight, "the emulated device channel for device tensors")) << straight;
  for (int step : {4, 8})
    EXPECT_TRUE(checkpoints_identical(dir / ("cpu/" + step_name(step)), dir / ("emu/" + step_name(step))))
        << "step " << step;
  const auto split = joined(args, {"--device", "emu", "--save", dir / "split", "--resume", "auto"});
  run_training(layout.ranks, joined(split, {"--exit-interval", "4"}), dir / "first.log");
  const std::string second = run_training(layout.ranks, split, dir / "second.log");
  EXPECT_TRUE(contains(second, "resumed from " + (dir / "split/") + step_name(4))) << second;
  EXPECT_TRUE(checkpoints_identical(dir / ("emu/" + step_name(8)), dir / ("split/" + step_name(8))));
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, EmulatedDeviceRun,
    ::testing::Values(Layout{"DataParallelZero1Accumulating", 2, {"--zero", "1", "--global-batch-size", "8"}},
                      Layout{"DataParallelBf16", 2, {"--precision", "bf16"}},
                      Layout{"DataParallelFp16Scaled", 2, {"--precision", "fp16", "--zero", "1"}},
                      Layout{"Pipeline", 2, {"--pp", "2", "--global-batch-size", "8"}},
                      Layout{"TensorSequenceParallel", 2, {"--tp", "2", "--sequence-parallel"}},
                      Layout{"DataTensorParallelZero1", 4, {"--tp", "2", "--zero", "1"}},
                      Layout{"DataParallelZero2Accumulating", 2, {"--zero", "2", "--global-batch-size", "8"}},
                      Layout{"DataPipelineParallelZero3Bf16", 4, {"--pp", "2", "--zero", "3", "--precision", "bf16"}},
                      Layout{"TensorPipelineParallel", 4, {"--tp", "2", "--pp", "2", "--global-batch-size", "4"}},
                      Layout{"PipelineZeroBubbleZero3", 4, {"--pp", "2", "--zero", "3", "--pipeline-schedule", "zb-h1"}},
                      Layout{"TensorSequencePipelineZeroBubble", 4,
                             {"--tp", "2", "--sequence-parallel", "--pp", "2", "--pipeline-schedule", "zb-h1",
                              "--global-batch-size", "4"}}),
    layout_name);

// A kernel that faults on rank 1's device (TESSERA_FAULT=device_fault@3:1)
// is found by whichever call touches that device next, the watchdog's event
// query or the main thread's copy. Either way the report says the device
// failed, names the rank and the last operation dispatched to the device, and
// does not blame a late or broken communication; the job ends.
TEST(EmulatedDeviceFault, IsReportedAsTheDevicesFailureWithItsLastOperation) {
  TESSERA_SEED_TRACE();
  ScratchDirectory dir("tessera_emulated_");
  std::mt19937_64 rng = make_rng();
  const std::string data = write_text_dataset(dir.path, 4000, rng);
  std::vector<std::string> argv = {TESSERA_MPIEXEC, "-np",  "2",  "--oversubscribe",
                                   "--bind-to",     "none", "-x", "TESSERA_FAULT=device_fault@3:1",
                                   TESSERA_BINARY,  "train"};
  for (const std::string& arg :
       joined(words("--model gpt --vocab-size 256 --seq-length 16 --num-layers 2 --num-heads 2 --hidden-size 32 "
                    "--micro-batch-size 2 --threads 1 --train-steps 8 --device emu --comm-timeout 60"),
              {"--data", data}))
    argv.push_back(arg);
  const Outcome outcome = run_command(argv, dir / "fault.log", seconds(120));
  const std::string& output = outcome.output;
  EXPECT_NE(outcome.status, 0) << output;
  EXPECT_NE(outcome.status, -1) << "the job did not end: " << output;
  EXPECT_FALSE(outcome.left) << "processes of the job were left running";
  EXPECT_TRUE(contains(output, "TESSERA_FAULT: device_fault at step 3 on rank 1")) << output;
  EXPECT_TRUE(contains(output, "emu:1 faulted") || contains(output, "emu:1 failed: a kernel or copy on it faulted"))
      << output;
  EXPECT_TRUE(contains(output, "[rank 1]")) << output;
  EXPECT_TRUE(contains(output, "The last operation dispatched to emu:1 was '") ||
              contains(output, "the last operation dispatched to emu:1 was '"))
      << output;
  EXPECT_TRUE(contains(output, "an illegal memory access was encountered")) << output;
  EXPECT_FALSE(contains(output, "did not complete within")) << output;
}

}  // namespace
}  // namespace tessera::testing

// Faults under real mpirun (label `fault`): TESSERA_FAULT makes one rank
// hang, crash, die in the middle of a checkpoint write, read a truncated data
// file, slow down or produce NaN gradients, and the job must end the way a
// user needs: the fault named (a hang by the watchdog: which rank, which
// collective), every process gone within --comm-timeout + 10 s, and the
// newest complete checkpoint intact and resumable to the end of the run; NaN
// steps skipped and the run stopped naming the step and the tensor after
// --max-skipped-steps; a slow rank waited for; a full disk (bytes, inodes)
// named with what to do, the previous checkpoint kept.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/context.h"
#include "io/checkpoint.h"
#include "tests/support/process_job.h"
#include "tests/support/resume_support.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

std::vector<std::string> gpt_args() {
  return words(
      "--model gpt --synthetic --vocab-size 32 --seq-length 8 --num-layers 2 --num-heads 4 --hidden-size 16 "
      "--micro-batch-size 2 --threads 1 --lr 1e-3");
}

Outcome run_job(int ranks, const std::vector<std::string>& args, const std::string& log, seconds limit) {
  return run_command(tessera_command(ranks, args), log, limit);
}

// A job a fault ended: a non-zero exit within --comm-timeout + 10 s, no
// process left behind, and every one of `parts` in its output.
void expect_ended_by_fault(const Outcome& out, double comm_timeout, const std::vector<std::string>& parts) {
  EXPECT_NE(out.status, 0) << out.output;
  EXPECT_LT(out.seconds, comm_timeout + 10.0) << out.output;
  EXPECT_FALSE(out.left) << "processes left after the job ended";
  for (const std::string& part : parts)
    EXPECT_TRUE(contains(out.output, part)) << "no '" << part << "' in:\n" << out.output;
}

// After a fault ended a run: the newest complete checkpoint under `save_dir`
// is `step`, every tensor's checksum holds, and the same run (`ranks`,
// `args`, no fault) resumes from it and reaches `final_step`.
void expect_newest_checkpoint_resumes(const std::string& save_dir, int64_t step, int ranks,
                                      const std::vector<std::string>& args, int64_t final_step,
                                      const std::string& log) {
  const std::optional<std::string> latest = io::find_latest_checkpoint(save_dir);
  ASSERT_TRUE(latest.has_value()) << "no complete checkpoint in " << save_dir;
  {
    const io::CheckpointReader reader(*latest);
    EXPECT_EQ(reader.step(), step);
    EXPECT_EQ(reader.verify(), std::vector<std::string>{}) << "tensors failing their checksum in " << *latest;
  }
  ::unsetenv("TESSERA_FAULT");
  const Outcome resumed = run_job(ranks, args, log, seconds(90));
  EXPECT_EQ(resumed.status, 0) << resumed.output;
  EXPECT_TRUE(contains(resumed.output, "resumed from " + *latest)) << resumed.output;
  EXPECT_EQ(io::CheckpointReader(*io::find_latest_checkpoint(save_dir)).step(), final_step);
}

TEST(Faults, HangOnOneRankOfDpTwoTpTwoIsNamedAndEndsTheJob) {
  ScratchDirectory dir("tessera_faults_");
  const double timeout = 4.0;
  const auto args = joined(gpt_args(), {"--tp", "2", "--train-steps", "6", "--comm-timeout", "4", "--save",
                                        dir / "ckpt", "--save-interval", "2", "--resume", "auto"});
  const FaultEnvironment fault("hang@3:2");  // world rank 2 stops as step 3 begins
  const Outcome out = run_job(4, args, dir / "hang.log", seconds(60));
  // The stalled rank is named by world rank, as not having reached the collective and idle.
  expect_ended_by_fault(out, timeout,
                        {"TESSERA_FAULT: hang at step 3 on rank 2", "did not complete within 4 s (--comm-timeout",
                         "all_reduce on communicator", "(world rank 2): has NOT reached it", "<- STALLED"});
  expect_newest_checkpoint_resumes(dir / "ckpt", 2, 4, args, 6, dir / "resumed.log");
}

// Point-to-point transfers have the same deadline: a stage that stops leaves
// its neighbour waiting in the pipeline exchange, which is named.
TEST(Faults, HangOfAPipelineStageIsNamedInTheTransfer) {
  ScratchDirectory dir("tessera_faults_");
  const FaultEnvironment fault("hang@3:1");  // stage 1 stops as step 3 begins
  const Outcome out = run_job(
      2, joined(gpt_args(), {"--pp", "2", "--global-batch-size", "8", "--train-steps", "6", "--comm-timeout", "4"}),
      dir / "pp_hang.log", seconds(60));
  expect_ended_by_fault(
      out, 4.0,
      {"TESSERA_FAULT: hang at step 3 on rank 1", "send_recv on communicator 'pp'",
       "did not complete within 4 s (--comm-timeout", "(world rank 1): has NOT reached it", "<- STALLED"});
}

// Expert parallelism: a rank that stops leaves the other waiting inside the
// experts' all-to-all (the first exchange of the step's forward), which is
// named with the stalled rank, on the CPU's MPI and on the emulated device's
// channel (the same stream communicator and watchdog as NCCL's).
TEST(Faults, ARankStalledInTheExpertsAllToAllIsNamed) {
  ScratchDirectory dir("tessera_faults_");
  const auto args = joined(gpt_args(), {"--num-experts", "4", "--moe-router-topk", "2", "--ep", "2", "--train-steps",
                                        "6", "--comm-timeout", "4"});
  const FaultEnvironment fault("hang@3:1");
  const Outcome cpu = run_job(2, args, dir / "ep_hang.log", seconds(60));
  expect_ended_by_fault(cpu, 4.0,
                        {"TESSERA_FAULT: hang at step 3 on rank 1", "all_to_all on communicator 'ep'",
                         "did not complete within 4 s (--comm-timeout", "(world rank 1): has NOT reached it",
                         "<- STALLED"});
  const Outcome emulated =
      run_job(2, joined(args, {"--device", "emu", "--comm-backend", "nccl"}), dir / "ep_emu_hang.log", seconds(60));
  expect_ended_by_fault(emulated, 4.0,
                        {"TESSERA_FAULT: hang at step 3 on rank 1",
                         "[rank 0] emulated device channel (MPI) watchdog: communicator 'ep'",
                         "did not complete within 4.0 s (--comm-timeout)"});
}

// The NCCL side of the watchdog (parallel/operation_watchdog.h): the host
// never waits for an NCCL collective, so the watchdog's thread must notice
// it is late, report, abort the communicator and end the process. Needs two
// GPUs (NCCL refuses two ranks on one device); skipped here, where no GPU exists.
// A hang with device tensors: the host only queues the collectives, so the
// device communicator's watchdog thread must report it and end the job. With
// NCCL where two GPUs exist; on the emulated device (the same stream
// communicator and watchdog, MPI requests in place of NCCL calls) everywhere.
void expect_device_hang_reported(const std::string& device, const std::string& library, const ScratchDirectory& dir) {
  SCOPED_TRACE(device);
  const FaultEnvironment fault("hang@3:1");
  const Outcome out = run_job(
      2,
      joined(gpt_args(), {"--device", device, "--comm-backend", "nccl", "--train-steps", "6", "--comm-timeout", "4"}),
      dir / (device + "_hang.log"), seconds(60));
  expect_ended_by_fault(
      out, 4.0,
      {"TESSERA_FAULT: hang at step 3 on rank 1", "[rank 0] " + library + " watchdog: communicator '",
       "did not complete within 4.0 s (--comm-timeout)", "rank 0 aborts " + library + " communicator"});
}

TEST(Faults, ADeviceCollectiveHangIsReportedByTheWatchdogOnTheEmulatedDevice) {
  ScratchDirectory dir("tessera_faults_");
  expect_device_hang_reported("emu", "emulated device channel (MPI)", dir);
}

TEST(Faults, NcclHangIsReportedByTheWatchdogAndEndsTheJob) {
  Context ctx;
  if (ctx.cuda_device_count() < 2)
    GTEST_SKIP() << "needs 2 CUDA devices (NCCL puts one rank on each), this machine has " << ctx.cuda_device_count()
                 << " (" << no_gpu_reason() << "); the emulated-device test runs the same watchdog here";
  ScratchDirectory dir("tessera_faults_");
  expect_device_hang_reported("cuda", "NCCL", dir);
}

TEST(Faults, CrashOfOneRankEndsTheJobAndTheLastCheckpointResumes) {
  ScratchDirectory dir("tessera_faults_");
  // Synchronous saves: the step-4 checkpoint is published before step 5
  // begins (an asynchronous one is published at a later step boundary, so a
  // crash in the step after it may find it unpublished: see below).
  const auto args = joined(gpt_args(), {"--train-steps", "8", "--save", dir / "ckpt", "--save-interval", "2",
                                        "--resume", "auto", "--no-async-save"});
  {
    const FaultEnvironment fault("crash@5:1");  // rank 1 dies as step 5 begins, after the step-4 checkpoint
    const Outcome out = run_job(2, args, dir / "crash.log", seconds(60));
    // The default --comm-timeout at most; mpirun ends the job as soon as the rank dies.
    expect_ended_by_fault(out, 300.0, {"TESSERA_FAULT: crash at step 5 on rank 1"});
  }
  expect_newest_checkpoint_resumes(dir / "ckpt", 4, 2, args, 8, dir / "resumed.log");
}

TEST(Faults, DeathInTheMiddleOfACheckpointWriteLeavesThePreviousOneIntact) {
  // A rank dies while writing the step-4 checkpoint, after some of its
  // pieces, before anything is published: rank 1 on its background thread
  // (sharded, asynchronous: training had gone on), rank 1 in a synchronous
  // sharded save, rank 0 gathering everything (format 1). --zero 1 gives
  // rank 1 optimizer state of its own to write.
  struct Case {
    std::string name, fault;
    std::vector<std::string> flags;
  };
  const std::vector<Case> cases = {
      {"async", "checkpoint_crash@4:1", {"--async-save"}},
      {"sync", "checkpoint_crash@4:1", {"--no-async-save"}},
      {"gathered", "checkpoint_crash@4:0", {"--ckpt-format", "gathered"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    ScratchDirectory dir("tessera_faults_");
    const auto args = joined(gpt_args(), joined({"--train-steps", "6", "--save", dir / "ckpt", "--save-interval", "2",
                                                 "--resume", "auto", "--comm-timeout", "10", "--zero", "1"},
                                                c.flags));
    {
      const FaultEnvironment fault(c.fault);
      const Outcome out = run_job(2, args, dir / "crash.log", seconds(60));
      const std::string rank = c.fault.substr(c.fault.size() - 1);
      expect_ended_by_fault(out, 10.0,
                            {"TESSERA_FAULT: checkpoint_crash while writing the step-4 checkpoint on rank " + rank});
    }
    EXPECT_FALSE(std::filesystem::exists(dir / "ckpt/step_00000004")) << "a half-written checkpoint was published";
    std::ifstream latest(dir / "ckpt/latest");
    EXPECT_EQ(std::string(std::istreambuf_iterator<char>(latest), {}), "step_00000002\n");
    expect_newest_checkpoint_resumes(dir / "ckpt", 2, 2, args, 6, dir / "resumed.log");
  }
}

// A writer that stops for good in the middle of a save (a dead mount, a
// stopped process) is a stall: the ranks waiting for it see no sign of life
// (no heartbeat between slabs) and name it within --comm-timeout (5 s here),
// not after --save-timeout (an hour, the default); the previous checkpoint
// stays the newest and resumes. Synchronous (rank 1), asynchronous (rank 1's
// background writer; the others wait at the next save) and gathered (rank 0,
// the only writer).
TEST(Faults, AWriterStoppedInTheMiddleOfASaveIsNamedWithinTheCommTimeout) {
  struct Case {
    std::string name, fault;
    std::vector<std::string> flags;
  };
  const std::vector<Case> cases = {
      {"sync", "checkpoint_hang@4:1", {"--no-async-save"}},
      {"async", "checkpoint_hang@4:1", {"--async-save"}},
      {"gathered", "checkpoint_hang@4:0", {"--ckpt-format", "gathered"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    ScratchDirectory dir("tessera_faults_");
    const auto args = joined(gpt_args(), joined({"--train-steps", "6", "--save", dir / "ckpt", "--save-interval", "2",
                                                 "--resume", "auto", "--comm-timeout", "5", "--zero", "1"},
                                                c.flags));
    {
      const FaultEnvironment fault(c.fault);
      const Outcome out = run_job(2, args, dir / "hang.log", seconds(60));
      const std::string rank = c.fault.substr(c.fault.size() - 1);
      expect_ended_by_fault(out, 5.0,
                            {"TESSERA_FAULT: checkpoint_hang while writing the step-4 checkpoint on rank " + rank,
                             "(within --save-timeout 3600 s) for ranks that show no sign of life for more than 5 s "
                             "(--comm-timeout)",
                             "world rank " + rank + ": no sign of life for "});
    }
    std::ifstream latest(dir / "ckpt/latest");
    EXPECT_EQ(std::string(std::istreambuf_iterator<char>(latest), {}), "step_00000002\n");
    expect_newest_checkpoint_resumes(dir / "ckpt", 2, 2, args, 6, dir / "resumed.log");
  }
}

TEST(Faults, ATruncatedDataFileInTheMiddleOfARunNamesTheRankAndTheFile) {
  ScratchDirectory dir("tessera_faults_");
  std::mt19937_64 rng(std::random_device{}());
  const std::string data = write_text_dataset(dir.path, 4000, rng);
  const auto args = words(
      "--model gpt --seq-length 8 --num-layers 2 --num-heads 4 --hidden-size 16 --micro-batch-size 2 --threads 1 "
      "--train-steps 6 --save-interval 2 --resume auto --comm-timeout 10 --no-async-save");
  // Synchronous saves: the step-4 checkpoint is published before step 5's
  // failure (an asynchronous one races the abort: DeathInTheMiddle... has it).
  const auto run_args = joined(args, {"--data", data, "--save", dir / "ckpt"});
  {
    const FaultEnvironment fault("truncated_data@5:1");  // rank 1's data file is cut as step 5 begins
    const Outcome out = run_job(2, run_args, dir / "truncated.log", seconds(60));
    // The readers' own check, naming the rank, the file and what to do.
    expect_ended_by_fault(
        out, 10.0,
        {"TESSERA_FAULT: truncated_data at step 5 on rank 1", "[rank 1]", "truncated file",
         "cannot be opened as an HDF5 file", "prepare it again", "rank 1 failed; aborting all 2 ranks"});
  }
  expect_newest_checkpoint_resumes(dir / "ckpt", 4, 2, run_args, 6, dir / "resumed.log");
}

// The data file of a running 2-rank job changes under it, as a user's `cp`,
// `truncate` or `mv` would do it (not through TESSERA_FAULT): the job must
// end at its next read naming the file and what changed, not train on zeros
// or on another file, leave no process behind, and keep its newest checkpoint
// intact; the same command with the file restored resumes from it.
struct DataChange {
  const char* name;
  const char* expected;  // what the message says changed
  std::function<void(const std::string& live, const std::string& other)> apply;
};

class DataFileChanged : public ::testing::TestWithParam<DataChange> {};

TEST_P(DataFileChanged, EndsTheJobNamingTheFileAndTheChange) {
  const DataChange& change = GetParam();
  ScratchDirectory dir("tessera_faults_");
  std::mt19937_64 rng(std::random_device{}());
  std::filesystem::create_directories(dir / "a");
  std::filesystem::create_directories(dir / "b");
  const std::string original = write_text_dataset(dir.path / "a", 60000, rng);
  const std::string other = write_text_dataset(dir.path / "b", 60000, rng);
  const std::string live = dir / "live.h5";
  std::filesystem::copy_file(original, live);
  const auto args = joined(words("--model gpt --seq-length 8 --num-layers 1 --num-heads 2 --hidden-size 16 "
                                 "--micro-batch-size 2 --threads 1 --train-steps 100000 --save-interval 5 "
                                 "--log-interval 1 --resume auto --comm-timeout 20"),
                           {"--data", live, "--save", dir / "ckpt", "--metrics", dir / "metrics.jsonl"});
  Job job(tessera_command(2, args), dir / "run.log");
  ASSERT_TRUE(wait_for_steps(job, dir / "metrics.jsonl", 12, seconds(60))) << job.output();
  change.apply(live, other);
  const int status = job.wait(seconds(60));
  const std::string output = job.output();
  EXPECT_NE(status, 0) << output;
  EXPECT_NE(status, -1) << "the job did not end:\n" << output;
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_FALSE(job.anything_left()) << "processes left after the job ended";
  for (const std::string& part : std::vector<std::string>{
           "[rank ", "data file " + live + " changed while this job was reading it", change.expected, "--resume auto"})
    EXPECT_TRUE(contains(output, part)) << "no '" << part << "' in:\n" << output;
  const std::optional<std::string> latest = io::find_latest_checkpoint(dir / "ckpt");
  ASSERT_TRUE(latest.has_value()) << output;
  const io::CheckpointReader reader(*latest);
  EXPECT_EQ(reader.verify(), std::vector<std::string>{});
  const int64_t saved = reader.step();
  std::filesystem::remove(live);
  std::filesystem::copy_file(original, live);
  const Outcome resumed =
      run_job(2, joined(args, {"--exit-interval", std::to_string(saved + 2)}), dir / "resumed.log", seconds(60));
  EXPECT_EQ(resumed.status, 0) << resumed.output;
  EXPECT_TRUE(contains(resumed.output, "resumed from " + *latest)) << resumed.output;
}

INSTANTIATE_TEST_SUITE_P(
    Changes, DataFileChanged,
    ::testing::Values(DataChange{"Truncated", "(truncated): HDF5 reads zeros past its end",
                                 [](const std::string& live, const std::string&) {
                                   std::filesystem::resize_file(live, std::filesystem::file_size(live) / 2);
                                 }},
                      DataChange{"RewrittenInPlace", "rewritten while open",
                                 [](const std::string& live, const std::string& other) {
                                   std::filesystem::copy_file(other, live,
                                                              std::filesystem::copy_options::overwrite_existing);
                                 }},
                      DataChange{"Replaced", "the path now names another file",
                                 [](const std::string& live, const std::string& other) {
                                   std::filesystem::copy_file(other, live + ".new");
                                   std::filesystem::rename(live + ".new", live);
                                 }}),
    [](const ::testing::TestParamInfo<DataChange>& param) { return std::string(param.param.name); });

// A checkpoint that takes longer to write than --comm-timeout (rank 0 sleeps
// 6 s in the middle of the step-2 write; the timeout is 3 s) is not a stall:
// the save has its own deadline (--save-timeout), and the run ends normally.
// With a save deadline shorter than the write, the others' report says rank
// 0 is writing checkpoint step 2, and names --save-timeout, not a stall.
TEST(Faults, ASaveSlowerThanTheCommTimeoutIsNotAStall) {
  ScratchDirectory dir("tessera_faults_");
  const auto args = joined(gpt_args(), {"--train-steps", "4", "--save-interval", "2", "--comm-timeout", "3"});
  const FaultEnvironment fault("slow_checkpoint@2:0");
  const Outcome ok = run_job(2, joined(args, {"--save", dir / "ok"}), dir / "ok.log", seconds(90));
  EXPECT_EQ(ok.status, 0) << ok.output;
  EXPECT_TRUE(contains(ok.output, "TESSERA_FAULT: slow_checkpoint while writing the step-2 checkpoint on rank 0"))
      << ok.output;
  EXPECT_FALSE(contains(ok.output, "STALLED")) << ok.output;
  ASSERT_TRUE(io::find_latest_checkpoint(dir / "ok").has_value());
  EXPECT_EQ(io::CheckpointReader(*io::find_latest_checkpoint(dir / "ok")).step(), 4);

  const Outcome late =
      run_job(2, joined(args, {"--save", dir / "late", "--save-timeout", "2"}), dir / "late.log", seconds(90));
  expect_ended_by_fault(late, 2.0,
                        {"did not complete within 2 s (--save-timeout", "(world rank 0): ",
                         "writing checkpoint step 2 for ", "<- WRITING A CHECKPOINT (--save-timeout)"});
  EXPECT_FALSE(contains(late.output, "STALLED")) << late.output;
}

// Two jobs given one --save directory: the second is refused at its start,
// told which job holds the directory (host, pid), and writes nothing; the
// first goes on undisturbed (a SIGUSR1 then makes it checkpoint and exit 0),
// and its checkpoints verify. Once it has ended the directory is free again.
TEST(Faults, ASecondJobWritingTheSameSaveDirectoryIsRefusedNamingTheFirst) {
  ScratchDirectory dir("tessera_faults_");
  const auto args = joined(gpt_args(), {"--train-steps", "100000", "--save", dir / "ckpt", "--save-interval", "20",
                                        "--log-interval", "1", "--resume", "auto"});
  Job first(tessera_command(2, joined(args, {"--metrics", dir / "first.jsonl"})), dir / "first.log");
  ASSERT_TRUE(wait_for_steps(first, dir / "first.jsonl", 25, seconds(60))) << first.output();
  const Outcome second = run_job(2, args, dir / "second.log", seconds(60));
  EXPECT_NE(second.status, 0) << second.output;
  EXPECT_FALSE(second.left) << "processes of the second job left";
  for (const std::string& part :
       std::vector<std::string>{"[rank 0]", "--save " + (dir / "ckpt") + " is in use: another job is writing", "host ",
                                ", pid ", "give this job its own --save"})
    EXPECT_TRUE(contains(second.output, part)) << "no '" << part << "' in:\n" << second.output;
  EXPECT_FALSE(contains(second.output, "resumed from")) << second.output;
  EXPECT_TRUE(first.running()) << "the first job was disturbed:\n" << first.output();
  ::kill(first.pid(), SIGUSR1);  // mpirun forwards it to the ranks: a checkpoint, then exit 0
  EXPECT_EQ(first.wait(seconds(60)), 0) << first.output();
  const std::optional<std::string> latest = io::find_latest_checkpoint(dir / "ckpt");
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(io::CheckpointReader(*latest).verify(), std::vector<std::string>{});
  // Free again: the same command now resumes (and stops at once).
  const Outcome third = run_job(2, joined(args, {"--exit-interval", "1"}), dir / "third.log", seconds(60));
  EXPECT_EQ(third.status, 0) << third.output;
  EXPECT_TRUE(contains(third.output, "resumed from " + *latest)) << third.output;
}

// A run whose --save directory sits on a small tmpfs (`mount_options`),
// mounted in a private mount namespace (unshare) so nothing outlives the
// test; the save directory is copied out to `copy` afterwards for the checks.
Outcome run_on_small_filesystem(const ScratchDirectory& dir, const std::string& mount_options,
                                const std::vector<std::string>& args, const std::string& copy) {
  const std::string mount_point = dir / "small";
  std::filesystem::create_directories(mount_point);
  const std::string script = "mount -t tmpfs -o " + mount_options + " tessera-test " + shell_words({mount_point}) +
                             " || exit 97; " +
                             shell_words(tessera_command(2, joined(args, {"--save", mount_point + "/ckpt"}))) +
                             "; status=$?; cp -a " + shell_words({mount_point + "/ckpt", copy}) + "; exit $status";
  return run_command({"/usr/bin/unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", script},
                     dir / "small.log", seconds(60));
}

TEST(Faults, AFullDiskStopsTheSaveSayingSoAndKeepsThePreviousCheckpoint) {
  if (::geteuid() != 0 || !std::filesystem::exists("/usr/bin/unshare"))
    GTEST_SKIP() << "needs root and util-linux's unshare to mount a small tmpfs in a private mount namespace";
  // Sharded (the default, asynchronous): each checkpoint of this model is
  // about 210 KiB in 4 inodes (the directory, rank 0's file, rank 1's, the
  // index); 500 KiB hold two, and so do 13 inodes (the save directory, its
  // lock file and `latest` take 3, `latest.tmp` one more while it is
  // replaced). The inodes run out as the ranks create their step-6 files: the
  // write itself fails, on the background threads, and the run stops at the
  // next step boundary naming the ranks and the files. Gathered (format 1):
  // about 123 KiB in 2 inodes; 300 KiB and 9 inodes hold two.
  struct Case {
    std::string mount_options, message;
    std::vector<std::string> format, parts;
  };
  const std::vector<std::string> gathered = {"--ckpt-format", "gathered"};
  const std::vector<Case> cases = {
      {"size=500k", "the checkpoint needs about", {}, {}},
      {"size=10m,nr_inodes=13",
       "no room for more files (inodes)",
       {},
       {"could not write ", ".step_00000006.tmp/rank_0000"}},
      {"size=300k", "the checkpoint needs about", gathered, {}},
      {"size=10m,nr_inodes=9", "no room for more files (inodes)", gathered, {}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.mount_options + (c.format.empty() ? " sharded" : " gathered"));
    ScratchDirectory dir("tessera_faults_");
    const auto args =
        joined(gpt_args(), joined({"--train-steps", "8", "--save-interval", "2", "--comm-timeout", "10"}, c.format));
    const Outcome out = run_on_small_filesystem(dir, c.mount_options, args, dir / "after");
    ASSERT_NE(out.status, 97) << "could not mount a tmpfs:\n" << out.output;
    expect_ended_by_fault(
        out, 10.0,
        {"[rank 0] tessera error: saving checkpoint ",
         "step_00000006 failed (the previous "
         "checkpoint and 'latest' are untouched)",
         c.message, "keep fewer checkpoints (--keep-checkpoints N), or --save to a larger filesystem"});
    for (const std::string& part : c.parts)
      EXPECT_TRUE(contains(out.output, part)) << part << " not in:\n" << out.output;
    EXPECT_FALSE(contains(out.output, "HDF5-DIAG")) << "HDF5's own error stack printed:\n" << out.output;
    // What was on the small filesystem: the step-4 checkpoint, complete, and nothing half-written.
    EXPECT_FALSE(std::filesystem::exists(dir / "after/.step_00000006.tmp"));
    expect_newest_checkpoint_resumes(dir / "after", 4, 2, joined(args, {"--save", dir / "after", "--resume", "auto"}),
                                     8, dir / "resumed.log");
  }
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
  // Steps 3, 4 and 5 bad: the run stops after 3 in a row, naming the step and
  // the first non-finite gradient; the checkpoint after (skipped) step 4
  // holds step 2's weights and the skip count, and resumes to the end.
  const auto args = joined(gpt_args(), {"--train-steps", "8", "--max-skipped-steps", "3", "--save", dir / "ckpt",
                                        "--save-interval", "2", "--resume", "auto"});
  {
    const FaultEnvironment fault("nan_grad@3:0,nan_grad@4:0,nan_grad@5:0");
    const Outcome out = run_job(2, args, dir / "all.log", seconds(60));
    expect_ended_by_fault(out, 300.0,
                          {"step 5: non-finite gradients in 3 consecutive steps", "first non-finite gradient: "});
  }
  expect_newest_checkpoint_resumes(dir / "ckpt", 4, 2, args, 8, dir / "resumed.log");
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

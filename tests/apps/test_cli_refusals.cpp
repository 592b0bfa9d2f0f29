// The real `tessera` program, refusing what a user gets wrong before any
// training starts (issue 21): a --config file with an array where one value
// goes or an unterminated string or array (a segfault before, on every rank
// under mpirun), settings given that the run would not use, unknown flags and
// commands (with the flag or command meant, and the rank under a launcher),
// numeric flags out of range (with the range in words), and a plain start
// inside a Slurm allocation of several tasks. Each must exit with a status
// (no signal), a message naming the key, line or flag and the fix, and no
// training step.
//
// The program is TESSERA_BINARY (from the environment, e.g. to try an older
// build, or from the build), else the `tessera` beside this test binary;
// mpiexec is TESSERA_MPIEXEC or the first on PATH (the tests that need it
// skip without one). Every run gets a clean environment: no Slurm or MPI
// launcher variables but those a test sets, so the tests behave the same
// inside a Slurm job or under mpirun.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "tests/support/process_job.h"

namespace tessera::testing {
namespace {

namespace fs = std::filesystem;

fs::path tessera_binary() {
  if (const char* path = std::getenv("TESSERA_BINARY"); path != nullptr && *path != '\0') return path;
#ifdef TESSERA_BINARY
  return TESSERA_BINARY;
#else
  return fs::read_symlink("/proc/self/exe").parent_path() / "tessera";
#endif
}

// mpiexec, or "" when there is none.
std::string mpiexec() {
  if (const char* path = std::getenv("TESSERA_MPIEXEC"); path != nullptr && *path != '\0') return path;
  const char* search = std::getenv("PATH");
  std::istringstream dirs(search != nullptr ? search : "/usr/bin:/bin");
  for (std::string dir; std::getline(dirs, dir, ':');)
    if (!dir.empty() && ::access((fs::path(dir) / "mpiexec").c_str(), X_OK) == 0)
      return (fs::path(dir) / "mpiexec").string();
  return "";
}

bool launcher_variable(const std::string& entry) {
  for (const char* prefix : {"SLURM_", "OMPI_", "PMIX_", "PMI_", "MV2_", "MPI_LOCALRANKID", "TESSERA_"})
    if (entry.rfind(prefix, 0) == 0) return true;
  return false;
}

// Runs `argv` with this process's environment less launcher (and TESSERA_)
// variables, plus `extra`; stdout and stderr together; killed after 90 s.
Outcome run(const std::vector<std::string>& argv, const std::vector<std::string>& extra = {}) {
  const fs::path log = fs::temp_directory_path() / ("tessera_cli_" + std::to_string(::getpid()) + ".log");
  Outcome outcome = run_command(argv, log, seconds(90), job_environment(launcher_variable, extra));
  fs::remove(log);
  return outcome;
}

std::vector<std::string> tessera(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {tessera_binary().string()};
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

std::vector<std::string> under_mpiexec(int ranks, const std::vector<std::string>& args) {
  std::vector<std::string> argv = {mpiexec(), "-np", std::to_string(ranks), "--oversubscribe", "--bind-to", "none"};
  const std::vector<std::string> program = tessera(args);
  argv.insert(argv.end(), program.begin(), program.end());
  return argv;
}

// A tiny run that finishes in a fraction of a second when nothing refuses it.
const std::vector<std::string> kTiny = {
    "train", "--synthetic", "--train-steps", "1", "--micro-batch-size", "2", "--threads", "1"};

std::vector<std::string> tiny(const std::vector<std::string>& more) {
  std::vector<std::string> args = kTiny;
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Refused: a plain exit status 1..127 (not a signal), every part in the
// output, no training step.
void expect_refused(const Outcome& out, const std::vector<std::string>& parts) {
  EXPECT_GE(out.status, 1) << out.output;
  EXPECT_LT(out.status, 128) << "ended by a signal (or killed):\n" << out.output;
  for (const std::string& part : parts)
    EXPECT_TRUE(contains(out.output, part)) << "no '" << part << "' in:\n" << out.output;
  EXPECT_FALSE(contains(out.output, "done:")) << out.output;
}

class Cli : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(fs::exists(tessera_binary())) << tessera_binary() << " is missing: build the tessera_cli target";
    dir = fs::temp_directory_path() / ("tessera_cli_" + std::to_string(::getpid()) + "_" +
                                       ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir);
  }
  void TearDown() override { fs::remove_all(dir); }

  std::string toml(const std::string& text) {
    const fs::path path = dir / "e.toml";
    std::ofstream(path, std::ios::binary) << text;
    return path.string();
  }

  fs::path dir;
};

// Issue 21, case 2: each of these was a segfault (status 139), or trained
// with 5 layers for [3, 5], or blamed the value instead of the quote.
TEST_F(Cli, ConfigArraysAndUnterminatedValuesAreErrorsNamingTheLine) {
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"num-layers = []\n", {"e.toml line 1", "'num-layers' takes one value"}},
      {"lr = []\n", {"e.toml line 1", "'lr' takes one value"}},
      {"model = []\n", {"e.toml line 1", "'model' takes one value"}},
      {"num-layers = [2\n", {"e.toml line 1: not valid TOML", "array"}},
      {"num-layers = [2\nlr = 0.5\n", {"e.toml line 2: not valid TOML", "array"}},
      {"num-layers = [3, 5]\n", {"e.toml line 1", "'num-layers' takes one value", "[3, 5]"}},
      {"# the model\nmodel = \"gpt\n", {"e.toml line 2: not valid TOML", "string"}},
  };
  for (const auto& [text, parts] : cases) {
    SCOPED_TRACE(text);
    expect_refused(run(tessera(tiny({"--config", toml(text)}))), parts);
  }
}

TEST_F(Cli, ConfigArraysStillSetListFlags) {
  const Outcome out = run(tessera(tiny({"--config", toml("hidden = [16,\n  8]  # widths\n")})));
  EXPECT_EQ(out.status, 0) << out.output;
  EXPECT_TRUE(contains(out.output, "hidden=16,8")) << out.output;
}

TEST_F(Cli, ConfigErrorsUnderMpiexecNameTheRankAndLineOnEveryRank) {
  if (mpiexec().empty()) GTEST_SKIP() << "no mpiexec on PATH (set TESSERA_MPIEXEC)";
  const Outcome out = run(under_mpiexec(2, tiny({"--config", toml("num-layers = []\n")})));
  EXPECT_NE(out.status, 0) << out.output;
  EXPECT_LT(out.status, 128) << out.output;
  for (const std::string rank : {"0", "1"})
    EXPECT_TRUE(contains(out.output, "tessera: [rank " + rank + "] tessera error: --config " + dir.string() +
                                         "/e.toml line 1: 'num-layers' takes one value"))
        << out.output;
  EXPECT_FALSE(contains(out.output, "signal")) << out.output;
  EXPECT_FALSE(contains(out.output, "Segmentation")) << out.output;
}

// Issue 21, case 5: each trained, ignoring the setting.
TEST_F(Cli, SettingsTheRunWouldNotUseAreRefusedWithTheReason) {
  const std::vector<std::pair<std::vector<std::string>, std::vector<std::string>>> cases = {
      {{"--model", "mlp", "--hidden-size", "64"}, {"--hidden-size 64", "--hidden 64,64"}},
      {{"--num-layers", "3"}, {"--num-layers 3", "--model mlp (the default)"}},
      {{"--vocab-size", "100"}, {"--vocab-size 100", "GPT"}},
      {{"--recompute"}, {"--recompute:", "GPT"}},
      {{"--hidden-dropout", "0.1"}, {"--hidden-dropout 0.1", "GPT"}},
      {{"--attention-dropout", "0.1"}, {"--attention-dropout 0.1", "GPT and the Llama"}},
      {{"--model", "cnn", "--num-layers", "2"}, {"--num-layers 2", "--model cnn"}},
      {{"--nesterov"}, {"--nesterov:", "--optimizer adamw (the default)", "--optimizer sgd"}},
      {{"--sequence-parallel"}, {"--sequence-parallel:", "--tensor-parallel 1"}},
  };
  for (const auto& [args, parts] : cases) {
    SCOPED_TRACE(::testing::PrintToString(args));
    std::vector<std::string> all = parts;
    all.push_back("would not use");
    expect_refused(run(tessera(tiny(args))), all);
  }
  // In the --config file: the message names the line.
  expect_refused(run(tessera(tiny({"--config", toml("hidden-size = 64\n")}))),
                 {"--hidden-size 64 (" + dir.string() + "/e.toml line 1)"});
  // Defaults, false flags and settings the run uses are not refused.
  for (const std::vector<std::string>& args : {std::vector<std::string>{"--hidden", "8"},
                                               {"--hidden", "8", "--recompute=false"},
                                               {"--hidden", "8", "--optimizer", "sgd", "--nesterov"}}) {
    const Outcome out = run(tessera(tiny(args)));
    EXPECT_EQ(out.status, 0) << ::testing::PrintToString(args) << "\n" << out.output;
  }
}

// Issue 21, case 5: unknown flags and command typos, with what was meant.
TEST_F(Cli, UnknownFlagsAndCommandsGetWhatWasMeant) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {tiny({"--learning-rate", "0.1"}), "unknown flag --learning-rate for `tessera train`; did you mean `--lr`?"},
      {tiny({"--train-step", "3"}), "unknown flag --train-step for `tessera train`; did you mean `--train-steps`?"},
      {tiny({"--bf16"}), "unknown flag --bf16 for `tessera train`; did you mean `--precision bf16`?"},
      {{"trian", "--synthetic"}, "'trian' is not a command of `tessera`; did you mean `tessera train`?"},
  };
  for (const auto& [args, part] : cases) {
    SCOPED_TRACE(::testing::PrintToString(args));
    expect_refused(run(tessera(args)), {"tessera: bad command line: " + part});
  }
}

TEST_F(Cli, UnknownFlagsUnderMpiexecCarryTheRankPrefix) {
  if (mpiexec().empty()) GTEST_SKIP() << "no mpiexec on PATH (set TESSERA_MPIEXEC)";
  const Outcome out = run(under_mpiexec(2, tiny({"--learning-rate", "0.1"})));
  EXPECT_NE(out.status, 0) << out.output;
  EXPECT_LT(out.status, 128) << out.output;
  for (const std::string rank : {"0", "1"})
    EXPECT_TRUE(contains(out.output, "tessera: [rank " + rank +
                                         "] bad command line: unknown flag --learning-rate for `tessera train`; did "
                                         "you mean `--lr`?"))
        << out.output;
}

// Issue 21, case 10: the range was printed as a 309-digit number.
TEST_F(Cli, NumericRangesAreInWords) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--comm-timeout", "-1"}, "--comm-timeout: must be a number of seconds from 0 (no limit) to 31536000"},
      {{"--tensor-parallel", "0"}, "--tensor-parallel: must be a whole number >= 1, got '0'"},
      {{"--pipeline-parallel", "0"}, "--pipeline-parallel: must be a whole number >= 1, got '0'"},
  };
  for (const auto& [args, part] : cases) {
    SCOPED_TRACE(::testing::PrintToString(args));
    const Outcome out = run(tessera(tiny(args)));
    expect_refused(out, {part});
    EXPECT_FALSE(contains(out.output, "0000000000")) << out.output;
  }
}

// Issue 21, case 9: `tessera train` run straight from an sbatch --ntasks=2
// script (these are the batch step's variables: SLURM_PROCID but no
// SLURM_STEP_ID) trained alone as one rank, without a word.
TEST_F(Cli, APlainStartInASlurmAllocationOfSeveralTasksIsRefused) {
  const std::vector<std::string> batch = {"SLURM_JOB_ID=4242", "SLURM_JOBID=4242",      "SLURM_NTASKS=2",
                                          "SLURM_NPROCS=2",    "SLURM_PROCID=0",        "SLURM_LOCALID=0",
                                          "SLURM_NODEID=0",    "SLURM_GTIDS=0",         "SLURM_JOB_NUM_NODES=1",
                                          "SLURM_NNODES=1",    "SLURM_TASKS_PER_NODE=2"};
  expect_refused(run(tessera(tiny({"--hidden", "8"})), batch),
                 {"Slurm job 4242", "2 tasks (SLURM_NTASKS=2)", "srun --mpi=pmix tessera train",
                  "mpirun -np 2 tessera train", "TESSERA_LAUNCH_CHECK=0"});

  // One rank on purpose, and a one-task allocation: they train.
  std::vector<std::string> allowed = batch;
  allowed.push_back("TESSERA_LAUNCH_CHECK=0");
  Outcome out = run(tessera(tiny({"--hidden", "8"})), allowed);
  EXPECT_EQ(out.status, 0) << out.output;
  out = run(tessera(tiny({"--hidden", "8"})),
            {"SLURM_JOB_ID=4242", "SLURM_NTASKS=1", "SLURM_NPROCS=1", "SLURM_PROCID=0"});
  EXPECT_EQ(out.status, 0) << out.output;
}

}  // namespace
}  // namespace tessera::testing

// Bad input under real mpirun (label `fault`), one test per case a user can
// give: config values (negative sizes, layouts that do not divide, an unknown
// model, ranks started with different flags or data), data files (missing,
// wrong schema, wrong dtype, truncated, labels out of range) and checkpoints
// (missing, truncated, checksum mismatch, a different model, not visible
// to every rank; a save directory that cannot be written). Every case is a
// 2-rank `tessera train --save DIR --resume auto` on a directory that
// already holds a good run's checkpoints, and must end with a message naming
// the rank, the flag or file and what to do, a non-zero exit, no hang (well
// within the test's deadline), no process left, and every file of DIR
// exactly as it was.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "io/checkpoint.h"
#include "io/save_lock.h"
#include "tests/io/io_test_files.h"
#include "tests/support/process_job.h"
#include "tests/support/resume_support.h"

namespace tessera::testing {
namespace {

namespace fs = std::filesystem;

const std::vector<std::string> kGpt = words(
    "--model gpt --seq-length 8 --num-layers 2 --num-heads 4 --hidden-size 16 --micro-batch-size 2 --threads 1 "
    "--train-steps 6 --save-interval 2 --comm-timeout 20");

// Every file under `dir` with its bytes: the "untouched" check.
// Every file of `dir` and its bytes, but the save directory's lock file
// (io/save_lock.h): each run that starts takes the lock and writes its name
// there; the checkpoints and `latest` are what must not change.
std::map<std::string, std::string> snapshot(const fs::path& dir) {
  std::map<std::string, std::string> files;
  for (const auto& entry : fs::recursive_directory_iterator(dir)) {
    if (!entry.is_regular_file() || entry.path().filename() == io::kSaveLockFile) continue;
    std::ifstream in(entry.path(), std::ios::binary);
    std::stringstream bytes;
    bytes << in.rdbuf();
    files[fs::relative(entry.path(), dir).string()] = bytes.str();
  }
  return files;
}

class BadInput : public ::testing::Test {
 protected:
  // A token file and a good 2-rank run's checkpoints (steps 2 and 4) in a fresh directory.
  void SetUp() override {
    std::mt19937_64 rng(std::random_device{}());
    data = write_text_dataset(dir.path, 4000, rng);
    Job job(tessera_command(2, joined(kGpt, {"--train-steps", "4", "--data", data, "--save", save})), dir / "good.log");
    ASSERT_EQ(job.wait(seconds(90)), 0) << job.output();
    ASSERT_TRUE(fs::exists(fs::path(save) / "step_00000004"));
  }

  // Runs `tessera train` on 2 ranks with the usual flags, `--save`/`--resume auto`
  // on the good run's directory, then `extra` (later flags win). Expects a
  // failure whose output holds every part of `expected`, within 30 s, nothing
  // left running and the save directory untouched. Returns the output.
  std::string expect_refused(const std::vector<std::string>& extra, const std::vector<std::string>& expected) {
    return expect_command_refused(tessera_command(2, train_args(extra)), expected);
  }

  // The usual flags, `--save`/`--resume auto` on the good run's directory, then `extra`.
  std::vector<std::string> train_args(const std::vector<std::string>& extra) const {
    return joined(joined(kGpt, {"--data", data, "--save", save, "--resume", "auto"}), extra);
  }

  // expect_refused for a whole command line (`argv`: mpiexec ...).
  std::string expect_command_refused(const std::vector<std::string>& argv, const std::vector<std::string>& expected) {
    const auto before = snapshot(save);
    const Outcome out = run_command(argv, dir / "bad.log", seconds(60));
    const std::string& output = out.output;
    EXPECT_NE(out.status, 0) << output;
    EXPECT_NE(out.status, -1) << "killed at the deadline: it hung";
    EXPECT_LT(out.seconds, 30.0) << output;
    EXPECT_FALSE(out.left) << "processes left after the job ended";
    for (const std::string& part : expected)
      EXPECT_TRUE(contains(output, part)) << "no '" << part << "' in:\n" << output;
    EXPECT_TRUE(contains(output, "[rank 0]") || contains(output, "[rank 1]")) << "no rank named in:\n" << output;
    EXPECT_TRUE(snapshot(save) == before) << "the save directory " << save << " changed";
    return output;
  }

  std::string newest_checkpoint_file() const { return (fs::path(save) / "step_00000004" / "checkpoint.h5").string(); }

  ScratchDirectory dir{"tessera_bad_input_"};
  std::string data;
  std::string save = dir / "ckpt";
};

// --- Config values ---------------------------------------------------------

TEST_F(BadInput, NegativeSizes) {
  expect_refused({"--micro-batch-size", "-4"}, {"--micro-batch-size must be positive, got -4"});
  expect_refused({"--hidden-size", "-16"}, {"--hidden-size -16 must be at least 1"});
  expect_refused({"--seq-length", "0"}, {"--seq-length 0 must be at least 1"});
}

// A typo in a size is refused at once with its bound (the search for a head
// count that divides --hidden-size 99999999999 used to spin for minutes).
TEST_F(BadInput, TypoSizesAreRefusedAtOnce) {
  expect_refused({"--hidden-size", "99999999999"},
                 {"--hidden-size 99999999999 is larger than 1048576", "check the value for a typo"});
  expect_refused({"--num-layers", "1000000"}, {"--num-layers 1000000 is larger than 16384"});
}

// --zero shards over the data-parallel ranks: with one (2 ranks, tp 2) it
// only adds memory, and is refused with the reason and the fix.
TEST_F(BadInput, ZeroWithOneDataParallelRank) {
  for (const char* stage : {"1", "3"})
    expect_refused({"--tensor-parallel", "2", "--zero", stage},
                   {std::string("--zero ") + stage + " shards", "over the data-parallel ranks, and this layout has one",
                    "it would only add memory; drop --zero", "mpirun -np 4"});
}

TEST_F(BadInput, LayoutsThatDoNotDivide) {
  expect_refused({"--tensor-parallel", "3"},
                 {"2 ranks cannot make --tensor-parallel 3", "launch a multiple of that many ranks"});
  expect_refused({"--pipeline-parallel", "2", "--num-layers", "1"},
                 {"--pipeline-parallel 2 needs at least one layer per stage", "use at most 1 stages"});
  expect_refused({"--num-heads", "3"}, {"--num-heads 3 does not divide --hidden-size 16", "e.g. --num-heads 4"});
  expect_refused({"--global-batch-size", "6"},
                 {"--global-batch-size 6 is not a multiple of --micro-batch-size 2 x 2 data-parallel ranks",
                  "use a multiple of 4"});
  expect_refused({"--tensor-parallel", "2", "--vocab-size", "257"},
                 {"--vocab-size 257 is not divisible by --tensor-parallel 2", "--vocab-size 258"});
  // Interleaving: chunks of at least one block, micro-batches a multiple of the stages, 1F1B only.
  expect_refused({"--pp", "2", "--virtual-pipeline-stages", "2", "--global-batch-size", "4"},
                 {"--pipeline-parallel 2 x --virtual-pipeline-stages 2 = 4 chunks need at least one Transformer block",
                  "the model has 2 (--num-layers)"});
  expect_refused({"--pp", "2", "--virtual-pipeline-stages", "2", "--num-layers", "4", "--global-batch-size", "6"},
                 {"a step's 3 micro-batches", "must be a multiple of --pipeline-parallel 2",
                  "use --global-batch-size 4 or a multiple of it"});
  expect_refused({"--pp", "2", "--virtual-pipeline-stages", "2", "--num-layers", "4", "--pipeline-schedule", "gpipe"},
                 {"--virtual-pipeline-stages 2 interleaves the 1F1B schedule"});
  // Zero-bubble schedules: zb-h1 has one chunk per stage, zbv two in a V.
  expect_refused({"--pp", "2", "--virtual-pipeline-stages", "2", "--num-layers", "4", "--pipeline-schedule", "zb-h1"},
                 {"--virtual-pipeline-stages 2 interleaves the 1F1B schedule"});
  expect_refused({"--pp", "2", "--virtual-pipeline-stages", "3", "--num-layers", "6", "--pipeline-schedule", "zbv"},
                 {"--pipeline-schedule zbv runs two chunks per stage in a V", "use --virtual-pipeline-stages 2"});
  expect_refused({"--pp", "2", "--num-layers", "2", "--pipeline-schedule", "zbv"},
                 {"--pipeline-parallel 2 x --pipeline-schedule zbv (2 chunks per stage) = 4 chunks need at least one "
                  "Transformer block",
                  "use --pipeline-schedule zb-h1 or more layers"});
}

// Ranks started with different flags or different data (an MPMD command
// line standing in for a launch script that differs between nodes): refused
// before the first collective of the run, naming each setting and which
// ranks have which value. CPU threads may differ.
TEST_F(BadInput, RanksStartedWithDifferentFlagsOrData) {
  const auto mpmd = [&](const std::vector<std::string>& first, const std::vector<std::string>& second) {
    std::vector<std::string> argv = {
        TESSERA_MPIEXEC, "--oversubscribe", "--bind-to", "none", "-np", "1", TESSERA_BINARY, "train"};
    argv = joined(argv, first);
    argv = joined(argv, {":", "-np", "1", TESSERA_BINARY, "train"});
    return joined(argv, second);
  };
  expect_command_refused(mpmd(train_args({}), train_args({"--hidden-size", "32", "--lr", "0.01"})),
                         {"the 2 ranks were not started alike", "--hidden-size: '16' on rank 0; '32' on rank 1",
                          "--lr: '", "' on rank 1", "check the launch script"});
  // Another copy of the data on "node" 1: other contents under the same flags.
  std::mt19937_64 rng(std::random_device{}());
  const fs::path other = dir.path / "other";
  fs::create_directories(other);
  const std::string other_data = write_text_dataset(other, 6000, rng);
  expect_command_refused(mpmd(train_args({}), train_args({"--data", other_data})),
                         {"the --data file's contents: 'tokens: ", "' on rank 0; 'tokens: ", "' on rank 1"});
  // A copy of the same size and vocabulary with other text: only the digest of
  // the values tells them apart.
  const fs::path twin = dir.path / "twin";
  fs::create_directories(twin);
  const std::string twin_data = write_text_dataset(twin, 4000, rng);
  expect_command_refused(
      mpmd(train_args({}), train_args({"--data", twin_data})),
      {"the --data file's contents: 'tokens: ", ", crc32 0x", "' on rank 0; 'tokens: ", "' on rank 1"});
  // A different thread count is fine: the run goes on to its end.
  const auto fresh = joined(kGpt, {"--data", data, "--save", dir / "ok"});
  Job job(mpmd(fresh, joined(fresh, {"--threads", "2"})), dir / "ok.log");
  EXPECT_EQ(job.wait(seconds(90)), 0) << job.output();
}

TEST_F(BadInput, RankOrderNamingAnAxisTwiceOrLeavingOutOneInUse) {
  expect_refused({"--rank-order", "tp-tp"}, {"--rank-order 'tp-tp' must name axes from tp, cp, ep, dp, pp once each"});
  expect_refused({"--rank-order", "tp-pp"}, {"--rank-order 'tp-pp' leaves out dp, whose size is 2"});
}

TEST_F(BadInput, ContextParallelismWhereItCannotRun) {
  expect_refused({"--context-parallel-size", "2", "--attention-dropout", "0.1"},
                 {"--attention-dropout 0.1 is not available with --context-parallel-size 2"});
  expect_refused({"--cp", "2", "--seq-length", "18"},
                 {"--context-parallel-size 2 cuts each sequence into 4 equal chunks; --seq-length 18"});
  expect_refused({"--cp", "2", "--sample-interval", "2"}, {"does not sample during training yet; drop --sample-interval"});
}

TEST_F(BadInput, UnknownModel) {
  expect_refused({"--model", "resnet"}, {"[rank 0] bad command line", "--model: resnet not in {mlp,cnn,gpt,llama}"});
}

// --- Data files ------------------------------------------------------------

TEST_F(BadInput, MissingDataFile) {
  const std::string missing = dir / "missing.h5";
  expect_refused({"--data", missing}, {"data file " + missing + " does not exist", "tessera prepare"});
}

TEST_F(BadInput, DataFileWithTheWrongSchema) {
  // A checkpoint given as data: HDF5, but no Tessera dataset.
  const std::string file = newest_checkpoint_file();
  expect_refused({"--data", file}, {file, "root attribute 'tessera_schema' is missing", "tessera prepare"});
  // A file that is not HDF5 at all.
  const std::string text = dir / "notes.txt";
  std::ofstream(text) << "not a dataset\n";
  expect_refused({"--data", text}, {text, "cannot be opened as an HDF5 file", "Not an HDF5 file"});
}

TEST_F(BadInput, DataFileWithTheWrongDtype) {
  std::mt19937_64 rng(std::random_device{}());
  std::vector<int32_t> tokens(3000);
  for (int32_t& token : tokens) token = std::uniform_int_distribution<int32_t>(0, 255)(rng);
  const std::string file = dir / "float_tokens.h5";
  write_tokens(file, tokens, H5T_IEEE_F32LE, 256);
  expect_refused({"--data", file}, {file, "dataset '/tokens' holds", "it must be uint8, uint16 or int32"});
}

TEST_F(BadInput, TruncatedDataFile) {
  const std::string cut = dir / "cut.h5";
  fs::copy_file(data, cut);
  fs::resize_file(cut, fs::file_size(cut) * 2 / 3);
  expect_refused({"--data", cut}, {cut, "truncated file", "prepare it again"});
}

TEST_F(BadInput, LabelsOutOfRange) {
  std::mt19937_64 rng(std::random_device{}());
  ClassificationFile images = random_classification(rng, 64, 1, 8, 8, 4);
  const auto bad_index = std::uniform_int_distribution<size_t>(0, images.labels.size() - 1)(rng);
  images.labels[bad_index] = 4;  // == num_classes
  const std::string file = dir / "images.h5";
  write_classification(file, images);
  // The MLP's own flags only: the GPT's would be refused as unused (apps/train_config.h).
  const std::vector<std::string> mlp = words(
      "--model mlp --hidden 16 --micro-batch-size 2 --threads 1 --train-steps 6 --save-interval 2 --comm-timeout 20");
  expect_command_refused(tessera_command(2, joined(mlp, {"--data", file, "--save", dir / "mlp_ckpt"})),
                         {file, "'/labels'[" + std::to_string(bad_index) + "] = 4 is outside [0, num_classes)",
                          "fix the labels or the attribute, or prepare the file again"});
}

// --- Checkpoints -----------------------------------------------------------

TEST_F(BadInput, SaveDirectoryThatCannotBeWritten) {
  // Found at the start, before any step runs, not at the first checkpoint.
  const std::string output =
      expect_refused({"--save", "/proc/tessera-no-such-dir"},
                     {"--save /proc/tessera-no-such-dir: cannot create the directory", "it is checked at the start"});
  EXPECT_FALSE(contains(output, "step 1/")) << output;
  const std::string file = dir / "a_file";
  std::ofstream(file) << "not a directory\n";
  expect_refused({"--save", file}, {"--save " + file + ": cannot create the directory"});
}

TEST_F(BadInput, MissingCheckpoint) {
  const std::string missing = dir / "nothing_here";
  expect_refused({"--resume", missing}, {"--resume " + missing + ": no such checkpoint", "--resume auto"});
}

TEST_F(BadInput, TruncatedCheckpoint) {
  const std::string file = newest_checkpoint_file();
  fs::resize_file(file, fs::file_size(file) / 2);
  expect_refused({}, {file, "cannot be opened as an HDF5 file", "truncated file",
                      "resume from an earlier one: --resume " + (fs::path(save) / "step_00000002").string()});
}

TEST_F(BadInput, CheckpointChecksumMismatch) {
  // The bytes of wte.weight: a piece in a rank's file (a sharded checkpoint's index holds none).
  const auto [file, dataset] = stored_tensor_data(newest_checkpoint_file(), "wte.weight");
  std::mt19937_64 rng(std::random_device{}());
  ASSERT_TRUE(flip_random_stored_bit(file, dataset, rng));  // what a bad disk or copy does
  expect_refused({}, {"checksum mismatch in tensor wte.weight of " + file,
                      "resume from an earlier one: --resume " + (fs::path(save) / "step_00000002").string()});
}

// Issue 21, case 3: bytes flipped in the HDF5 metadata, not in a tensor.
// Before: HDF5's raw error stack, then "HDF5: infinite loop closing library"
// and a line of FL,FL,... at exit, and no advice.
TEST_F(BadInput, CheckpointMetadataDamaged) {
  const std::string file = newest_checkpoint_file();
  damage_object_header(file, "/metadata");
  const std::vector<std::string> expected = {
      "checkpoint " + file + " is damaged: HDF5 cannot read its metadata (/metadata)",
      "resume from an earlier one: --resume " + (fs::path(save) / "step_00000002").string()};
  // Under mpiexec MPI_Abort ends the ranks before HDF5's exit handler runs;
  // started plainly, the process exits normally and the handler ran.
  for (const std::string& output :
       {expect_refused({}, expected),
        expect_command_refused(joined({TESSERA_BINARY, "train"}, train_args({"--comm-timeout", "0"})), expected)}) {
    EXPECT_FALSE(contains(output, "infinite loop closing library")) << output;
    EXPECT_FALSE(contains(output, "FL,FL")) << output;
    EXPECT_FALSE(contains(output, "HDF5-DIAG")) << output;
  }
}

// Node-local --save directories: rank 1 runs in a mount namespace of its own
// where the save directory is an empty tmpfs, so it cannot see the
// checkpoint rank 0 picks for --resume auto.
TEST_F(BadInput, CheckpointNotVisibleToEveryRank) {
  if (::geteuid() != 0 || !fs::exists("/usr/bin/unshare"))
    GTEST_SKIP() << "needs root and util-linux's unshare to give one rank a private mount namespace";
  const std::string rank1 = "mount -t tmpfs tessera-test " + shell_words({save}) + " && exec " +
                            shell_words(joined({TESSERA_BINARY, "train"}, train_args({})));
  const std::vector<std::string> argv = joined(
      {TESSERA_MPIEXEC, "--oversubscribe", "--bind-to", "none", "-np", "1", TESSERA_BINARY, "train"},
      joined(train_args({}),
             {":", "-np", "1", "/usr/bin/unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", rank1}));
  expect_command_refused(
      argv, {"[rank 1] tessera error: rank 1 cannot see " + save + "/step_00000004",
             "the checkpoint rank 0 chose to resume from", "--save must be on a filesystem all ranks share"});
}

TEST_F(BadInput, CheckpointOfADifferentModel) {
  expect_refused({"--hidden-size", "32"}, {"holds another model: --hidden-size is 32 here but 16 in the checkpoint",
                                           "tessera checkpoint inspect"});
}

}  // namespace
}  // namespace tessera::testing

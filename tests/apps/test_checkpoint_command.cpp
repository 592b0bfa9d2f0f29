// `tessera checkpoint inspect|list` run in-process through CLI11: the output
// names the step, layout, metadata, rank state and every tensor with its
// shape, dtype and size, and verifies the checksums (exit code 0); a flipped
// byte in one tensor's data makes inspect exit 1 naming that tensor; a save
// directory resolves to its latest checkpoint; list marks the latest and
// leftovers of interrupted saves.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "apps/checkpoint_command.h"
#include "core/context.h"
#include "core/error.h"
#include "io/checkpoint.h"
#include "parallel/local_communicator.h"
#include "tests/io/io_test_files.h"
#include "tests/support/error_text.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

namespace fs = std::filesystem;

class ScratchDir {
 public:
  ScratchDir() {
    std::random_device device;
    path = fs::temp_directory_path() /
           ("tessera_checkpoint_command_test_" + std::to_string(getpid()) + "_" + std::to_string(device()));
    fs::create_directories(path);
  }
  ~ScratchDir() {
    std::error_code ignored;
    fs::remove_all(path, ignored);
  }
  fs::path path;
};

struct CliRun {
  int exit_code = -1;
  std::string out, err;
};

CliRun run_cli(std::vector<std::string> args) {
  CLI::App app;
  CliRun run;
  app::register_checkpoint_command(app, run.exit_code);
  args.insert(args.begin(), "tessera");
  std::vector<const char*> argv;
  for (const std::string& arg : args) argv.push_back(arg.c_str());
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  try {
    app.parse(int(argv.size()), argv.data());
  } catch (...) {
    run.out = ::testing::internal::GetCapturedStdout();
    run.err = ::testing::internal::GetCapturedStderr();
    throw;
  }
  run.out = ::testing::internal::GetCapturedStdout();
  run.err = ::testing::internal::GetCapturedStderr();
  return run;
}

io::TensorPiece whole(const std::string& name, const Tensor& tensor) {
  io::TensorPiece piece;
  piece.name = name;
  piece.global_shape = tensor.shape();
  piece.dtype = tensor.dtype();
  piece.local = tensor;
  return piece;
}

TEST(CheckpointCommand, InspectPrintsTensorsAndVerifiesChecksums) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto world = parallel::make_local_communicator();
  ScratchDir dir;
  const std::string save_dir = (dir.path / "run").string();
  std::mt19937_64 rng = make_rng();
  const Tensor weight = random_tensor(ctx, Shape{33, 17}, DType::f32, rng).tensor;
  const Tensor bias = random_tensor(ctx, Shape{17}, DType::bf16, rng).tensor;
  // A distinctive byte pattern, to find in the file and corrupt.
  std::vector<uint8_t> pattern(96);
  for (auto& byte : pattern) byte = uint8_t(rng());
  const Tensor blob = ctx.from_vector(Shape{96}, pattern);
  io::SaveOptions options;
  options.rank_state = {{"rng", {1, 2, 3, 4}}};
  io::save_checkpoint(*world, save_dir, 3, {whole("layers.0.weight", weight)}, {});
  const std::string path = io::save_checkpoint(
      *world, save_dir, 8, {whole("layers.0.weight", weight), whole("layers.0.bias", bias), whole("blob", blob)},
      {{"dp", "1"}, {"zero", "0"}, {"model", "mlp"}}, options);

  for (const std::string& given : {path, path + "/checkpoint.h5", save_dir}) {
    SCOPED_TRACE(given);
    const CliRun run = run_cli({"checkpoint", "inspect", given});
    EXPECT_EQ(run.exit_code, 0) << run.out << run.err;
    EXPECT_CONTAINS(run.out, "step: 8\n");
    EXPECT_CONTAINS(run.out, "saved by: 1 rank\n");
    EXPECT_CONTAINS(run.out, "layout: dp=1 zero=0\n");
    EXPECT_CONTAINS(run.out, "  model = mlp\n");
    EXPECT_CONTAINS(run.out, "rank 0: rng (4 B)");
    EXPECT_CONTAINS(run.out, "tensors: 3");
    EXPECT_CONTAINS(run.out, "format: 2 (every rank's file and an index of whole tensors)");
    for (const auto& [name, shape, dtype] :
         {std::tuple<std::string, std::string, std::string>{"layers.0.weight", "[33, 17]", "f32"},
          {"layers.0.bias", "[17]", "bf16"},
          {"blob", "[96]", "u8"}}) {
      const size_t line = run.out.find("  " + name + " ");
      ASSERT_NE(line, std::string::npos) << name << " missing from:\n" << run.out;
      const std::string text = run.out.substr(line, run.out.find('\n', line) - line);
      EXPECT_CONTAINS(text, shape);
      EXPECT_CONTAINS(text, " " + dtype + " ");
      EXPECT_CONTAINS(text, " ok");
    }
    EXPECT_CONTAINS(run.out, "checksums: all 3 tensors verified");
  }

  // Flip one byte of the pattern where it is stored: rank 0's file (the
  // index, checkpoint.h5, holds no tensor data).
  const std::string file = path + "/rank_00000.h5";
  std::vector<char> bytes;
  {
    std::ifstream in(file, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  const auto at = std::search(bytes.begin(), bytes.end(), pattern.begin(), pattern.end(),
                              [](char a, uint8_t b) { return uint8_t(a) == b; });
  ASSERT_NE(at, bytes.end());
  at[std::uniform_int_distribution<int>(0, 95)(rng)] ^= 0x10;
  std::ofstream(file, std::ios::binary).write(bytes.data(), std::streamsize(bytes.size()));

  const CliRun corrupt = run_cli({"checkpoint", "inspect", path});
  EXPECT_EQ(corrupt.exit_code, 1);
  EXPECT_CONTAINS(corrupt.err, "checksum mismatch in 1 tensor of " + path + "/checkpoint.h5: blob");
  EXPECT_CONTAINS(corrupt.out, "MISMATCH");
  EXPECT_CONTAINS(corrupt.out, "checksums: 1 of 3 tensors do not match");

  // list: both checkpoints, the latest marked, a leftover reported.
  fs::create_directories(fs::path(save_dir) / ".step_00000009.tmp");
  const CliRun listed = run_cli({"checkpoint", "list", save_dir});
  EXPECT_EQ(listed.exit_code, 0);
  EXPECT_CONTAINS(listed.out, "2 checkpoints, latest step_00000008");
  EXPECT_CONTAINS(listed.out, "step_00000003");
  EXPECT_CONTAINS(listed.out, "<- latest");
  EXPECT_CONTAINS(listed.out, ".step_00000009.tmp  incomplete");

  try {
    run_cli({"checkpoint", "inspect", (dir.path / "empty").string()});
    ADD_FAILURE() << "no error for a missing path";
  } catch (const Error& error) {
    EXPECT_CONTAINS(std::string(error.what()), "does not exist");
  }
}

// `checkpoint inspect` on damaged HDF5 metadata says which part: a tensor's
// header shows as DAMAGED in the table (the others are listed and verified);
// damage to the structure fails naming the part and the earlier checkpoint.
TEST(CheckpointCommand, InspectNamesTheDamagedPart) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto world = parallel::make_local_communicator();
  ScratchDir dir;
  const std::string save_dir = (dir.path / "run").string();
  std::mt19937_64 rng = make_rng();
  const std::vector<io::TensorPiece> pieces = {whole("a", random_tensor(ctx, Shape{5, 3}, DType::f32, rng).tensor),
                                               whole("b", random_tensor(ctx, Shape{7}, DType::f32, rng).tensor)};
  io::save_checkpoint(*world, save_dir, 1, pieces, {{"model", "mlp"}});
  std::string path = io::save_checkpoint(*world, save_dir, 2, pieces, {{"model", "mlp"}});
  damage_object_header(path + "/checkpoint.h5", "/tensors/a");
  const CliRun tensor = run_cli({"checkpoint", "inspect", path});
  EXPECT_EQ(tensor.exit_code, 1);
  const size_t a = tensor.out.find("\n  a ");
  ASSERT_NE(a, std::string::npos) << tensor.out;
  EXPECT_CONTAINS(tensor.out.substr(a, tensor.out.find('\n', a + 1) - a), "DAMAGED: HDF5 cannot read its header (");
  EXPECT_CONTAINS(tensor.out, "checksums: 0 of 1 tensors do not match, 1 damaged");
  EXPECT_CONTAINS(tensor.err, "checksum mismatch or a damaged header in 1 tensor of ");
  const size_t b = tensor.out.find("  b ");
  ASSERT_NE(b, std::string::npos) << tensor.out;
  EXPECT_CONTAINS(tensor.out.substr(b, tensor.out.find('\n', b) - b), " ok");

  fs::remove_all(path);
  path = io::save_checkpoint(*world, save_dir, 2, pieces, {{"model", "mlp"}});
  damage_object_header(path + "/checkpoint.h5", "/metadata");
  try {
    run_cli({"checkpoint", "inspect", path});
    ADD_FAILURE() << "no error";
  } catch (const Error& error) {
    const std::string what = error.what();
    EXPECT_CONTAINS(what, "is damaged: HDF5 cannot read its metadata (/metadata)");
    EXPECT_CONTAINS(what, "resume from an earlier one: --resume " + (fs::path(save_dir) / "step_00000001").string());
  }
}

}  // namespace
}  // namespace tessera::testing

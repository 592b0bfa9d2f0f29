// io/hdf5_threads.h: the start-up decision taken both ways (Debian's HDF5 is
// thread-safe, so the other answer is given, not found); with serialisation
// forced on, the data loader's worker and an asynchronous checkpoint's
// writer each reach an HDF5 call and wait while the lock is held, then
// finish with the right batches and a checkpoint that reads back; with it
// off, the same held guard holds nobody up.
#include <gtest/gtest.h>

#include <chrono>
#include <numeric>
#include <optional>
#include <thread>
#include <vector>

#include "core/context.h"
#include "io/checkpoint.h"
#include "io/hdf5_threads.h"
#include "io/loader.h"
#include "parallel/local_communicator.h"
#include "tests/io/io_test_files.h"

namespace tessera::io {
namespace {

using testing::TempDir;

// Serialisation as the test sets it, put back to the library's own answer after.
class SerialisationForTest {
 public:
  explicit SerialisationForTest(bool on) { serialise_hdf5_calls(on); }
  ~SerialisationForTest() { set_up_hdf5_threading(hdf5_library_threadsafe()); }
  SerialisationForTest(const SerialisationForTest&) = delete;
  SerialisationForTest& operator=(const SerialisationForTest&) = delete;
};

// Until `count` threads wait for the HDF5 lock; false past a bound that only
// a hang reaches.
bool waiters_reach(int count) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (hdf5_serial_waiters() < count)
    if (std::chrono::steady_clock::now() > deadline)
      return false;
    else
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return true;
}

TEST(Hdf5Threading, SerialisesExactlyWhenTheLibraryIsNotThreadSafe) {
  const SerialisationForTest restore(false);
  const std::string note = set_up_hdf5_threading(false);
  EXPECT_TRUE(hdf5_calls_serialised());
  EXPECT_NE(note.find("without thread safety"), std::string::npos) << note;
  EXPECT_NE(note.find("serialises"), std::string::npos) << note;
  EXPECT_EQ(set_up_hdf5_threading(true), "");
  EXPECT_FALSE(hdf5_calls_serialised());
}

// Consecutive windows of a token file: batch b's row r starts at (b * B + r) * T.
struct TokenFixture {
  TempDir dir;
  std::string path = dir.file("tokens.h5");
  std::vector<int32_t> tokens;
  LoaderOptions options;
  TokenFixture() {
    tokens.resize(4096);
    std::iota(tokens.begin(), tokens.end(), 0);
    for (int32_t& t : tokens) t %= 250;
    testing::write_tokens(path, tokens, H5T_STD_I32LE, 256);
    options.batch_size = 4;
    options.seq_length = 16;
    options.shuffle = false;
    options.prefetch = 2;
  }
  std::vector<int32_t> expected_inputs(int64_t batch) const {
    const auto first = tokens.begin() + batch * options.batch_size * options.seq_length;
    return {first, first + options.batch_size * options.seq_length};
  }
};

// Several tensors of several 8 MiB slabs each, whole on this (only) rank.
std::vector<TensorPiece> large_pieces(Context& ctx) {
  std::vector<TensorPiece> pieces;
  for (int t = 0; t < 3; ++t) {
    std::vector<float> values(size_t(5) << 20);  // 20 MiB: three slabs
    for (size_t i = 0; i < values.size(); ++i) values[i] = float(i % 1000) + float(t);
    TensorPiece piece;
    piece.name = "tensor" + std::to_string(t);
    piece.global_shape = Shape{int64_t(values.size())};
    piece.local = ctx.from_vector(piece.global_shape, values);
    pieces.push_back(piece);
  }
  return pieces;
}

// The loader's batches against the token file, and the checkpoint read back
// against what was saved.
void expect_batches(DataLoader& loader, const TokenFixture& data, int64_t count) {
  for (int64_t b = 0; b < count; ++b) EXPECT_EQ(loader.next().inputs.to_vector<int32_t>(), data.expected_inputs(b));
}
void expect_saved(const std::string& path, Context& ctx, const std::vector<TensorPiece>& pieces) {
  const CheckpointReader reader(path);
  for (const TensorPiece& saved : pieces) {
    TensorPiece load = saved;
    load.local = ctx.full(saved.global_shape, DType::f32, -1.0);
    reader.read(load);
    EXPECT_EQ(load.local.to_vector<float>(), saved.local.to_vector<float>()) << saved.name;
  }
}

TEST(Hdf5Threading, SerialisedTheLoaderAndAnAsyncSaveWaitForTheLockThenFinish) {
  const SerialisationForTest serialised(true);
  Context ctx;
  const TokenFixture data;
  auto world = parallel::make_local_communicator();
  const TempDir saves;
  const std::vector<TensorPiece> pieces = large_pieces(ctx);
  CheckpointSaver saver(*world);
  std::optional<Hdf5Serial> held(std::in_place);    // the test's turn: no other thread's HDF5 call runs
  DataLoader loader(ctx, data.path, data.options);  // opened on this thread, which holds the lock
  EXPECT_FALSE(saver.save(saves.path().string(), 1, pieces, {}, {}, true).has_value());
  ASSERT_TRUE(waiters_reach(2)) << "the loader's worker and the checkpoint writer should both wait for the lock";
  EXPECT_FALSE(saver.written());
  held.reset();  // both go on, taking turns: batches are read while the checkpoint is written
  expect_batches(loader, data, 40);
  while (!saver.written()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_FALSE(saver.write_failed());
  expect_saved(saver.finish().path, ctx, pieces);
}

TEST(Hdf5Threading, NotSerialisedTheGuardHoldsNobodyUp) {
  const SerialisationForTest off(false);
  Context ctx;
  const TokenFixture data;
  const Hdf5Serial held;  // takes no lock
  DataLoader loader(ctx, data.path, data.options);
  expect_batches(loader, data, 3);  // read by the worker while this thread "holds" the guard
  EXPECT_EQ(hdf5_serial_waiters(), 0);
}

}  // namespace
}  // namespace tessera::io

// Checkpoints (io/checkpoint.h) in one process: round trips of every dtype
// and slice kind, compared byte for byte with slices cut by a naive
// multi-index reference; the file layout read back with the raw HDF5 C API
// and the checksums recomputed by a bitwise CRC-32; metadata and rank state;
// keep-K, `latest` and find_latest_checkpoint's fallbacks; crash safety (a
// forked child killed by the checkpoint_crash fault in the middle of a save);
// a flipped byte detected by read() and verify(); files that are not
// checkpoints; ownership gaps and overlaps refused with nothing published;
// head shards of a fused QKV weight (dim_range of a view) and ZeRO sub-ranges
// of them saved from many pieces and read back under other cuts, their
// agreement with nn::ParameterShard, their gaps and overlaps; the reader's
// one-tensor cache; and the TESSERA_FAULT parser. Multi-rank saves are in
// tests/mpi/.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/context.h"
#include "core/device_runtime.h"
#include "core/error.h"
#include "core/fault.h"
#include "core/process_end.h"
#include "io/checkpoint.h"
#include "io/host_snapshot.h"
#include "nn/parameter.h"
#include "parallel/local_communicator.h"
#include "tests/io/io_test_files.h"
#include "tests/support/error_text.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

namespace fs = std::filesystem;
using io::TensorPiece;
using io::TensorSlice;

constexpr DType kAllDtypes[] = {DType::f32, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8};

// CRC-32 (IEEE 802.3, reflected, polynomial 0xEDB88320), one bit at a time.
uint32_t naive_crc32(const std::vector<uint8_t>& bytes) {
  uint32_t crc = 0xFFFFFFFFu;
  for (uint8_t byte : bytes) {
    crc ^= byte;
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
  }
  return ~crc;
}

std::vector<uint8_t> bytes_of(const Tensor& tensor) {
  const Tensor host = tensor.to(Device::cpu());
  const auto* begin = static_cast<const uint8_t*>(host.data_ptr());
  return std::vector<uint8_t>(begin, begin + host.nbytes());
}

// A tensor of random bytes (any bit pattern round-trips exactly).
Tensor random_bytes_tensor(Context& ctx, const Shape& shape, DType dtype, std::mt19937_64& rng) {
  Tensor tensor = ctx.empty(shape, dtype);
  auto* bytes = static_cast<uint8_t*>(tensor.data_ptr());
  std::uniform_int_distribution<int> byte(0, 255);
  for (size_t i = 0; i < tensor.nbytes(); ++i) bytes[i] = uint8_t(byte(rng));
  return tensor;
}

// The global element index of each element of the slice `slice` with local
// shape `local`, through multi-indices: a dim_range shard is the cut shape
// (the view, or the global shape) with `count` indices along `dim`; local
// element l (plus sub_begin in a sub-range) is a multi-index of the shard,
// shifted by `begin` along `dim` and flattened in the cut shape (the global
// tensor's row-major order).
std::vector<int64_t> expected_indices(const Shape& global, const TensorSlice& slice, const Shape& local) {
  std::vector<int64_t> out;
  for (int64_t l = 0; l < local.numel(); ++l) {
    if (slice.kind == TensorSlice::Kind::whole) {
      out.push_back(l);
    } else if (slice.kind == TensorSlice::Kind::flat_range) {
      out.push_back(slice.begin + l);
    } else {
      const Shape cut = slice.view.ndim() > 0 ? slice.view : global;
      int64_t count = local.ndim() == cut.ndim() ? local[slice.dim] : 0;
      if (slice.view.ndim() > 0) count = local.numel() / (cut.numel() / cut[slice.dim]);
      if (slice.sub_range) count = slice.shard_length;
      const Shape shard = cut.with_dim(slice.dim, count);
      std::vector<int64_t> index(size_t(shard.ndim()));
      int64_t rest = l + (slice.sub_range ? slice.sub_begin : 0);
      for (int d = shard.ndim() - 1; d >= 0; --d) {
        index[size_t(d)] = rest % shard[d];
        rest /= shard[d];
      }
      index[size_t(slice.dim)] += slice.begin;
      int64_t g = 0;
      for (int d = 0; d < cut.ndim(); ++d) g = g * cut[d] + index[size_t(d)];
      out.push_back(g);
    }
  }
  return out;
}

// The slice `slice` of a whole tensor's bytes, element by element (the reference for read()).
std::vector<uint8_t> expected_slice(const std::vector<uint8_t>& whole, const Shape& global, DType dtype,
                                    const TensorSlice& slice, const Shape& local) {
  const size_t size = dtype_size(dtype);
  std::vector<uint8_t> out(size_t(local.numel()) * size);
  const std::vector<int64_t> indices = expected_indices(global, slice, local);
  for (size_t l = 0; l < indices.size(); ++l)
    std::memcpy(out.data() + l * size, whole.data() + size_t(indices[l]) * size, size);
  return out;
}

TensorPiece whole_piece(const std::string& name, const Tensor& tensor) {
  TensorPiece piece;
  piece.name = name;
  piece.global_shape = tensor.shape();
  piece.dtype = tensor.dtype();
  piece.local = tensor;
  return piece;
}

// A random dim_range slice of `global` (a dimension of size ≥ 1) and its local shape.
std::pair<TensorSlice, Shape> random_dim_slice(const Shape& global, std::mt19937_64& rng) {
  TensorSlice slice;
  slice.kind = TensorSlice::Kind::dim_range;
  slice.dim = std::uniform_int_distribution<int>(0, global.ndim() - 1)(rng);
  const int64_t extent = global[slice.dim];
  slice.begin = std::uniform_int_distribution<int64_t>(0, extent - 1)(rng);
  const int64_t count = std::uniform_int_distribution<int64_t>(1, extent - slice.begin)(rng);
  return {slice, global.with_dim(slice.dim, count)};
}

// A piece of `original` cut as `slice` with local shape `local`, its values
// copied by the reference.
TensorPiece cut_piece(Context& ctx, const std::string& name, const Tensor& original, const TensorSlice& slice,
                      const Shape& local) {
  TensorPiece piece = whole_piece(name, original);
  piece.slice = slice;
  piece.local = ctx.empty(local, original.dtype());
  const std::vector<uint8_t> bytes =
      expected_slice(bytes_of(original), original.shape(), original.dtype(), slice, local);
  if (!bytes.empty()) std::memcpy(piece.local.data_ptr(), bytes.data(), bytes.size());
  return piece;
}

// `parts` + 1 boundaries 0 = b0 ≤ b1 ≤ ... ≤ b_parts = n at random (uneven, empty parts allowed).
std::vector<int64_t> random_cuts(int64_t n, int parts, std::mt19937_64& rng) {
  std::vector<int64_t> cuts = {0, n};
  for (int i = 1; i < parts; ++i) cuts.push_back(std::uniform_int_distribution<int64_t>(0, n)(rng));
  std::sort(cuts.begin(), cuts.end());
  return cuts;
}

// A fused QKV weight [3·H·Dh, C] cut by heads: viewed as [3, H, Dh·C], cut along dimension 1.
constexpr int64_t kHeads = 4, kHeadDim = 3, kChannels = 5;
const Shape kQkvShape{3 * kHeads * kHeadDim, kChannels};
constexpr int64_t kHeadColumns = kHeadDim * kChannels;  // Dh·C
const Shape kQkvView{3, kHeads, kHeadColumns};

// Head shard `part` of `parts` (a tensor-parallel rank's weight) and its
// local shape [3·(H/parts)·Dh, C], as the layer holds it.
TensorSlice head_slice(int part, int parts) {
  return TensorSlice::along(1, part * kHeads / parts, kQkvView);
}
Shape head_local(int parts) {
  return Shape{3 * kHeads / parts * kHeadDim, kChannels};
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Every test runs with both writers: every_rank (format 2: rank files and an
// index of virtual datasets) and rank_zero (format 1: one file).
class Checkpoint : public ::testing::TestWithParam<io::CheckpointWriters> {
 protected:
  bool sharded() const { return GetParam() == io::CheckpointWriters::every_rank; }

  std::string save(int64_t step, const std::vector<TensorPiece>& pieces, const io::CheckpointMetadata& metadata,
                   io::SaveOptions options = {}) {
    options.writers = GetParam();
    return io::save_checkpoint(*world, save_dir, step, pieces, metadata, options);
  }

  // The file and dataset holding the bytes of piece `index` (of this rank's
  // list) of tensor `name`: the piece in rank 0's file, or the whole tensor.
  std::pair<std::string, std::string> stored_data(const std::string& path, const std::string& name, int index) const {
    if (sharded())
      return {(fs::path(path) / "rank_00000.h5").string(), "/tensors/" + name + "/" + std::to_string(index)};
    return {(fs::path(path) / "checkpoint.h5").string(), "/tensors/" + name};
  }

  // /tensors/<name> of the checkpoint's file read whole by HDF5 (format 2:
  // through the virtual dataset, from the rank files), as stored bytes.
  static std::vector<uint8_t> hdf5_read_whole(const std::string& file, const std::string& name, size_t bytes) {
    std::vector<uint8_t> out(bytes);
    const hid_t h5 = H5Fopen(file.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    const hid_t dataset = H5Dopen2(h5, ("/tensors/" + name).c_str(), H5P_DEFAULT);
    const hid_t type = H5Dget_type(dataset);
    EXPECT_GE(H5Dread(dataset, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data()), 0) << name;
    H5Tclose(type);
    H5Dclose(dataset);
    H5Fclose(h5);
    return out;
  }

  Context ctx;
  std::unique_ptr<parallel::Communicator> world = parallel::make_local_communicator();
  TempDir dir;
  std::string save_dir = dir.file("run");
  std::mt19937_64 rng = make_rng();
};

INSTANTIATE_TEST_SUITE_P(Writers, Checkpoint,
                         ::testing::Values(io::CheckpointWriters::every_rank, io::CheckpointWriters::rank_zero),
                         [](const ::testing::TestParamInfo<io::CheckpointWriters>& writers) {
                           return std::string(writers.param == io::CheckpointWriters::every_rank ? "sharded"
                                                                                                 : "gathered");
                         });

TEST_P(Checkpoint, RoundTripsEveryDtypeAndSliceKind) {
  TESSERA_SEED_TRACE();
  std::vector<TensorPiece> pieces;
  std::vector<Tensor> originals;
  const std::vector<Shape> shapes = {Shape{7, 5}, Shape{3, 4, 5}, Shape{13}, Shape{2, 3, 2, 3}};
  for (DType dtype : kAllDtypes)
    for (size_t s = 0; s < shapes.size(); ++s) {
      originals.push_back(random_bytes_tensor(ctx, shapes[s], dtype, rng));
      pieces.push_back(
          whole_piece("blocks." + std::to_string(s) + ".w." + std::string(dtype_name(dtype)), originals.back()));
    }
  originals.push_back(random_bytes_tensor(ctx, Shape{}, DType::i64, rng));  // a scalar (e.g. a step count)
  pieces.push_back(whole_piece("optimizer.step", originals.back()));
  originals.push_back(ctx.empty(Shape{0, 3}, DType::f32));  // an empty tensor
  pieces.push_back(whole_piece("empty", originals.back()));

  const std::string path = save(12, pieces, {});
  EXPECT_EQ(path, (fs::path(save_dir) / "step_00000012").string());

  io::CheckpointReader reader(path);
  EXPECT_EQ(reader.step(), 12);
  EXPECT_EQ(reader.ranks_saved(), 1);
  ASSERT_EQ(reader.tensors().size(), pieces.size());
  EXPECT_TRUE(reader.verify().empty());
  for (size_t i = 0; i < pieces.size(); ++i) {
    SCOPED_TRACE(pieces[i].name);
    const Shape& global = pieces[i].global_shape;
    const DType dtype = pieces[i].dtype;
    const std::vector<uint8_t> whole = bytes_of(originals[i]);
    const auto stored = std::find_if(reader.tensors().begin(), reader.tensors().end(),
                                     [&](const io::StoredTensor& t) { return t.name == pieces[i].name; });
    ASSERT_NE(stored, reader.tensors().end());
    EXPECT_EQ(stored->shape, global);
    EXPECT_EQ(stored->dtype, dtype);
    if (sharded()) {
      EXPECT_EQ(stored->pieces, global.numel() > 0 ? 1 : 0);  // one piece per owned piece, its CRC inside
    } else {
      EXPECT_EQ(stored->crc32, naive_crc32(whole));
    }
    EXPECT_TRUE(reader.has_tensor(pieces[i].name));

    std::vector<std::pair<TensorSlice, Shape>> slices = {{TensorSlice{}, global}};
    if (global.numel() > 0) {
      const int64_t begin = std::uniform_int_distribution<int64_t>(0, global.numel() - 1)(rng);
      const int64_t count = std::uniform_int_distribution<int64_t>(1, global.numel() - begin)(rng);
      slices.push_back({TensorSlice{TensorSlice::Kind::flat_range, begin, 0}, Shape{count}});
      if (global.ndim() > 0) slices.push_back(random_dim_slice(global, rng));
    }
    for (const auto& [slice, local_shape] : slices) {
      TensorPiece load = pieces[i];
      load.slice = slice;
      load.local = poisoned(ctx, local_shape, dtype);
      reader.read(load);
      EXPECT_EQ(bytes_of(load.local), expected_slice(whole, global, dtype, slice, local_shape))
          << "slice kind " << int(slice.kind) << " begin " << slice.begin << " dim " << slice.dim;
    }
  }

  // The documented layout, read with the raw C API.
  const std::string file = (fs::path(path) / "checkpoint.h5").string();
  const hid_t h5 = H5Fopen(file.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  ASSERT_GE(h5, 0);
  int64_t format = 0;
  const hid_t attribute = H5Aopen(h5, "tessera_checkpoint_format", H5P_DEFAULT);
  ASSERT_GE(attribute, 0);
  H5Aread(attribute, H5T_NATIVE_INT64, &format);
  H5Aclose(attribute);
  EXPECT_EQ(format, sharded() ? 2 : 1);
  // Every tensor read whole by HDF5 itself (format 2: through the virtual
  // dataset, from the rank file) equals what was saved.
  for (size_t i = 0; i < pieces.size(); ++i) {
    const hid_t dataset = H5Dopen2(h5, ("/tensors/" + pieces[i].name).c_str(), H5P_DEFAULT);
    ASSERT_GE(dataset, 0) << pieces[i].name;
    std::vector<uint8_t> read(bytes_of(originals[i]).size());
    const hid_t type = H5Dget_type(dataset);
    if (!read.empty()) {
      EXPECT_GE(H5Dread(dataset, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, read.data()), 0);
    }
    H5Tclose(type);
    H5Dclose(dataset);
    EXPECT_EQ(read, bytes_of(originals[i])) << pieces[i].name;
  }
  for (const char* name : {"/tensors/blocks.0.w.bf16", "/tensors/blocks.1.w.f32"}) {
    const hid_t dataset = H5Dopen2(h5, name, H5P_DEFAULT);
    ASSERT_GE(dataset, 0) << name;
    const hid_t type = H5Dget_type(dataset);
    const bool bf16 = std::string(name).find("bf16") != std::string::npos;
    EXPECT_EQ(H5Tget_class(type), bf16 ? H5T_INTEGER : H5T_FLOAT) << name;
    EXPECT_EQ(H5Tget_size(type), bf16 ? 2u : 4u) << name;
    H5Tclose(type);
    H5Dclose(dataset);
  }
  H5Fclose(h5);
}

TEST_P(Checkpoint, SavesSeveralPiecesOfOneTensorFromOneRank) {
  TESSERA_SEED_TRACE();
  // One rank may own several pieces of a tensor: flat_range pieces of a flat
  // tensor, dim_range pieces along dimension 1, and replicas with owner=false.
  const Tensor flat = random_bytes_tensor(ctx, Shape{4, 9}, DType::bf16, rng);
  const Tensor wide = random_bytes_tensor(ctx, Shape{5, 8, 3}, DType::f32, rng);
  std::vector<TensorPiece> pieces;
  const Tensor flat_view = flat.flatten();
  for (auto [begin, end] : {std::pair<int64_t, int64_t>{20, 36}, {0, 11}, {11, 20}}) {
    TensorPiece piece = whole_piece("flat", flat);
    piece.slice = {TensorSlice::Kind::flat_range, begin, 0};
    piece.local = ctx.empty(Shape{end - begin}, DType::bf16).copy_(flat_view.slice(begin, end));
    pieces.push_back(piece);
  }
  for (auto [begin, end] : {std::pair<int64_t, int64_t>{0, 3}, {3, 8}}) {
    TensorPiece piece = whole_piece("wide", wide);
    piece.slice = {TensorSlice::Kind::dim_range, begin, 1};
    Tensor local = ctx.empty(Shape{5, end - begin, 3}, DType::f32);
    const std::vector<uint8_t> bytes =
        expected_slice(bytes_of(wide), wide.shape(), DType::f32, piece.slice, local.shape());
    std::memcpy(local.data_ptr(), bytes.data(), bytes.size());
    piece.local = local;
    pieces.push_back(piece);
  }
  TensorPiece replica = whole_piece("wide", poisoned(ctx, wide.shape(), DType::f32));
  replica.owner = false;  // contributes nothing
  pieces.push_back(replica);

  io::CheckpointReader reader(save(3, pieces, {}));
  for (const Tensor& original : {flat, wide}) {
    TensorPiece load = whole_piece(original.dtype() == DType::bf16 ? "flat" : "wide", original);
    load.local = poisoned(ctx, original.shape(), original.dtype());
    reader.read(load);
    EXPECT_EQ(bytes_of(load.local), bytes_of(original)) << load.name;
  }
}

TEST_P(Checkpoint, KeepsMetadataAndRankState) {
  TESSERA_SEED_TRACE();
  io::CheckpointMetadata metadata = {{"dp", "1"}, {"model.hidden-size", "48"}, {"empty", ""}, {"lr", "0.001"}};
  std::string config(100000, ' ');  // over HDF5's 64 KiB compact-attribute limit
  std::uniform_int_distribution<int> letter('a', 'z');
  for (char& c : config) c = char(letter(rng));
  metadata["config"] = config;
  io::SaveOptions options;
  std::vector<uint8_t> rng_state(48);
  for (auto& byte : rng_state) byte = uint8_t(rng());
  options.rank_state = {{"rng", rng_state}, {"sampler.position", {1, 2, 3}}, {"nothing", {}}};
  const Tensor weight = random_bytes_tensor(ctx, Shape{3, 3}, DType::f32, rng);

  io::CheckpointReader reader(save(7, {whole_piece("w", weight)}, metadata, options));
  EXPECT_EQ(reader.metadata(), metadata);
  EXPECT_EQ(reader.rank_state(0, "rng"), rng_state);
  EXPECT_EQ(reader.rank_state(0, "sampler.position"), (std::vector<uint8_t>{1, 2, 3}));
  EXPECT_EQ(reader.rank_state(0, "nothing"), std::vector<uint8_t>{});
  EXPECT_EQ(reader.rank_state(0, "missing"), std::nullopt);
  EXPECT_EQ(reader.rank_state(1, "rng"), std::nullopt);
}

TEST_P(Checkpoint, KeepsTheNewestKAndUpdatesLatest) {
  const Tensor weight = ctx.full(Shape{4}, DType::f32, 1.0);
  io::SaveOptions keep_two;
  keep_two.keep = 2;
  for (int64_t step : {10, 20, 30, 40}) {
    const std::string path = save(step, {whole_piece("w", weight)}, {}, keep_two);
    EXPECT_EQ(read_text(fs::path(save_dir) / "latest"), fs::path(path).filename().string() + "\n");
    EXPECT_EQ(io::find_latest_checkpoint(save_dir), path);
  }
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(save_dir)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"latest", "step_00000030", "step_00000040"}));

  // keep = 0 keeps everything; the checkpoint `latest` names survives pruning
  // even when higher steps exist (a run resumed from an earlier checkpoint).
  save(5, {whole_piece("w", weight)}, {});
  EXPECT_EQ(io::find_latest_checkpoint(save_dir), (fs::path(save_dir) / "step_00000005").string());
  io::SaveOptions keep_one;
  keep_one.keep = 1;
  save(6, {whole_piece("w", weight)}, {}, keep_one);
  EXPECT_TRUE(fs::exists(fs::path(save_dir) / "step_00000006"));
  EXPECT_TRUE(fs::exists(fs::path(save_dir) / "step_00000040"));  // the newest by step
  EXPECT_FALSE(fs::exists(fs::path(save_dir) / "step_00000030"));
  EXPECT_FALSE(fs::exists(fs::path(save_dir) / "step_00000005"));

  // Saving a step again replaces it.
  const Tensor other = ctx.full(Shape{4}, DType::f32, 2.0);
  io::CheckpointReader reader(save(6, {whole_piece("w", other)}, {}));
  TensorPiece load = whole_piece("w", poisoned(ctx, Shape{4}, DType::f32));
  reader.read(load);
  EXPECT_EQ(load.local.to_vector<float>(), std::vector<float>(4, 2.0f));
}

TEST_P(Checkpoint, FindLatestFallsBackToTheHighestCompleteStep) {
  EXPECT_EQ(io::find_latest_checkpoint(dir.file("nowhere")), std::nullopt);
  fs::create_directories(save_dir);
  EXPECT_EQ(io::find_latest_checkpoint(save_dir), std::nullopt);
  const Tensor weight = ctx.full(Shape{2}, DType::f32, 3.0);
  save(9, {whole_piece("w", weight)}, {});
  save(100, {whole_piece("w", weight)}, {});
  const fs::path root(save_dir);

  fs::remove(root / "latest");
  EXPECT_EQ(io::find_latest_checkpoint(save_dir), (root / "step_00000100").string());
  std::ofstream(root / "latest") << "step_00000009\n";
  EXPECT_EQ(io::find_latest_checkpoint(save_dir), (root / "step_00000009").string());
  std::ofstream(root / "latest") << "step_00000077\n";  // names a missing directory
  EXPECT_EQ(io::find_latest_checkpoint(save_dir), (root / "step_00000100").string());

  // Leftovers of interrupted saves are never chosen, and the next save removes them.
  fs::create_directories(root / ".step_00000200.tmp");
  std::ofstream(root / ".step_00000200.tmp" / "checkpoint.h5") << "partial";
  fs::create_directories(root / "step_00000300");  // no checkpoint.h5: not a checkpoint
  fs::remove(root / "latest");
  EXPECT_EQ(io::find_latest_checkpoint(save_dir), (root / "step_00000100").string());
  save(101, {whole_piece("w", weight)}, {});
  EXPECT_FALSE(fs::exists(root / ".step_00000200.tmp"));
  EXPECT_EQ(io::find_latest_checkpoint(save_dir), (root / "step_00000101").string());
}

TEST_P(Checkpoint, WriterKilledMidSaveLeavesThePreviousCheckpoint) {
  TESSERA_SEED_TRACE();
  std::vector<Tensor> first, second;
  std::vector<TensorPiece> first_pieces, second_pieces;
  for (int i = 0; i < 6; ++i) {
    first.push_back(random_bytes_tensor(ctx, Shape{64, 33}, DType::f32, rng));
    second.push_back(random_bytes_tensor(ctx, Shape{64, 33}, DType::f32, rng));
    first_pieces.push_back(whole_piece("layer." + std::to_string(i), first.back()));
    second_pieces.push_back(whole_piece("layer." + std::to_string(i), second.back()));
  }
  const std::string previous = save(10, first_pieces, {{"note", "first"}});

  std::fflush(nullptr);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // The child saves step 20 with the fault armed for step 20 on rank 0; it
    // must die inside save_checkpoint (exit code 3 would mean it did not).
    // The injected crash goes through end_process (core/process_end.h): the
    // hook the program installs (apps/process_end.cpp) ends it by SIGKILL.
    set_process_end_hook([](ProcessEnd how, int) {
      if (how == ProcessEnd::injected_crash) std::raise(SIGKILL);
    });
    setenv("TESSERA_FAULT", "checkpoint_crash@20:0", 1);
    try {
      save(20, second_pieces, {{"note", "second"}});
    } catch (...) {
      _exit(4);
    }
    _exit(3);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status)) << "the child was not killed (exit status " << WEXITSTATUS(status) << ")";
  EXPECT_EQ(WTERMSIG(status), SIGKILL);

  const fs::path root(save_dir);
  EXPECT_TRUE(fs::exists(root / ".step_00000020.tmp" / (sharded() ? "rank_00000.h5" : "checkpoint.h5")))
      << "the child died before writing";
  if (sharded()) {
    EXPECT_FALSE(fs::exists(root / ".step_00000020.tmp" / "checkpoint.h5")) << "an index before the data";
  }
  EXPECT_FALSE(fs::exists(root / "step_00000020"));
  EXPECT_EQ(read_text(root / "latest"), "step_00000010\n");
  ASSERT_EQ(io::find_latest_checkpoint(save_dir), previous);
  io::CheckpointReader reader(previous);
  EXPECT_TRUE(reader.verify().empty());
  EXPECT_EQ(reader.metadata().at("note"), "first");
  for (size_t i = 0; i < first.size(); ++i) {
    TensorPiece load = whole_piece(first_pieces[i].name, poisoned(ctx, Shape{64, 33}, DType::f32));
    reader.read(load);
    EXPECT_EQ(bytes_of(load.local), bytes_of(first[i])) << first_pieces[i].name;
  }

  // The fault is scoped to its step: the same save without it (and at
  // another step with it armed) completes and cleans up the leftover.
  setenv("TESSERA_FAULT", "checkpoint_crash@21:0", 1);
  const std::string next = save(20, second_pieces, {{"note", "second"}});
  unsetenv("TESSERA_FAULT");
  EXPECT_FALSE(fs::exists(root / ".step_00000020.tmp"));
  EXPECT_EQ(io::find_latest_checkpoint(save_dir), next);
  EXPECT_TRUE(io::CheckpointReader(next).verify().empty());
}

TEST_P(Checkpoint, AFlippedByteIsDetected) {
  TESSERA_SEED_TRACE();
  const Tensor good = random_bytes_tensor(ctx, Shape{17, 6}, DType::f16, rng);
  const Tensor bad = random_bytes_tensor(ctx, Shape{31}, DType::i64, rng);
  save(1, {whole_piece("good", good)}, {});
  const std::string path = save(2, {whole_piece("good", good), whole_piece("head.bias", bad)}, {});
  const auto [file, data] = stored_data(path, "head.bias", 1);
  ASSERT_TRUE(flip_random_stored_bit(file, data, rng));

  io::CheckpointReader reader(path);
  EXPECT_EQ(reader.verify(), std::vector<std::string>{"head.bias"});
  TensorPiece load = whole_piece("head.bias", poisoned(ctx, Shape{31}, DType::i64));
  const std::string message = error_of([&] { reader.read(load); });
  EXPECT_CONTAINS(message, "checksum mismatch in tensor head.bias of " + file);
  EXPECT_CONTAINS(message, "corrupt; resume from an earlier one");
  EXPECT_CONTAINS(message, "--resume " + (fs::path(save_dir) / "step_00000001").string());
  TensorPiece fine = whole_piece("good", poisoned(ctx, good.shape(), DType::f16));
  reader.read(fine);
  EXPECT_EQ(bytes_of(fine.local), bytes_of(good));
}

// Damage to a checkpoint's HDF5 metadata (not its tensors' data) is reported
// as a corrupt checkpoint is: which part HDF5 cannot read, HDF5's innermost
// complaint, and the earlier checkpoint to resume from. The structure (root
// attributes, /metadata, /tensors) fails the open; a tensor's header fails
// only that tensor: verify() lists it and read() names it, and the others
// still read. HDF5 prints nothing itself.
TEST_P(Checkpoint, DamagedMetadataIsACorruptCheckpointNamingThePart) {
  TESSERA_SEED_TRACE();
  const Tensor weight = random_bytes_tensor(ctx, Shape{9, 4}, DType::f32, rng);
  const Tensor bias = random_bytes_tensor(ctx, Shape{9}, DType::f32, rng);
  const auto pieces = std::vector<TensorPiece>{whole_piece("w", weight), whole_piece("b", bias)};
  save(1, pieces, {{"model", "mlp"}});
  const std::string earlier = "--resume " + (fs::path(save_dir) / "step_00000001").string();
  struct Case {
    const char* object;
    const char* part;
  };
  for (const Case& c : {Case{"/", "its root attributes"}, Case{"/metadata", "its metadata (/metadata)"},
                        Case{"/tensors", "its list of tensors (/tensors)"}}) {
    SCOPED_TRACE(c.object);
    const std::string path = save(2, pieces, {{"model", "mlp"}});
    const std::string file = (fs::path(path) / "checkpoint.h5").string();
    damage_object_header(file, c.object);
    ::testing::internal::CaptureStderr();
    const std::string message = error_of([&] { io::CheckpointReader reader(path); });
    const std::string printed = ::testing::internal::GetCapturedStderr();
    EXPECT_CONTAINS(message, "checkpoint " + file + " is damaged: HDF5 cannot read " + c.part);
    EXPECT_CONTAINS(message, "corrupt; resume from an earlier one: " + earlier);
    EXPECT_EQ(message.find("; #1 "), std::string::npos) << "HDF5's whole stack: " << message;
    EXPECT_EQ(printed, "") << "HDF5 printed its own stack";
    fs::remove_all(path);
  }
  const std::string path = save(2, pieces, {{"model", "mlp"}});
  const std::string file = (fs::path(path) / "checkpoint.h5").string();
  damage_object_header(file, "/tensors/w");
  io::CheckpointReader reader(path);
  ASSERT_EQ(reader.damaged().size(), 1u);
  EXPECT_EQ(reader.damaged()[0].first, "w");
  EXPECT_EQ(reader.verify(), std::vector<std::string>{"w"});
  TensorPiece load = whole_piece("w", poisoned(ctx, weight.shape(), DType::f32));
  const std::string message = error_of([&] { reader.read(load); });
  EXPECT_CONTAINS(message, "is damaged: HDF5 cannot read the header of tensor w");
  EXPECT_CONTAINS(message, earlier);
  TensorPiece fine = whole_piece("b", poisoned(ctx, bias.shape(), DType::f32));
  reader.read(fine);
  EXPECT_EQ(bytes_of(fine.local), bytes_of(bias));
}

TEST_P(Checkpoint, RefusesFilesThatAreNotCheckpoints) {
  const std::string tokens = dir.file("tokens.h5");
  write_tokens(tokens, {1, 2, 3, 4}, H5T_STD_U8LE, 256);
  EXPECT_CONTAINS(error_of([&] { io::CheckpointReader reader(tokens); }), "is not a Tessera checkpoint");

  const std::string newer = dir.file("newer.h5");
  {
    RawH5Writer writer(newer);
    writer.int_attribute("tessera_checkpoint_format", io::kCheckpointFormat + 1);
  }
  EXPECT_CONTAINS(error_of([&] { io::CheckpointReader reader(newer); }), "newer than this build reads");

  const std::string text = dir.file("text.h5");
  std::ofstream(text) << "not hdf5";
  EXPECT_CONTAINS(error_of([&] { io::CheckpointReader reader(text); }), "cannot be opened as an HDF5 file");
  EXPECT_CONTAINS(error_of([&] { io::CheckpointReader reader(dir.file("missing")); }), "does not exist");

  save(1, {whole_piece("w", ctx.zeros(Shape{1}, DType::f32))}, {});
  EXPECT_CONTAINS(error_of([&] { io::CheckpointReader reader(save_dir); }), "is a save directory");
}

TEST_P(Checkpoint, RefusesGapsOverlapsAndMismatchesWithoutPublishing) {
  const Tensor weight = ctx.full(Shape{4, 6}, DType::f32, 1.0);
  const std::string first = save(1, {whole_piece("w", weight)}, {});
  const auto flat_piece = [&](int64_t begin, int64_t count) {
    TensorPiece piece = whole_piece("blocks.0.w", weight);
    piece.slice = {TensorSlice::Kind::flat_range, begin, 0};
    piece.local = ctx.zeros(Shape{count}, DType::f32);
    return piece;
  };
  const auto refusal = [&](std::vector<TensorPiece> pieces) { return error_of([&] { save(2, pieces, {}); }); };
  const std::string gap = refusal({flat_piece(0, 10), flat_piece(12, 12)});
  EXPECT_CONTAINS(gap, "tensor blocks.0.w: elements [10, 12) are owned by no rank");
  EXPECT_CONTAINS(refusal({flat_piece(0, 13), flat_piece(12, 12)}),
                  "elements [12, 13) are owned by both rank 0 and rank 0");
  EXPECT_CONTAINS(refusal({flat_piece(0, 20)}), "elements [20, 24) are owned by no rank");
  TensorPiece unowned = whole_piece("blocks.0.w", weight);
  unowned.owner = false;
  EXPECT_CONTAINS(refusal({unowned}), "elements [0, 24) are owned by no rank");
  TensorPiece dim_piece = whole_piece("blocks.0.w", weight);
  dim_piece.slice = {TensorSlice::Kind::dim_range, 2, 1};
  dim_piece.local = ctx.zeros(Shape{4, 3}, DType::f32);
  EXPECT_CONTAINS(refusal({dim_piece}), "tensor blocks.0.w: indices along dimension 1 [0, 2) are owned by no rank");
  dim_piece.local = ctx.zeros(Shape{4, 5}, DType::f32);
  EXPECT_CONTAINS(refusal({dim_piece}), "dim_range piece [2, 7) along dimension 1 lies outside its size 6");
  TensorPiece wrong_dtype = whole_piece("blocks.0.w", weight);
  wrong_dtype.dtype = DType::bf16;
  EXPECT_CONTAINS(refusal({wrong_dtype}), "tensor blocks.0.w: the piece says bf16 but its local tensor holds f32");
  EXPECT_CONTAINS(refusal({whole_piece("a/b", weight)}), "tensor name 'a/b' cannot be stored");
  TensorPiece other_shape = whole_piece("blocks.0.w", ctx.zeros(Shape{24}, DType::f32));
  EXPECT_CONTAINS(refusal({whole_piece("blocks.0.w", weight), other_shape}), "is f32 [4, 6] on rank 0 but f32 [24]");

  // Nothing was published or left behind.
  EXPECT_EQ(io::find_latest_checkpoint(save_dir), first);
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(save_dir)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"latest", "step_00000001"}));

  // Loading refuses another configuration or precision, naming the tensor.
  io::CheckpointReader reader(first);
  TensorPiece wider = whole_piece("w", ctx.zeros(Shape{4, 7}, DType::f32));
  EXPECT_CONTAINS(error_of([&] { reader.read(wider); }), "tensor w has shape [4, 6] in the checkpoint but [4, 7] here");
  TensorPiece half = whole_piece("w", ctx.zeros(Shape{4, 6}, DType::bf16));
  EXPECT_CONTAINS(error_of([&] { reader.read(half); }), "tensor w is f32 in the checkpoint but bf16 here");
  TensorPiece missing = whole_piece("v", weight);
  EXPECT_CONTAINS(error_of([&] { reader.read(missing); }), "the checkpoint has no tensor v");
}

TEST_P(Checkpoint, SavesHeadShardsAndSubRangesAndReadsThemUnderAnotherCut) {
  TESSERA_SEED_TRACE();
  // Each "rank" of a tensor-parallel group of 2 or 4 holds the heads
  // [p·H/parts, (p+1)·H/parts) of a fused QKV weight (3 runs each: Q, K and V),
  // and its optimizer moment split into uneven ZeRO-like sub-ranges of the
  // shard (some empty); the one process owns them all, in shuffled order.
  int64_t step = 0;
  for (DType dtype : {DType::f32, DType::bf16})
    for (int parts : {2, 4}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + ", " + std::to_string(parts) + " head shards");
      const Tensor weight = random_bytes_tensor(ctx, kQkvShape, dtype, rng);
      const Tensor moment = random_bytes_tensor(ctx, kQkvShape, dtype, rng);
      const std::string name = "blocks.0.attn.qkv.weight", moment_name = name + ".exp_avg";
      const int64_t shard_heads = kHeads / parts, shard_numel = kQkvShape.numel() / parts;
      std::vector<TensorPiece> pieces;
      for (int p = 0; p < parts; ++p) {
        pieces.push_back(cut_piece(ctx, name, weight, head_slice(p, parts), head_local(parts)));
        const std::vector<int64_t> cuts = random_cuts(shard_numel, 3, rng);
        for (size_t i = 0; i + 1 < cuts.size(); ++i)
          pieces.push_back(cut_piece(ctx, moment_name, moment,
                                     head_slice(p, parts).with_sub_range(cuts[i], shard_heads),
                                     Shape{cuts[i + 1] - cuts[i]}));
      }
      std::shuffle(pieces.begin(), pieces.end(), rng);
      io::CheckpointReader reader(save(++step, pieces, {}));

      // Stored whole, equal to the originals.
      for (const auto& [stored_name, original] : {std::pair{name, weight}, std::pair{moment_name, moment}}) {
        SCOPED_TRACE(stored_name);
        const auto stored = std::find_if(reader.tensors().begin(), reader.tensors().end(),
                                         [&](const io::StoredTensor& t) { return t.name == stored_name; });
        ASSERT_NE(stored, reader.tensors().end());
        EXPECT_EQ(stored->shape, kQkvShape);
        if (sharded()) {  // HDF5 itself stitches the pieces (head shards, sub-ranges) into the whole tensor
          EXPECT_EQ(hdf5_read_whole(reader.path(), stored_name, original.nbytes()), bytes_of(original));
        } else {
          EXPECT_EQ(stored->crc32, naive_crc32(bytes_of(original)));
        }
        TensorPiece load = whole_piece(stored_name, poisoned(ctx, kQkvShape, dtype));
        reader.read(load);
        EXPECT_EQ(bytes_of(load.local), bytes_of(original));
      }

      // Read back under another cut: the other number of head shards, plain
      // and in sub-ranges (local shapes flat or the layer's), a row range
      // without a view, and a flat range.
      const int read_parts = 6 - parts;  // 2 ↔ 4
      const int64_t read_heads = kHeads / read_parts, read_numel = kQkvShape.numel() / read_parts;
      std::vector<std::pair<TensorSlice, Shape>> cuts;
      for (int p = 0; p < read_parts; ++p) {
        cuts.push_back({head_slice(p, read_parts), head_local(read_parts)});
        cuts.push_back({head_slice(p, read_parts), Shape{read_numel}});
        const std::vector<int64_t> sub = random_cuts(read_numel, 2, rng);
        for (size_t i = 0; i + 1 < sub.size(); ++i)
          cuts.push_back({head_slice(p, read_parts).with_sub_range(sub[i], read_heads), Shape{sub[i + 1] - sub[i]}});
      }
      const int64_t row = std::uniform_int_distribution<int64_t>(0, kQkvShape[0] - 1)(rng);
      cuts.push_back({TensorSlice::along(0, row), Shape{kQkvShape[0] - row, kChannels}});
      cuts.push_back({TensorSlice::along(0, row).with_sub_range(3, kQkvShape[0] - row),
                      Shape{(kQkvShape[0] - row) * kChannels - 3}});
      const int64_t flat = std::uniform_int_distribution<int64_t>(0, kQkvShape.numel())(rng);
      cuts.push_back({TensorSlice::flat(flat), Shape{kQkvShape.numel() - flat}});
      for (const auto& [stored_name, original] : {std::pair{name, weight}, std::pair{moment_name, moment}})
        for (const auto& [slice, local] : cuts) {
          TensorPiece load = whole_piece(stored_name, original);
          load.slice = slice;
          load.local = poisoned(ctx, local, dtype);
          reader.read(load);
          EXPECT_EQ(bytes_of(load.local), expected_slice(bytes_of(original), kQkvShape, dtype, slice, local))
              << stored_name << " kind " << int(slice.kind) << " dim " << slice.dim << " begin " << slice.begin
              << " view " << slice.view.to_string() << " sub-range " << slice.sub_range << " [" << slice.sub_begin
              << ", +" << local.numel() << ") of " << slice.shard_length;
        }
    }
}

TEST_P(Checkpoint, ShardSliceDescribesAParameterShard) {
  TESSERA_SEED_TRACE();
  // A trainer's pieces: each tensor-parallel rank's weight is filled through
  // nn::shard_runs (as nn::init_shard_* draws it), its optimizer state split
  // by ZeRO into flat sub-ranges of the local tensor, both described by
  // shard_slice(); the result is the original, and the slices cut the same
  // elements as the multi-index reference.
  const Tensor weight = random_bytes_tensor(ctx, kQkvShape, DType::f32, rng);
  const Tensor moment = random_bytes_tensor(ctx, kQkvShape, DType::f32, rng);
  const auto* weight_values = static_cast<const float*>(weight.data_ptr());
  const auto* moment_values = static_cast<const float*>(moment.data_ptr());
  const int parts = 4, zero = 3;
  std::vector<TensorPiece> pieces;
  for (int p = 0; p < parts; ++p) {
    nn::ParameterShard shard;
    shard.global_shape = kQkvShape;
    shard.split = true;
    shard.view = kQkvView;
    shard.dim = 1;
    shard.begin = p * kHeads / parts;
    shard.length = kHeads / parts;
    const TensorSlice slice = io::shard_slice(shard);
    EXPECT_EQ(slice.kind, TensorSlice::Kind::dim_range);
    EXPECT_EQ(slice.dim, 1);
    EXPECT_EQ(slice.begin, shard.begin);
    EXPECT_EQ(slice.view, kQkvView);
    EXPECT_FALSE(slice.sub_range);

    TensorPiece piece = whole_piece("qkv.weight", weight);
    piece.slice = slice;
    piece.local = ctx.empty(head_local(parts), DType::f32);
    Tensor local_moment = ctx.empty(head_local(parts), DType::f32);
    for (const nn::ShardRun& run : nn::shard_runs(shard)) {
      std::memcpy(piece.local.data<float>() + run.local_offset, weight_values + run.global_offset,
                  size_t(run.count) * sizeof(float));
      std::memcpy(local_moment.data<float>() + run.local_offset, moment_values + run.global_offset,
                  size_t(run.count) * sizeof(float));
    }
    EXPECT_EQ(bytes_of(piece.local), expected_slice(bytes_of(weight), kQkvShape, DType::f32, slice, head_local(parts)));
    pieces.push_back(piece);

    const std::vector<int64_t> cuts = random_cuts(shard.local_numel(), zero, rng);
    for (int z = 0; z < zero; ++z) {
      const TensorSlice sub = io::shard_slice(shard, cuts[size_t(z)]);
      EXPECT_TRUE(sub.sub_range);
      EXPECT_EQ(sub.sub_begin, cuts[size_t(z)]);
      EXPECT_EQ(sub.shard_length, shard.length);
      TensorPiece part = whole_piece("qkv.weight.exp_avg", moment);
      part.slice = sub;
      part.local = ctx.empty(Shape{cuts[size_t(z) + 1] - cuts[size_t(z)]}, DType::f32)
                       .copy_(local_moment.flatten().slice(cuts[size_t(z)], cuts[size_t(z) + 1]));
      pieces.push_back(part);
    }
  }
  nn::ParameterShard unsplit;
  unsplit.global_shape = Shape{7, 3};
  EXPECT_EQ(io::shard_slice(unsplit).kind, TensorSlice::Kind::whole);
  const TensorSlice flat = io::shard_slice(unsplit, 5);
  EXPECT_EQ(flat.kind, TensorSlice::Kind::flat_range);
  EXPECT_EQ(flat.begin, 5);

  io::CheckpointReader reader(save(1, pieces, {}));
  for (const auto& [name, original] : {std::pair{"qkv.weight", weight}, std::pair{"qkv.weight.exp_avg", moment}}) {
    TensorPiece load = whole_piece(name, poisoned(ctx, kQkvShape, DType::f32));
    reader.read(load);
    EXPECT_EQ(bytes_of(load.local), bytes_of(original)) << name;
  }
}

TEST_P(Checkpoint, ReadsConsecutivePiecesOfATensorFromOneVerifiedCopy) {
  TESSERA_SEED_TRACE();
  // read() keeps the last tensor it read and verified: further pieces of it
  // come from that copy (a byte flipped on disk in between goes unseen), and
  // reading another tensor drops it (the flip is then detected). The tensors
  // are larger than HDF5's 64 KiB sieve buffer, so every read is from the file.
  const Tensor first = random_bytes_tensor(ctx, Shape{160, 128}, DType::f32, rng);
  const Tensor second = random_bytes_tensor(ctx, Shape{160, 128}, DType::f32, rng);
  const std::string path = save(1, {whole_piece("first", first), whole_piece("second", second)}, {});
  const auto [file, data] = stored_data(path, "first", 0);
  io::CheckpointReader reader(path);
  const auto read_rows = [&](const std::string& name, int64_t begin, int64_t end) {
    TensorPiece load = whole_piece(name, first);
    load.slice = TensorSlice::along(0, begin);
    load.local = poisoned(ctx, Shape{end - begin, 128}, DType::f32);
    reader.read(load);
    return bytes_of(load.local);
  };
  const Tensor& original_first = first;
  const auto rows_of = [&](int64_t begin, int64_t end) {
    return expected_slice(bytes_of(original_first), first.shape(), DType::f32, TensorSlice::along(0, begin),
                          Shape{end - begin, 128});
  };
  EXPECT_EQ(read_rows("first", 0, 80), rows_of(0, 80));

  ASSERT_TRUE(flip_stored_bit(file, data, 100 * 128 * 4, 4));              // in row 100
  EXPECT_EQ(read_rows("first", 80, 160), rows_of(80, 160));                // the verified copy
  TensorPiece other = whole_piece("second", poisoned(ctx, second.shape(), DType::f32));
  reader.read(other);
  EXPECT_EQ(bytes_of(other.local), bytes_of(second));
  EXPECT_CONTAINS(error_of([&] { read_rows("first", 80, 160); }), "checksum mismatch in tensor first");
  EXPECT_CONTAINS(error_of([&] { read_rows("first", 0, 10); }), "checksum mismatch in tensor first");  // not cached
}

TEST_P(Checkpoint, RefusesGapsAndOverlapsOfHeadShardsAndSubRanges) {
  const Tensor weight = ctx.full(kQkvShape, DType::f32, 1.0);
  const std::string first = save(1, {whole_piece("w", weight)}, {});
  // Heads [begin, begin + heads) of the view [3, 4, 15] (45 elements a head),
  // whole or a sub-range [sub_begin, sub_end) of the shard's flattening.
  const auto heads = [&](int64_t begin, int64_t count) {
    TensorPiece piece = whole_piece("qkv", weight);
    piece.slice = TensorSlice::along(1, begin, kQkvView);
    piece.local = ctx.zeros(Shape{count * 45}, DType::f32);
    return piece;
  };
  const auto sub = [&](int64_t begin, int64_t count, int64_t sub_begin, int64_t sub_end) {
    TensorPiece piece = heads(begin, count);
    piece.slice = piece.slice.with_sub_range(sub_begin, count);
    piece.local = ctx.zeros(Shape{sub_end - sub_begin}, DType::f32);
    return piece;
  };
  const auto refusal = [&](std::vector<TensorPiece> pieces) { return error_of([&] { save(2, pieces, {}); }); };
  EXPECT_CONTAINS(refusal({heads(0, 1), heads(2, 2)}),
                  "tensor qkv: indices along dimension 1 of view [3, 4, 15] [1, 2) are owned by no rank");
  EXPECT_CONTAINS(
      refusal({heads(0, 2), heads(1, 3)}),
      "tensor qkv: indices along dimension 1 of view [3, 4, 15] [1, 2) are owned by both rank 0 and rank 0");
  EXPECT_CONTAINS(refusal({heads(0, 3)}),
                  "tensor qkv: indices along dimension 1 of view [3, 4, 15] [3, 4) are owned by no rank");
  // Shard heads [0, 2) is [3, 2, 15]: its elements 40 and 41 are (1, 0, 10)
  // and (1, 0, 11), at 1·60 + 10 = 70 and 71 of the tensor.
  EXPECT_CONTAINS(refusal({sub(0, 2, 0, 40), sub(0, 2, 42, 90), heads(2, 2)}),
                  "tensor qkv: elements [70, 72) are owned by no rank");
  EXPECT_CONTAINS(refusal({sub(0, 2, 0, 41), sub(0, 2, 40, 90), heads(2, 2)}),
                  "tensor qkv: elements [70, 71) are owned by both rank 0 and rank 0");
  // A sub-range of heads [2, 4) overlapping a whole shard of heads [1, 3):
  // head 2 of Q is elements [30, 45) of the tensor.
  EXPECT_CONTAINS(refusal({heads(0, 1), heads(1, 2), sub(2, 2, 0, 90)}),
                  "tensor qkv: elements [30, 45) are owned by both rank 0 and rank 0");

  TensorPiece uneven = heads(0, 1);
  uneven.local = ctx.zeros(Shape{50}, DType::f32);
  EXPECT_CONTAINS(refusal({uneven}),
                  "tensor qkv: a dim_range piece along dimension 1 of view [3, 4, 15] (tensor shape [36, 5]) holds a "
                  "whole number of indices of 45 elements each, but its local tensor [50] has 50 elements");
  TensorPiece resized = heads(0, 4);
  resized.slice.view = Shape{3, 4, 16};
  EXPECT_CONTAINS(refusal({resized}),
                  "tensor qkv: dim_range view [3, 4, 16] holds 192 elements but the tensor [36, 5] has 180");
  TensorPiece outside = heads(3, 2);
  EXPECT_CONTAINS(refusal({outside}), "dim_range piece [3, 5) along dimension 1 lies outside its size 4 of view");
  EXPECT_CONTAINS(refusal({sub(0, 2, 80, 100), heads(2, 2)}),
                  "tensor qkv: sub-range [80, 100) lies outside the 90 elements of its dim_range shard [0, 2) along "
                  "dimension 1 of view [3, 4, 15]");
  TensorPiece flat_sub = whole_piece("qkv", weight);
  flat_sub.slice = TensorSlice::flat(0);
  flat_sub.slice.sub_range = true;
  EXPECT_CONTAINS(refusal({flat_sub}), "tensor qkv: a view or a sub-range belongs to a dim_range slice only");
  TensorPiece stray = heads(0, 4);
  stray.slice.shard_length = 4;
  EXPECT_CONTAINS(refusal({stray}), "sub_begin and shard_length describe a sub-range");
  EXPECT_EQ(io::find_latest_checkpoint(save_dir), first);
  EXPECT_FALSE(fs::exists(fs::path(save_dir) / "step_00000002"));

  // Loading checks the same way.
  io::CheckpointReader reader(first);
  TensorPiece load = heads(0, 1);
  load.name = "w";
  load.local = ctx.zeros(Shape{44}, DType::f32);
  EXPECT_CONTAINS(error_of([&] { reader.read(load); }), "loading " + reader.path() + ": tensor w: a dim_range piece");
}

TEST(Fault, ParsesKindsStepsAndRanks) {
  const FaultPlan plan = FaultPlan::parse(" checkpoint_crash@20:0 , hang:3,nan_grad@7 ,crash");
  ASSERT_EQ(plan.points().size(), 4u);
  EXPECT_TRUE(plan.due("checkpoint_crash", 20, 0));
  EXPECT_FALSE(plan.due("checkpoint_crash", 20, 1));
  EXPECT_FALSE(plan.due("checkpoint_crash", 21, 0));
  EXPECT_TRUE(plan.due("hang", 5, 3));
  EXPECT_TRUE(plan.due("hang", 99, 3));
  EXPECT_FALSE(plan.due("hang", 5, 2));
  EXPECT_TRUE(plan.due("nan_grad", 7, 5));
  EXPECT_FALSE(plan.due("nan_grad", 8, 5));
  EXPECT_TRUE(plan.due("crash", 1, 1));
  EXPECT_FALSE(plan.due("slow", 1, 1));
  EXPECT_TRUE(FaultPlan::parse("").empty());
  for (const char* bad : {"checkpoint_krash", "crash@x", "crash:-1", "crash@5:", "crash@@5"})
    EXPECT_CONTAINS(error_of([&] { FaultPlan::parse(bad); }), "TESSERA_FAULT");
}

TEST(Fault, FollowsTheEnvironmentVariable) {
  unsetenv("TESSERA_FAULT");
  EXPECT_FALSE(fault_due("crash", 1, 0));
  setenv("TESSERA_FAULT", "crash@1", 1);
  EXPECT_TRUE(fault_due("crash", 1, 0));
  EXPECT_FALSE(fault_due("crash", 2, 0));
  setenv("TESSERA_FAULT", "crash@2", 1);  // a changed value is parsed again
  EXPECT_TRUE(fault_due("crash", 2, 0));
  setenv("TESSERA_FAULT", "crash@two", 1);
  EXPECT_CONTAINS(error_of([&] { fault_due("crash", 2, 0); }), "crash@two");
  unsetenv("TESSERA_FAULT");
  EXPECT_FALSE(fault_due("crash", 2, 0));
}

TEST_P(Checkpoint, GpuSavesAndLoadsDeviceTensors) {
  TESSERA_REQUIRE_GPU(ctx);
  TESSERA_SEED_TRACE();
  const Tensor host = random_bytes_tensor(ctx, Shape{9, 5}, DType::bf16, rng);
  const std::string path = save(1, {whole_piece("w", host.to(Device::cuda(0)))}, {});
  io::CheckpointReader reader(path);
  TensorPiece load = whole_piece("w", host);
  load.slice = {TensorSlice::Kind::dim_range, 2, 0};
  load.local = poisoned(ctx, Shape{4, 5}, DType::bf16, Device::cuda(0));
  reader.read(load);
  EXPECT_EQ(bytes_of(load.local), expected_slice(bytes_of(host), host.shape(), DType::bf16, load.slice, Shape{4, 5}));
}

// Saves of device pieces copy them through one bounded pinned staging
// buffer (io/host_snapshot.h), on the emulated device: after an asynchronous
// save is published the rank holds at most kSnapshotStagingBytes of
// page-locked memory although its pieces are 2.5 times that (it held them
// all, for the rest of the run, before), a second save pins nothing new, and
// each checkpoint holds what the pieces held when its save began (they are
// poisoned right after). A synchronous save goes the same way.
TEST(CheckpointSnapshot, DevicePiecesArePinnedOnlyThroughABoundedStagingBuffer) {
  TESSERA_SEED_TRACE();
  std::mt19937_64 rng = make_rng();
  const Device device = Device::emulated(0);
  bind_thread_to_device(device);
  Context ctx;
  const auto world = parallel::make_local_communicator();
  const TempDir dir;
  const int64_t elements = io::kSnapshotStagingBytes * 5 / 2 / 4 / 3;  // 3 f32 pieces: 2.5 times the buffer
  std::vector<TensorPiece> pieces(3);
  io::CheckpointSaver saver(*world);
  uint64_t segments_after_first = 0;
  for (int step = 1; step <= 3; ++step) {
    SCOPED_TRACE("save " + std::to_string(step));
    std::vector<std::vector<float>> expected;
    for (size_t t = 0; t < pieces.size(); ++t) {
      std::vector<float> values(size_t(elements) + t * 4099);
      std::uniform_real_distribution<float> value(-1.0f, 1.0f);
      for (float& v : values) v = value(rng);
      pieces[t].name = "tensor" + std::to_string(t);
      pieces[t].global_shape = Shape{int64_t(values.size())};
      pieces[t].local = ctx.from_vector(pieces[t].global_shape, values, device);
      expected.push_back(std::move(values));
    }
    const bool async = step != 3;
    std::optional<io::PublishedCheckpoint> published = saver.save(dir.path().string(), step, pieces, {}, {}, async);
    for (TensorPiece& piece : pieces) piece.local.fill_(std::nan(""));  // training goes on and overwrites them
    if (!published) published = saver.finish();
    const AllocatorStats pinned = ctx.pinned_allocator(device).stats();
    EXPECT_LE(int64_t(pinned.reserved_bytes), io::kSnapshotStagingBytes);
    EXPECT_GT(int64_t(pinned.reserved_bytes), 0) << "the device pieces did not go through pinned staging";
    if (step == 1) segments_after_first = pinned.segments;
    EXPECT_EQ(pinned.segments, segments_after_first) << "a later save pinned more memory";
    const io::CheckpointReader reader(published->path);
    for (size_t t = 0; t < pieces.size(); ++t) {
      TensorPiece load = pieces[t];
      load.local = ctx.full(load.global_shape, DType::f32, -7.0);
      reader.read(load);
      EXPECT_TRUE(load.local.to_vector<float>() == expected[t]) << pieces[t].name;
    }
  }
}

}  // namespace
}  // namespace tessera::testing

// Checkpoints under mpiexec (2 and 4 ranks): every rank owns flat_range
// (ZeRO-like) and dim_range (tensor-parallel-like) pieces of a few tensors,
// cut at random points, plus whole tensors owned by one rank and listed as
// non-owned replicas by the others; rank 0 gathers and writes them. Head
// shards of a fused QKV weight (a dim_range of a view), and ZeRO sub-ranges
// of them under tp = 2 × dp = ranks / 2, the same way. Every
// rank then reads the checkpoint back under a different slicing (resharding
// at the file level) and compares, byte for byte, with the values it computes
// itself from the shared seed. Ownership gaps and overlaps across ranks, and
// an error on one rank, make every rank throw without publishing anything.
// Sharded checkpoints (format 2): each rank reads its own slices from its own
// file only (the others' files hidden); an asynchronous save writes what the
// pieces held when it was called, publishes only in finish(), and no save
// holds more than what the rank owns plus a bounded buffer (the pieces'
// allocator and the process's resident-set high-water mark, measured).
#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/allocator.h"
#include "core/context.h"
#include "core/error.h"
#include "io/checkpoint.h"
#include "parallel/mpi_communicator.h"
#include "tests/mpi/mpi_test.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

namespace fs = std::filesystem;
using io::TensorPiece;
using io::TensorSlice;

// A directory every rank sees (one machine): rank 0 names it, all remove it at the end.
class SharedDir {
 public:
  explicit SharedDir(parallel::Communicator& world) : world_(world) {
    char name[256] = {};
    if (world.rank() == 0) {
      std::random_device device;
      const std::string path = (fs::temp_directory_path() /
                                ("tessera_ckpt_mpi_" + std::to_string(getpid()) + "_" + std::to_string(device())))
                                   .string();
      std::snprintf(name, sizeof name, "%s", path.c_str());
    }
    MPI_Bcast(name, sizeof name, MPI_CHAR, 0, MPI_COMM_WORLD);
    path_ = name;
  }
  ~SharedDir() {
    world_.barrier();
    if (world_.rank() == 0) {
      std::error_code ignored;
      fs::remove_all(path_, ignored);
    }
  }
  const std::string& path() const { return path_; }

 private:
  parallel::Communicator& world_;
  std::string path_;
};

// The logical tensors: their values are random bytes drawn in the same order
// on every rank, so every rank knows every tensor whole.
struct Logical {
  std::string name;
  Shape shape;
  DType dtype;
  std::vector<uint8_t> bytes;
};

std::vector<Logical> make_tensors(std::mt19937_64& rng) {
  std::vector<Logical> tensors = {
      {"layers.0.qkv.weight", Shape{37, 11}, DType::f32, {}},             // flat_range pieces (ZeRO)
      {"layers.0.qkv.weight.exp_avg", Shape{6, 10, 3}, DType::bf16, {}},  // dim_range along 1 (tp)
      {"layers.0.proj.weight", Shape{9, 7}, DType::i64, {}},              // dim_range along 0
      {"final_norm.weight", Shape{13}, DType::f16, {}},                   // whole, owned by rank 0
      {"embedding.table", Shape{4, 4}, DType::u8, {}},                    // whole, owned by the last rank
      {"optimizer.step", Shape{}, DType::i32, {}},                        // a scalar, owned by rank 1
  };
  std::uniform_int_distribution<int> byte(0, 255);
  for (Logical& t : tensors) {
    t.bytes.resize(size_t(t.shape.numel()) * dtype_size(t.dtype));
    for (auto& b : t.bytes) b = uint8_t(byte(rng));
  }
  return tensors;
}

// `parts` + 1 boundaries 0 = b0 ≤ b1 ≤ ... ≤ b_parts = n at random (empty parts allowed).
std::vector<int64_t> random_cuts(int64_t n, int parts, std::mt19937_64& rng) {
  std::vector<int64_t> cuts = {0, n};
  for (int i = 1; i < parts; ++i) cuts.push_back(std::uniform_int_distribution<int64_t>(0, n)(rng));
  std::sort(cuts.begin(), cuts.end());
  return cuts;
}

// The bytes of `slice` with local shape `local`, element by element through
// multi-indices: a dim_range shard is the cut shape (the view, or the global
// shape) with `count` indices along `dim`; local element l (plus sub_begin in
// a sub-range) is a multi-index of the shard, shifted by `begin` along `dim`
// and flattened in the cut shape.
std::vector<uint8_t> slice_bytes(const Logical& t, const TensorSlice& slice, const Shape& local) {
  const size_t size = dtype_size(t.dtype);
  std::vector<uint8_t> out(size_t(local.numel()) * size);
  for (int64_t l = 0; l < local.numel(); ++l) {
    int64_t g = l;
    if (slice.kind == TensorSlice::Kind::flat_range) g = slice.begin + l;
    if (slice.kind == TensorSlice::Kind::dim_range) {
      const Shape cut = slice.view.ndim() > 0 ? slice.view : t.shape;
      int64_t count = slice.view.ndim() > 0 ? local.numel() / (cut.numel() / cut[slice.dim]) : local[slice.dim];
      if (slice.sub_range) count = slice.shard_length;
      const Shape shard = cut.with_dim(slice.dim, count);
      std::vector<int64_t> index(size_t(shard.ndim()));
      int64_t rest = l + (slice.sub_range ? slice.sub_begin : 0);
      for (int d = shard.ndim() - 1; d >= 0; --d) {
        index[size_t(d)] = rest % shard[d];
        rest /= shard[d];
      }
      index[size_t(slice.dim)] += slice.begin;
      g = 0;
      for (int d = 0; d < cut.ndim(); ++d) g = g * cut[d] + index[size_t(d)];
    }
    std::memcpy(out.data() + size_t(l) * size, t.bytes.data() + size_t(g) * size, size);
  }
  return out;
}

TensorPiece make_piece(Context& ctx, const Logical& t, TensorSlice slice, const Shape& local, bool owner) {
  TensorPiece piece;
  piece.name = t.name;
  piece.global_shape = t.shape;
  piece.dtype = t.dtype;
  piece.slice = slice;
  piece.owner = owner;
  piece.local = ctx.empty(local, t.dtype);
  const std::vector<uint8_t> bytes = slice_bytes(t, slice, local);
  if (!bytes.empty()) std::memcpy(piece.local.data_ptr(), bytes.data(), bytes.size());
  return piece;
}

TensorPiece flat_piece(Context& ctx, const Logical& t, int64_t begin, int64_t end, bool owner = true) {
  return make_piece(ctx, t, {TensorSlice::Kind::flat_range, begin, 0}, Shape{end - begin}, owner);
}

TensorPiece dim_piece(Context& ctx, const Logical& t, int dim, int64_t begin, int64_t end, bool owner = true) {
  return make_piece(ctx, t, {TensorSlice::Kind::dim_range, begin, dim}, t.shape.with_dim(dim, end - begin), owner);
}

TensorPiece whole_piece(Context& ctx, const Logical& t, bool owner) {
  return make_piece(ctx, t, {}, t.shape, owner);
}

// This rank's pieces for saving, cut at `cuts` (one vector of boundaries per sliced tensor).
std::vector<TensorPiece> save_layout(Context& ctx, const std::vector<Logical>& t, int rank, int ranks,
                                     const std::vector<std::vector<int64_t>>& cuts) {
  const size_t r = size_t(rank);
  return {
      flat_piece(ctx, t[0], cuts[0][r], cuts[0][r + 1]),   dim_piece(ctx, t[1], 1, cuts[1][r], cuts[1][r + 1]),
      dim_piece(ctx, t[2], 0, cuts[2][r], cuts[2][r + 1]), whole_piece(ctx, t[3], rank == 0),
      whole_piece(ctx, t[4], rank == ranks - 1),           whole_piece(ctx, t[5], rank == 1 % ranks),
  };
}

std::vector<uint8_t> bytes_of(const Tensor& tensor) {
  const auto* begin = static_cast<const uint8_t*>(tensor.data_ptr());
  return std::vector<uint8_t>(begin, begin + tensor.nbytes());
}

std::vector<uint8_t> rank_blob(int rank) {
  std::vector<uint8_t> blob(size_t(5 + 3 * rank));
  for (size_t i = 0; i < blob.size(); ++i) blob[i] = uint8_t(17 * rank + int(i));
  return blob;
}

class CheckpointMpi : public ::testing::Test {
 protected:
  Context ctx;
  std::unique_ptr<parallel::Communicator> world = parallel::make_mpi_communicator(MPI_COMM_WORLD, "world");
  int rank = world->rank(), ranks = world->size();
  std::mt19937_64 rng = make_rng();  // the same sequence on every rank
};

TEST_F(CheckpointMpi, SavesShardsAndReadsThemBackUnderAnotherLayout) {
  TESSERA_SEED_TRACE();
  SharedDir dir(*world);
  const std::vector<Logical> tensors = make_tensors(rng);
  const std::vector<std::vector<int64_t>> cuts = {random_cuts(37 * 11, ranks, rng), random_cuts(10, ranks, rng),
                                                  random_cuts(9, ranks, rng)};
  io::SaveOptions options;
  options.rank_state = {{"rng", rank_blob(rank)}};
  const io::CheckpointMetadata metadata = {{"dp", std::to_string(ranks)}, {"zero", "1"}};
  std::string path;
  try {
    path = io::save_checkpoint(*world, dir.path(), 42, save_layout(ctx, tensors, rank, ranks, cuts), metadata, options);
  } catch (const Error& error) {
    ADD_FAILURE() << error.what();
  }
  EXPECT_EQ(path, (fs::path(dir.path()) / "step_00000042").string());
  EXPECT_EQ(io::find_latest_checkpoint(dir.path()), path);

  io::CheckpointReader reader(path);
  EXPECT_EQ(reader.step(), 42);
  EXPECT_EQ(reader.ranks_saved(), ranks);
  EXPECT_EQ(reader.metadata(), metadata);
  EXPECT_EQ(reader.tensors().size(), tensors.size());
  EXPECT_TRUE(reader.verify().empty());
  for (int r = 0; r < ranks; ++r) EXPECT_EQ(reader.rank_state(r, "rng"), rank_blob(r)) << "rank " << r;

  // Another layout: different cut points, other dimensions, the flat tensor
  // along a dimension and the sharded ones whole or flat.
  const int parts = ranks + 1;  // another count of pieces than was saved
  const auto read_cuts = [&](int64_t n) {
    std::vector<int64_t> c = random_cuts(n, parts, rng);
    return std::pair<int64_t, int64_t>{c[size_t(rank)], c[size_t(rank) + 1]};
  };
  std::vector<TensorPiece> loads;
  for (const Logical& t : tensors) loads.push_back(whole_piece(ctx, t, true));
  const auto [f0, f1] = read_cuts(37 * 11);
  loads.push_back(flat_piece(ctx, tensors[0], f0, f1));
  const auto [a0, a1] = read_cuts(11);
  loads.push_back(dim_piece(ctx, tensors[0], 1, a0, a1));
  const auto [b0, b1] = read_cuts(3);
  loads.push_back(dim_piece(ctx, tensors[1], 2, b0, b1));
  const auto [c0, c1] = read_cuts(6 * 10 * 3);
  loads.push_back(flat_piece(ctx, tensors[1], c0, c1));
  const auto [d0, d1] = read_cuts(7);
  loads.push_back(dim_piece(ctx, tensors[2], 1, d0, d1));
  for (TensorPiece& load : loads) {
    const std::vector<uint8_t> expected = bytes_of(load.local);  // made from the logical values
    load.local.copy_(poisoned(ctx, load.local.shape(), load.dtype));
    reader.read(load);
    EXPECT_EQ(bytes_of(load.local), expected) << load.name << " slice kind " << int(load.slice.kind) << " begin "
                                              << load.slice.begin << " dim " << load.slice.dim;
  }
}

// A fused QKV weight [3·H·Dh, C] cut by heads: viewed as [3, H, Dh·C], cut along dimension 1.
constexpr int64_t kHeads = 4, kHeadDim = 2, kChannels = 3;
const Shape kQkvShape{3 * kHeads * kHeadDim, kChannels};
constexpr int64_t kHeadColumns = kHeadDim * kChannels;  // Dh·C
const Shape kQkvView{3, kHeads, kHeadColumns};

TensorSlice head_slice(int part, int parts) {
  return TensorSlice::along(1, part * kHeads / parts, kQkvView);
}
Shape head_local(int parts) {  // as the layer holds its shard
  return Shape{3 * kHeads / parts * kHeadDim, kChannels};
}

TEST_F(CheckpointMpi, SavesHeadShardsAndZeroSubRangesOfEveryRank) {
  TESSERA_SEED_TRACE();
  SharedDir dir(*world);
  // tp = 2 (rank % 2) × dp = ranks / 2 (rank / 2): the weight's head shard is
  // owned by dp rank 0 (replicas elsewhere), its moment is split by ZeRO into
  // uneven sub-ranges of the shard over the dp ranks; a third tensor is cut
  // into `ranks` head shards, one per rank.
  std::uniform_int_distribution<int> byte(0, 255);
  std::vector<Logical> t = {{"attn.qkv.weight", kQkvShape, DType::f32, {}},
                            {"attn.qkv.weight.exp_avg", kQkvShape, DType::bf16, {}},
                            {"attn.qkv.heads", kQkvShape, DType::i32, {}}};
  for (Logical& logical : t) {
    logical.bytes.resize(size_t(logical.shape.numel()) * dtype_size(logical.dtype));
    for (auto& b : logical.bytes) b = uint8_t(byte(rng));
  }
  const int tp = 2, dp = ranks / 2, tp_rank = rank % tp, dp_rank = rank / tp;
  const int64_t shard_numel = kQkvShape.numel() / tp;
  std::vector<std::vector<int64_t>> zero_cuts;
  for (int s = 0; s < tp; ++s) zero_cuts.push_back(random_cuts(shard_numel, dp, rng));
  const std::vector<int64_t>& mine = zero_cuts[size_t(tp_rank)];
  const std::vector<TensorPiece> pieces = {
      make_piece(ctx, t[0], head_slice(tp_rank, tp), head_local(tp), dp_rank == 0),
      make_piece(ctx, t[1], head_slice(tp_rank, tp).with_sub_range(mine[size_t(dp_rank)], kHeads / tp),
                 Shape{mine[size_t(dp_rank) + 1] - mine[size_t(dp_rank)]}, true),
      make_piece(ctx, t[2], head_slice(rank, ranks), head_local(ranks), true),
  };
  std::string path;
  try {
    path = io::save_checkpoint(*world, dir.path(), 7, pieces, {{"tp", "2"}});
  } catch (const Error& error) {
    ADD_FAILURE() << error.what();
  }
  io::CheckpointReader reader(path);
  EXPECT_TRUE(reader.verify().empty());

  // Every rank reads every tensor whole, then under another cut: the
  // moment as `ranks` head shards, the per-rank tensor as tp = 2 shards in
  // dp sub-ranges cut elsewhere, the weight as one rank's ZeRO range of it
  // at tp = 1 (a flat range).
  std::vector<TensorPiece> loads;
  for (const Logical& logical : t) loads.push_back(whole_piece(ctx, logical, true));
  loads.push_back(make_piece(ctx, t[1], head_slice(rank, ranks), Shape{kQkvShape.numel() / ranks}, true));
  const std::vector<int64_t> other = random_cuts(shard_numel, dp + 1, rng);
  loads.push_back(make_piece(ctx, t[2], head_slice(tp_rank, tp).with_sub_range(other[size_t(dp_rank)], kHeads / tp),
                             Shape{other[size_t(dp_rank) + 1] - other[size_t(dp_rank)]}, true));
  const std::vector<int64_t> flat = random_cuts(kQkvShape.numel(), ranks, rng);
  loads.push_back(flat_piece(ctx, t[0], flat[size_t(rank)], flat[size_t(rank) + 1]));
  for (TensorPiece& load : loads) {
    const std::vector<uint8_t> expected = bytes_of(load.local);  // made from the logical values
    load.local.copy_(poisoned(ctx, load.local.shape(), load.dtype));
    reader.read(load);
    EXPECT_EQ(bytes_of(load.local), expected)
        << load.name << " slice kind " << int(load.slice.kind) << " begin " << load.slice.begin << " sub-range "
        << load.slice.sub_range << " at " << load.slice.sub_begin;
  }

  // A gap: the first rank with a non-empty ZeRO range of the moment does not own it.
  int victim = 0;
  while (zero_cuts[size_t(victim % tp)][size_t(victim / tp) + 1] == zero_cuts[size_t(victim % tp)][size_t(victim / tp)])
    ++victim;
  std::vector<TensorPiece> gap = pieces;
  if (rank == victim) gap[1].owner = false;
  std::string message = "(no error)";
  try {
    io::save_checkpoint(*world, dir.path(), 8, gap, {});
  } catch (const Error& error) {
    message = error.what();
  }
  EXPECT_NE(message.find("tensor attn.qkv.weight.exp_avg: elements ["), std::string::npos) << message;
  EXPECT_NE(message.find("are owned by no rank"), std::string::npos) << message;
  EXPECT_EQ(io::find_latest_checkpoint(dir.path()), path);
}

TEST_F(CheckpointMpi, GapsOverlapsAndOneRanksErrorStopEveryRank) {
  TESSERA_SEED_TRACE();
  SharedDir dir(*world);
  const std::vector<Logical> tensors = make_tensors(rng);
  const int64_t n = 37 * 11;
  std::vector<std::vector<int64_t>> cuts = {{0}, random_cuts(10, ranks, rng), random_cuts(9, ranks, rng)};
  for (int r = 1; r <= ranks; ++r) cuts[0].push_back(n * r / ranks);  // every rank owns ≥ 2 elements
  const std::string first =
      io::save_checkpoint(*world, dir.path(), 1, save_layout(ctx, tensors, rank, ranks, cuts), {});

  const auto expect_refused = [&](std::vector<TensorPiece> pieces, const std::string& fragment) {
    std::string message = "(no error)";
    try {
      io::save_checkpoint(*world, dir.path(), 2, pieces, {});
    } catch (const Error& error) {
      message = error.what();
    }
    EXPECT_NE(message.find(fragment), std::string::npos) << "expected '" << fragment << "' in: " << message;
  };

  // A gap: the last rank does not own its flat piece.
  std::vector<TensorPiece> gap = save_layout(ctx, tensors, rank, ranks, cuts);
  if (rank == ranks - 1) gap[0].owner = false;
  expect_refused(gap, "tensor layers.0.qkv.weight: elements [" + std::to_string(cuts[0][size_t(ranks - 1)]) + ", " +
                          std::to_string(n) + ") are owned by no rank");

  // An overlap: rank 1's flat piece starts one element early.
  std::vector<TensorPiece> overlap = save_layout(ctx, tensors, rank, ranks, cuts);
  if (rank == 1) overlap[0] = flat_piece(ctx, tensors[0], cuts[0][1] - 1, cuts[0][2]);
  expect_refused(overlap, "elements [" + std::to_string(cuts[0][1] - 1) + ", " + std::to_string(cuts[0][1]) +
                              ") are owned by both rank 0 and rank 1");

  // A replica owned twice: every rank claims the whole final_norm.weight.
  std::vector<TensorPiece> replicas = save_layout(ctx, tensors, rank, ranks, cuts);
  replicas[3].owner = true;
  expect_refused(replicas, "tensor final_norm.weight: elements [0, 13) are owned by both rank 0 and rank 1");

  // One rank's piece is wrong: all ranks stop, the others naming that rank.
  std::vector<TensorPiece> wrong = save_layout(ctx, tensors, rank, ranks, cuts);
  if (rank == ranks - 1) wrong[2].dtype = DType::i32;
  expect_refused(wrong, rank == ranks - 1 ? "the piece says i32 but its local tensor holds i64"
                                          : "rank " + std::to_string(ranks - 1) + " failed");

  EXPECT_EQ(io::find_latest_checkpoint(dir.path()), first);
  world->barrier();  // rank 0 has finished every save before anyone looks
  EXPECT_FALSE(fs::exists(fs::path(dir.path()) / "step_00000002"));
  EXPECT_FALSE(fs::exists(fs::path(dir.path()) / ".step_00000002.tmp"));
}

// --- Sharded checkpoints: reads of one's own file, asynchronous saves, memory ---

// This rank's even share [n·r/R, n·(r+1)/R) of each tensor as flat ranges.
std::vector<TensorPiece> even_flat_pieces(Context& ctx, const std::vector<Logical>& tensors, int rank, int ranks) {
  std::vector<TensorPiece> pieces;
  for (const Logical& t : tensors) {
    const int64_t n = t.shape.numel();
    pieces.push_back(flat_piece(ctx, t, n * rank / ranks, n * (rank + 1) / ranks));
  }
  return pieces;
}

// Until every rank's background write has ended (agreed as a trainer does at its step boundaries).
void wait_until_written_everywhere(const io::CheckpointSaver& saver) {
  for (;;) {
    int writing = saver.written() ? 0 : 1;
    MPI_Allreduce(MPI_IN_PLACE, &writing, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (writing == 0) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

TEST_F(CheckpointMpi, EachRankReadsItsOwnSlicesFromItsOwnFileOnly) {
  TESSERA_SEED_TRACE();
  SharedDir dir(*world);
  const std::vector<Logical> tensors = make_tensors(rng);
  std::vector<TensorPiece> pieces = even_flat_pieces(ctx, tensors, rank, ranks);
  const std::string path = io::save_checkpoint(*world, dir.path(), 5, pieces, {});
  // A private copy holding the index and this rank's file only.
  const fs::path mine = fs::path(dir.path()) / ("rank" + std::to_string(rank)) / "step_00000005";
  fs::create_directories(mine);
  char rank_file[32];
  std::snprintf(rank_file, sizeof rank_file, "rank_%05d.h5", rank);
  for (const char* name : {"checkpoint.h5", static_cast<const char*>(rank_file)})
    fs::copy_file(fs::path(path) / name, mine / name);
  io::CheckpointReader reader(mine.string());
  EXPECT_EQ(reader.format(), 2);
  for (TensorPiece& load : pieces) {
    if (load.local.numel() == 0) continue;
    const std::vector<uint8_t> expected = bytes_of(load.local);
    load.local.copy_(poisoned(ctx, load.local.shape(), load.dtype));
    reader.read(load);
    EXPECT_EQ(bytes_of(load.local), expected) << load.name;
  }
  // A tensor whole needs the other ranks' files: the one missing is named.
  TensorPiece whole = whole_piece(ctx, tensors[0], true);
  std::string message = "(no error)";
  try {
    reader.read(whole);
  } catch (const Error& error) {
    message = error.what();
  }
  EXPECT_NE(message.find("is incomplete: "), std::string::npos) << message;
  EXPECT_NE(message.find("rank_0000" + std::to_string(rank == 0 ? 1 : 0) + ".h5"), std::string::npos) << message;
  EXPECT_NE(message.find("is missing"), std::string::npos) << message;
}

TEST_F(CheckpointMpi, AnAsynchronousSaveWritesWhatThePiecesHeldAndPublishesInFinish) {
  TESSERA_SEED_TRACE();
  SharedDir dir(*world);
  const std::vector<Logical> tensors = make_tensors(rng);
  std::vector<TensorPiece> pieces = even_flat_pieces(ctx, tensors, rank, ranks);
  std::vector<std::vector<uint8_t>> saved;
  for (const TensorPiece& piece : pieces) saved.push_back(bytes_of(piece.local));
  io::CheckpointSaver saver(*world);
  io::SaveOptions options;
  options.rank_state = {{"rng", rank_blob(rank)}};
  const std::string first = io::save_checkpoint(*world, dir.path(), 1, pieces, {}, options);
  EXPECT_FALSE(saver.save(dir.path(), 2, pieces, {{"note", "async"}}, options, true).has_value());
  EXPECT_TRUE(saver.pending());
  // Training goes on: the pieces change under the background write.
  for (TensorPiece& piece : pieces) piece.local.copy_(poisoned(ctx, piece.local.shape(), piece.dtype));
  EXPECT_EQ(io::find_latest_checkpoint(dir.path()), first) << "published before finish()";
  wait_until_written_everywhere(saver);
  EXPECT_FALSE(saver.write_failed());
  const io::PublishedCheckpoint published = saver.finish();
  EXPECT_FALSE(saver.pending());
  EXPECT_EQ(published.path, (fs::path(dir.path()) / "step_00000002").string());
  EXPECT_EQ(io::find_latest_checkpoint(dir.path()), published.path);
  int64_t owned = 0;
  for (const std::vector<uint8_t>& bytes : saved) owned += int64_t(bytes.size());
  EXPECT_EQ(published.bytes, owned);
  io::CheckpointReader reader(published.path);
  EXPECT_TRUE(reader.verify().empty());
  EXPECT_EQ(reader.metadata().at("note"), "async");
  for (int r = 0; r < ranks; ++r) EXPECT_EQ(reader.rank_state(r, "rng"), rank_blob(r)) << "rank " << r;
  for (const Logical& t : tensors) {  // every rank reads every tensor whole: the values at save time
    TensorPiece load = whole_piece(ctx, t, true);
    load.local.copy_(poisoned(ctx, load.local.shape(), load.dtype));
    reader.read(load);
    EXPECT_EQ(bytes_of(load.local), t.bytes) << t.name;
  }
}

// /proc/self/status fields in bytes ("VmRSS", "VmHWM").
int64_t status_bytes(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1)) * 1024;
  return -1;
}

// The resident-set high-water mark back to the current resident set.
bool reset_peak_rss() {
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
  out.flush();
  return bool(out);
}

TEST_F(CheckpointMpi, NoSaveHoldsMoreThanTheRankOwnsPlusABoundedBuffer) {
  TESSERA_SEED_TRACE();
  SharedDir dir(*world);
  // Four f32 tensors of 1 Mi elements (4 MiB each), each split evenly over the ranks.
  constexpr int64_t n = int64_t(1) << 20;
  std::vector<TensorPiece> pieces;
  for (int i = 0; i < 4; ++i) {
    TensorPiece piece;
    piece.name = "layers." + std::to_string(i) + ".weight";
    piece.global_shape = Shape{n};
    piece.dtype = DType::f32;
    piece.slice = TensorSlice::flat(n * rank / ranks);
    piece.local = random_tensor(ctx, Shape{n * (rank + 1) / ranks - n * rank / ranks}, DType::f32, rng).tensor;
    pieces.push_back(std::move(piece));
  }
  int64_t owned = 0;
  for (const TensorPiece& piece : pieces) owned += int64_t(piece.local.nbytes());
  constexpr int64_t kBuffer = int64_t(16) << 20;  // HDF5's buffers, descriptors, page-cache bookkeeping
  Allocator& allocator = ctx.allocator(Device::cpu());
  const bool rss_measured = reset_peak_rss();
  int64_t step = 0;
  for (const bool async : {false, true}) {
    SCOPED_TRACE(async ? "asynchronous" : "synchronous");
    io::CheckpointSaver saver(*world);
    allocator.reset_peak_stats();
    const int64_t allocated = int64_t(allocator.stats().allocated_bytes);
    reset_peak_rss();
    const int64_t rss = status_bytes("VmRSS");
    saver.save(dir.path(), ++step, pieces, {}, {}, async);
    if (async) {
      wait_until_written_everywhere(saver);
      saver.finish();
    }
    const int64_t tensor_growth = int64_t(allocator.stats().peak_allocated_bytes) - allocated;
    const int64_t rss_growth = status_bytes("VmHWM") - rss;
    // Tensors: nothing at all synchronously (CPU pieces are written from
    // where they are), exactly a copy of what the rank owns asynchronously.
    EXPECT_EQ(tensor_growth, async ? owned : 0) << "rank " << rank;
    if (rss_measured) {
      EXPECT_LE(rss_growth, (async ? owned : 0) + kBuffer) << "rank " << rank;
    }
    if (rank == 0)
      std::printf("save of %lld bytes owned per rank (%s): tensor memory +%lld, resident set +%lld bytes\n",
                  static_cast<long long>(owned), async ? "async" : "sync", static_cast<long long>(tensor_growth),
                  static_cast<long long>(rss_growth));
  }
  io::CheckpointReader reader(io::find_latest_checkpoint(dir.path()).value());
  EXPECT_TRUE(reader.verify().empty());
}

}  // namespace
}  // namespace tessera::testing

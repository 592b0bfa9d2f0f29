// The every_rank save (checkpoint.h, format 2): each rank writes what it owns
// into its own file in the temporary step directory, then rank 0 writes the
// index (checkpoint.h5: metadata, rank states, and every tensor as a virtual
// dataset over the rank files with the table of its pieces and their CRCs)
// and publishes the directory atomically. CheckpointSaver runs the rank's
// write on a background thread from a host copy; save_checkpoint is its
// synchronous use.
//
// Why per-rank files and an HDF5 virtual-dataset index, not parallel HDF5
// over MPI-IO: Debian ships serial HDF5 (thread-safe) beside an MPI build
// whose library and headers would replace it for the whole project; a
// collective H5Dwrite cannot run on a background thread under
// MPI_THREAD_FUNNELED, so it would rule out asynchronous saves; and ranks
// writing separate files need no locking or collective metadata on the
// filesystem. The virtual datasets keep what format 1 gave: each logical
// tensor readable whole by any HDF5 tool (h5py, h5dump), resolved through
// the rank files' names relative to the index, so the directory can be
// renamed (the atomic publish) or copied. CRCs are per piece, computed by
// the rank that wrote it.
//
// The phases of a save (the first three are checkpoint_plan.cpp's):
//   1-3. descriptors all-gathered, every tensor planned and its coverage
//        checked (the same verdict on every rank);
//   4.   rank 0 prepares the save directory (stale temporaries, room, the
//        temporary directory) and broadcasts the outcome;
//   5.   every rank writes its owned pieces to `rank_<r>.h5` and fsyncs it
//        (asynchronous: on a background thread, from a host copy);
//   6.   (finish) every rank's outcome (error or CRCs) all-gathered; rank 0
//        writes the index, publishes, and broadcasts the outcome; every rank
//        returns the path or throws naming the rank and file that failed.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include "core/context.h"
#include "core/error.h"
#include "core/storage.h"
#include "io/checkpoint_internal.h"
#include "io/host_snapshot.h"

namespace tessera::io {

using namespace checkpoint_detail;

namespace checkpoint_detail {

std::string rank_file_name(int rank) {
  char name[32];
  std::snprintf(name, sizeof name, "rank_%05d.h5", rank);
  return name;
}

std::string piece_dataset_name(const std::string& tensor, int index) {
  return "tensors/" + tensor + "/" + std::to_string(index);
}

// [rank, index, crc32, kind, begin, dim, sub_range, sub_begin, shard_length,
//  local ndim, local sizes (kMaxDims), view ndim, view sizes (kMaxDims)]
std::vector<int64_t> piece_row(const StoredPiece& piece) {
  const TensorSlice& slice = piece.slice;
  std::vector<int64_t> row = {piece.rank, piece.index, int64_t(piece.crc32)};
  for (int64_t value : {int64_t(slice.kind), slice.begin, int64_t(slice.dim), int64_t(slice.sub_range), slice.sub_begin,
                        slice.shard_length})
    row.push_back(value);
  for (const Shape* shape : {&piece.local, &piece.slice.view}) {
    row.push_back(shape->ndim());
    for (int d = 0; d < Shape::kMaxDims; ++d) row.push_back(d < shape->ndim() ? (*shape)[d] : 0);
  }
  return row;
}

StoredPiece piece_from_row(const int64_t* row) {
  const auto shape_at = [](const int64_t* at) {
    const int64_t ndim = at[0];
    TESSERA_CHECK(ndim >= 0 && ndim <= Shape::kMaxDims, "a piece's shape has ", ndim, " dimensions");
    int64_t numel = 1;
    for (int64_t d = 0; d < ndim; ++d) {
      TESSERA_CHECK(at[1 + d] >= 0 && at[1 + d] <= (int64_t(1) << 40), "a piece's size ", at[1 + d], " is impossible");
      numel = at[1 + d] == 0 ? 0 : std::min(numel * at[1 + d], int64_t(1) << 50);
    }
    TESSERA_CHECK(numel < (int64_t(1) << 50), "a piece's shape claims more elements than a file holds");
    return Shape(std::vector<int64_t>(at + 1, at + 1 + ndim));
  };
  StoredPiece piece;
  TESSERA_CHECK(row[0] >= 0 && row[0] < (1 << 24) && row[1] >= 0 && row[1] < (1 << 30), "a piece's rank ", row[0],
                " or index ", row[1], " is impossible");
  piece.rank = int(row[0]);
  piece.index = int(row[1]);
  piece.crc32 = uint32_t(row[2]);
  TESSERA_CHECK(row[3] >= 0 && row[3] <= int64_t(TensorSlice::Kind::dim_range), "a piece's slice kind is ", row[3]);
  piece.slice.kind = TensorSlice::Kind(row[3]);
  piece.slice.begin = row[4];
  piece.slice.dim = int(row[5]);
  piece.slice.sub_range = row[6] != 0;
  piece.slice.sub_begin = row[7];
  piece.slice.shard_length = row[8];
  piece.local = shape_at(row + 9);
  piece.slice.view = shape_at(row + 10 + Shape::kMaxDims);
  return piece;
}

}  // namespace checkpoint_detail

namespace {

using Clock = std::chrono::steady_clock;

// A piece this rank writes, as host bytes.
struct OwnedPiece {
  const PieceInfo* info;
  const std::byte* bytes;
  int64_t size;  // bytes
};

// How this rank's write of its file ended.
struct WriteOutcome {
  std::string error;           // empty: written and fsynced
  std::vector<uint32_t> crcs;  // per owned piece, in order
  int64_t bytes = 0;
  double seconds = 0.0;
};

// This rank's owned pieces with elements, in the order of its list (the
// order the index pairs them with their CRCs).
std::vector<const PieceInfo*> owned_pieces(const SaveJob& job, int rank) {
  std::vector<const PieceInfo*> owned;
  for (const PieceInfo& piece : job.all[size_t(rank)].pieces)
    if (piece.owner && piece.local.numel() > 0) owned.push_back(&piece);
  return owned;
}

// Slabs of this size per H5Dwrite: HDF5's global lock is taken per call, so
// a data loader reading on another thread waits at most one slab.
constexpr int64_t kSlabBytes = int64_t(8) << 20;

// Returns the piece's CRC-32 (also stored as its dataset's attribute).
uint32_t write_piece(const std::string& path, hid_t file, const OwnedPiece& piece, const WriteProgress& progress) {
  const PieceInfo& info = *piece.info;
  const std::string name = piece_dataset_name(info.name, info.index);
  Hdf5Handle links = property_list_handle(TESSERA_HDF5_CHECK_AT(path, H5Pcreate(H5P_LINK_CREATE)));
  TESSERA_HDF5_CHECK_AT(path, H5Pset_create_intermediate_group(links.get(), 1));
  const hsize_t numel = hsize_t(info.local.numel());
  Hdf5Handle space = dataspace_handle(TESSERA_HDF5_CHECK_AT(path, H5Screate_simple(1, &numel, nullptr)));
  Hdf5Handle dataset =
      dataset_handle(TESSERA_HDF5_CHECK_AT(path, H5Dcreate2(file, name.c_str(), file_type_of(info.dtype), space.get(),
                                                            links.get(), H5P_DEFAULT, H5P_DEFAULT)));
  const hsize_t element = dtype_size(info.dtype), slab = hsize_t(kSlabBytes) / element;
  for (hsize_t first = 0; first < numel; first += slab) {
    const hsize_t count = std::min(slab, numel - first), one = 1;
    Hdf5Handle memory = dataspace_handle(TESSERA_HDF5_CHECK_AT(path, H5Screate_simple(1, &count, nullptr)));
    TESSERA_HDF5_CHECK_AT(path, H5Sselect_hyperslab(space.get(), H5S_SELECT_SET, &first, nullptr, &one, &count));
    TESSERA_HDF5_CHECK_AT(path, H5Dwrite(dataset.get(), memory_type_of(info.dtype), memory.get(), space.get(),
                                         H5P_DEFAULT, piece.bytes + first * element));
    progress();
  }
  write_string_attribute(path, dataset.get(), kDtypeAttribute, dtype_name(info.dtype));
  const uint32_t crc = crc32_of(piece.bytes, size_t(piece.size));
  write_int64_attribute(path, dataset.get(), kCrcAttribute, crc);
  return crc;
}

// Phase 5: `rank_<r>.h5` in the temporary directory, one 1-D dataset per
// owned piece (tensors/<name>/<index in the rank's list>) with its dtype and
// CRC, flushed, closed and fsynced. Never throws: the error (naming the rank
// and the file) is the outcome, reported by every rank in finish.
WriteOutcome write_rank_file(const SaveJob& job, int rank, const std::vector<OwnedPiece>& owned,
                             const WriteProgress& progress) {
  WriteOutcome outcome;
  const auto start = Clock::now();
  const std::string path = (job.temporary / rank_file_name(rank)).string();
  try {
    Hdf5QuietErrors quiet;
    Hdf5Handle file = create_checkpoint_file(path);  // a group per tensor: links in an object header
    write_int64_attribute(path, file.get(), kFormatAttribute, 2);
    write_int64_attribute(path, file.get(), "step", job.step);
    write_int64_attribute(path, file.get(), "rank", rank);
    for (size_t i = 0; i < owned.size(); ++i) {
      outcome.crcs.push_back(write_piece(path, file.get(), owned[i], progress));
      outcome.bytes += owned[i].size;
      if (i == owned.size() / 2) crash_if_due(job.step, rank, progress);
    }
    if (owned.empty()) crash_if_due(job.step, rank, progress);
    TESSERA_HDF5_CHECK_AT(path, H5Fflush(file.get(), H5F_SCOPE_GLOBAL));  // errors surface here, not in close
    file.reset();
    fsync_path(path, false);
  } catch (const std::exception& error) {
    outcome.error = "rank " + std::to_string(rank) + " could not write " + path + ": " + message_of(error);
  }
  outcome.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return outcome;
}

std::vector<uint8_t> outcome_bytes(const WriteOutcome& outcome) {
  std::vector<uint8_t> bytes(sizeof(int64_t) + outcome.error.size() + 4 * outcome.crcs.size());
  const int64_t length = int64_t(outcome.error.size());
  std::memcpy(bytes.data(), &length, sizeof length);
  std::memcpy(bytes.data() + sizeof length, outcome.error.data(), outcome.error.size());
  std::memcpy(bytes.data() + sizeof length + outcome.error.size(), outcome.crcs.data(), 4 * outcome.crcs.size());
  return bytes;
}

WriteOutcome outcome_from(const std::vector<uint8_t>& bytes) {
  WriteOutcome outcome;
  int64_t length = 0;
  TESSERA_CHECK(bytes.size() >= sizeof length, "checkpoint: a rank's outcome is truncated");
  std::memcpy(&length, bytes.data(), sizeof length);
  TESSERA_CHECK(length >= 0 && size_t(length) <= bytes.size() - sizeof length,
                "checkpoint: a rank's outcome is corrupt");
  outcome.error.assign(reinterpret_cast<const char*>(bytes.data()) + sizeof length, size_t(length));
  const size_t rest = bytes.size() - sizeof length - size_t(length);
  outcome.crcs.resize(rest / 4);
  std::memcpy(outcome.crcs.data(), bytes.data() + sizeof length + size_t(length), 4 * outcome.crcs.size());
  return outcome;
}

// Phases 1-3, on every rank.
std::unique_ptr<SaveJob> plan_save(parallel::Communicator& world, Context& scratch, const std::string& dir,
                                   int64_t step, const std::vector<TensorPiece>& pieces,
                                   const CheckpointMetadata& metadata, const SaveOptions& options) {
  auto job = std::make_unique<SaveJob>();
  job->save_dir = fs::path(dir);
  job->final_path = job->save_dir / step_directory_name(step);
  job->temporary = job->save_dir / temporary_directory_name(step);
  job->what = "saving checkpoint " + job->final_path.string();
  job->step = step;
  job->keep = options.keep;
  job->metadata = metadata;
  std::exception_ptr local_error;
  const RankInfo mine = describe_pieces(dir, step, pieces, metadata, options, job->what, world.rank(), local_error);
  job->all = gather_descriptors(world, scratch, mine, local_error, job->what);
  job->plans = plan_tensors(job->all, job->what);
  job->needed = checkpoint_file_bytes(job->plans, job->all, options.writers == CheckpointWriters::every_rank);
  return job;
}

// Phase 4: rank 0 prepares the directory; every rank throws its failure.
void prepare_everywhere(parallel::Communicator& world, Context& scratch, const SaveJob& job) {
  std::string failure;
  if (world.rank() == 0) {
    try {
      prepare_save_directory(job.save_dir, job.temporary, job.needed);
    } catch (const std::exception& error) {
      failure = message_of(error);
      std::error_code ignored;
      fs::remove_all(job.temporary, ignored);
    }
  }
  failure = broadcast_outcome(world, scratch, failure);
  TESSERA_CHECK(failure.empty(), job.what, " failed (the previous checkpoint and 'latest' are untouched): ", failure);
}

// Rank 0's index: metadata, every tensor's virtual dataset and piece table
// (the CRCs the ranks computed), the ranks' state blobs; closed and fsynced.
void write_index(const SaveJob& job, const std::vector<WriteOutcome>& outcomes) {
  std::map<std::pair<int, int>, uint32_t> crc_of;  // (rank, piece index) -> CRC
  for (int r = 0; r < int(outcomes.size()); ++r) {
    const std::vector<const PieceInfo*> owned = owned_pieces(job, r);
    TESSERA_CHECK(owned.size() == outcomes[size_t(r)].crcs.size(), job.what, ": rank ", r, " reported ",
                  outcomes[size_t(r)].crcs.size(), " checksums for ", owned.size(), " pieces");
    for (size_t i = 0; i < owned.size(); ++i) crc_of[{r, owned[i]->index}] = outcomes[size_t(r)].crcs[i];
  }
  CheckpointWriter index(job.temporary, job.step, int(job.all.size()), job.metadata, 2);
  for (const TensorPlan& plan : job.plans) {
    std::vector<uint32_t> crcs;
    for (const PieceInfo* piece : plan.owned) {
      const auto found = crc_of.find({piece->rank, piece->index});
      crcs.push_back(found == crc_of.end() ? 0 : found->second);
    }
    index.write_virtual_tensor(plan, crcs);
  }
  for (int r = 0; r < int(job.all.size()); ++r)
    for (const auto& [key, bytes] : job.all[size_t(r)].states) index.write_rank_state(r, key, bytes);
  index.close();
}

// The marker an asynchronous save's rank writes beside its file (below).
std::string marker_name(int rank) {
  return rank_file_name(rank) + ".done";
}

// Rank 0: the index written and the directory published, or the temporary
// removed; the failure (empty: published).
std::string publish_or_abandon(const SaveJob& job, const std::vector<WriteOutcome>& outcomes) {
  std::string failure;
  for (const WriteOutcome& outcome : outcomes)
    if (!outcome.error.empty()) failure += (failure.empty() ? "" : "; ") + outcome.error;
  if (failure.empty()) {
    try {
      for (size_t r = 1; r < outcomes.size(); ++r) fs::remove(job.temporary / marker_name(int(r)));
      write_index(job, outcomes);
    } catch (const std::exception& error) {
      failure =
          "rank 0 could not write the index " + (job.temporary / kCheckpointFile).string() + ": " + message_of(error);
    }
  }
  if (failure.empty()) failure = publish_checkpoint(job.save_dir, job.temporary, job.final_path, job.keep);
  if (!failure.empty()) failure = abandon_checkpoint(job.save_dir, job.temporary, job.needed, failure);
  return failure;
}

// Phase 6: every rank's outcome; rank 0 writes the index and publishes (or
// removes the temporary); every rank returns or throws the same failure.
PublishedCheckpoint publish_everywhere(parallel::Communicator& world, Context& scratch, const SaveJob& job,
                                       const WriteOutcome& mine) {
  const std::vector<std::vector<uint8_t>> gathered = parallel::all_gather_bytes(world, scratch, outcome_bytes(mine));
  std::string failure;
  if (world.rank() == 0) {
    std::vector<WriteOutcome> outcomes;
    for (const std::vector<uint8_t>& bytes : gathered) outcomes.push_back(outcome_from(bytes));
    failure = publish_or_abandon(job, outcomes);
  }
  failure = broadcast_outcome(world, scratch, failure);
  TESSERA_CHECK(failure.empty(), job.what, " failed (the previous checkpoint and 'latest' are untouched): ", failure);
  return PublishedCheckpoint{job.final_path.string(), job.step, mine.bytes, mine.seconds};
}

// Asynchronous saves: each rank's background thread writes its file, then
// (ranks other than 0) a marker `rank_<r>.done` beside it holding its
// outcome (error or CRCs), written atomically. Rank 0's thread, after its own
// file, waits for every marker and then writes the index and publishes, with
// no MPI: a checkpoint is published as soon as the slowest rank's file is on
// disk, even when the main threads are stuck in a collective by then (a hung
// or crashed rank after the save). finish() (collective) hands rank 0 the
// outcomes through MPI too, so a marker that cannot be written (a full disk)
// does not leave rank 0 waiting, then tells every rank how it ended.

// Rank 0's thread: every rank's outcome, from its marker or from finish();
// nothing when cancelled.
struct Collected {
  std::mutex mutex;
  std::condition_variable wake;
  bool cancel = false;
  std::optional<std::vector<WriteOutcome>> from_finish;
};

std::optional<std::vector<WriteOutcome>> collect_outcomes(const SaveJob& job, const WriteOutcome& mine,
                                                          Collected& collected) {
  std::vector<WriteOutcome> outcomes(job.all.size());
  outcomes[0] = mine;
  for (size_t r = 1; r < outcomes.size(); ++r) {
    const fs::path marker = job.temporary / marker_name(int(r));
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(collected.mutex);
        if (collected.cancel) return std::nullopt;
        if (collected.from_finish) return collected.from_finish;
      }
      std::error_code error;
      if (fs::exists(marker, error)) {
        std::ifstream in(marker, std::ios::binary);
        outcomes[r] = outcome_from(std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {}));
        break;
      }
      std::unique_lock<std::mutex> lock(collected.mutex);
      collected.wake.wait_for(lock, std::chrono::milliseconds(5));
    }
  }
  return outcomes;
}

}  // namespace

// ---------------------------------------------------------------------------
// CheckpointSaver

struct CheckpointSaver::State {
  explicit State(parallel::Communicator& group) : world(group) {}

  parallel::Communicator& world;
  Context scratch;               // host buffers of the descriptors and outcomes
  std::unique_ptr<SaveJob> job;  // the asynchronous save not published yet
  std::optional<double> timeout_s;
  std::vector<Tensor> snapshot;  // the host copies the background thread writes from
  HostSnapshot snapshot_copies;  // makes them, through one bounded pinned staging buffer
  std::thread writer;
  std::atomic<bool> own_written{false};  // this rank's file (and marker) written, or failed
  std::atomic<int64_t> written_slabs{0};  // the background writer's progress, for finish()'s heartbeats
  std::atomic<bool> done{false};         // the thread has ended (rank 0: after publishing)
  WriteOutcome outcome;                  // this rank's write, read once own_written
  std::string publication_failure;       // rank 0, read once done
  Collected collected;

  // The background thread of `rank`.
  void run(int rank, const std::vector<OwnedPiece>& owned) {
    outcome = write_rank_file(*job, rank, owned, [this] { written_slabs.fetch_add(1, std::memory_order_relaxed); });
    if (rank != 0) {
      try {
        write_file_atomically(job->temporary / marker_name(rank), [&] {
          const std::vector<uint8_t> bytes = outcome_bytes(outcome);
          return std::string(bytes.begin(), bytes.end());
        }());
      } catch (const std::exception& error) {
        if (outcome.error.empty())
          outcome.error = "rank " + std::to_string(rank) + " could not write its marker in " + job->temporary.string() +
                          ": " + message_of(error);
      }
    }
    own_written.store(true, std::memory_order_release);
    if (rank == 0) {
      const std::optional<std::vector<WriteOutcome>> outcomes = collect_outcomes(*job, outcome, collected);
      if (outcomes) publication_failure = publish_or_abandon(*job, *outcomes);
    }
    done.store(true, std::memory_order_release);
  }

  void cancel_and_join() {
    {
      std::lock_guard<std::mutex> lock(collected.mutex);
      collected.cancel = true;
    }
    collected.wake.notify_all();
    if (writer.joinable()) writer.join();
  }
};

CheckpointSaver::CheckpointSaver(parallel::Communicator& world) : state_(std::make_unique<State>(world)) {}

CheckpointSaver::~CheckpointSaver() {
  state_->cancel_and_join();
}

bool CheckpointSaver::pending() const {
  return state_->job != nullptr;
}

bool CheckpointSaver::written() const {
  return !pending() || state_->done.load(std::memory_order_acquire);
}

bool CheckpointSaver::write_failed() const {
  return pending() && state_->own_written.load(std::memory_order_acquire) && !state_->outcome.error.empty();
}

std::optional<PublishedCheckpoint> CheckpointSaver::save(const std::string& dir, int64_t step,
                                                         const std::vector<TensorPiece>& pieces,
                                                         const CheckpointMetadata& metadata, const SaveOptions& options,
                                                         bool async) {
  State& s = *state_;
  if (pending()) finish();
  parallel::Communicator& world = s.world;
  const int rank = world.rank();
  // Every rank waits for the slowest writer: the save has its own deadline.
  std::optional<parallel::ScopedTimeout> deadline;
  if (options.timeout_s) deadline.emplace(world, *options.timeout_s, "--save-timeout", true);
  const auto start = Clock::now();
  std::unique_ptr<SaveJob> job = plan_save(world, s.scratch, dir, step, pieces, metadata, options);

  if (options.writers == CheckpointWriters::rank_zero) {
    const WritingActivity writing(world, rank == 0, step);
    PublishedCheckpoint published{save_gathered(world, s.scratch, *job, pieces), step, 0, 0.0};
    for (const PieceInfo* piece : owned_pieces(*job, rank))
      published.bytes += piece->local.numel() * int64_t(dtype_size(piece->dtype));
    published.write_seconds = std::chrono::duration<double>(Clock::now() - start).count();
    return published;
  }
  prepare_everywhere(world, s.scratch, *job);
  // The bytes each owned piece is written from: host copies made now when
  // the save is asynchronous (training overwrites the pieces next) or the
  // piece lives on a device; a host piece of a synchronous save in place.
  const std::vector<const PieceInfo*> mine = owned_pieces(*job, rank);
  std::vector<Tensor> to_copy;
  for (const PieceInfo* info : mine)
    if (async || pieces[size_t(info->index)].local.device().is_accelerator())
      to_copy.push_back(pieces[size_t(info->index)].local);
  std::vector<Tensor> held = s.snapshot_copies.copy(to_copy);
  std::vector<OwnedPiece> owned;
  for (size_t i = 0, copied = 0; i < mine.size(); ++i) {
    const Tensor& local = pieces[size_t(mine[i]->index)].local;
    const bool copy = async || local.device().is_accelerator();
    const Tensor& source = copy ? held[copied++] : local;
    owned.push_back({mine[i], static_cast<const std::byte*>(source.data_ptr()), int64_t(local.nbytes())});
  }
  if (!async) {
    WriteOutcome outcome;
    {
      const WritingActivity writing(world, true, step);
      outcome = write_rank_file(*job, rank, owned, [&world] { world.heartbeat(); });
    }
    return publish_everywhere(world, s.scratch, *job, outcome);
  }
  s.timeout_s = options.timeout_s;
  s.snapshot = std::move(held);
  s.own_written.store(false, std::memory_order_release);
  s.done.store(false, std::memory_order_release);
  s.outcome = WriteOutcome{};
  s.publication_failure.clear();
  s.collected.cancel = false;
  s.collected.from_finish.reset();
  s.job = std::move(job);
  s.writer = std::thread([&s, rank, owned = std::move(owned)] { s.run(rank, owned); });
  return std::nullopt;
}

PublishedCheckpoint CheckpointSaver::finish() {
  State& s = *state_;
  TESSERA_CHECK(pending(), "CheckpointSaver::finish: no asynchronous save is pending");
  parallel::Communicator& world = s.world;
  std::optional<parallel::ScopedTimeout> deadline;
  if (s.timeout_s) deadline.emplace(world, *s.timeout_s, "--save-timeout", true);
  {
    const WritingActivity writing(world, !s.own_written.load(std::memory_order_acquire), s.job->step);
    // This rank's own write: a heartbeat for the others whenever its writer has made progress (a stuck writer
    // then shows no sign of life, and the others name it within --comm-timeout).
    int64_t seen = -1;
    while (!s.own_written.load(std::memory_order_acquire)) {
      if (const int64_t slabs = s.written_slabs.load(std::memory_order_relaxed); slabs != seen) {
        world.heartbeat();
        seen = slabs;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (world.rank() != 0) s.writer.join();
  }
  // Every rank's outcome to rank 0's thread (which may have them from the markers already).
  const std::vector<std::vector<uint8_t>> gathered =
      parallel::all_gather_bytes(world, s.scratch, outcome_bytes(s.outcome));
  if (world.rank() == 0) {
    {
      std::lock_guard<std::mutex> lock(s.collected.mutex);
      std::vector<WriteOutcome> outcomes;
      for (const std::vector<uint8_t>& bytes : gathered) outcomes.push_back(outcome_from(bytes));
      s.collected.from_finish = std::move(outcomes);
    }
    s.collected.wake.notify_all();
    s.writer.join();
  }
  s.snapshot.clear();
  const std::unique_ptr<SaveJob> job = std::move(s.job);
  const std::string failure = broadcast_outcome(world, s.scratch, s.publication_failure);
  TESSERA_CHECK(failure.empty(), job->what, " failed (the previous checkpoint and 'latest' are untouched): ", failure);
  return PublishedCheckpoint{job->final_path.string(), job->step, s.outcome.bytes, s.outcome.seconds};
}

std::string save_checkpoint(parallel::Communicator& world, const std::string& dir, int64_t step,
                            const std::vector<TensorPiece>& pieces, const CheckpointMetadata& metadata,
                            const SaveOptions& options) {
  CheckpointSaver saver(world);
  return saver.save(dir, step, pieces, metadata, options, false)->path;
}

}  // namespace tessera::io

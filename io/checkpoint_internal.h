// The parts of a checkpoint that its files share (io/checkpoint*.cpp): the
// file layout's names, the runs that place a piece in its tensor, the
// descriptors of the pieces every rank holds, a save's plan, and the HDF5
// writers. Internal to io/: the interface is io/checkpoint.h.
//
//   checkpoint_files.cpp    directory names, POSIX durability, atomic publish,
//                           keep-K retention, free space, `latest`
//   checkpoint_layout.cpp   where a piece lies in its tensor (runs), scatter and
//                           gather, the pieces' checks, shard slices
//   checkpoint_plan.cpp     the phases every save shares: descriptors, their
//                           all-gather, each tensor's plan and coverage check
//   checkpoint_writer.cpp   checksums, dtypes in HDF5, the index/file writer
//   checkpoint.cpp          the rank_zero save (format 1: gather, one file)
//   checkpoint_sharded.cpp  the every_rank save (format 2: a file per rank,
//                           an index of virtual datasets), CheckpointSaver
//                           (asynchronous saves), save_checkpoint
//   checkpoint_reader.cpp   CheckpointReader: formats 1 and 2, checksums, slices
#pragma once

#include <hdf5.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "io/checkpoint.h"
#include "io/hdf5_file.h"

namespace tessera::io::checkpoint_detail {

namespace fs = std::filesystem;

inline constexpr const char* kCheckpointFile = "checkpoint.h5";
inline constexpr const char* kLatestFile = "latest";
inline constexpr const char* kFormatAttribute = "tessera_checkpoint_format";
inline constexpr const char* kDtypeAttribute = "tessera_dtype";
inline constexpr const char* kCrcAttribute = "crc32";
inline constexpr const char* kPiecesAttribute = "tessera_pieces";  // format 2: a tensor's stored pieces

// --- checkpoint_files.cpp ---------------------------------------------------
std::string step_directory_name(int64_t step);      // "step_00000042"
std::optional<int64_t> parse_step_name(std::string_view name);  // the step of "step_<digits>"
bool is_temporary_name(std::string_view name);     // ".step_<anything>.tmp"
std::string temporary_directory_name(int64_t step);  // ".step_00000042.tmp": a save before it is published
struct StepDirectory {
  int64_t step;
  fs::path path;
};
// The published checkpoints of `dir` (step_* directories holding the file), oldest first.
std::vector<StepDirectory> list_step_directories(const fs::path& dir);
std::string read_latest_name(const fs::path& dir);
std::string errno_text(int error);
void fsync_path(const fs::path& path, bool directory);  // throws naming the path
void rename_path(const fs::path& from, const fs::path& to);
// Writes `text` to `path` atomically: `path`.tmp, fsync, rename, fsync of the directory.
void write_file_atomically(const fs::path& path, const std::string& text);
void remove_stale_temporaries(const fs::path& dir);  // `.step_*.tmp` left by crashed saves
void publish_directory(const fs::path& temporary, const fs::path& final_path);
void prune(const fs::path& dir, int keep, const std::string& latest);  // keep-K and the one `latest` names
std::vector<std::string> other_checkpoints(const fs::path& save_dir, const fs::path& except);
// What to tell a user whose checkpoint in `directory` is corrupt: the newest other one to resume from.
std::string corrupt_advice(const fs::path& directory);
std::string no_room_message(const fs::path& save_dir, int64_t needed, bool while_writing);
bool has_room(const fs::path& save_dir, int64_t needed);
// Rank 0 before any rank writes: `save_dir` created, stale temporaries
// removed, room for `needed` bytes checked, `temporary` created (throws).
void prepare_save_directory(const fs::path& save_dir, const fs::path& temporary, int64_t needed);
// Rank 0 after every file is written and fsynced: `temporary` fsynced and
// renamed to `final_path`, `latest` pointed at it, keep-K applied. Returns
// the failure (empty: published).
std::string publish_checkpoint(const fs::path& save_dir, const fs::path& temporary, const fs::path& final_path,
                               int keep);
// After a failed save: `temporary` removed; returns `failure`, a full disk said first.
std::string abandon_checkpoint(const fs::path& save_dir, const fs::path& temporary, int64_t needed,
                               std::string failure);

// --- checkpoint_layout.cpp --------------------------------------------------
// Where a piece lies in its tensor: runs of consecutive elements in both
// row-major flattenings, elements [piece, piece + count) of the piece being
// elements [global, global + count) of the tensor. A piece's runs follow one
// another in the piece (the first at 0, each starting where the previous one
// ends) and two runs are never contiguous in the tensor too (they are merged).
struct Run {
  int64_t global = 0, piece = 0, count = 0;
};

struct PieceLayout {
  std::vector<Run> runs;  // empty for an empty piece
  int64_t numel = 0;      // the piece's elements
  // dim_range: the shape that is cut (the view or the global shape) and the
  // indices [begin, begin + count) along the slice's dim that the (whole)
  // shard spans.
  Shape cut;
  int64_t count = 0;

  bool contiguous() const { return runs.size() <= 1; }
};

// Checks a piece against its tensor and returns its layout; throws naming the
// tensor and `what` (the operation) when it does not fit.
PieceLayout piece_layout(const std::string& name, const Shape& global, const TensorSlice& slice,
                         const Shape& local_shape, const std::string& what);
// Copies a piece's elements into their places in the whole tensor, and back.
void scatter_runs(const std::vector<Run>& runs, size_t element_size, const std::byte* piece, std::byte* whole);
void gather_runs(const std::vector<Run>& runs, size_t element_size, const std::byte* whole, std::byte* piece);
void check_tensor_name(const std::string& name, const std::string& what);
void check_piece_local(const TensorPiece& piece, const std::string& what);
// A host pointer to `tensor`'s bytes, copying from a device into `staging` when needed.
const std::byte* host_bytes(const Tensor& tensor, Tensor& staging);
// An exception's message without tessera::Error's context lines (for wrapping).
std::string message_of(const std::exception& error);

// --- checkpoint_plan.cpp: what every rank holds, and each tensor's plan ---
struct PieceInfo {
  std::string name;
  DType dtype = DType::f32;
  Shape global;
  TensorSlice slice;
  Shape local;
  bool owner = true;
  int rank = 0;
  int index = 0;  // in that rank's `pieces`
};

struct TensorPlan {
  std::string name;
  Shape shape;
  DType dtype = DType::f32;
  std::vector<const PieceInfo*> owned;  // in (rank, index) order
};

struct RankInfo {
  std::string error;  // non-empty: this rank's pieces are unusable
  std::vector<PieceInfo> pieces;
  std::vector<std::pair<std::string, std::vector<uint8_t>>> states;  // rank_state blobs (keys sorted)
};

// One save as every rank sees it after phases 1-3 (the same on every rank).
// Not copyable: the plans point into `all`.
struct SaveJob {
  std::string what;  // "saving checkpoint DIR/step_N", the start of every error
  fs::path save_dir, final_path, temporary;
  int64_t step = 0;
  int keep = 0;
  int64_t needed = 0;  // bytes on disk, estimated (checkpoint_file_bytes)
  CheckpointMetadata metadata;
  std::vector<RankInfo> all;      // every rank's descriptors, by world rank
  std::vector<TensorPlan> plans;  // every tensor, by name

  SaveJob() = default;
  SaveJob(const SaveJob&) = delete;
  SaveJob& operator=(const SaveJob&) = delete;
};

// Phase 1: this rank's pieces and rank states described (or the error that
// stops every rank: `local_error` holds it, the descriptor its message).
RankInfo describe_pieces(const std::string& dir, int64_t step, const std::vector<TensorPiece>& pieces,
                         const CheckpointMetadata& metadata, const SaveOptions& options, const std::string& what,
                         int rank, std::exception_ptr& local_error);
// Phase 2: every rank's descriptors; all ranks stop together on any rank's error.
std::vector<RankInfo> gather_descriptors(parallel::Communicator& world, Context& scratch, const RankInfo& mine,
                                         const std::exception_ptr& local_error, const std::string& what);
// Phase 3: shapes agree and every tensor is owned exactly once (same verdict on every rank).
std::vector<TensorPlan> plan_tensors(const std::vector<RankInfo>& ranks, const std::string& what);
// Rank 0's `failure` (empty: success), on every rank.
std::string broadcast_outcome(parallel::Communicator& world, Context& scratch, const std::string& failure);
// A writer's sign of life between slabs (parallel::Communicator::heartbeat
// on the thread that communicates; a timestamp for a background writer).
using WriteProgress = std::function<void()>;
// The slow_checkpoint, checkpoint_hang and checkpoint_crash faults of
// TESSERA_FAULT, at a writer's midpoint (a slow write still makes progress).
void crash_if_due(int64_t step, int rank, const WriteProgress& progress);
// Bytes a checkpoint of `plans` and the ranks' state will take on disk.
int64_t checkpoint_file_bytes(const std::vector<TensorPlan>& plans, const std::vector<RankInfo>& all, bool sharded);

// The rank's "writing checkpoint step N" for the others' deadline reports,
// for the life of this object.
class WritingActivity {
 public:
  WritingActivity(parallel::Communicator& world, bool writer, int64_t step) : world_(world), writer_(writer) {
    if (writer_) world_.set_activity(parallel::RankActivity::writing_checkpoint, step);
  }
  ~WritingActivity() {
    if (writer_) world_.set_activity(parallel::RankActivity::none, 0);
  }
  WritingActivity(const WritingActivity&) = delete;
  WritingActivity& operator=(const WritingActivity&) = delete;

 private:
  parallel::Communicator& world_;
  bool writer_;
};

// --- checkpoint.cpp ---------------------------------------------------------
// The rank_zero save's data phases (gather to rank 0, one file, publish);
// returns the path or throws on every rank.
std::string save_gathered(parallel::Communicator& world, Context& scratch, const SaveJob& job,
                          const std::vector<TensorPiece>& pieces);

// --- checkpoint_sharded.cpp -------------------------------------------------
std::string rank_file_name(int rank);                                  // "rank_00003.h5"
std::string piece_dataset_name(const std::string& tensor, int index);  // "tensors/<tensor>/<index>" in it
// A stored piece as the index lists it (one row of kPiecesAttribute).
struct StoredPiece {
  int rank = 0, index = 0;  // which rank file and which dataset in it
  uint32_t crc32 = 0;       // of the piece's bytes
  TensorSlice slice;
  Shape local;
};
inline constexpr int kPieceRowLength = 11 + 2 * Shape::kMaxDims;
std::vector<int64_t> piece_row(const StoredPiece& piece);
StoredPiece piece_from_row(const int64_t* row);

// --- checkpoint_writer.cpp ---------------------------------------------------
uint32_t crc32_of(const void* data, size_t bytes);
hid_t file_type_of(DType dtype);
hid_t memory_type_of(DType dtype);
H5T_class_t type_class_of(DType dtype);
Hdf5Handle group_handle(hid_t id);  // closes with H5Gclose
Hdf5Handle create_checkpoint_file(const std::string& path);  // a new file (exclusive) in HDF5's 1.8+ format

// The checkpoint file (rank 0) in the temporary directory: metadata, tensors
// whole with dtype and CRC attributes (format 1) or as virtual datasets over
// the rank files with their pieces' table (format 2), the ranks' state blobs.
class CheckpointWriter {
 public:
  CheckpointWriter(const fs::path& directory, int64_t step, int ranks, const CheckpointMetadata& metadata,
                   int64_t format);
  const std::string& path() const { return path_; }
  void write_tensor(const TensorPlan& plan, const void* bytes);
  // Format 2: the tensor as a virtual dataset mapping each owned piece's
  // elements to its dataset in its rank's file; `crcs[i]` is owned[i]'s.
  void write_virtual_tensor(const TensorPlan& plan, const std::vector<uint32_t>& crcs);
  void write_rank_state(int rank, const std::string& key, const std::vector<uint8_t>& bytes);
  // Flushes and closes the file, then fsyncs it.
  void close();

 private:
  std::string path_;
  Hdf5Handle file_, tensors_, ranks_, rank_group_;
  int rank_group_rank_ = -1;
};

}  // namespace tessera::io::checkpoint_detail

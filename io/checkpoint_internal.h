// The parts of a checkpoint that its four files share (io/checkpoint*.cpp):
// the file layout's names, the runs that place a piece in its tensor, the
// descriptors of the pieces every rank holds, and the HDF5 writer. Internal
// to io/: the interface is io/checkpoint.h.
//
//   checkpoint_files.cpp    directory names, POSIX durability, atomic publish,
//                           keep-K retention, free space, `latest`
//   checkpoint_layout.cpp   where a piece lies in its tensor (runs), scatter and
//                           gather, the pieces' checks, shard slices
//   checkpoint_writer.cpp   checksums, dtypes in HDF5, the writer (rank 0)
//   checkpoint.cpp          save_checkpoint in phases (see there)
//   checkpoint_reader.cpp   CheckpointReader: format, checksums, slices
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

// --- checkpoint.cpp: what every rank holds, and each tensor's plan ----------
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

// --- checkpoint_writer.cpp ---------------------------------------------------
uint32_t crc32_of(const void* data, size_t bytes);
hid_t file_type_of(DType dtype);
hid_t memory_type_of(DType dtype);
H5T_class_t type_class_of(DType dtype);
Hdf5Handle group_handle(hid_t id);  // closes with H5Gclose

// The checkpoint file (rank 0) in the temporary directory: metadata, tensors
// whole with dtype and CRC attributes, the ranks' state blobs.
class CheckpointWriter {
 public:
  CheckpointWriter(const fs::path& directory, int64_t step, int ranks, const CheckpointMetadata& metadata);
  const std::string& path() const { return path_; }
  void write_tensor(const TensorPlan& plan, const void* bytes);
  void write_rank_state(int rank, const std::string& key, const std::vector<uint8_t>& bytes);
  // Flushes and closes the file, then fsyncs it.
  void close();

 private:
  std::string path_;
  Hdf5Handle file_, tensors_, ranks_, rank_group_;
  int rank_group_rank_ = -1;
};

}  // namespace tessera::io::checkpoint_detail

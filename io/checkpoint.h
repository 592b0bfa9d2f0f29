// Checkpoints: one directory per step, `DIR/step_00000100/`, in which every
// logical tensor (a parameter, an optimizer moment, a master weight) is
// readable WHOLE under its name with its global shape and CRC-32 checksums,
// plus the run's metadata (step, config, the layout it was saved under,
// data-sampler position, scheduler and loss-scaler state, each rank's RNG
// state) as attributes and small datasets. Because tensors are whole, any
// layout reads back its own slices: resharding (dp, ZeRO, tp, pp and their
// combinations) is a read with another slice description.
//
// Two ways to write (SaveOptions::writers, io/README.md has the formats):
//   every_rank (format 2, the default): each rank writes the elements it owns
//     into its own file `rank_<r>.h5` in the step directory, in parallel,
//     with a CRC per piece; rank 0 then writes `checkpoint.h5`, an index in
//     which each tensor is an HDF5 virtual dataset stitching the ranks'
//     pieces into the whole tensor (so h5py, h5dump and HDF5 tools read it
//     whole), and the table of pieces the reader uses to read only what a
//     rank needs. No gather: no rank holds more than it owns. Needs a save
//     directory every rank can write (a shared filesystem across nodes).
//     With CheckpointSaver it can run asynchronously: the pieces are copied
//     to host memory and a background thread writes them.
//   rank_zero (format 1): the owners send their pieces to world rank 0,
//     which assembles each tensor in host memory and writes one
//     self-contained file (for save directories only rank 0's node sees).
//
// Atomic publish: the directory is written as `DIR/.step_00000100.tmp`,
// every file fsynced, renamed to `step_00000100`, the parent fsynced, and
// only then the text file `DIR/latest` (the directory's name) replaced
// atomically (write `latest.tmp`, fsync, rename). A crash at any moment
// leaves the previous checkpoint intact and `latest` naming a complete one.
// The last `keep` checkpoints are kept.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "nn/parameter.h"
#include "parallel/communicator.h"

namespace tessera::io {

// The newest format this build reads and writes (2: a file per rank and an
// index; 1, one file written by rank 0, is still written and read).
inline constexpr int64_t kCheckpointFormat = 2;

// Which part of a logical tensor `local` holds. Five forms (examples on a
// tensor W), each built by a helper or the constructor {kind, begin, dim}:
//
//   whole        TensorSlice{}
//                local: any shape with W's number of elements.
//   flat_range   TensorSlice::flat(12)  (or {Kind::flat_range, 12})
//                elements [12, 12 + local.numel()) of W's row-major
//                flattening (local: any shape, usually [n]): a ZeRO shard
//                of an unsplit tensor.
//   dim_range    TensorSlice::along(1, 4)  (or {Kind::dim_range, 4, 1})
//                W [6, 10, 3], local [6, 3, 3]: indices [4, 7) along
//                dimension 1, everything along the others (a column- or
//                row-parallel weight). Without a view the local tensor has
//                W's dimensions, equal except along `dim`, and the count
//                along `dim` is local.size(dim).
//   dim_range    TensorSlice::along(1, 8, Shape{3, 16, 64 * 1024})
//   with a view  W the fused QKV weight [3·1024, 1024] = [3·H·Dh, C] with
//                H = 16 heads of Dh = 64, viewed row-major as [3, H, Dh·C]
//                and cut along the heads: heads [8, 16) of Q, K and V (the
//                second of two tensor-parallel ranks). The local tensor may
//                have any shape (e.g. [3·8·64, 1024]) holding
//                view.numel() / view[dim] · count elements; the count along
//                `dim` is derived from local.numel() (refused if it does not
//                divide). view.numel() must equal W's. An explicit view equal
//                to W's shape is the plain dim_range with a free local shape.
//   dim_range    TensorSlice::along(1, 8, Shape{3, 16, 64 * 1024}).with_sub_range(1000, 8)
//   sub-range    the same shard of 8 heads (shard_length 8 indices along
//                `dim`: 3·8·64·1024 elements), of which `local` holds the
//                elements [1000, 1000 + local.numel()) of the shard's own
//                row-major flattening (ZeRO-1 over a tensor-parallel shard:
//                optimizer state of a contiguous range of the local
//                parameter). `local` may have any shape. Works with or
//                without a view.
//
// The element mapping of dim_range (view, dim, begin, count) is that of
// nn::ParameterShard{global_shape, true, view, dim, begin, count} and
// nn::shard_runs; shard_slice() below builds the slice of a parameter's
// shard. `view`, `sub_range`, `sub_begin` and `shard_length` belong to
// dim_range only and must keep their defaults for the other kinds.
struct TensorSlice {
  enum class Kind {
    whole,       // the whole tensor
    flat_range,  // elements [begin, begin + local.numel()) of the row-major flattening (ZeRO shards)
    dim_range,   // indices [begin, begin + count) along `dim` of `view` (or the global shape), everything along the
                 // others (tensor parallelism); optionally only a sub-range of that shard's flattening
  };
  Kind kind = Kind::whole;
  int64_t begin = 0;
  int dim = 0;
  Shape view;                // dim_range: the tensor seen row-major as this shape (empty: the global shape)
  bool sub_range = false;    // dim_range: local holds elements [sub_begin, sub_begin + local.numel()) of the shard
  int64_t sub_begin = 0;     //   (the shard's row-major flattening), the shard being
  int64_t shard_length = 0;  //   indices [begin, begin + shard_length) along `dim`

  TensorSlice() = default;
  TensorSlice(Kind slice_kind, int64_t slice_begin = 0, int slice_dim = 0)
      : kind(slice_kind), begin(slice_begin), dim(slice_dim) {}

  static TensorSlice flat(int64_t flat_begin) { return {Kind::flat_range, flat_begin}; }
  static TensorSlice along(int along_dim, int64_t dim_begin, Shape dim_view = {}) {
    TensorSlice slice(Kind::dim_range, dim_begin, along_dim);
    slice.view = dim_view;
    return slice;
  }
  // This dim_range slice as a shard of `length` indices along `dim`, of which
  // the piece holds elements [first, first + local.numel()).
  TensorSlice with_sub_range(int64_t first, int64_t length) const {
    TensorSlice slice = *this;
    slice.sub_range = true;
    slice.sub_begin = first;
    slice.shard_length = length;
    return slice;
  }
};

// The slice of a parameter's shard (whole when !shard.split, else dim_range
// along shard.dim with the view shard.cut_shape(), so any local shape with
// shard.local_numel() elements fits) ...
TensorSlice shard_slice(const nn::ParameterShard& shard);
// ... and of elements [sub_begin, sub_begin + local.numel()) of that shard's
// row-major flattening (flat_range when !shard.split, else dim_range with a
// sub-range): a ZeRO range of the shard's optimizer state.
TensorSlice shard_slice(const nn::ParameterShard& shard, int64_t sub_begin);

// A piece of a logical tensor on this rank. For saving, `owner` says this
// rank writes it (exactly one owner per element across the job); for
// loading, every rank reads every piece it lists.
struct TensorPiece {
  std::string name;          // e.g. "blocks.0.attn.qkv.weight", "blocks.0.attn.qkv.weight.exp_avg"
  Shape global_shape;        // the logical tensor's shape
  DType dtype = DType::f32;  // the stored dtype (the local tensor's)
  TensorSlice slice;
  Tensor local;  // on any device; copied through the host
  bool owner = true;
};

// Metadata: string key/value pairs stored as attributes of the /metadata
// group (apart from the format's own root attributes; io/README.md). The trainer
// stores its config (one key per flag), the layout ("dp", "tp", "pp", "zero"),
// the step, the sampler position, scheduler and loss-scaler state.
using CheckpointMetadata = std::map<std::string, std::string>;

// Who writes the data (see the top of this file).
enum class CheckpointWriters {
  every_rank,  // format 2: each rank its own file, rank 0 the index (parallel; may be asynchronous)
  rank_zero,   // format 1: everything gathered to world rank 0, one file
};

struct SaveOptions {
  int keep = 0;  // keep the newest `keep` checkpoints (0: keep all)
  CheckpointWriters writers = CheckpointWriters::every_rank;
  // Per-rank blobs (e.g. RNG states), gathered and stored as
  // /ranks/<world rank>/<key>; every rank passes its own.
  std::map<std::string, std::vector<uint8_t>> rank_state;
  // The deadline of the save's communication (every rank waits for the
  // slowest writer) in seconds, in place of the communicator's own for the save's
  // duration (--save-timeout; 0: none); unset keeps the communicator's.
  std::optional<double> timeout_s;
};

// Collective over `world`: writes DIR/step_<step> atomically and updates
// DIR/latest; returns the checkpoint's path (on every rank). Throws
// tessera::Error naming the directory (and the rank and file that failed) on
// any failure, leaving the previous checkpoint and `latest` untouched.
std::string save_checkpoint(parallel::Communicator& world, const std::string& dir, int64_t step,
                            const std::vector<TensorPiece>& pieces, const CheckpointMetadata& metadata,
                            const SaveOptions& options = {});

// What a published save wrote, as this rank saw it.
struct PublishedCheckpoint {
  std::string path;  // DIR/step_N
  int64_t step = 0;
  int64_t bytes = 0;           // tensor bytes this rank wrote (every_rank) or owned (rank_zero)
  double write_seconds = 0.0;  // this rank's write of its file (every_rank), or the whole save (rank_zero)
};

// Saves, synchronously or asynchronously, one at a time. An asynchronous
// save (every_rank writers only) costs the step loop the descriptors'
// all-gather and a copy of what this rank owns into host memory (pinned for
// device tensors): that copy is the memory cost, held until the rank's file
// is written. A background thread writes the file (no MPI on it: MPI runs
// with MPI_THREAD_FUNNELED); publishing (rank 0's index, the rename,
// `latest`) happens in finish(), collective, which the caller runs when
// every rank's write has ended (written() everywhere, e.g. agreed in an
// all-reduce it already does each step) or any failed, and before the next
// save, the end of training or an exit on a signal. Until then `latest`
// names the previous checkpoint. The destructor waits for a running write
// but publishes nothing (the next save removes the leftover temporary).
class CheckpointSaver {
 public:
  explicit CheckpointSaver(parallel::Communicator& world);
  ~CheckpointSaver();
  CheckpointSaver(const CheckpointSaver&) = delete;
  CheckpointSaver& operator=(const CheckpointSaver&) = delete;

  // Collective. Publishes a pending save first. Synchronous (`async` false,
  // or rank_zero writers): returns the published checkpoint. Asynchronous:
  // returns nothing once this rank's pieces are copied; pending() is true.
  // Throws (every rank) as save_checkpoint does.
  std::optional<PublishedCheckpoint> save(const std::string& dir, int64_t step, const std::vector<TensorPiece>& pieces,
                                          const CheckpointMetadata& metadata, const SaveOptions& options = {},
                                          bool async = false);
  bool pending() const;  // an asynchronous save not published yet
  // Local, no communication: this rank's background write has ended
  // (true when nothing is pending) ...
  bool written() const;
  // ... and ended with an error (the file and the reason are in finish()'s error).
  bool write_failed() const;
  // Collective (every rank, while pending()): waits for this rank's write,
  // learns every rank's outcome, and rank 0 writes the index and publishes.
  // Returns what was published; throws on every rank naming the rank(s) and
  // file(s) that failed, the previous checkpoint and `latest` untouched.
  PublishedCheckpoint finish();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// Creates the save directory `dir` if needed and writes (then removes) a
// probe file in it, so a run finds out at its start, not at its first
// checkpoint hours later, that checkpoints cannot go there. Throws
// tessera::Error naming the directory, the reason and the flag.
void check_save_directory(const std::string& dir);

// The newest complete checkpoint in `dir` (following `latest`, falling back
// to the highest step_* directory if `latest` is missing or names a missing
// directory), or nothing if there is none.
std::optional<std::string> find_latest_checkpoint(const std::string& dir);

// What a command given PATH reads: PATH itself when it is a checkpoint (a
// step directory or its checkpoint.h5), else the newest checkpoint of the
// save directory PATH. Throws naming PATH (`command` starts the message)
// when it does not exist or holds no checkpoint.
std::string resolve_checkpoint(const std::string& path, const std::string& command);

// Whether `path` is a checkpoint or a save directory: a directory holding a
// checkpoint.h5 or checkpoints (step_*, `latest`), or an HDF5 file of
// Tessera's checkpoint format. For messages to a user who named one where
// something else (a dataset) was asked for.
bool is_checkpoint(const std::string& path);

// The complete checkpoints in `dir` (step_* directories holding their HDF5
// file), oldest step first; empty if there are none or `dir` does not exist.
std::vector<std::string> list_checkpoints(const std::string& dir);

struct StoredTensor {
  std::string name;
  Shape shape;
  DType dtype;
  uint32_t crc32 = 0;  // format 1: of the whole tensor
  int pieces = 1;      // format 2: stored pieces (each with its CRC-32 and rank file); format 1: 1
};

// Reads a checkpoint directory (or its HDF5 file). Opening validates the
// format; reads verify each tensor's checksum and throw naming the tensor and
// the file on a mismatch.
class CheckpointReader {
 public:
  explicit CheckpointReader(const std::string& path);
  ~CheckpointReader();
  CheckpointReader(const CheckpointReader&) = delete;
  CheckpointReader& operator=(const CheckpointReader&) = delete;

  const std::string& path() const;
  int64_t step() const;
  const CheckpointMetadata& metadata() const;
  const std::vector<StoredTensor>& tensors() const;
  bool has_tensor(const std::string& name) const;
  int ranks_saved() const;  // world size of the run that saved it
  int64_t format() const;   // 1: one file written by rank 0; 2: a file per rank and an index
  std::optional<std::vector<uint8_t>> rank_state(int world_rank, const std::string& key) const;
  std::vector<std::string> rank_state_keys(int world_rank) const;  // sorted; empty if that rank stored none

  // Fills piece.local (allocated by the caller, on any device, with as many
  // elements as the slice holds: see TensorSlice) with its slice of the
  // stored tensor, converting nothing: dtype and global shape must match,
  // else a clear error. Format 2 reads only the stored pieces that overlap
  // the slice (each whole, its checksum verified): a rank resuming under the
  // layout that saved reads just its own pieces. Format 1 reads the whole
  // tensor and verifies its checksum. What was read is kept for the current
  // tensor (format 1: the tensor; format 2: the pieces read), so consecutive
  // reads of pieces of one tensor (several shards or sub-ranges of it listed
  // one after another) read and check it once; reading another tensor
  // replaces it, destroying the reader frees it, a failed check caches
  // nothing. Not for concurrent use from several threads.
  void read(TensorPiece& piece) const;
  // Recomputes every tensor's checksum; returns the names that do not match
  // (and those whose HDF5 header is damaged, see damaged()).
  std::vector<std::string> verify() const;
  // Tensors whose HDF5 header (dataset, attributes) cannot be read: name and
  // HDF5's innermost complaint. They are not in tensors(); read() of one
  // says it is damaged. Damage to the file's structure (root attributes, the
  // metadata, the list of tensors) is an error of the constructor instead,
  // naming the part and what to resume from.
  const std::vector<std::pair<std::string, std::string>>& damaged() const;

 private:
  struct State;
  State* state_;
};

}  // namespace tessera::io

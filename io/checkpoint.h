// Checkpoints: one directory per step, `DIR/step_00000100/`, holding one HDF5
// file in which every logical tensor (a parameter, an optimizer moment, a
// master weight) is stored WHOLE under its name with its global shape and a
// CRC-32 checksum, plus the run's metadata (step, config, the layout it was
// saved under, data-sampler position, scheduler and loss-scaler state, each
// rank's RNG state) as attributes and small datasets. Because tensors are
// stored whole, any layout reads back its own slices: resharding (dp, ZeRO,
// later tp and pp) is a read with another slice description.
//
// Writing is collective and gathers to one writer (world rank 0): each rank
// sends the pieces it owns (one owner per piece: replicas are written once)
// and rank 0 assembles each logical tensor in host memory and writes it.
// This works with the serial HDF5 Debian ships and keeps one self-contained
// file; its cost is one tensor at a time in rank 0's memory and rank 0's
// write bandwidth (fine at the model sizes a CPU cluster trains; parallel HDF5
// hyperslab writes are the way up).
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
#include <optional>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "parallel/communicator.h"

namespace tessera::io {

inline constexpr int64_t kCheckpointFormat = 1;

// Which part of a logical tensor `local` holds.
struct TensorSlice {
  enum class Kind {
    whole,       // the whole tensor
    flat_range,  // elements [begin, begin + local.numel()) of the row-major flattening (ZeRO shards)
    dim_range,   // indices [begin, begin + local.size(dim)) along `dim`, everything along the others (tensor
                 // parallelism)
  };
  Kind kind = Kind::whole;
  int64_t begin = 0;
  int dim = 0;
};

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

struct SaveOptions {
  int keep = 0;  // keep the newest `keep` checkpoints (0: keep all)
  // Per-rank blobs (e.g. RNG states), gathered and stored as
  // /ranks/<world rank>/<key>; every rank passes its own.
  std::map<std::string, std::vector<uint8_t>> rank_state;
};

// Collective over `world`: writes DIR/step_<step> atomically and updates
// DIR/latest; returns the checkpoint's path (on every rank). Throws
// tessera::Error naming the directory on any failure, leaving the previous
// checkpoint and `latest` untouched.
std::string save_checkpoint(parallel::Communicator& world, const std::string& dir, int64_t step,
                            const std::vector<TensorPiece>& pieces, const CheckpointMetadata& metadata,
                            const SaveOptions& options = {});

// The newest complete checkpoint in `dir` (following `latest`, falling back
// to the highest step_* directory if `latest` is missing or names a missing
// directory), or nothing if there is none.
std::optional<std::string> find_latest_checkpoint(const std::string& dir);

// The complete checkpoints in `dir` (step_* directories holding their HDF5
// file), oldest step first; empty if there are none or `dir` does not exist.
std::vector<std::string> list_checkpoints(const std::string& dir);

struct StoredTensor {
  std::string name;
  Shape shape;
  DType dtype;
  uint32_t crc32 = 0;
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
  std::optional<std::vector<uint8_t>> rank_state(int world_rank, const std::string& key) const;
  std::vector<std::string> rank_state_keys(int world_rank) const;  // sorted; empty if that rank stored none

  // Fills piece.local (allocated by the caller, on any device, with the
  // slice's shape: the global shape for whole, [n] for flat_range, the
  // global shape with `dim` resized for dim_range) with its slice of the
  // stored tensor, converting nothing: dtype and global shape must match,
  // else a clear error. Reads the whole tensor and verifies its checksum.
  void read(TensorPiece& piece) const;
  // Recomputes every tensor's checksum; returns the names that do not match.
  std::vector<std::string> verify() const;

 private:
  struct State;
  State* state_;
};

}  // namespace tessera::io

// A model's weights as Hugging Face's save_pretrained(DIR) writes them, read
// and written: one DIR/model.safetensors, or above a size limit shards
// DIR/model-0000i-of-0000N.safetensors with DIR/model.safetensors.index.json
//
//   {"metadata": {"total_size": <bytes of tensor data>},
//    "weight_map": {"<tensor>": "model-00001-of-00002.safetensors", ...}}
//
// (transformers' names; the shards filled in order, a new one started when
// the next tensor would take the current one past the limit, a tensor larger
// than the limit alone in its shard; each file's metadata {"format": "pt"}).
// Reading validates the whole set before any data is read (every shard
// exists and is a valid safetensors file, each tensor of the index is in the
// shard it names, no tensor is in two shards; the index says which tensors
// there are) and reads any run of a
// tensor's elements at its offset (io/safetensors.h), so each rank reads only
// its own slices. Errors name the directory or file, the tensor and the fix.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "io/safetensors.h"

namespace tessera::io {

inline constexpr const char* kSafetensorsWeightsName = "model.safetensors";
inline constexpr const char* kSafetensorsIndexName = "model.safetensors.index.json";
// transformers' default max_shard_size, "5GB".
inline constexpr int64_t kDefaultMaxShardBytes = int64_t(5) * 1000 * 1000 * 1000;

// config.json's "torch_dtype" of tensors of `dtype`: "bfloat16", "float16", else "float32".
const char* torch_dtype_name(DType dtype);

// Bytes of a size as transformers' max_shard_size spells it: "5GB", "500MB",
// "10KB", "1TB" (powers of 1000, a decimal number allowed: "1.5GB"), "2GiB",
// "512MiB", "64KiB" (powers of 1024), or a plain number of bytes. Throws
// naming `flag` and the text when it is none of these or not positive.
int64_t parse_shard_size(const std::string& text, const std::string& flag = "--max-shard-size");

// The files save_pretrained writes for tensors of these byte sizes (in
// order) under a limit of `max_shard_bytes`: one file, or shards.
struct ShardPlan {
  std::vector<std::string> files;  // file names: model.safetensors, or model-00001-of-0000N.safetensors ...
  std::vector<int> file_of;        // per tensor, its index in `files`
  bool sharded() const { return files.size() > 1; }
};
ShardPlan plan_shards(const std::vector<int64_t>& tensor_bytes, int64_t max_shard_bytes);

struct SafetensorsWritten {
  std::vector<std::string> files;  // every file written (paths), the index last when sharded
  int64_t tensors = 0, bytes = 0;  // tensor data bytes
};
// Writes `tensors` into `directory` (which must exist) as plan_shards says:
// model.safetensors, or the shards and model.safetensors.index.json, each
// file's metadata {"format": "pt"} plus `metadata`. A failed write removes
// the files this call wrote.
SafetensorsWritten write_safetensors_directory(const std::string& directory,
                                               const std::vector<SafetensorsInput>& tensors,
                                               int64_t max_shard_bytes = kDefaultMaxShardBytes,
                                               const std::map<std::string, std::string>& metadata = {});

// The weights of a directory (its model.safetensors, else the shards its
// model.safetensors.index.json names, as from_pretrained prefers them) or of
// one safetensors file, validated on opening. `flag` (e.g. "--init-from")
// begins the messages about the path itself.
class SafetensorsDirectory {
 public:
  explicit SafetensorsDirectory(const std::string& path, const std::string& flag = "");

  const std::string& path() const { return path_; }  // as given
  bool sharded() const { return files_.size() > 1 || !index_.empty(); }
  const std::string& index() const { return index_; }  // the index file's path; empty without one
  const std::vector<SafetensorsFile>& files() const { return files_; }

  // The tensor `name` and the file holding it; nullptr when there is none.
  struct Located {
    const SafetensorsFile* file = nullptr;
    const SafetensorsEntry* entry = nullptr;
  };
  Located find(const std::string& name) const;
  // Every tensor's name (of a sharded directory: those its index names), sorted.
  std::vector<std::string> names() const;
  // Where the tensors are, for messages: "DIR (3 shards, index model.safetensors.index.json)" or the file.
  std::string describe() const;

 private:
  void open_single(const std::string& file);
  void open_sharded(const std::string& index);

  std::string path_, index_;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, std::pair<size_t, size_t>> tensors_;  // name → (file, entry) indices
};

}  // namespace tessera::io

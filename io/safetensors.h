// safetensors files, the weights format Hugging Face and PyTorch users load
// (https://github.com/huggingface/safetensors): an unsigned 64-bit
// little-endian header length N, N bytes of JSON
//
//   {"<name>": {"dtype": "F32", "shape": [768, 2304], "data_offsets": [b, e]},
//    ..., "__metadata__": {"<key>": "<string>", ...}}
//
// (the header padded with spaces to a multiple of 8 bytes), then the data:
// each tensor's bytes little-endian and row-major at [b, e) of the data
// section, the tensors tiling it with no gap and no overlap. JSON through
// nlohmann::json. Tessera's dtypes map to F32, BF16, F16, I32, I64, U8; F64
// (which PyTorch users save) is read too, as f32 (SafetensorsEntry::float64);
// a file with others (I8, BOOL, F8_*, ...) is refused naming the tensor.
// Reading takes a tensor whole or any run of its elements (pread at their
// offsets: a rank reads its slices without the rest of the file).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/shape.h"

namespace tessera::io {

// A tensor to write: `data` holds shape.numel() elements of `dtype`.
struct SafetensorsInput {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;
  const void* data = nullptr;
};

// Writes `tensors` (in the order given, names unique) and `metadata` to
// `path` through "<path>.partial", renamed into place when complete (and
// removed when the write fails). Throws tessera::Error naming the file.
void write_safetensors(const std::string& path, const std::vector<SafetensorsInput>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::f32;  // F64: f32, the dtype read_values() gives
  bool float64 = false;      // the file holds F64 (8 bytes an element)
  Shape shape;
  int64_t begin = 0, end = 0;  // byte offsets in the data section
};

// Opens and validates a safetensors file: the header's length against the
// file, its JSON, the data the header describes against what follows it (a
// file cut short is called truncated), every entry (dtype, shape, offsets
// matching the shape and inside the data, the data tiled exactly). Errors
// name the file and, where there is one, the tensor and the field.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(std::string path);

  const std::string& path() const { return path_; }
  const std::vector<SafetensorsEntry>& tensors() const { return tensors_; }  // in file order of their data
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const SafetensorsEntry* find(const std::string& name) const;
  // The bytes of tensor `name` as the file stores them (little-endian,
  // row-major); throws naming it if absent.
  std::vector<std::byte> read(const std::string& name) const;
  // The same values as `entry.dtype` (F64 narrowed to f32), elements of shape.numel().
  std::vector<std::byte> read_values(const SafetensorsEntry& entry) const;
  // Elements [first, first + count) of the tensor (row-major), as stored, into
  // `out` (count × the stored element size), read at their offset in the file.
  void read_elements(const SafetensorsEntry& entry, int64_t first, int64_t count, std::byte* out) const;
  // The same converted to f32 (a floating dtype: F64, F32, BF16, F16; F64
  // beyond f32's range becomes ±Inf), `out` holding `count` floats.
  void read_floats(const SafetensorsEntry& entry, int64_t first, int64_t count, float* out) const;

 private:
  class Descriptor;  // the open file, shared by copies

  std::string path_;
  std::shared_ptr<const Descriptor> descriptor_;
  int64_t data_start_ = 0;
  std::vector<SafetensorsEntry> tensors_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace tessera::io

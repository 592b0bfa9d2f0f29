// safetensors reading and writing (io/safetensors.h): the header as JSON
// through nlohmann::json, every field checked against the file on reading;
// tensor data read with pread at its offsets.
#include "io/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <type_traits>

#include "core/error.h"
#include "core/half.h"

namespace tessera::io {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr int64_t kMaxHeaderBytes = int64_t(100) << 20;  // the reference implementation's limit

const char* safetensors_dtype(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return "F32";
    case DType::bf16:
      return "BF16";
    case DType::f16:
      return "F16";
    case DType::i32:
      return "I32";
    case DType::i64:
      return "I64";
    case DType::u8:
      return "U8";
  }
  throw_unsupported_dtype(dtype, "safetensors");
}

// The entry's dtype and, for F64, its `float64` flag.
void parse_safetensors_dtype(const std::string& path, const std::string& text, SafetensorsEntry& entry) {
  entry.float64 = text == "F64";
  if (entry.float64) {
    entry.dtype = DType::f32;
    return;
  }
  for (DType dtype : {DType::f32, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8})
    if (text == safetensors_dtype(dtype)) {
      entry.dtype = dtype;
      return;
    }
  TESSERA_THROW(path, ": tensor ", entry.name, " has dtype \"", text,
                "\", which Tessera does not read (F64, F32, BF16, F16, I32, I64, U8); convert it first (e.g. "
                "load it in Python and save it again as float32 or bfloat16)");
}

// f32 of a double; beyond f32's range ±Inf (a cast would be undefined), which loading weights refuses.
float narrowed(double value) {
  return std::fabs(value) > double(std::numeric_limits<float>::max()) && std::isfinite(value)
             ? static_cast<float>(std::copysign(std::numeric_limits<double>::infinity(), value))
             : static_cast<float>(value);
}

// `count` stored elements of `entry`'s dtype in `stored` as floats in `out`.
template <typename Stored>
void widen(const std::byte* stored, int64_t count, float* out) {
  for (int64_t i = 0; i < count; ++i) {
    Stored value;
    std::memcpy(&value, stored + i * int64_t(sizeof value), sizeof value);
    if constexpr (std::is_same_v<Stored, double>)
      out[i] = narrowed(value);
    else
      out[i] = static_cast<float>(value);
  }
}

// Bytes of one element as the file stores it.
int64_t stored_element_bytes(const SafetensorsEntry& entry) {
  return entry.float64 ? int64_t(sizeof(double)) : int64_t(dtype_size(entry.dtype));
}

// The largest end offset the header's entries name (0 when none is a number):
// more than the data after the header means the file was cut short.
uint64_t described_data_bytes(const json& header) {
  uint64_t described = 0;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__" || !entry.is_object() || !entry.contains("data_offsets")) continue;
    const json& offsets = entry["data_offsets"];
    if (offsets.is_array() && offsets.size() == 2 && offsets[1].is_number_unsigned())
      described = std::max(described, offsets[1].get<uint64_t>());
  }
  return described;
}

}  // namespace

// The file opened once for reading, closed with the last copy of its SafetensorsFile.
class SafetensorsFile::Descriptor {
 public:
  explicit Descriptor(const std::string& path) : fd_(::open(path.c_str(), O_RDONLY | O_CLOEXEC)) {
    TESSERA_CHECK(fd_ >= 0, "cannot open ", path, ": ", std::strerror(errno));
  }
  ~Descriptor() { ::close(fd_); }
  Descriptor(const Descriptor&) = delete;
  Descriptor& operator=(const Descriptor&) = delete;

  // `bytes` bytes at `offset` into `out`; false when the file ends first.
  bool read_at(int64_t offset, int64_t bytes, std::byte* out) const {
    while (bytes > 0) {
      const ssize_t got = ::pread(fd_, out, size_t(bytes), off_t(offset));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) return false;
      out += got;
      offset += got;
      bytes -= got;
    }
    return true;
  }

 private:
  int fd_;
};

void write_safetensors(const std::string& path, const std::vector<SafetensorsInput>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  int64_t offset = 0;
  for (const SafetensorsInput& tensor : tensors) {
    TESSERA_CHECK(!tensor.name.empty() && tensor.name != "__metadata__", "writing ", path, ": tensor name '",
                  tensor.name, "' cannot be stored");
    TESSERA_CHECK(!header.contains(tensor.name), "writing ", path, ": tensor ", tensor.name, " is given twice");
    const int64_t bytes = tensor.shape.numel() * int64_t(dtype_size(tensor.dtype));
    header[tensor.name] = {{"dtype", safetensors_dtype(tensor.dtype)},
                           {"shape", std::vector<int64_t>(tensor.shape.sizes().begin(), tensor.shape.sizes().end())},
                           {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const std::string partial = path + ".partial";
  std::error_code error;
  try {
    std::ofstream out(partial, std::ios::binary | std::ios::trunc);
    TESSERA_CHECK(out, "cannot create ", partial, ": ", std::strerror(errno));
    const uint64_t length = text.size();
    out.write(reinterpret_cast<const char*>(&length), sizeof length);  // little-endian on every supported host
    out.write(text.data(), std::streamsize(text.size()));
    for (const SafetensorsInput& tensor : tensors)
      out.write(static_cast<const char*>(tensor.data),
                std::streamsize(tensor.shape.numel() * int64_t(dtype_size(tensor.dtype))));
    out.flush();
    TESSERA_CHECK(out, "writing ", partial, " failed: ", std::strerror(errno));
    out.close();
    fs::rename(partial, path, error);
    TESSERA_CHECK(!error, "cannot rename ", partial, " to ", path, ": ", error.message());
  } catch (...) {
    fs::remove(partial, error);  // a failed write leaves nothing behind
    throw;
  }
}

SafetensorsFile::SafetensorsFile(std::string path) : path_(std::move(path)) {
  const std::string& p = path_;
  std::error_code error;
  TESSERA_CHECK(fs::exists(p, error), p, " does not exist; check the path");
  const int64_t size = int64_t(fs::file_size(p, error));
  TESSERA_CHECK(!error, "cannot read the size of ", p, ": ", error.message());
  TESSERA_CHECK(size >= 8, p, " holds ", size, " bytes, fewer than the 8 of a safetensors header length");
  std::ifstream in(p, std::ios::binary);
  TESSERA_CHECK(in, "cannot open ", p, ": ", std::strerror(errno));
  uint64_t length = 0;
  in.read(reinterpret_cast<char*>(&length), sizeof length);
  TESSERA_CHECK(length <= uint64_t(std::min(kMaxHeaderBytes, size - 8)), p, ": the header length is ", length,
                " bytes, more than the file's ", size - 8,
                " after it (or than 100 MiB): not a safetensors file, or "
                "truncated");
  std::string text(size_t(length), '\0');
  in.read(text.data(), std::streamsize(length));
  TESSERA_CHECK(in.gcount() == std::streamsize(length), p, ": cannot read its ", length, "-byte header");
  data_start_ = 8 + int64_t(length);
  const int64_t data_size = size - data_start_;
  const json header = json::parse(text, nullptr, false);
  TESSERA_CHECK(!header.is_discarded() && header.is_object(), p,
                ": the header is not a JSON object: not a safetensors file, or damaged");
  const uint64_t described = described_data_bytes(header);
  TESSERA_CHECK(described <= uint64_t(data_size), p, " is truncated: its header describes ", described,
                " bytes of tensor data but only ", data_size, " follow the header (the file is ", size,
                " bytes, it should be ", uint64_t(data_start_) + described,
                "); copy or download it again (or its header is damaged)");
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      TESSERA_CHECK(entry.is_object(), p, ": \"__metadata__\" is not an object of strings");
      for (const auto& [key, value] : entry.items()) {
        TESSERA_CHECK(value.is_string(), p, ": \"__metadata__\" entry ", key, " is not a string");
        metadata_[key] = value.get<std::string>();
      }
      continue;
    }
    TESSERA_CHECK(entry.is_object() && entry.contains("dtype") && entry["dtype"].is_string() &&
                      entry.contains("shape") && entry["shape"].is_array() && entry.contains("data_offsets") &&
                      entry["data_offsets"].is_array() && entry["data_offsets"].size() == 2,
                  p, ": tensor ", name, " lacks a string 'dtype', an array 'shape' or a pair 'data_offsets'");
    SafetensorsEntry tensor;
    tensor.name = name;
    parse_safetensors_dtype(p, entry["dtype"].get<std::string>(), tensor);
    std::vector<int64_t> dims;
    int64_t numel = 1;
    for (const json& dim : entry["shape"]) {
      TESSERA_CHECK(dim.is_number_unsigned() && dim.get<uint64_t>() <= uint64_t(data_size), p, ": tensor ", name,
                    "'s 'shape' holds ", dim.dump(), ", not a size the file can hold");
      dims.push_back(dim.get<int64_t>());
      // Capped past the data's size (no overflow): such a shape fails the offsets' check below.
      numel = dims.back() == 0 ? 0 : numel > (data_size + 1) / dims.back() ? data_size + 1 : numel * dims.back();
    }
    TESSERA_CHECK(dims.size() <= size_t(Shape::kMaxDims), p, ": tensor ", name, " has ", dims.size(),
                  " dimensions, more than ", Shape::kMaxDims);
    for (const json& offset : entry["data_offsets"])
      TESSERA_CHECK(offset.is_number_unsigned() && offset.get<uint64_t>() <= uint64_t(data_size), p, ": tensor ", name,
                    "'s 'data_offsets' holds ", offset.dump(), ", outside the ", data_size, " bytes of data");
    tensor.begin = entry["data_offsets"][0].get<int64_t>();
    tensor.end = entry["data_offsets"][1].get<int64_t>();
    TESSERA_CHECK(tensor.begin <= tensor.end && tensor.end - tensor.begin == numel * stored_element_bytes(tensor), p,
                  ": tensor ", name, "'s 'data_offsets' [", tensor.begin, ", ", tensor.end, ") do not hold the ", numel,
                  " ", entry["dtype"].get<std::string>(), " elements of its 'shape'");
    tensor.shape = Shape(dims);
    tensors_.push_back(std::move(tensor));
  }
  std::sort(tensors_.begin(), tensors_.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    return a.begin < b.begin || (a.begin == b.begin && a.end < b.end);
  });
  int64_t covered = 0;
  for (const SafetensorsEntry& tensor : tensors_) {
    TESSERA_CHECK(tensor.begin == covered, p, ": tensor ", tensor.name, "'s data starts at byte ", tensor.begin,
                  " of the data, but ", covered, " is where the previous one ends (",
                  tensor.begin > covered ? "a gap" : "an overlap", "); the data must be tiled exactly");
    covered = tensor.end;
  }
  TESSERA_CHECK(covered == data_size, p, ": the tensors hold ", covered, " bytes of data but the file has ", data_size,
                " after the header");
  descriptor_ = std::make_shared<const Descriptor>(p);
}

const SafetensorsEntry* SafetensorsFile::find(const std::string& name) const {
  for (const SafetensorsEntry& tensor : tensors_)
    if (tensor.name == name) return &tensor;
  return nullptr;
}

std::vector<std::byte> SafetensorsFile::read(const std::string& name) const {
  const SafetensorsEntry* tensor = find(name);
  TESSERA_CHECK(tensor != nullptr, path_, " has no tensor ", name);
  std::vector<std::byte> bytes(size_t(tensor->end - tensor->begin));
  read_elements(*tensor, 0, (tensor->end - tensor->begin) / stored_element_bytes(*tensor), bytes.data());
  return bytes;
}

std::vector<std::byte> SafetensorsFile::read_values(const SafetensorsEntry& entry) const {
  std::vector<std::byte> stored = read(entry.name);
  if (!entry.float64) return stored;
  const int64_t count = int64_t(stored.size() / sizeof(double));
  std::vector<std::byte> values(size_t(count) * sizeof(float));  // operator new's alignment suits floats
  widen<double>(stored.data(), count, reinterpret_cast<float*>(values.data()));
  return values;
}

void SafetensorsFile::read_elements(const SafetensorsEntry& entry, int64_t first, int64_t count, std::byte* out) const {
  const int64_t size = stored_element_bytes(entry);
  TESSERA_CHECK(first >= 0 && count >= 0 && first + count <= (entry.end - entry.begin) / size, path_, ": elements [",
                first, ", ", first + count, ") are outside tensor ", entry.name, " ", entry.shape.to_string());
  TESSERA_CHECK(descriptor_->read_at(data_start_ + entry.begin + first * size, count * size, out), path_,
                " ended inside tensor ", entry.name, "; did it change while being read?");
}

void SafetensorsFile::read_floats(const SafetensorsEntry& entry, int64_t first, int64_t count, float* out) const {
  TESSERA_CHECK(entry.float64 || is_floating(entry.dtype), path_, ": tensor ", entry.name, " holds ",
                dtype_name(entry.dtype), ", not floating-point values");
  std::vector<std::byte> stored(size_t(count * stored_element_bytes(entry)));
  read_elements(entry, first, count, stored.data());
  if (entry.float64) return widen<double>(stored.data(), count, out);
  switch (entry.dtype) {
    case DType::bf16:
      return widen<bf16>(stored.data(), count, out);
    case DType::f16:
      return widen<f16>(stored.data(), count, out);
    default:
      std::memcpy(out, stored.data(), stored.size());
  }
}

}  // namespace tessera::io

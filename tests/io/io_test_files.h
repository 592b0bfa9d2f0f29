// Test helpers for io/: a temporary directory removed at scope end, and a
// small HDF5 writer on the raw C API, independent of io/'s own writers, to
// make valid and deliberately broken dataset files.
#pragma once

#include <gtest/gtest.h>
#include <hdf5.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace tessera::testing {

class TempDir {
 public:
  TempDir() {
    std::random_device device;
    path_ = std::filesystem::temp_directory_path() /
            ("tessera_io_test_" + std::to_string(getpid()) + "_" + std::to_string(device()));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// Writes an HDF5 file with the C API. Strings are variable-length UTF-8 (as
// h5py writes them), unlike io/'s fixed-length ASCII, so readers see both.
class RawH5Writer {
 public:
  explicit RawH5Writer(const std::string& path)
      : file_(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT)) {
    EXPECT_GE(file_, 0) << path;
  }
  ~RawH5Writer() { H5Fclose(file_); }
  RawH5Writer(const RawH5Writer&) = delete;
  RawH5Writer& operator=(const RawH5Writer&) = delete;

  // A dataset of `dims` stored as `file_type`, from `data` in `memory_type`;
  // chunked with deflate when `chunk_rows` > 0.
  void dataset(const char* name, hid_t file_type, hid_t memory_type, const std::vector<hsize_t>& dims, const void* data,
               hsize_t chunk_rows = 0) {
    const hid_t space = H5Screate_simple(int(dims.size()), dims.data(), nullptr);
    const hid_t properties = H5Pcreate(H5P_DATASET_CREATE);
    if (chunk_rows > 0) {
      std::vector<hsize_t> chunk = dims;
      chunk[0] = chunk_rows;
      H5Pset_chunk(properties, int(chunk.size()), chunk.data());
      H5Pset_deflate(properties, 6);
    }
    const hid_t set = H5Dcreate2(file_, name, file_type, space, H5P_DEFAULT, properties, H5P_DEFAULT);
    EXPECT_GE(set, 0) << name;
    EXPECT_GE(H5Dwrite(set, memory_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data), 0) << name;
    H5Dclose(set);
    H5Pclose(properties);
    H5Sclose(space);
  }

  void int_attribute(const char* name, int64_t value, hid_t file_type = H5T_STD_I64LE) {
    const hid_t space = H5Screate(H5S_SCALAR);
    const hid_t attribute = H5Acreate2(file_, name, file_type, space, H5P_DEFAULT, H5P_DEFAULT);
    EXPECT_GE(H5Awrite(attribute, H5T_NATIVE_INT64, &value), 0) << name;
    H5Aclose(attribute);
    H5Sclose(space);
  }

  void string_attribute(const char* name, const std::string& value) {
    const hid_t space = H5Screate(H5S_SCALAR);
    const hid_t type = H5Tcopy(H5T_C_S1);
    H5Tset_size(type, H5T_VARIABLE);
    H5Tset_cset(type, H5T_CSET_UTF8);
    const hid_t attribute = H5Acreate2(file_, name, type, space, H5P_DEFAULT, H5P_DEFAULT);
    const char* text = value.c_str();
    EXPECT_GE(H5Awrite(attribute, type, &text), 0) << name;
    H5Aclose(attribute);
    H5Tclose(type);
    H5Sclose(space);
  }

  hid_t id() const { return file_; }

 private:
  hid_t file_;
};

struct ClassificationFile {
  int64_t n = 0, c = 0, h = 0, w = 0, num_classes = 0;
  std::vector<uint8_t> images;  // [n, c, h, w]
  std::vector<int64_t> labels;  // [n]
};

inline ClassificationFile random_classification(std::mt19937_64& rng, int64_t n, int64_t c, int64_t h, int64_t w,
                                                int64_t num_classes) {
  ClassificationFile data{n, c, h, w, num_classes, {}, {}};
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_int_distribution<int64_t> label(0, num_classes - 1);
  data.images.resize(size_t(n * c * h * w));
  for (auto& value : data.images) value = uint8_t(byte(rng));
  data.labels.resize(size_t(n));
  for (auto& value : data.labels) value = label(rng);
  return data;
}

// A valid classification file (images optionally chunked and deflated).
inline void write_classification(const std::string& path, const ClassificationFile& data, hsize_t chunk_rows = 0) {
  RawH5Writer file(path);
  file.int_attribute("tessera_schema", 1);
  file.string_attribute("kind", "classification");
  file.int_attribute("num_classes", data.num_classes);
  file.dataset("images", H5T_STD_U8LE, H5T_NATIVE_UINT8,
               {hsize_t(data.n), hsize_t(data.c), hsize_t(data.h), hsize_t(data.w)}, data.images.data(), chunk_rows);
  file.dataset("labels", H5T_STD_I64LE, H5T_NATIVE_INT64, {hsize_t(data.n)}, data.labels.data());
}

// A valid token file storing `tokens` as `file_type` (uint8, uint16 or int32).
inline void write_tokens(const std::string& path, const std::vector<int32_t>& tokens, hid_t file_type,
                         int64_t vocab_size) {
  RawH5Writer file(path);
  file.int_attribute("tessera_schema", 1);
  file.string_attribute("kind", "tokens");
  file.int_attribute("vocab_size", vocab_size);
  file.dataset("tokens", file_type, H5T_NATIVE_INT32, {hsize_t(tokens.size())}, tokens.data());
}

// Flips bit `bit` of the byte `offset` bytes into the stored data of the
// contiguous dataset `name` of `path`, behind HDF5's back (what a bad disk or
// a bad copy does). Returns false when the dataset has no contiguous storage
// or `offset` is outside it.
inline bool flip_stored_bit(const std::string& path, const std::string& name, hsize_t offset, int bit) {
  const hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  const hid_t set = H5Dopen2(file, name.c_str(), H5P_DEFAULT);
  const haddr_t start = H5Dget_offset(set);
  const hsize_t stored = H5Dget_storage_size(set);
  H5Dclose(set);
  H5Fclose(file);
  if (start == HADDR_UNDEF || offset >= stored) return false;
  std::fstream stream(path, std::ios::in | std::ios::out | std::ios::binary);
  const auto at = std::streamoff(start + offset);
  stream.seekg(at);
  char byte = 0;
  stream.read(&byte, 1);
  byte = char(byte ^ (1 << bit));
  stream.seekp(at);
  stream.write(&byte, 1);
  return bool(stream);
}

// The same at a random byte and bit of the dataset's stored data.
inline bool flip_random_stored_bit(const std::string& path, const std::string& name, std::mt19937_64& rng) {
  const hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  const hid_t set = H5Dopen2(file, name.c_str(), H5P_DEFAULT);
  const hsize_t stored = H5Dget_storage_size(set);
  H5Dclose(set);
  H5Fclose(file);
  if (stored == 0) return false;
  return flip_stored_bit(path, name, std::uniform_int_distribution<hsize_t>(0, stored - 1)(rng),
                         std::uniform_int_distribution<int>(0, 7)(rng));
}

// Where the bytes of tensor `name` of the checkpoint whose index (or only
// file) is `index_file` are stored: format 1, /tensors/<name> of that file;
// format 2, the first stored piece the index's `tessera_pieces` table lists
// (row: rank, index in the rank's list, ...): tensors/<name>/<index> of
// rank_<rank>.h5 beside it. Read with the raw C API.
inline std::pair<std::string, std::string> stored_tensor_data(const std::string& index_file, const std::string& name) {
  const std::string dataset_name = "/tensors/" + name;
  const hid_t file = H5Fopen(index_file.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  const hid_t set = H5Dopen2(file, dataset_name.c_str(), H5P_DEFAULT);
  std::pair<std::string, std::string> where = {index_file, dataset_name};
  if (H5Aexists(set, "tessera_pieces") > 0) {
    const hid_t attribute = H5Aopen(set, "tessera_pieces", H5P_DEFAULT);
    const hid_t space = H5Aget_space(attribute);
    hsize_t dims[2] = {0, 0};
    H5Sget_simple_extent_dims(space, dims, nullptr);
    std::vector<int64_t> rows(dims[0] * dims[1]);
    H5Aread(attribute, H5T_NATIVE_INT64, rows.data());
    H5Sclose(space);
    H5Aclose(attribute);
    char rank_file[32];
    std::snprintf(rank_file, sizeof rank_file, "rank_%05d.h5", int(rows.at(0)));
    where = {(std::filesystem::path(index_file).parent_path() / rank_file).string(),
             dataset_name + "/" + std::to_string(rows.at(1))};
  }
  H5Dclose(set);
  H5Fclose(file);
  return where;
}

// Inverts 8 bytes starting `offset` bytes into the header of HDF5 object
// `name` of `path` (inside its checksummed prefix and messages), as a bad disk
// would: damage to the file's metadata rather than its data.
inline void damage_object_header(const std::string& path, const std::string& name, int offset = 12) {
  const hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  H5O_info_t info{};  // HDF5 1.10: the header's address is H5O_info_t::addr
  H5Oget_info_by_name2(file, name.c_str(), &info, H5O_INFO_BASIC, H5P_DEFAULT);
  H5Fclose(file);
  std::fstream stream(path, std::ios::in | std::ios::out | std::ios::binary);
  const auto at = std::streamoff(info.addr + haddr_t(offset));
  char bytes[8];
  stream.seekg(at);
  stream.read(bytes, sizeof bytes);
  for (char& b : bytes) b = char(~b);
  stream.seekp(at);
  stream.write(bytes, sizeof bytes);
}

// A whole 1-D or N-D dataset read back with the C API, converted to `memory_type`.
template <typename T>
std::vector<T> read_whole_dataset(const std::string& path, const char* name, hid_t memory_type) {
  const hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  EXPECT_GE(file, 0) << path;
  const hid_t set = H5Dopen2(file, name, H5P_DEFAULT);
  EXPECT_GE(set, 0) << name;
  const hid_t space = H5Dget_space(set);
  std::vector<T> values(size_t(H5Sget_simple_extent_npoints(space)));
  EXPECT_GE(H5Dread(set, memory_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()), 0) << name;
  H5Sclose(space);
  H5Dclose(set);
  H5Fclose(file);
  return values;
}

}  // namespace tessera::testing

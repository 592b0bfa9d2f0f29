// RAII ownership of HDF5 ids (files, datasets, dataspaces, datatypes,
// attributes, property lists) and the few file-level helpers io/ needs:
// opening with a message that names the path, scalar attributes, whole-row
// hyperslab reads and writes along the first dimension. Every failure throws
// tessera::Error naming the file and carrying HDF5's own error stack.
//
//   Hdf5Handle file = open_hdf5_read(path);            // closed at scope end
//   const int64_t version = read_int64_attribute(path, file.get(), "tessera_schema");
#pragma once

#include <hdf5.h>

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "io/hdf5_check.h"
#include "io/hdf5_threads.h"

namespace tessera::io {

// Owns one HDF5 id and closes it with the matching H5?close function.
class Hdf5Handle {
 public:
  using Closer = herr_t (*)(hid_t);

  Hdf5Handle() = default;
  Hdf5Handle(hid_t id, Closer close) : id_(id), close_(close) {}
  ~Hdf5Handle() { reset(); }
  Hdf5Handle(Hdf5Handle&& other) noexcept : id_(std::exchange(other.id_, -1)), close_(other.close_) {}
  Hdf5Handle& operator=(Hdf5Handle&& other) noexcept {
    if (this != &other) {
      reset();
      id_ = std::exchange(other.id_, -1);
      close_ = other.close_;
    }
    return *this;
  }
  Hdf5Handle(const Hdf5Handle&) = delete;
  Hdf5Handle& operator=(const Hdf5Handle&) = delete;

  hid_t get() const { return id_; }
  bool valid() const { return id_ >= 0; }
  void reset() noexcept {
    if (id_ >= 0 && close_) {
      // Errors on close are not actionable here (a write that already failed
      // has been reported): they must not print HDF5's stack either.
      const Hdf5Serial serial;
      H5E_auto2_t function = nullptr;
      void* data = nullptr;
      H5Eget_auto2(H5E_DEFAULT, &function, &data);
      H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
      close_(id_);
      H5Eset_auto2(H5E_DEFAULT, function, data);
    }
    id_ = -1;
  }

 private:
  hid_t id_ = -1;
  Closer close_ = nullptr;
};

inline Hdf5Handle file_handle(hid_t id) {
  return {id, H5Fclose};
}
inline Hdf5Handle dataset_handle(hid_t id) {
  return {id, H5Dclose};
}
inline Hdf5Handle dataspace_handle(hid_t id) {
  return {id, H5Sclose};
}
inline Hdf5Handle datatype_handle(hid_t id) {
  return {id, H5Tclose};
}
inline Hdf5Handle attribute_handle(hid_t id) {
  return {id, H5Aclose};
}
inline Hdf5Handle property_list_handle(hid_t id) {
  return {id, H5Pclose};
}

// While alive, HDF5 does not print its error stack to stderr on this thread
// (the stack is still recorded, and our checks put it into the exception).
class Hdf5QuietErrors {
 public:
  Hdf5QuietErrors() {
    const Hdf5Serial serial;
    H5Eget_auto2(H5E_DEFAULT, &function_, &data_);
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  }
  ~Hdf5QuietErrors() {
    const Hdf5Serial serial;
    H5Eset_auto2(H5E_DEFAULT, function_, data_);
  }
  Hdf5QuietErrors(const Hdf5QuietErrors&) = delete;
  Hdf5QuietErrors& operator=(const Hdf5QuietErrors&) = delete;

 private:
  H5E_auto2_t function_ = nullptr;
  void* data_ = nullptr;
};

namespace detail {
template <typename T>
T hdf5_checked_at(T status, std::string_view path, std::string_view statement, std::string_view file, int line) {
  if (status < 0) [[unlikely]]
    throw_error(ErrorSite{"HDF5", static_cast<long long>(status), {}, statement, file, line, {}},
                std::string(path) + ": " + tessera::detail::hdf5_error_stack());
  return status;
}
}  // namespace detail

// TESSERA_HDF5_CHECK that also names the file the call was working on.
// Holds the HDF5 lock as TESSERA_HDF5_CHECK does.
#define TESSERA_HDF5_CHECK_AT(path, expr) \
  ::tessera::io::detail::hdf5_checked_at((::tessera::io::Hdf5Serial(), (expr)), (path), #expr, __FILE__, __LINE__)

// Opens an existing file read-only. A missing path is reported as such; a
// file HDF5 cannot open (truncated, not HDF5) throws with HDF5's error stack.
Hdf5Handle open_hdf5_read(const std::string& path);

// Whether `path` is a file HDF5 recognises (its signature), HDF5's complaints kept quiet.
bool is_hdf5_file(const std::string& path);

// Throws unless this process can open `path` for reading, with what the
// operating system said (no such file, permission denied with the file's
// owner and mode and this process's user, not a regular file, ...). `what`
// names the file's role in the message ("data file", "checkpoint"), `fix` is
// appended when the file does not exist.
void check_readable_file(const std::string& path, std::string_view what, std::string_view fix);
// Creates (or truncates) a file for writing.
Hdf5Handle create_hdf5_file(const std::string& path);

bool has_attribute(hid_t object, const char* name);
// Whether `object` has attribute `name`; nothing when HDF5 cannot tell (the
// object's header is damaged), with HDF5's error left on its stack.
std::optional<bool> attribute_exists(hid_t object, const char* name);
bool has_dataset(hid_t file, const char* name);  // a link that exists and is a dataset

// Scalar attributes. The readers throw when the attribute is missing or of the
// wrong type, naming `path`, the attribute and what is wrong.
int64_t read_int64_attribute(const std::string& path, hid_t object, const char* name);
std::string read_string_attribute(const std::string& path, hid_t object, const char* name);
void write_int64_attribute(const std::string& path, hid_t object, const char* name, int64_t value);
void write_string_attribute(const std::string& path, hid_t object, const char* name, std::string_view value);

// The shape of a dataset's dataspace.
std::vector<int64_t> dataset_dims(const std::string& path, hid_t dataset);

// The number of elements of a shape, or nothing when the product does not fit
// in int64 (only a corrupt file claims such a shape).
std::optional<int64_t> element_count(std::span<const int64_t> dims);

// Whether every element of `dataset` has storage in the file (empty datasets
// do). A dataset that was created but never, or only partly, written reads
// back as fill values, and its shape can claim any size in a file of a few
// hundred bytes: readers refuse it before allocating for it.
bool all_elements_stored(const std::string& path, hid_t dataset);

// A fixed-size, contiguous dataset of `dims` elements of `file_type`.
Hdf5Handle create_dataset(const std::string& path, hid_t file, const char* name, hid_t file_type,
                          std::span<const int64_t> dims);

// Rows [first_row, first_row + rows) of a dataset (whole trailing
// dimensions), converted by HDF5 between `memory_type` and the file's type.
void read_rows(const std::string& path, hid_t dataset, int64_t first_row, int64_t rows, hid_t memory_type, void* out);
void write_rows(const std::string& path, hid_t dataset, int64_t first_row, int64_t rows, hid_t memory_type,
                const void* data);

}  // namespace tessera::io

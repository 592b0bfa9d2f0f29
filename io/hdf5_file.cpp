// HDF5 file helpers for io/: opening with errors that name the path, scalar
// attributes, and row-range (hyperslab) reads and writes.
#include "io/hdf5_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <system_error>

namespace tessera::io {
namespace {

constexpr size_t kSieveBytes = 4096;

std::vector<hsize_t> to_hsize(std::span<const int64_t> dims) {
  return std::vector<hsize_t>(dims.begin(), dims.end());
}

// A dataspace selecting rows [first_row, first_row + rows) of `dims`.
Hdf5Handle select_rows(const std::string& path, hid_t dataset, int64_t first_row, int64_t rows,
                       std::vector<hsize_t>& count) {
  Hdf5Handle space = dataspace_handle(TESSERA_HDF5_CHECK_AT(path, H5Dget_space(dataset)));
  const int ndims = TESSERA_HDF5_CHECK_AT(path, H5Sget_simple_extent_ndims(space.get()));
  TESSERA_CHECK(ndims >= 1, path, ": a dataset read by rows must have at least one dimension");
  std::vector<hsize_t> dims(size_t(ndims), 0);
  TESSERA_HDF5_CHECK_AT(path, H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr));
  TESSERA_CHECK(first_row >= 0 && rows >= 0 && hsize_t(first_row + rows) <= dims[0], path, ": rows [", first_row, ", ",
                first_row + rows, ") are outside the dataset's ", dims[0], " rows");
  std::vector<hsize_t> start(dims.size(), 0);
  start[0] = hsize_t(first_row);
  count = dims;
  count[0] = hsize_t(rows);
  TESSERA_HDF5_CHECK_AT(path,
                        H5Sselect_hyperslab(space.get(), H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr));
  return space;
}

std::string mode_text(mode_t mode) {
  char text[8];
  std::snprintf(text, sizeof text, "%04o", unsigned(mode & 07777));
  return text;
}

// Who may read `path` and who this process is: the file's owner, group and
// mode (or the first directory on the way that this process cannot search),
// and this process's user and group, so "permission denied" says what to change.
std::string describe_access_failure(const std::string& path) {
  std::ostringstream out;
  out << "this process runs as uid " << ::geteuid() << " gid " << ::getegid();
  struct stat info {};
  std::filesystem::path walked;
  for (const auto& part : std::filesystem::absolute(path).parent_path()) {
    walked /= part;
    if (::access(walked.c_str(), X_OK) != 0) {
      out << "; directory " << walked.string() << " cannot be searched by this user";
      if (::stat(walked.c_str(), &info) == 0)
        out << " (owner uid " << info.st_uid << ", mode " << mode_text(info.st_mode) << ")";
      return out.str();
    }
  }
  if (::stat(path.c_str(), &info) == 0)
    out << "; the file is owned by uid " << info.st_uid << " gid " << info.st_gid << " with mode "
        << mode_text(info.st_mode) << "; make it readable (chmod a+r) or run as a user who may read it";
  return out.str();
}

}  // namespace

void check_readable_file(const std::string& path, std::string_view what, std::string_view fix) {
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0) {
    const int error = errno;
    TESSERA_CHECK(error != ENOENT, what, " ", path, " does not exist; ", fix);
    TESSERA_THROW(what, " ", path, " cannot be reached: ", std::strerror(error), " (", describe_access_failure(path),
                  ")");
  }
  TESSERA_CHECK(S_ISREG(info.st_mode), what, " ", path, " is not a regular file");
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int error = errno;
    TESSERA_THROW(what, " ", path, " cannot be opened for reading: ", std::strerror(error), " (",
                  describe_access_failure(path), ")");
  }
  ::close(fd);
}

Hdf5Handle open_hdf5_read(const std::string& path) {
  check_readable_file(path, "file", "check the path (datasets are made by `tessera prepare idx|text`)");
  Hdf5QuietErrors quiet;
  // Readers fetch samples at random positions: HDF5's default 64 KiB sieve
  // buffer would read (and copy) 64 KiB around each one.
  Hdf5Handle access = property_list_handle(TESSERA_HDF5_CHECK_AT(path, H5Pcreate(H5P_FILE_ACCESS)));
  TESSERA_HDF5_CHECK_AT(path, H5Pset_sieve_buf_size(access.get(), kSieveBytes));
  const Hdf5Serial serial;  // calls outside TESSERA_HDF5_CHECK (io/hdf5_threads.h)
  const hid_t id = H5Fopen(path.c_str(), H5F_ACC_RDONLY, access.get());
  if (id < 0)
    throw_error(ErrorSite{"HDF5", static_cast<long long>(id), {}, "H5Fopen", __FILE__, __LINE__, {}},
                path + " cannot be opened as an HDF5 file (truncated, corrupt, or not HDF5; prepare it again): " +
                    tessera::detail::hdf5_error_stack());
  return file_handle(id);
}

bool is_hdf5_file(const std::string& path) {
  Hdf5QuietErrors quiet;
  const htri_t signature = H5Fis_hdf5(path.c_str());  // H5Fis_accessible from HDF5 1.12 on
  H5Eclear2(H5E_DEFAULT);
  return signature > 0;
}

Hdf5Handle create_hdf5_file(const std::string& path) {
  const Hdf5Serial serial;  // calls outside TESSERA_HDF5_CHECK (io/hdf5_threads.h)
  Hdf5QuietErrors quiet;
  const hid_t id = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  if (id < 0)
    throw_error(ErrorSite{"HDF5", static_cast<long long>(id), {}, "H5Fcreate", __FILE__, __LINE__, {}},
                "cannot create " + path +
                    " (does its directory exist and is it writable?): " + tessera::detail::hdf5_error_stack());
  return file_handle(id);
}

bool has_attribute(hid_t object, const char* name) {
  const Hdf5Serial serial;  // calls outside TESSERA_HDF5_CHECK (io/hdf5_threads.h)
  Hdf5QuietErrors quiet;
  const htri_t exists = H5Aexists(object, name);
  H5Eclear2(H5E_DEFAULT);
  return exists > 0;
}

std::optional<bool> attribute_exists(hid_t object, const char* name) {
  const Hdf5Serial serial;  // calls outside TESSERA_HDF5_CHECK (io/hdf5_threads.h)
  Hdf5QuietErrors quiet;
  const htri_t exists = H5Aexists(object, name);
  if (exists < 0) return std::nullopt;
  return exists > 0;
}

bool has_dataset(hid_t file, const char* name) {
  const Hdf5Serial serial;  // calls outside TESSERA_HDF5_CHECK (io/hdf5_threads.h)
  Hdf5QuietErrors quiet;
  if (H5Lexists(file, name, H5P_DEFAULT) <= 0) {
    H5Eclear2(H5E_DEFAULT);
    return false;
  }
  H5O_info_t info;
  const herr_t status = H5Oget_info_by_name2(file, name, &info, H5O_INFO_BASIC, H5P_DEFAULT);
  H5Eclear2(H5E_DEFAULT);
  return status >= 0 && info.type == H5O_TYPE_DATASET;
}

namespace {

Hdf5Handle open_scalar_attribute(const std::string& path, hid_t object, const char* name) {
  TESSERA_CHECK(has_attribute(object, name), path, ": attribute '", name, "' is missing");
  Hdf5Handle attribute = attribute_handle(TESSERA_HDF5_CHECK_AT(path, H5Aopen(object, name, H5P_DEFAULT)));
  Hdf5Handle space = dataspace_handle(TESSERA_HDF5_CHECK_AT(path, H5Aget_space(attribute.get())));
  const hssize_t points = TESSERA_HDF5_CHECK_AT(path, H5Sget_simple_extent_npoints(space.get()));
  TESSERA_CHECK(points == 1, path, ": attribute '", name, "' must hold one value, it holds ", points);
  return attribute;
}

}  // namespace

int64_t read_int64_attribute(const std::string& path, hid_t object, const char* name) {
  const Hdf5Serial serial;  // calls outside TESSERA_HDF5_CHECK (io/hdf5_threads.h)
  Hdf5Handle attribute = open_scalar_attribute(path, object, name);
  Hdf5Handle type = datatype_handle(TESSERA_HDF5_CHECK_AT(path, H5Aget_type(attribute.get())));
  TESSERA_CHECK(H5Tget_class(type.get()) == H5T_INTEGER, path, ": attribute '", name, "' must be an integer");
  int64_t value = 0;
  TESSERA_HDF5_CHECK_AT(path, H5Aread(attribute.get(), H5T_NATIVE_INT64, &value));
  return value;
}

std::string read_string_attribute(const std::string& path, hid_t object, const char* name) {
  const Hdf5Serial serial;  // calls outside TESSERA_HDF5_CHECK (io/hdf5_threads.h)
  Hdf5Handle attribute = open_scalar_attribute(path, object, name);
  Hdf5Handle type = datatype_handle(TESSERA_HDF5_CHECK_AT(path, H5Aget_type(attribute.get())));
  TESSERA_CHECK(H5Tget_class(type.get()) == H5T_STRING, path, ": attribute '", name, "' must be a string");
  std::string value;
  if (TESSERA_HDF5_CHECK_AT(path, H5Tis_variable_str(type.get())) > 0) {
    char* text = nullptr;  // read as stored (same character set: h5py writes UTF-8)
    TESSERA_HDF5_CHECK_AT(path, H5Aread(attribute.get(), type.get(), &text));
    if (text) {
      value = text;
      H5free_memory(text);
    }
  } else {
    const size_t size = H5Tget_size(type.get());
    std::vector<char> buffer(size + 1, '\0');
    TESSERA_HDF5_CHECK_AT(path, H5Aread(attribute.get(), type.get(), buffer.data()));
    value.assign(buffer.data());  // stops at the first NUL (null-terminated or null-padded)
  }
  return value;
}

void write_int64_attribute(const std::string& path, hid_t object, const char* name, int64_t value) {
  Hdf5Handle space = dataspace_handle(TESSERA_HDF5_CHECK_AT(path, H5Screate(H5S_SCALAR)));
  Hdf5Handle attribute = attribute_handle(
      TESSERA_HDF5_CHECK_AT(path, H5Acreate2(object, name, H5T_STD_I64LE, space.get(), H5P_DEFAULT, H5P_DEFAULT)));
  TESSERA_HDF5_CHECK_AT(path, H5Awrite(attribute.get(), H5T_NATIVE_INT64, &value));
}

void write_string_attribute(const std::string& path, hid_t object, const char* name, std::string_view value) {
  Hdf5Handle space = dataspace_handle(TESSERA_HDF5_CHECK_AT(path, H5Screate(H5S_SCALAR)));
  Hdf5Handle type = datatype_handle(TESSERA_HDF5_CHECK_AT(path, H5Tcopy(H5T_C_S1)));
  TESSERA_HDF5_CHECK_AT(path, H5Tset_size(type.get(), value.size() + 1));
  TESSERA_HDF5_CHECK_AT(path, H5Tset_strpad(type.get(), H5T_STR_NULLTERM));
  Hdf5Handle attribute = attribute_handle(
      TESSERA_HDF5_CHECK_AT(path, H5Acreate2(object, name, type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT)));
  const std::string text(value);  // null-terminated
  TESSERA_HDF5_CHECK_AT(path, H5Awrite(attribute.get(), type.get(), text.c_str()));
}

std::vector<int64_t> dataset_dims(const std::string& path, hid_t dataset) {
  Hdf5Handle space = dataspace_handle(TESSERA_HDF5_CHECK_AT(path, H5Dget_space(dataset)));
  const int ndims = TESSERA_HDF5_CHECK_AT(path, H5Sget_simple_extent_ndims(space.get()));
  std::vector<hsize_t> dims(size_t(ndims), 0);
  if (ndims > 0) TESSERA_HDF5_CHECK_AT(path, H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr));
  return std::vector<int64_t>(dims.begin(), dims.end());
}

std::optional<int64_t> element_count(std::span<const int64_t> dims) {
  int64_t count = 1;
  for (int64_t dim : dims)
    if (dim < 0 || __builtin_mul_overflow(count, dim, &count)) return std::nullopt;
  return count;
}

bool all_elements_stored(const std::string& path, hid_t dataset) {
  const std::vector<int64_t> dims = dataset_dims(path, dataset);
  if (element_count(dims) == int64_t(0)) return true;
  Hdf5Handle create = property_list_handle(TESSERA_HDF5_CHECK_AT(path, H5Dget_create_plist(dataset)));
  if (TESSERA_HDF5_CHECK_AT(path, H5Pget_layout(create.get())) == H5D_CHUNKED) {
    // Every chunk in the index. (H5Dget_space_status compares byte counts,
    // which compressed or edge chunks never match.)
    std::vector<hsize_t> chunk(dims.size(), 0);
    TESSERA_HDF5_CHECK_AT(path, H5Pget_chunk(create.get(), int(chunk.size()), chunk.data()));
    hsize_t chunks = 1, stored = 0;
    for (size_t i = 0; i < dims.size(); ++i)
      chunks *= (hsize_t(dims[i]) + chunk[i] - 1) / std::max<hsize_t>(chunk[i], 1);
    Hdf5Handle space = dataspace_handle(TESSERA_HDF5_CHECK_AT(path, H5Dget_space(dataset)));
    TESSERA_HDF5_CHECK_AT(path, H5Dget_num_chunks(dataset, space.get(), &stored));
    return stored == chunks;
  }
  H5D_space_status_t status = H5D_SPACE_STATUS_ERROR;  // contiguous: allocated on the first write
  TESSERA_HDF5_CHECK_AT(path, H5Dget_space_status(dataset, &status));
  return status == H5D_SPACE_STATUS_ALLOCATED;
}

Hdf5Handle create_dataset(const std::string& path, hid_t file, const char* name, hid_t file_type,
                          std::span<const int64_t> dims) {
  const std::vector<hsize_t> sizes = to_hsize(dims);
  Hdf5Handle space =
      dataspace_handle(TESSERA_HDF5_CHECK_AT(path, H5Screate_simple(int(sizes.size()), sizes.data(), nullptr)));
  return dataset_handle(TESSERA_HDF5_CHECK_AT(
      path, H5Dcreate2(file, name, file_type, space.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT)));
}

void read_rows(const std::string& path, hid_t dataset, int64_t first_row, int64_t rows, hid_t memory_type, void* out) {
  if (rows == 0) return;
  std::vector<hsize_t> count;
  Hdf5Handle file_space = select_rows(path, dataset, first_row, rows, count);
  Hdf5Handle memory_space =
      dataspace_handle(TESSERA_HDF5_CHECK_AT(path, H5Screate_simple(int(count.size()), count.data(), nullptr)));
  TESSERA_HDF5_CHECK_AT(path, H5Dread(dataset, memory_type, memory_space.get(), file_space.get(), H5P_DEFAULT, out));
}

void write_rows(const std::string& path, hid_t dataset, int64_t first_row, int64_t rows, hid_t memory_type,
                const void* data) {
  if (rows == 0) return;
  std::vector<hsize_t> count;
  Hdf5Handle file_space = select_rows(path, dataset, first_row, rows, count);
  Hdf5Handle memory_space =
      dataspace_handle(TESSERA_HDF5_CHECK_AT(path, H5Screate_simple(int(count.size()), count.data(), nullptr)));
  TESSERA_HDF5_CHECK_AT(path, H5Dwrite(dataset, memory_type, memory_space.get(), file_space.get(), H5P_DEFAULT, data));
}

}  // namespace tessera::io

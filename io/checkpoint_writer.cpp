// The checkpoint file's writer (rank 0, io/checkpoint_internal.h): CRC-32 of
// the bytes, dtypes as HDF5 types, the datasets and attributes of the format
// (checkpoint.h: /metadata, /tensors, /ranks).
#include <zlib.h>

#include <string>
#include <vector>

#include "core/error.h"
#include "io/checkpoint_internal.h"

namespace tessera::io::checkpoint_detail {

// ---------------------------------------------------------------------------
// Bytes, checksums, dtypes.

uint32_t crc32_of(const void* data, size_t bytes) {
  uLong crc = crc32(0L, Z_NULL, 0);
  const Bytef* at = static_cast<const Bytef*>(data);
  while (bytes > 0) {  // zlib takes 32-bit lengths
    const uInt chunk = uInt(std::min<size_t>(bytes, size_t(1) << 30));
    crc = crc32(crc, at, chunk);
    at += chunk;
    bytes -= chunk;
  }
  return uint32_t(crc);
}

hid_t file_type_of(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return H5T_IEEE_F32LE;
    case DType::bf16:
    case DType::f16:
      return H5T_STD_U16LE;  // raw 16-bit patterns, tagged with tessera_dtype
    case DType::i32:
      return H5T_STD_I32LE;
    case DType::i64:
      return H5T_STD_I64LE;
    case DType::u8:
      return H5T_STD_U8LE;
  }
  throw_unsupported_dtype(dtype, "checkpoint");
}

hid_t memory_type_of(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return H5T_NATIVE_FLOAT;
    case DType::bf16:
    case DType::f16:
      return H5T_NATIVE_UINT16;
    case DType::i32:
      return H5T_NATIVE_INT32;
    case DType::i64:
      return H5T_NATIVE_INT64;
    case DType::u8:
      return H5T_NATIVE_UINT8;
  }
  throw_unsupported_dtype(dtype, "checkpoint");
}

H5T_class_t type_class_of(DType dtype) {
  return dtype == DType::f32 ? H5T_FLOAT : H5T_INTEGER;
}


// ---------------------------------------------------------------------------
// The writer (rank 0): HDF5 file in the temporary directory.

Hdf5Handle group_handle(hid_t id) {
  return {id, H5Gclose};
}

Hdf5Handle create_group(const std::string& path, hid_t parent, const char* name) {
  return group_handle(TESSERA_HDF5_CHECK_AT(path, H5Gcreate2(parent, name, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT)));
}

Hdf5Handle create_dataspace(const std::string& path, const Shape& shape) {
  if (shape.ndim() == 0) return dataspace_handle(TESSERA_HDF5_CHECK_AT(path, H5Screate(H5S_SCALAR)));
  std::vector<hsize_t> dims(shape.sizes().begin(), shape.sizes().end());
  return dataspace_handle(TESSERA_HDF5_CHECK_AT(path, H5Screate_simple(int(dims.size()), dims.data(), nullptr)));
}

void write_u32_attribute(const std::string& path, hid_t object, const char* name, uint32_t value) {
  Hdf5Handle space = dataspace_handle(TESSERA_HDF5_CHECK_AT(path, H5Screate(H5S_SCALAR)));
  Hdf5Handle attribute = attribute_handle(
      TESSERA_HDF5_CHECK_AT(path, H5Acreate2(object, name, H5T_STD_U32LE, space.get(), H5P_DEFAULT, H5P_DEFAULT)));
  TESSERA_HDF5_CHECK_AT(path, H5Awrite(attribute.get(), H5T_NATIVE_UINT32, &value));
}

// A dataset `name` in `group` holding `bytes` (row-major, `dtype`), with its
// dtype and checksum attributes.
void write_tensor_dataset(const std::string& path, hid_t group, const std::string& name, const Shape& shape,
                          DType dtype, const void* bytes) {
  Hdf5Handle space = create_dataspace(path, shape);
  Hdf5Handle dataset = dataset_handle(TESSERA_HDF5_CHECK_AT(
      path, H5Dcreate2(group, name.c_str(), file_type_of(dtype), space.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT)));
  if (shape.numel() > 0)
    TESSERA_HDF5_CHECK_AT(path, H5Dwrite(dataset.get(), memory_type_of(dtype), H5S_ALL, H5S_ALL, H5P_DEFAULT, bytes));
  write_string_attribute(path, dataset.get(), kDtypeAttribute, dtype_name(dtype));
  write_u32_attribute(path, dataset.get(), kCrcAttribute, crc32_of(bytes, size_t(shape.numel()) * dtype_size(dtype)));
}

CheckpointWriter::CheckpointWriter(const fs::path& directory, int64_t step, int ranks,
                                   const CheckpointMetadata& metadata)
    : path_((directory / kCheckpointFile).string()) {
    Hdf5QuietErrors quiet;
    // Format 1.8 or later: attributes over 64 KiB (a long config value) go to dense storage.
    Hdf5Handle access = property_list_handle(TESSERA_HDF5_CHECK_AT(path_, H5Pcreate(H5P_FILE_ACCESS)));
    TESSERA_HDF5_CHECK_AT(path_, H5Pset_libver_bounds(access.get(), H5F_LIBVER_V18, H5F_LIBVER_LATEST));
    const hid_t id = H5Fcreate(path_.c_str(), H5F_ACC_EXCL, H5P_DEFAULT, access.get());
    if (id < 0)
      throw_error(ErrorSite{"HDF5", static_cast<long long>(id), {}, "H5Fcreate", __FILE__, __LINE__, {}},
                  "cannot create " + path_ + ": " + tessera::detail::hdf5_error_stack());
    file_ = file_handle(id);
    write_int64_attribute(path_, file_.get(), kFormatAttribute, kCheckpointFormat);
    write_int64_attribute(path_, file_.get(), "step", step);
    write_int64_attribute(path_, file_.get(), "ranks_saved", ranks);
    Hdf5Handle group = create_group(path_, file_.get(), "metadata");
    for (const auto& [key, value] : metadata) write_string_attribute(path_, group.get(), key.c_str(), value);
    tensors_ = create_group(path_, file_.get(), "tensors");
    ranks_ = create_group(path_, file_.get(), "ranks");
}

void CheckpointWriter::write_tensor(const TensorPlan& plan, const void* bytes) {
    Hdf5QuietErrors quiet;
    write_tensor_dataset(path_, tensors_.get(), plan.name, plan.shape, plan.dtype, bytes);
}

void CheckpointWriter::write_rank_state(int rank, const std::string& key, const std::vector<uint8_t>& bytes) {
    Hdf5QuietErrors quiet;
    const std::string group_name = std::to_string(rank);
    if (!rank_group_.valid() || rank_group_rank_ != rank) {
      rank_group_.reset();
      rank_group_ = create_group(path_, ranks_.get(), group_name.c_str());
      rank_group_rank_ = rank;
    }
    write_tensor_dataset(path_, rank_group_.get(), key, Shape{int64_t(bytes.size())}, DType::u8, bytes.data());
}

void CheckpointWriter::close() {
    {
      Hdf5QuietErrors quiet;
      rank_group_.reset();
      ranks_.reset();
      tensors_.reset();
      TESSERA_HDF5_CHECK_AT(path_, H5Fflush(file_.get(), H5F_SCOPE_GLOBAL));  // errors surface here, not in close
      file_.reset();
    }
    fsync_path(path_, false);
}

}  // namespace tessera::io::checkpoint_detail

// The checkpoint file's writer (rank 0, io/checkpoint_internal.h): CRC-32 of
// the bytes, dtypes as HDF5 types, the datasets and attributes of the format
// (checkpoint.h: /metadata, /tensors, /ranks): format 1's whole tensors, and
// format 2's virtual datasets, each mapping the pieces in the rank files to
// their places in the whole tensor as HDF5 hyperslabs.
#include <zlib.h>

#include <cmath>
#include <limits>
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

// HDF5's 1.8 object format or later: attributes over 64 KiB (a long config
// value) go to dense storage, and a group is a few links in an object header.
Hdf5Handle create_checkpoint_file(const std::string& path) {
  Hdf5Handle access = property_list_handle(TESSERA_HDF5_CHECK_AT(path, H5Pcreate(H5P_FILE_ACCESS)));
  TESSERA_HDF5_CHECK_AT(path, H5Pset_libver_bounds(access.get(), H5F_LIBVER_V18, H5F_LIBVER_LATEST));
  const Hdf5Serial serial;  // calls outside TESSERA_HDF5_CHECK (io/hdf5_threads.h)
  const hid_t id = H5Fcreate(path.c_str(), H5F_ACC_EXCL, H5P_DEFAULT, access.get());
  if (id < 0)
    throw_error(ErrorSite{"HDF5", static_cast<long long>(id), {}, "H5Fcreate", __FILE__, __LINE__, {}},
                "cannot create " + path + ": " + tessera::detail::hdf5_error_stack());
  return file_handle(id);
}

CheckpointWriter::CheckpointWriter(const fs::path& directory, int64_t step, int ranks,
                                   const CheckpointMetadata& metadata, int64_t format)
    : path_((directory / kCheckpointFile).string()) {
  Hdf5QuietErrors quiet;
  file_ = create_checkpoint_file(path_);
  write_int64_attribute(path_, file_.get(), kFormatAttribute, format);
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

namespace {

// A box of a tensor as an HDF5 hyperslab (start, stride, count, block per
// dimension) and the range of a piece's flattening it takes, in order.
struct Hyperslab {
  std::vector<hsize_t> start, stride, count, block;
  int64_t piece = 0, numel = 0;
};

// The elements [g, g + n) of a tensor of `dims`, row-major, as boxes in
// order, each itself a row-major range: at g, the outermost dimension d
// whose sub-blocks g is aligned to and n still fills, as many of them as
// fit before the next index of dimension d - 1 (at most 2·ndim boxes).
void flat_range_boxes(const std::vector<hsize_t>& dims, int64_t g, int64_t n, int64_t piece,
                      std::vector<Hyperslab>& out) {
  const int ndim = int(dims.size());
  std::vector<int64_t> stride(size_t(ndim), 1);  // elements per index of each dimension
  for (int d = ndim - 2; d >= 0; --d) stride[size_t(d)] = stride[size_t(d) + 1] * int64_t(dims[size_t(d) + 1]);
  while (n > 0) {
    int d = 0;
    while (g % stride[size_t(d)] != 0 || stride[size_t(d)] > n) ++d;
    const int64_t index = (g / stride[size_t(d)]) % int64_t(dims[size_t(d)]);
    const int64_t take = std::min(n / stride[size_t(d)], int64_t(dims[size_t(d)]) - index);
    Hyperslab box;
    for (int k = 0; k < ndim; ++k) {
      const int64_t at = (g / stride[size_t(k)]) % int64_t(dims[size_t(k)]);
      box.start.push_back(hsize_t(k <= d ? at : 0));
      box.stride.push_back(1);
      box.count.push_back(1);
      box.block.push_back(k < d ? 1 : k == d ? hsize_t(take) : dims[size_t(k)]);
    }
    box.piece = piece;
    box.numel = take * stride[size_t(d)];
    out.push_back(std::move(box));
    g += box.numel;
    piece += box.numel;
    n -= box.numel;
  }
}

// Appends `box` to `slab` as one more block at a constant stride along one
// dimension k when that keeps row-major order: same block shape, starts
// equal but along k, blocks 1 wide before k, and slab repeated along k only.
bool extend(Hyperslab& slab, const Hyperslab& box) {
  const size_t ndim = slab.start.size();
  if (box.block != slab.block || box.piece != slab.piece + slab.numel) return false;
  for (size_t k = 0; k < ndim; ++k) {
    if (box.start[k] == slab.start[k]) continue;
    for (size_t j = 0; j < ndim; ++j)
      if (j != k && (box.start[j] != slab.start[j] || slab.count[j] != 1)) return false;
    for (size_t j = 0; j < k; ++j)
      if (slab.block[j] != 1) return false;
    const hsize_t next = slab.start[k] + slab.count[k] * slab.stride[k];
    if (slab.count[k] == 1) {
      if (box.start[k] < slab.start[k] + slab.block[k]) return false;
      slab.stride[k] = box.start[k] - slab.start[k];
    } else if (box.start[k] != next) {
      return false;
    }
    ++slab.count[k];
    slab.numel += box.numel;
    return true;
  }
  return false;
}

// A piece's runs as few hyperslabs as row-major order allows (a column
// shard's one run per row is one strided hyperslab).
std::vector<Hyperslab> hyperslabs(const std::vector<Run>& runs, const Shape& shape) {
  if (shape.ndim() == 0) return {Hyperslab{{}, {}, {}, {}, 0, 1}};  // a scalar: all of it
  const std::vector<hsize_t> dims(shape.sizes().begin(), shape.sizes().end());
  std::vector<Hyperslab> boxes, merged;
  for (const Run& run : runs) flat_range_boxes(dims, run.global, run.count, run.piece, boxes);
  for (Hyperslab& box : boxes)
    if (merged.empty() || !extend(merged.back(), box)) merged.push_back(std::move(box));
  return merged;
}

// A source dataset's name for H5Pset_virtual, whose '%' is a format character.
std::string virtual_source_name(const std::string& name) {
  std::string out = "/";
  for (char c : name) out += c == '%' ? std::string("%%") : std::string(1, c);
  return out;
}

// Where nothing is mapped (a rank file missing when a tool reads through
// the virtual dataset), floats read NaN, not a plausible zero.
void set_missing_value(const std::string& path, hid_t create, DType dtype) {
  if (dtype == DType::f32) {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    TESSERA_HDF5_CHECK_AT(path, H5Pset_fill_value(create, H5T_NATIVE_FLOAT, &nan));
  } else if (dtype == DType::bf16 || dtype == DType::f16) {
    const uint16_t nan = dtype == DType::bf16 ? 0x7FC0 : 0x7E00;
    TESSERA_HDF5_CHECK_AT(path, H5Pset_fill_value(create, H5T_NATIVE_UINT16, &nan));
  }
}

void write_piece_table(const std::string& path, hid_t dataset, const std::vector<int64_t>& rows) {
  const hsize_t dims[2] = {hsize_t(rows.size() / kPieceRowLength), hsize_t(kPieceRowLength)};
  Hdf5Handle space = dataspace_handle(TESSERA_HDF5_CHECK_AT(path, H5Screate_simple(2, dims, nullptr)));
  Hdf5Handle attribute = attribute_handle(TESSERA_HDF5_CHECK_AT(
      path, H5Acreate2(dataset, kPiecesAttribute, H5T_STD_I64LE, space.get(), H5P_DEFAULT, H5P_DEFAULT)));
  TESSERA_HDF5_CHECK_AT(path, H5Awrite(attribute.get(), H5T_NATIVE_INT64, rows.data()));
}

}  // namespace

void CheckpointWriter::write_virtual_tensor(const TensorPlan& plan, const std::vector<uint32_t>& crcs) {
  Hdf5QuietErrors quiet;
  Hdf5Handle create = property_list_handle(TESSERA_HDF5_CHECK_AT(path_, H5Pcreate(H5P_DATASET_CREATE)));
  set_missing_value(path_, create.get(), plan.dtype);
  Hdf5Handle space = create_dataspace(path_, plan.shape);
  std::vector<int64_t> rows;
  for (size_t i = 0; i < plan.owned.size(); ++i) {
    const PieceInfo& piece = *plan.owned[i];
    const PieceLayout layout = piece_layout(plan.name, plan.shape, piece.slice, piece.local, "writing the index");
    if (layout.numel == 0) continue;
    const StoredPiece stored{piece.rank, piece.index, crcs.at(i), piece.slice, piece.local};
    const std::vector<int64_t> row = piece_row(stored);
    rows.insert(rows.end(), row.begin(), row.end());
    const std::string file = rank_file_name(piece.rank);
    const std::string source = virtual_source_name(piece_dataset_name(plan.name, piece.index));
    const hsize_t source_size = hsize_t(layout.numel);
    Hdf5Handle source_space =
        dataspace_handle(TESSERA_HDF5_CHECK_AT(path_, H5Screate_simple(1, &source_size, nullptr)));
    for (const Hyperslab& slab : hyperslabs(layout.runs, plan.shape)) {
      Hdf5Handle mapped = dataspace_handle(TESSERA_HDF5_CHECK_AT(path_, H5Scopy(space.get())));
      if (plan.shape.ndim() == 0)
        TESSERA_HDF5_CHECK_AT(path_, H5Sselect_all(mapped.get()));
      else
        TESSERA_HDF5_CHECK_AT(path_, H5Sselect_hyperslab(mapped.get(), H5S_SELECT_SET, slab.start.data(),
                                                         slab.stride.data(), slab.count.data(), slab.block.data()));
      const hsize_t first = hsize_t(slab.piece), count = 1, block = hsize_t(slab.numel);
      TESSERA_HDF5_CHECK_AT(path_,
                            H5Sselect_hyperslab(source_space.get(), H5S_SELECT_SET, &first, nullptr, &count, &block));
      TESSERA_HDF5_CHECK_AT(
          path_, H5Pset_virtual(create.get(), mapped.get(), file.c_str(), source.c_str(), source_space.get()));
    }
  }
  Hdf5Handle dataset = dataset_handle(
      TESSERA_HDF5_CHECK_AT(path_, H5Dcreate2(tensors_.get(), plan.name.c_str(), file_type_of(plan.dtype), space.get(),
                                              H5P_DEFAULT, create.get(), H5P_DEFAULT)));
  write_string_attribute(path_, dataset.get(), kDtypeAttribute, dtype_name(plan.dtype));
  if (!rows.empty()) write_piece_table(path_, dataset.get(), rows);
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

// CheckpointReader (checkpoint.h): opens a checkpoint, checks its format,
// lists its tensors (naming any whose header HDF5 cannot read), and reads
// tensors and slices of them with their CRC-32 verified: format 1 reads the
// whole tensor (kept so a tensor's pieces are read and checked once); format
// 2 reads, from the rank files, only the stored pieces that overlap the
// slice asked for (kept while the same tensor is read).
#include <hdf5.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <sstream>

#include "core/context.h"
#include "core/error.h"
#include "io/checkpoint_internal.h"

namespace tessera::io {

using namespace checkpoint_detail;

// ---------------------------------------------------------------------------
// CheckpointReader

namespace {

// A format-2 tensor's stored piece with its runs in the tensor, sorted by
// their place in the tensor.
struct PieceOnDisk {
  StoredPiece stored;
  std::vector<Run> runs;
  int64_t numel = 0;
};

// The runs where a piece asked for (`wanted`) and a stored piece overlap:
// global = offset in the stored piece, piece = offset in the one asked for.
std::vector<Run> overlap(const std::vector<Run>& wanted, const std::vector<Run>& stored) {
  std::vector<Run> out;
  size_t i = 0, j = 0;
  while (i < wanted.size() && j < stored.size()) {
    const Run& a = wanted[i];
    const Run& b = stored[j];
    const int64_t lo = std::max(a.global, b.global), hi = std::min(a.global + a.count, b.global + b.count);
    if (lo < hi) out.push_back({b.piece + (lo - b.global), a.piece + (lo - a.global), hi - lo});
    if (a.global + a.count <= b.global + b.count)
      ++i;
    else
      ++j;
  }
  return out;
}

std::vector<Run> sorted_runs(std::vector<Run> runs) {
  std::sort(runs.begin(), runs.end(), [](const Run& a, const Run& b) { return a.global < b.global; });
  return runs;
}

}  // namespace

struct CheckpointReader::State {
  std::string path;    // the HDF5 file
  fs::path directory;  // the step directory
  Hdf5Handle file, tensors_group;
  int64_t format = 1;
  int64_t step = 0;
  int ranks_saved = 0;
  std::vector<std::vector<PieceOnDisk>> pieces;                    // format 2: per tensor (as `tensors`)
  mutable std::map<int, Hdf5Handle> rank_files;                    // format 2: opened as needed
  mutable std::map<size_t, std::vector<std::byte>> cached_pieces;  // format 2: of cached_name, by piece
  CheckpointMetadata metadata;
  std::vector<StoredTensor> tensors;
  std::map<std::string, size_t> index;
  std::vector<std::pair<std::string, std::string>> damaged;  // tensor name, HDF5's complaint
  // The last tensor read() read, checksum verified: pieces of one tensor are
  // read one after another, and each would otherwise read and check it whole.
  mutable std::string cached_name;
  mutable std::vector<std::byte> cached_bytes;

  // The whole tensor's verified bytes, through the one-entry cache.
  const std::vector<std::byte>& whole_verified(const StoredTensor& tensor) const {
    if (cached_name != tensor.name) {
      cached_name.clear();
      cached_bytes.clear();
      cached_bytes.shrink_to_fit();  // the old tensor goes before the new one is read
      cached_bytes = read_verified(tensor);
      cached_name = tensor.name;
    }
    return cached_bytes;
  }

  // The whole tensor's bytes, checksum verified (throws naming tensor and file).
  std::vector<std::byte> read_verified(const StoredTensor& tensor) const {
    std::vector<std::byte> bytes = read_raw(tensor);
    const uint32_t crc = crc32_of(bytes.data(), bytes.size());
    TESSERA_CHECK(crc == tensor.crc32, "checksum mismatch in tensor ", tensor.name, " of ", path, ": ",
                  corrupt_advice(directory));
    return bytes;
  }

  // Format 2: the rank file of `rank`, opened once.
  hid_t rank_file(int rank) const {
    auto found = rank_files.find(rank);
    if (found != rank_files.end()) return found->second.get();
    const std::string name = (directory / rank_file_name(rank)).string();
    std::error_code error;
    TESSERA_CHECK(fs::exists(name, error), "checkpoint ", directory.string(), " is incomplete: ", name, " (rank ", rank,
                  "'s pieces) is missing; ", corrupt_advice(directory));
    check_readable_file(name, "checkpoint", "check the file's permissions");
    Hdf5QuietErrors quiet;
    const Hdf5Serial serial;  // calls outside TESSERA_HDF5_CHECK (io/hdf5_threads.h)
    const hid_t id = H5Fopen(name.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    TESSERA_CHECK(id >= 0, "checkpoint ", directory.string(), " is damaged: ", name, " (rank ", rank,
                  "'s pieces) cannot be opened as an HDF5 file; ", corrupt_advice(directory));
    return rank_files.emplace(rank, file_handle(id)).first->second.get();
  }

  // Format 2: stored piece k of `tensor` (index `t`), its CRC verified.
  std::vector<std::byte> read_piece(const StoredTensor& tensor, const PieceOnDisk& piece) const {
    const hid_t source = rank_file(piece.stored.rank);
    const std::string where = (directory / rank_file_name(piece.stored.rank)).string();
    const std::string name = piece_dataset_name(tensor.name, piece.stored.index);
    Hdf5QuietErrors quiet;
    Hdf5Handle dataset = dataset_handle(TESSERA_HDF5_CHECK_AT(where, H5Dopen2(source, name.c_str(), H5P_DEFAULT)));
    const std::vector<int64_t> dims = dataset_dims(where, dataset.get());
    TESSERA_CHECK(dims.size() == 1 && dims[0] == piece.numel, where, ": ", name, " does not hold the ", piece.numel,
                  " elements the index lists: ", corrupt_advice(directory));
    std::vector<std::byte> bytes(size_t(piece.numel) * dtype_size(tensor.dtype));
    TESSERA_HDF5_CHECK_AT(
        where, H5Dread(dataset.get(), memory_type_of(tensor.dtype), H5S_ALL, H5S_ALL, H5P_DEFAULT, bytes.data()));
    TESSERA_CHECK(crc32_of(bytes.data(), bytes.size()) == piece.stored.crc32, "checksum mismatch in tensor ",
                  tensor.name, " of ", where, " (rank ", piece.stored.rank, "'s piece ", name,
                  "): ", corrupt_advice(directory));
    return bytes;
  }

  // Format 2: the pieces of tensor `t` overlapping `wanted`, copied into `out`.
  void gather_from_pieces(size_t t, const std::vector<Run>& wanted, int64_t numel, std::byte* out) const {
    const StoredTensor& tensor = tensors[t];
    if (cached_name != tensor.name) {
      cached_pieces.clear();
      cached_name = tensor.name;
    }
    const size_t element = dtype_size(tensor.dtype);
    const std::vector<Run> asked = sorted_runs(wanted);
    int64_t copied = 0;
    for (size_t k = 0; k < pieces[t].size(); ++k) {
      const std::vector<Run> shared = overlap(asked, pieces[t][k].runs);
      if (shared.empty()) continue;
      auto cached = cached_pieces.find(k);
      if (cached == cached_pieces.end()) cached = cached_pieces.emplace(k, read_piece(tensor, pieces[t][k])).first;
      for (const Run& run : shared) {
        std::memcpy(out + run.piece * int64_t(element), cached->second.data() + run.global * int64_t(element),
                    size_t(run.count) * element);
        copied += run.count;
      }
    }
    TESSERA_CHECK(copied == numel, "checkpoint ", path, ": the stored pieces of tensor ", tensor.name, " cover ",
                  copied, " of the ", numel, " elements asked for: ", corrupt_advice(directory));
  }

  std::vector<std::byte> read_raw(const StoredTensor& tensor) const {
    Hdf5QuietErrors quiet;
    std::vector<std::byte> bytes(size_t(tensor.shape.numel()) * dtype_size(tensor.dtype));
    Hdf5Handle dataset =
        dataset_handle(TESSERA_HDF5_CHECK_AT(path, H5Dopen2(tensors_group.get(), tensor.name.c_str(), H5P_DEFAULT)));
    if (!bytes.empty())
      TESSERA_HDF5_CHECK_AT(
          path, H5Dread(dataset.get(), memory_type_of(tensor.dtype), H5S_ALL, H5S_ALL, H5P_DEFAULT, bytes.data()));
    return bytes;
  }
};

namespace {

herr_t collect_link_name(hid_t, const char* name, const H5L_info_t*, void* names) {
  static_cast<std::vector<std::string>*>(names)->emplace_back(name);
  return 0;
}

herr_t collect_attribute_name(hid_t, const char* name, const H5A_info_t*, void* names) {
  static_cast<std::vector<std::string>*>(names)->emplace_back(name);
  return 0;
}

// Whether `name` (a path relative to `object`, every parent existing or not) is a link.
bool link_exists(hid_t object, const std::string& name) {
  const Hdf5Serial serial;  // calls outside TESSERA_HDF5_CHECK (io/hdf5_threads.h)
  Hdf5QuietErrors quiet;
  size_t at = 0;
  bool exists = true;
  while (exists) {
    at = name.find('/', at + 1);
    exists = H5Lexists(object, name.substr(0, at).c_str(), H5P_DEFAULT) > 0;
    if (at == std::string::npos) break;
  }
  H5Eclear2(H5E_DEFAULT);
  return exists;
}

fs::path resolve_checkpoint_file(const std::string& path) {
  std::error_code error;
  const fs::path given(path);
  TESSERA_CHECK(fs::exists(given, error), "checkpoint ", path, " does not exist; check the path (--resume)");
  if (!fs::is_directory(given, error)) return given;
  const fs::path file = given / kCheckpointFile;
  if (fs::exists(file, error)) return file;
  const bool save_dir = fs::exists(given / kLatestFile, error) || !list_step_directories(given).empty();
  TESSERA_THROW(path, " holds no ", kCheckpointFile,
                save_dir ? ": it is a save directory; pass one of its step_* directories (or --resume auto)"
                         : ": it is not a checkpoint directory");
}

}  // namespace

namespace {

// The innermost entry of an HDF5 error message ("#5 H5B__cache_deserialize:
// wrong B-tree signature (...)"): what is damaged, without the call chain.
std::string innermost_hdf5_error(const std::string& message) {
  const size_t last = message.rfind("; #");
  return last == std::string::npos ? message : message.substr(last + 2);
}

// Runs `read` (part of opening a checkpoint); an HDF5 failure there means the
// file's metadata is damaged: said as a corrupt checkpoint is, naming `part`.
template <typename Read>
void read_part(const std::string& path, const fs::path& directory, const std::string& part, Read&& read) {
  try {
    read();
  } catch (const Error& error) {
    if (error.library() != "HDF5") throw;
    TESSERA_THROW("checkpoint ", path, " is damaged: HDF5 cannot read ", part, " (",
                  innermost_hdf5_error(error.message()), "); ", corrupt_advice(directory));
  }
}

// A tensor dataset's shape, checked to be one a file can hold, and its HDF5
// type checked against its `tessera_dtype` tag.
Shape checked_shape_and_type(const std::string& p, const fs::path& directory, hid_t dataset, const std::string& name,
                             DType dtype) {
  const std::vector<int64_t> dims = dataset_dims(p, dataset);
  TESSERA_CHECK(dims.size() <= size_t(Shape::kMaxDims), p, ": tensor ", name, " has ", dims.size(),
                " dimensions, more than ", Shape::kMaxDims);
  const std::optional<int64_t> count = element_count(dims);
  TESSERA_CHECK(count && *count <= std::numeric_limits<int64_t>::max() / 8, p, ": tensor ", name,
                " claims more elements than a file can hold: ", corrupt_advice(directory));
  Hdf5Handle type = datatype_handle(TESSERA_HDF5_CHECK_AT(p, H5Dget_type(dataset)));
  const Hdf5Serial serial;  // calls outside TESSERA_HDF5_CHECK (io/hdf5_threads.h)
  TESSERA_CHECK(H5Tget_class(type.get()) == type_class_of(dtype) && H5Tget_size(type.get()) == dtype_size(dtype), p,
                ": tensor ", name, " is tagged ", dtype_name(dtype),
                " but its HDF5 type does not match: ", corrupt_advice(directory));
  return Shape(dims);
}

// A tensor's stored description, from its dataset's header.
StoredTensor read_stored_tensor(const std::string& p, const fs::path& directory, hid_t tensors_group,
                                const std::string& name) {
  Hdf5Handle dataset = dataset_handle(TESSERA_HDF5_CHECK_AT(p, H5Dopen2(tensors_group, name.c_str(), H5P_DEFAULT)));
  StoredTensor stored;
  stored.name = name;
  TESSERA_CHECK(has_attribute(dataset.get(), kDtypeAttribute) && has_attribute(dataset.get(), kCrcAttribute), p,
                ": tensor ", name, " lacks its '", kDtypeAttribute, "' or '", kCrcAttribute,
                "' attribute: ", corrupt_advice(directory));
  stored.dtype = parse_dtype(read_string_attribute(p, dataset.get(), kDtypeAttribute));
  stored.crc32 = uint32_t(read_int64_attribute(p, dataset.get(), kCrcAttribute));
  stored.shape = checked_shape_and_type(p, directory, dataset.get(), name, stored.dtype);
  TESSERA_CHECK(all_elements_stored(p, dataset.get()), p, ": tensor ", name,
                " has no data stored for some or all of its elements (created but not completely written): ",
                corrupt_advice(directory));
  return stored;
}

// Format 2: a tensor's description from its virtual dataset's header and
// its table of stored pieces (each checked against the tensor).
StoredTensor read_virtual_tensor(const std::string& p, const fs::path& directory, hid_t tensors_group,
                                 const std::string& name, std::vector<PieceOnDisk>& pieces) {
  Hdf5Handle dataset = dataset_handle(TESSERA_HDF5_CHECK_AT(p, H5Dopen2(tensors_group, name.c_str(), H5P_DEFAULT)));
  StoredTensor stored;
  stored.name = name;
  TESSERA_CHECK(has_attribute(dataset.get(), kDtypeAttribute), p, ": tensor ", name, " lacks its '", kDtypeAttribute,
                "' attribute: ", corrupt_advice(directory));
  stored.dtype = parse_dtype(read_string_attribute(p, dataset.get(), kDtypeAttribute));
  stored.shape = checked_shape_and_type(p, directory, dataset.get(), name, stored.dtype);
  std::vector<int64_t> rows;
  if (has_attribute(dataset.get(), kPiecesAttribute)) {
    Hdf5Handle attribute =
        attribute_handle(TESSERA_HDF5_CHECK_AT(p, H5Aopen(dataset.get(), kPiecesAttribute, H5P_DEFAULT)));
    Hdf5Handle space = dataspace_handle(TESSERA_HDF5_CHECK_AT(p, H5Aget_space(attribute.get())));
    hsize_t table[2] = {0, 0};
    const Hdf5Serial serial;  // calls outside TESSERA_HDF5_CHECK (io/hdf5_threads.h)
    TESSERA_CHECK(H5Sget_simple_extent_ndims(space.get()) == 2, p, ": tensor ", name, "'s '", kPiecesAttribute,
                  "' is not a table: ", corrupt_advice(directory));
    TESSERA_HDF5_CHECK_AT(p, H5Sget_simple_extent_dims(space.get(), table, nullptr));
    TESSERA_CHECK(table[1] == hsize_t(kPieceRowLength) && table[0] <= hsize_t(1) << 20, p, ": tensor ", name, "'s '",
                  kPiecesAttribute, "' has rows of ", table[1], " values, not ", kPieceRowLength, ": ",
                  corrupt_advice(directory));
    rows.resize(size_t(table[0] * table[1]));
    TESSERA_HDF5_CHECK_AT(p, H5Aread(attribute.get(), H5T_NATIVE_INT64, rows.data()));
  }
  int64_t covered = 0;
  for (size_t at = 0; at < rows.size(); at += kPieceRowLength) {
    PieceOnDisk piece;
    try {
      piece.stored = piece_from_row(rows.data() + at);
      PieceLayout layout = piece_layout(name, stored.shape, piece.stored.slice, piece.stored.local, "reading " + p);
      piece.runs = sorted_runs(std::move(layout.runs));
      piece.numel = layout.numel;
    } catch (const Error& error) {
      TESSERA_THROW(p, ": tensor ", name, "'s table of pieces is damaged (", error.message(),
                    "): ", corrupt_advice(directory));
    }
    covered += piece.numel;
    pieces.push_back(std::move(piece));
  }
  TESSERA_CHECK(covered == stored.shape.numel(), p, ": the pieces of tensor ", name, " hold ", covered, " of its ",
                stored.shape.numel(), " elements: ", corrupt_advice(directory));
  stored.pieces = int(pieces.size());
  return stored;
}

}  // namespace

CheckpointReader::CheckpointReader(const std::string& path) : state_(new State) {
  std::unique_ptr<State> state(state_);
  const fs::path file = resolve_checkpoint_file(path);
  state->path = file.string();
  state->directory = file.parent_path();
  check_readable_file(state->path, "checkpoint", "check the path (--resume)");
  const std::string& p = state->path;
  const fs::path& directory = state->directory;
  Hdf5QuietErrors quiet;
  read_part(p, directory, "its superblock (the file's header: it cannot be opened as an HDF5 file)", [&] {
    const Hdf5Serial serial;  // calls outside TESSERA_HDF5_CHECK (io/hdf5_threads.h)
    const hid_t id = H5Fopen(p.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    if (id < 0)
      throw_error(ErrorSite{"HDF5", static_cast<long long>(id), {}, "H5Fopen", __FILE__, __LINE__, {}},
                  tessera::detail::hdf5_error_stack());
    state->file = file_handle(id);
  });
  const hid_t root = state->file.get();
  read_part(p, directory, "its root attributes (format, step, ranks)", [&] {
    const std::optional<bool> tagged = attribute_exists(root, kFormatAttribute);
    if (!tagged) TESSERA_HDF5_CHECK_AT(p, H5Aexists(root, kFormatAttribute));  // damaged: HDF5's reason
    TESSERA_CHECK(*tagged, p, " is not a Tessera checkpoint: its root has no '", kFormatAttribute,
                  "' attribute (a dataset file? checkpoints are step_* directories written by --save); if it is one, ",
                  corrupt_advice(directory));
    const int64_t format = read_int64_attribute(p, root, kFormatAttribute);
    TESSERA_CHECK(format <= kCheckpointFormat, p, " is checkpoint format ", format,
                  ", newer than this build reads (up to ", kCheckpointFormat, "); load it with a newer tessera");
    TESSERA_CHECK(format >= 1, p, ": invalid checkpoint format ", format, "; ", corrupt_advice(directory));
    state->format = format;
    state->step = read_int64_attribute(p, root, "step");
    state->ranks_saved = int(read_int64_attribute(p, root, "ranks_saved"));
  });
  TESSERA_CHECK(link_exists(root, "tensors"), p, ": it has no /tensors group: ", corrupt_advice(directory));
  read_part(p, directory, "its metadata (/metadata)", [&] {
    if (!link_exists(root, "metadata")) return;
    Hdf5Handle group = group_handle(TESSERA_HDF5_CHECK_AT(p, H5Gopen2(root, "metadata", H5P_DEFAULT)));
    std::vector<std::string> keys;
    TESSERA_HDF5_CHECK_AT(p,
                          H5Aiterate2(group.get(), H5_INDEX_NAME, H5_ITER_INC, nullptr, collect_attribute_name, &keys));
    for (const std::string& key : keys) state->metadata[key] = read_string_attribute(p, group.get(), key.c_str());
  });
  std::vector<std::string> names;
  read_part(p, directory, "its list of tensors (/tensors)", [&] {
    state->tensors_group = group_handle(TESSERA_HDF5_CHECK_AT(p, H5Gopen2(root, "tensors", H5P_DEFAULT)));
    TESSERA_HDF5_CHECK_AT(
        p, H5Literate(state->tensors_group.get(), H5_INDEX_NAME, H5_ITER_INC, nullptr, collect_link_name, &names));
  });
  for (const std::string& name : names) {
    try {
      std::vector<PieceOnDisk> pieces;
      StoredTensor stored = state->format >= 2
                                ? read_virtual_tensor(p, directory, state->tensors_group.get(), name, pieces)
                                : read_stored_tensor(p, directory, state->tensors_group.get(), name);
      state->index[name] = state->tensors.size();
      state->tensors.push_back(std::move(stored));
      state->pieces.push_back(std::move(pieces));
    } catch (const Error& error) {
      if (error.library() != "HDF5") throw;
      state->damaged.emplace_back(name, innermost_hdf5_error(error.message()));
    }
  }
  state.release();
}

CheckpointReader::~CheckpointReader() {
  delete state_;
}

const std::string& CheckpointReader::path() const {
  return state_->path;
}
int64_t CheckpointReader::step() const {
  return state_->step;
}
const CheckpointMetadata& CheckpointReader::metadata() const {
  return state_->metadata;
}
const std::vector<StoredTensor>& CheckpointReader::tensors() const {
  return state_->tensors;
}
bool CheckpointReader::has_tensor(const std::string& name) const {
  return state_->index.count(name) > 0;
}
int CheckpointReader::ranks_saved() const {
  return state_->ranks_saved;
}
int64_t CheckpointReader::format() const {
  return state_->format;
}
const std::vector<std::pair<std::string, std::string>>& CheckpointReader::damaged() const {
  return state_->damaged;
}

std::optional<std::vector<uint8_t>> CheckpointReader::rank_state(int world_rank, const std::string& key) const {
  const std::string& p = state_->path;
  const std::string link = "ranks/" + std::to_string(world_rank) + "/" + key;
  const hid_t root = state_->file.get();
  if (key.empty() || key.find('/') != std::string::npos || !link_exists(root, link)) return std::nullopt;
  Hdf5QuietErrors quiet;
  Hdf5Handle dataset = dataset_handle(TESSERA_HDF5_CHECK_AT(p, H5Dopen2(root, link.c_str(), H5P_DEFAULT)));
  const std::vector<int64_t> dims = dataset_dims(p, dataset.get());
  TESSERA_CHECK(dims.size() == 1, p, ": rank state ", link, " must be a 1-D byte dataset");
  TESSERA_CHECK(all_elements_stored(p, dataset.get()), p, ": rank state ", link,
                " has no data stored for some or all of its bytes: ", corrupt_advice(state_->directory));
  std::vector<uint8_t> bytes(static_cast<size_t>(dims[0]));
  if (!bytes.empty())
    TESSERA_HDF5_CHECK_AT(p, H5Dread(dataset.get(), H5T_NATIVE_UINT8, H5S_ALL, H5S_ALL, H5P_DEFAULT, bytes.data()));
  if (has_attribute(dataset.get(), kCrcAttribute)) {
    const uint32_t expected = uint32_t(read_int64_attribute(p, dataset.get(), kCrcAttribute));
    TESSERA_CHECK(crc32_of(bytes.data(), bytes.size()) == expected, "checksum mismatch in rank state ", link, " of ", p,
                  ": ", corrupt_advice(state_->directory));
  }
  return bytes;
}

std::vector<std::string> CheckpointReader::rank_state_keys(int world_rank) const {
  const std::string group_name = "ranks/" + std::to_string(world_rank);
  std::vector<std::string> keys;
  if (!link_exists(state_->file.get(), group_name)) return keys;
  Hdf5QuietErrors quiet;
  Hdf5Handle group =
      group_handle(TESSERA_HDF5_CHECK_AT(state_->path, H5Gopen2(state_->file.get(), group_name.c_str(), H5P_DEFAULT)));
  TESSERA_HDF5_CHECK_AT(state_->path,
                        H5Literate(group.get(), H5_INDEX_NAME, H5_ITER_INC, nullptr, collect_link_name, &keys));
  return keys;
}

void CheckpointReader::read(TensorPiece& piece) const {
  const std::string what = "loading " + state_->path;
  check_piece_local(piece, what);
  const auto found = state_->index.find(piece.name);
  for (const auto& [name, complaint] : state_->damaged)
    TESSERA_CHECK(name != piece.name, "checkpoint ", state_->path,
                  " is damaged: HDF5 cannot read the header of tensor ", name, " (", complaint, "); ",
                  corrupt_advice(state_->directory));
  if (found == state_->index.end()) {
    std::string names;
    for (size_t i = 0; i < state_->tensors.size() && i < 8; ++i) names += (i ? ", " : "") + state_->tensors[i].name;
    if (state_->tensors.size() > 8) names += ", ...";
    TESSERA_THROW(what, ": the checkpoint has no tensor ", piece.name, " (it has ", state_->tensors.size(),
                  " tensors: ", names, "); was it saved from another model? (`tessera checkpoint inspect` lists them)");
  }
  const StoredTensor& stored = state_->tensors[found->second];
  TESSERA_CHECK(stored.shape == piece.global_shape, what, ": tensor ", piece.name, " has shape ",
                stored.shape.to_string(), " in the checkpoint but ", piece.global_shape.to_string(),
                " here; the checkpoint was saved with a different model configuration");
  TESSERA_CHECK(stored.dtype == piece.dtype, what, ": tensor ", piece.name, " is ", dtype_name(stored.dtype),
                " in the checkpoint but ", dtype_name(piece.dtype),
                " here; the checkpoint was saved with a different precision (--precision)");
  const PieceLayout layout = piece_layout(piece.name, piece.global_shape, piece.slice, piece.local.shape(), what);
  Tensor host = piece.local.device().is_cpu()
                    ? piece.local
                    : piece.local.context().empty(piece.local.shape(), piece.dtype, Device::cpu());
  std::byte* out = static_cast<std::byte*>(host.data_ptr());
  if (state_->format >= 2) {
    if (layout.numel > 0) state_->gather_from_pieces(found->second, layout.runs, layout.numel, out);
  } else {
    gather_runs(layout.runs, dtype_size(stored.dtype), state_->whole_verified(stored).data(), out);
  }
  if (!host.shares_storage_with(piece.local)) piece.local.copy_(host);
}

std::vector<std::string> CheckpointReader::verify() const {
  std::vector<std::string> bad;
  for (const auto& [name, complaint] : state_->damaged) bad.push_back(name);
  for (size_t t = 0; t < state_->tensors.size(); ++t) {
    const StoredTensor& tensor = state_->tensors[t];
    if (state_->format >= 2) {
      try {
        for (const PieceOnDisk& piece : state_->pieces[t]) state_->read_piece(tensor, piece);
      } catch (const Error&) {
        bad.push_back(tensor.name);  // unreadable or not matching its CRC
      }
      continue;
    }
    try {
      const std::vector<std::byte> bytes = state_->read_raw(tensor);
      if (crc32_of(bytes.data(), bytes.size()) != tensor.crc32) bad.push_back(tensor.name);
    } catch (const Error&) {
      bad.push_back(tensor.name);  // unreadable counts as corrupt
    }
  }
  return bad;
}

}  // namespace tessera::io

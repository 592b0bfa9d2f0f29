// CheckpointReader (checkpoint.h): opens a checkpoint, checks its format,
// lists its tensors (naming any whose header HDF5 cannot read), and reads
// tensors and slices of them with their CRC-32 verified, keeping the last
// tensor read so a tensor's pieces are read and checked once.
#include <hdf5.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <sstream>

#include "core/context.h"
#include "core/error.h"
#include "io/checkpoint_internal.h"

namespace tessera::io {

using namespace checkpoint_detail;

// ---------------------------------------------------------------------------
// CheckpointReader

struct CheckpointReader::State {
  std::string path;    // the HDF5 file
  fs::path directory;  // the step directory
  Hdf5Handle file, tensors_group;
  int64_t step = 0;
  int ranks_saved = 0;
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
  const std::vector<int64_t> dims = dataset_dims(p, dataset.get());
  TESSERA_CHECK(dims.size() <= size_t(Shape::kMaxDims), p, ": tensor ", name, " has ", dims.size(),
                " dimensions, more than ", Shape::kMaxDims);
  const std::optional<int64_t> count = element_count(dims);
  TESSERA_CHECK(count && *count <= std::numeric_limits<int64_t>::max() / 8, p, ": tensor ", name,
                " claims more elements than a file can hold: ", corrupt_advice(directory));
  TESSERA_CHECK(all_elements_stored(p, dataset.get()), p, ": tensor ", name,
                " has no data stored for some or all of its elements (created but not completely written): ",
                corrupt_advice(directory));
  stored.shape = Shape(dims);
  Hdf5Handle type = datatype_handle(TESSERA_HDF5_CHECK_AT(p, H5Dget_type(dataset.get())));
  TESSERA_CHECK(
      H5Tget_class(type.get()) == type_class_of(stored.dtype) && H5Tget_size(type.get()) == dtype_size(stored.dtype), p,
      ": tensor ", name, " is tagged ", dtype_name(stored.dtype),
      " but its HDF5 type does not match: ", corrupt_advice(directory));
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
      StoredTensor stored = read_stored_tensor(p, directory, state->tensors_group.get(), name);
      state->index[name] = state->tensors.size();
      state->tensors.push_back(std::move(stored));
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
  const std::vector<std::byte>& whole = state_->whole_verified(stored);
  const size_t element_size = dtype_size(stored.dtype);
  if (piece.local.device().is_cpu()) {
    gather_runs(layout.runs, element_size, whole.data(), static_cast<std::byte*>(piece.local.data_ptr()));
    return;
  }
  Tensor host = piece.local.context().empty(piece.local.shape(), piece.dtype, Device::cpu());
  gather_runs(layout.runs, element_size, whole.data(), static_cast<std::byte*>(host.data_ptr()));
  piece.local.copy_(host);
}

std::vector<std::string> CheckpointReader::verify() const {
  std::vector<std::string> bad;
  for (const auto& [name, complaint] : state_->damaged) bad.push_back(name);
  for (const StoredTensor& tensor : state_->tensors) {
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

// libFuzzer harness: the checkpoint readers of io/checkpoint.h on fuzz-built
// save directories. The fuzz bytes describe a save directory (the `latest`
// pointer's text, extra step_* and .step_*.tmp entries) and one checkpoint
// file: the format, step and ranks_saved attributes, the /metadata group's
// keys and values, tensors with their tessera_dtype tags, HDF5 types,
// shapes, data and CRC-32s (right or wrong), and per-rank state blobs;
// possibly truncated. The harness finds and lists the checkpoints, opens the
// file with CheckpointReader, reads the metadata and rank state, verifies
// every checksum and reads each tensor whole and in part, as resuming does.
// Bad checkpoints must end in tessera::Error (or be reported by verify()),
// never a crash, a leak, an HDF5 id left open or undefined behaviour.
#include <zlib.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/context.h"
#include "fuzz_support.h"
#include "io/checkpoint.h"
#include "io/hdf5_file.h"

namespace {

using namespace tessera;
using namespace tessera::fuzz;

// A name for an HDF5 link or attribute: choice 0 is `usual`.
std::string fuzzed_name(FuzzedDataProvider& data, const std::string& usual) {
  if (data.ConsumeBool()) return usual;
  std::string name = data.ConsumeRandomLengthString(24);
  return name.empty() ? usual : name;
}

uint32_t crc32_of(const std::vector<uint8_t>& bytes) {
  return uint32_t(crc32(0L, bytes.data(), uInt(bytes.size())));
}

void build_tensors(FuzzedDataProvider& data, hid_t root) {
  const int form = data.ConsumeIntegralInRange<int>(0, 2);  // a group, missing, a dataset
  if (form == 1) return;
  if (form == 2) {
    const int64_t value = 0;
    write_dataset(root, "tensors", H5T_STD_I64LE, {1}, &value);
    return;
  }
  io::Hdf5Handle tensors(H5Gcreate2(root, "tensors", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Gclose);
  const int count = data.ConsumeIntegralInRange<int>(1, 4);
  for (int t = 0; t < count; ++t) {
    struct Tag {
      const char* name;
      ElementType stored;
    };
    static constexpr Tag kTags[] = {{"f32", ElementType::f32}, {"bf16", ElementType::u16}, {"f16", ElementType::u16},
                                    {"i32", ElementType::i32}, {"i64", ElementType::i64},  {"u8", ElementType::u8}};
    const Tag tag = kTags[data.ConsumeIntegralInRange<size_t>(0, std::size(kTags) - 1)];
    const std::string name = fuzzed_name(data, "blocks." + std::to_string(t) + ".weight");
    std::vector<hsize_t> dims(size_t(data.ConsumeIntegralInRange<int>(0, 3)));
    for (hsize_t& dim : dims) dim = data.ConsumeIntegralInRange<hsize_t>(1, 6);
    const std::vector<uint8_t> stored = fuzz_dataset(data, tensors.get(), name.c_str(), {tag.stored, dims, 256});
    io::Hdf5Handle dataset(H5Dopen2(tensors.get(), name.c_str(), H5P_DEFAULT), H5Dclose);
    if (!dataset.valid()) continue;
    fuzz_string_attribute(data, dataset.get(), "tessera_dtype", tag.name);
    fuzz_int_attribute(data, dataset.get(), "crc32", crc32_of(stored));
  }
}

void build_rank_state(FuzzedDataProvider& data, hid_t root, int ranks) {
  if (data.ConsumeBool()) return;
  io::Hdf5Handle group(H5Gcreate2(root, "ranks", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Gclose);
  for (int r = 0; r < ranks; ++r) {
    io::Hdf5Handle rank(H5Gcreate2(group.get(), std::to_string(r).c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
                        H5Gclose);
    const std::string key = fuzzed_name(data, "rng");
    const std::vector<uint8_t> stored = fuzz_dataset(
        data, rank.get(), key.c_str(), {ElementType::u8, {data.ConsumeIntegralInRange<hsize_t>(0, 16)}, 256});
    io::Hdf5Handle dataset(H5Dopen2(rank.get(), key.c_str(), H5P_DEFAULT), H5Dclose);
    if (dataset.valid() && data.ConsumeIntegralInRange<int>(0, 3) != 3)
      fuzz_int_attribute(data, dataset.get(), "crc32", crc32_of(stored));
  }
}

void build_checkpoint_file(FuzzedDataProvider& data, const fs::path& path) {
  io::Hdf5Handle file = io::file_handle(create_file(path));
  const hid_t root = file.get();
  fuzz_int_attribute(data, root, "tessera_checkpoint_format", io::kCheckpointFormat);
  fuzz_int_attribute(data, root, "step", 10);
  const int ranks = data.ConsumeIntegralInRange<int>(1, 3);
  fuzz_int_attribute(data, root, "ranks_saved", ranks);
  if (data.ConsumeIntegralInRange<int>(0, 3) != 3) {
    io::Hdf5Handle metadata(H5Gcreate2(root, "metadata", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Gclose);
    const int keys = data.ConsumeIntegralInRange<int>(0, 4);
    for (int k = 0; k < keys; ++k)
      fuzz_string_attribute(data, metadata.get(), fuzzed_name(data, "key" + std::to_string(k)).c_str(), "value");
  }
  build_tensors(data, root);
  build_rank_state(data, root, ranks);
}

// The save directory around the checkpoint; returns the path to open.
fs::path build_save_directory(FuzzedDataProvider& data, const fs::path& save) {
  fs::create_directories(save);
  const std::string step_name = data.ConsumeIntegralInRange<int>(0, 7) != 7 ? "step_00000010" : "step_x";
  const fs::path step = save / step_name;
  fs::create_directories(step);
  build_checkpoint_file(data, step / "checkpoint.h5");
  maybe_truncate(data, step / "checkpoint.h5");

  switch (data.ConsumeIntegralInRange<int>(0, 3)) {
    case 0:
      write_file(save / "latest", step_name + "\n");
      break;
    case 1:
      write_file(save / "latest", data.ConsumeRandomLengthString(40));
      break;
    case 2:
      break;  // no pointer: the highest step_* directory counts
    default:
      fs::create_directories(save / "latest");
      break;
  }
  const int extras = data.ConsumeIntegralInRange<int>(0, 2);
  for (int e = 0; e < extras; ++e) {
    std::string name = data.ConsumeRandomLengthString(24);
    for (char& c : name)
      if (c == '/' || c == '\0') c = '_';
    if (name.empty() || name == "." || name == ".." || name == step_name || name == "latest") continue;
    const fs::path extra = save / name;
    fs::create_directories(extra);
    if (data.ConsumeBool()) write_file(extra / "checkpoint.h5", data.ConsumeRandomLengthString(64));
  }
  switch (data.ConsumeIntegralInRange<int>(0, 2)) {
    case 0:
      return step;
    case 1:
      return step / "checkpoint.h5";
    default:
      return save;
  }
}

void read_checkpoint(FuzzedDataProvider& data, const fs::path& save, const fs::path& given) {
  static Context ctx;
  expect_clean_errors([&] {
    io::list_checkpoints(save.string());
    io::find_latest_checkpoint(save.string());
  });
  expect_clean_errors([&] {
    io::CheckpointReader reader(given.string());
    (void)reader.step();
    (void)reader.metadata();
    for (int r = 0; r <= std::min(reader.ranks_saved(), 4); ++r) {
      for (const std::string& key : reader.rank_state_keys(r)) expect_clean_errors([&] { reader.rank_state(r, key); });
      expect_clean_errors([&] { reader.rank_state(r, data.ConsumeRandomLengthString(16)); });
    }
    reader.verify();
    for (const io::StoredTensor& stored : reader.tensors()) {
      if (stored.shape.numel() > (int64_t(1) << 16)) continue;  // fuzz_dataset's data is small; huge ones are unwritten
      expect_clean_errors([&] {
        io::TensorPiece whole{stored.name, stored.shape, stored.dtype, {}, ctx.empty(stored.shape, stored.dtype)};
        reader.read(whole);
        const int64_t half = stored.shape.numel() / 2;
        io::TensorPiece tail{stored.name, stored.shape, stored.dtype, io::TensorSlice::flat(half),
                             ctx.empty(Shape{stored.shape.numel() - half}, stored.dtype)};
        reader.read(tail);
      });
    }
  });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  FuzzedDataProvider data(bytes, size);
  const fs::path save = fresh_scratch_dir() / "save";
  const fs::path given = build_save_directory(data, save);
  read_checkpoint(data, save, given);
  check_hdf5_ids_closed();
  return 0;
}

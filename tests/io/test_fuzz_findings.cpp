// Regression tests for what the fuzz harnesses (tests/fuzz/) found in io/'s
// parsers, each reduced to the smallest file that shows it:
//   - a dataset, tensor or rank-state blob created but never written (its
//     shape can claim 2^40 elements in a file of a few KiB) made the readers
//     allocate for the claimed size; now refused naming the file;
//   - IDX headers claiming 2^32 - 1 labels, or images of 2^32 - 1 squared
//     pixels, made `prepare idx` allocate for them (and overflow int64)
//     before finding the file truncated; now the truncation message, or a
//     corrupt-header message.
#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "core/context.h"
#include "core/error.h"
#include "io/checkpoint.h"
#include "io/dataset.h"
#include "io/prepare.h"
#include "tests/io/io_test_files.h"

namespace tessera::testing {
namespace {

// Runs `body`; it must throw tessera::Error whose text holds every one of `parts`.
void expect_error(const std::function<void()>& body, const std::vector<std::string>& parts) {
  try {
    body();
    ADD_FAILURE() << "no error thrown; expected one mentioning " << ::testing::PrintToString(parts);
  } catch (const Error& error) {
    const std::string what = error.what();
    for (const std::string& part : parts)
      EXPECT_NE(what.find(part), std::string::npos) << "missing '" << part << "' in: " << what;
  }
}

// A dataset of `dims` that is created and never written: chunked (one
// element per chunk along the first dimension), so it costs no file space.
void unwritten_dataset(hid_t group, const char* name, hid_t type, const std::vector<hsize_t>& dims) {
  const hid_t space = H5Screate_simple(int(dims.size()), dims.data(), nullptr);
  const hid_t properties = H5Pcreate(H5P_DATASET_CREATE);
  std::vector<hsize_t> chunk(dims.size(), 1);
  H5Pset_chunk(properties, int(chunk.size()), chunk.data());
  const hid_t set = H5Dcreate2(group, name, type, space, H5P_DEFAULT, properties, H5P_DEFAULT);
  EXPECT_GE(set, 0) << name;
  H5Dclose(set);
  H5Pclose(properties);
  H5Sclose(space);
}

TEST(FuzzFindings, UnwrittenTokensAreRefusedBeforeAnyAllocation) {
  TempDir dir;
  const std::string path = dir.file("unwritten.h5");
  {
    RawH5Writer file(path);
    file.int_attribute("tessera_schema", 1);
    file.string_attribute("kind", "tokens");
    file.int_attribute("vocab_size", 256);
    unwritten_dataset(file.id(), "tokens", H5T_STD_U8LE, {hsize_t(1) << 40});
  }
  expect_error([&] { io::inspect_dataset(path); }, {path, "'/tokens'", "no data stored"});
  expect_error([&] { io::TokenData data(path); }, {path, "no data stored"});
}

TEST(FuzzFindings, UnwrittenLabelsAreRefused) {
  TempDir dir;
  const std::string path = dir.file("unwritten.h5");
  {
    RawH5Writer file(path);
    file.int_attribute("tessera_schema", 1);
    file.string_attribute("kind", "classification");
    file.int_attribute("num_classes", 10);
    const std::vector<uint8_t> images(4 * 3 * 3, 7);
    file.dataset("images", H5T_STD_U8LE, H5T_NATIVE_UINT8, {4, 1, 3, 3}, images.data());
    const hsize_t labels = 4;  // contiguous, never written: reads back as zeros
    const hid_t space = H5Screate_simple(1, &labels, nullptr);
    H5Dclose(H5Dcreate2(file.id(), "labels", H5T_STD_I64LE, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
    H5Sclose(space);
  }
  expect_error([&] { io::inspect_dataset(path); }, {path, "'/labels'", "no data stored"});
}

TEST(FuzzFindings, WrittenChunkedAndCompressedDataIsAccepted) {
  // Compressed chunks, and a last chunk running past the end, are stored in
  // fewer or more bytes than the elements: still whole.
  TempDir dir;
  const std::string path = dir.file("chunked.h5");
  auto rng = std::mt19937_64(7);
  const ClassificationFile data = random_classification(rng, 10, 1, 4, 4, 3);
  write_classification(path, data, /*chunk_rows=*/3);
  EXPECT_EQ(io::inspect_dataset(path).num_samples, 10);
}

// An IDX file: big-endian magic and sizes, then `bytes`.
void write_idx(const std::string& path, uint32_t magic, const std::vector<uint32_t>& sizes,
               const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary);
  auto word = [&](uint32_t value) {
    const char big_endian[4] = {char(value >> 24), char(value >> 16), char(value >> 8), char(value)};
    out.write(big_endian, 4);
  };
  word(magic);
  for (uint32_t size : sizes) word(size);
  out.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
}

TEST(FuzzFindings, IdxHeadersClaimingHugeCountsEndInTheTruncationMessage) {
  TempDir dir;
  const std::string images = dir.file("images"), labels = dir.file("labels"), out = dir.file("out.h5");
  write_idx(labels, 0x801, {0xffffffffu}, {1, 2, 3});
  write_idx(images, 0x803, {0xffffffffu, 1, 1}, {9, 9, 9});
  expect_error([&] { io::prepare_idx(images, labels, out); },
               {"--labels", labels, "ends after 3 of the 4294967295 bytes", "truncated"});
}

TEST(FuzzFindings, IdxImagesTooLargeForAnyFileAreACorruptHeader) {
  TempDir dir;
  const std::string images = dir.file("images"), labels = dir.file("labels"), out = dir.file("out.h5");
  write_idx(labels, 0x801, {2}, {0, 1});
  write_idx(images, 0x803, {2, 0xffffffffu, 0xffffffffu}, {9, 9});
  expect_error([&] { io::prepare_idx(images, labels, out); }, {"--images", images, "header is corrupt"});
}

// A checkpoint file written with the raw C API: the format's root attributes
// and one tensor `w` made by `make_tensor`.
void write_checkpoint(const std::string& path, const std::function<void(hid_t tensors)>& make_tensor) {
  RawH5Writer file(path);
  file.int_attribute("tessera_checkpoint_format", 1);
  file.int_attribute("step", 5);
  file.int_attribute("ranks_saved", 1);
  const hid_t tensors = H5Gcreate2(file.id(), "tensors", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  make_tensor(tensors);
  const hid_t tensor = H5Dopen2(tensors, "w", H5P_DEFAULT);
  const hid_t space = H5Screate(H5S_SCALAR);
  const hid_t type = H5Tcopy(H5T_C_S1);
  H5Tset_size(type, 4);
  const hid_t dtype = H5Acreate2(tensor, "tessera_dtype", type, space, H5P_DEFAULT, H5P_DEFAULT);
  H5Awrite(dtype, type, "f32");
  const hid_t crc = H5Acreate2(tensor, "crc32", H5T_STD_U32LE, space, H5P_DEFAULT, H5P_DEFAULT);
  const uint32_t zero = 0;  // the CRC-32 of no bytes
  H5Awrite(crc, H5T_NATIVE_UINT32, &zero);
  for (hid_t id : {dtype, crc}) H5Aclose(id);
  H5Tclose(type);
  H5Sclose(space);
  H5Dclose(tensor);
  H5Gclose(tensors);
}

TEST(FuzzFindings, UnwrittenCheckpointTensorIsRefusedBeforeAnyAllocation) {
  TempDir dir;
  const std::string path = dir.file("checkpoint.h5");
  write_checkpoint(path, [](hid_t tensors) { unwritten_dataset(tensors, "w", H5T_IEEE_F32LE, {hsize_t(1) << 40, 3}); });
  expect_error([&] { io::CheckpointReader reader(path); }, {path, "tensor w", "no data stored", "corrupt"});
}

TEST(FuzzFindings, EmptyCheckpointTensorIsStillAccepted) {
  // save_checkpoint writes no data for a tensor of no elements: that is whole.
  TempDir dir;
  const std::string path = dir.file("checkpoint.h5");
  write_checkpoint(path, [](hid_t tensors) {
    const hsize_t none = 0;
    const hid_t space = H5Screate_simple(1, &none, nullptr);
    H5Dclose(H5Dcreate2(tensors, "w", H5T_IEEE_F32LE, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
    H5Sclose(space);
  });
  io::CheckpointReader reader(path);
  ASSERT_EQ(reader.tensors().size(), 1u);
  EXPECT_EQ(reader.tensors()[0].shape.numel(), 0);
  EXPECT_TRUE(reader.verify().empty());
}

}  // namespace
}  // namespace tessera::testing

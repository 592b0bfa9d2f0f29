// Helpers shared by the resume tests (in-process ones in tests/apps/ and the
// multi-process ones in tests/multiprocess/): small random datasets written
// through the real `prepare` code, a scratch directory, and a bit-for-bit
// comparison of two checkpoints through io::CheckpointReader. Header-only so
// both test binaries can use it without another library.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "core/context.h"
#include "io/checkpoint.h"
#include "io/prepare.h"
#include "tests/support/test_support.h"

namespace tessera::testing {

// A scratch directory named after the running test, removed at the end.
struct ScratchDirectory {
  explicit ScratchDirectory(const std::string& prefix)
      : path(std::filesystem::temp_directory_path() / (prefix + std::to_string(::getpid()) + "_" + test_name())) {
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~ScratchDirectory() { std::filesystem::remove_all(path); }
  ScratchDirectory(const ScratchDirectory&) = delete;
  ScratchDirectory& operator=(const ScratchDirectory&) = delete;
  std::string operator/(const std::string& name) const { return (path / name).string(); }
  std::filesystem::path path;

 private:
  static std::string test_name() {  // "Suite.Name/1" of parameterised tests, as one path component
    std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    for (char& ch : name)
      if (ch == '/') ch = '_';
    return name;
  }
};

inline void write_big_endian(std::ofstream& out, uint32_t value) {
  const unsigned char bytes[4] = {static_cast<unsigned char>(value >> 24), static_cast<unsigned char>(value >> 16),
                                  static_cast<unsigned char>(value >> 8), static_cast<unsigned char>(value)};
  out.write(reinterpret_cast<const char*>(bytes), 4);
}

// `count` random height x width images with labels in [0, classes), as plain
// IDX files turned into a classification HDF5 file by io::prepare_idx.
inline std::string write_image_dataset(const std::filesystem::path& dir, int64_t count, int64_t height, int64_t width,
                                       int64_t classes, std::mt19937_64& rng) {
  const std::string images = (dir / "images.idx").string(), labels = (dir / "labels.idx").string();
  std::uniform_int_distribution<int> pixel(0, 255), label(0, int(classes) - 1);
  {
    std::ofstream out(images, std::ios::binary);
    write_big_endian(out, 0x00000803);
    write_big_endian(out, uint32_t(count));
    write_big_endian(out, uint32_t(height));
    write_big_endian(out, uint32_t(width));
    for (int64_t i = 0; i < count * height * width; ++i) out.put(char(pixel(rng)));
  }
  {
    std::ofstream out(labels, std::ios::binary);
    write_big_endian(out, 0x00000801);
    write_big_endian(out, uint32_t(count));
    for (int64_t i = 0; i < count; ++i) out.put(char(i < classes ? i : label(rng)));  // every class present
  }
  const std::string h5 = (dir / "images.h5").string();
  io::prepare_idx(images, labels, h5, {}, classes);
  return h5;
}

// `bytes` random lowercase letters and spaces as a byte-level token file
// (vocabulary 256) made by io::prepare_text.
inline std::string write_text_dataset(const std::filesystem::path& dir, int64_t bytes, std::mt19937_64& rng) {
  const std::string text = (dir / "text.txt").string(), h5 = (dir / "text.h5").string();
  std::uniform_int_distribution<int> letter(0, 26);
  {
    std::ofstream out(text, std::ios::binary);
    for (int64_t i = 0; i < bytes; ++i) {
      const int value = letter(rng);
      out.put(value == 26 ? ' ' : char('a' + value));
    }
  }
  io::prepare_text({text}, h5, "", 0.0);
  return h5;
}

// A stored tensor read whole into a fresh NaN-poisoned host tensor.
inline Tensor read_whole(Context& ctx, const io::CheckpointReader& reader, const io::StoredTensor& stored) {
  io::TensorPiece piece;
  piece.name = stored.name;
  piece.global_shape = stored.shape;
  piece.dtype = stored.dtype;
  piece.local = poisoned(ctx, stored.shape, stored.dtype);
  reader.read(piece);
  return piece.local;
}

// Whether two checkpoints hold the same tensors with the same bytes, and
// agree on the metadata keys a resumed run depends on.
inline ::testing::AssertionResult checkpoints_identical(const std::string& a, const std::string& b) {
  Context ctx;
  const io::CheckpointReader first(a), second(b);
  std::set<std::string> names_a, names_b;
  for (const io::StoredTensor& t : first.tensors()) names_a.insert(t.name);
  for (const io::StoredTensor& t : second.tensors()) names_b.insert(t.name);
  if (names_a != names_b)
    return ::testing::AssertionFailure() << a << " holds " << names_a.size() << " tensors, " << b << " "
                                         << names_b.size() << " (different names)";
  if (names_a.empty()) return ::testing::AssertionFailure() << a << " holds no tensors";
  std::ostringstream differences;
  int different = 0;
  for (const io::StoredTensor& stored : first.tensors()) {
    const Tensor x = read_whole(ctx, first, stored);
    const Tensor y = read_whole(ctx, second, stored);
    if (x.shape() != y.shape() || x.dtype() != y.dtype()) {
      differences << "\n  " << stored.name << ": shape or dtype differs";
      ++different;
      continue;
    }
    const size_t size = x.element_size();
    const auto* px = static_cast<const unsigned char*>(x.data_ptr());
    const auto* py = static_cast<const unsigned char*>(y.data_ptr());
    int64_t bad = 0, first_bad = -1;
    for (int64_t i = 0; i < x.numel(); ++i)
      if (std::memcmp(px + size_t(i) * size, py + size_t(i) * size, size) != 0) {
        if (first_bad < 0) first_bad = i;
        ++bad;
      }
    if (bad > 0) {
      const std::vector<double> vx = x.to_doubles(), vy = y.to_doubles();
      differences << "\n  " << stored.name << ": " << bad << " of " << x.numel() << " elements differ, first at "
                  << first_bad << ": " << vx[size_t(first_bad)] << " vs " << vy[size_t(first_bad)];
      ++different;
    }
  }
  for (const char* key : {"optimizer.step_count", "schedule.iteration", "schedule.num_steps", "sampler.epoch",
                          "sampler.samples", "scaler.scale", "scaler.growth_tracker", "train.skipped_steps"}) {
    const auto x = first.metadata().find(key), y = second.metadata().find(key);
    if (x == first.metadata().end() || y == second.metadata().end() || x->second != y->second) {
      differences << "\n  metadata " << key << ": "
                  << (x == first.metadata().end() ? std::string("(missing)") : x->second) << " vs "
                  << (y == second.metadata().end() ? std::string("(missing)") : y->second);
      ++different;
    }
  }
  if (different > 0)
    return ::testing::AssertionFailure() << different << " difference(s) between " << a << " and " << b << ":"
                                         << differences.str();
  return ::testing::AssertionSuccess() << names_a.size() << " tensors identical";
}

// Whether two checkpoints hold the same tensors with values within `tolerance`
// of each other (the same model trained with additions in another order).
inline ::testing::AssertionResult checkpoints_close(const std::string& a, const std::string& b, Tolerance tolerance) {
  Context ctx;
  const io::CheckpointReader first(a), second(b);
  if (first.tensors().size() != second.tensors().size() || first.tensors().empty())
    return ::testing::AssertionFailure() << a << " holds " << first.tensors().size() << " tensors, " << b << " "
                                         << second.tensors().size();
  for (const io::StoredTensor& stored : first.tensors()) {
    const auto other = std::find_if(second.tensors().begin(), second.tensors().end(),
                                    [&](const io::StoredTensor& t) { return t.name == stored.name; });
    if (other == second.tensors().end()) return ::testing::AssertionFailure() << b << " has no " << stored.name;
    const std::vector<double> x = read_whole(ctx, first, stored).to_doubles(),
                              y = read_whole(ctx, second, *other).to_doubles();
    if (!all_close(y, x, tolerance)) return ::testing::AssertionFailure() << stored.name << " differs";
  }
  return ::testing::AssertionSuccess();
}

}  // namespace tessera::testing

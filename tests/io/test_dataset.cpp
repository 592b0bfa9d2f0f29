// io/dataset.h: files written with the raw HDF5 C API read back exactly
// (whole ranges, gathered indices, every token storage type), and every kind
// of broken file is refused with an error naming the file and the problem.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <random>

#include "core/error.h"
#include "io/dataset.h"
#include "tests/io/io_test_files.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

using io::ClassificationData;
using io::DatasetKind;
using io::TokenData;

// Runs `open`; it must throw tessera::Error whose text holds every one of `parts`.
void expect_error(const std::function<void()>& open, const std::vector<std::string>& parts) {
  try {
    open();
    ADD_FAILURE() << "no error thrown; expected one mentioning " << ::testing::PrintToString(parts);
  } catch (const Error& error) {
    const std::string what = error.what();
    for (const std::string& part : parts)
      EXPECT_NE(what.find(part), std::string::npos) << "missing '" << part << "' in: " << what;
  }
}

void expect_refused(const std::string& path, const std::vector<std::string>& parts) {
  std::vector<std::string> with_path = parts;
  with_path.push_back(path);
  expect_error([&] { io::inspect_dataset(path); }, with_path);
}

TEST(Dataset, ClassificationReadsBack) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  TempDir dir;
  const std::string path = dir.file("images.h5");
  std::uniform_int_distribution<int64_t> size(1, 9);
  const int64_t n = 23 + size(rng), c = size(rng), h = size(rng), w = size(rng);
  const ClassificationFile data = random_classification(rng, n, c, h, w, 7);
  write_classification(path, data);

  const io::DatasetInfo info = io::inspect_dataset(path);
  EXPECT_EQ(info.kind, DatasetKind::classification);
  EXPECT_EQ(info.schema_version, 1);
  EXPECT_EQ(info.num_samples, data.n);
  EXPECT_EQ(info.channels, data.c);
  EXPECT_EQ(info.height, data.h);
  EXPECT_EQ(info.width, data.w);
  EXPECT_EQ(info.num_classes, 7);
  EXPECT_NE(info.describe().find(std::to_string(data.n) + " samples"), std::string::npos) << info.describe();

  ClassificationData reader(path);
  EXPECT_EQ(std::vector<int64_t>(reader.labels().begin(), reader.labels().end()), data.labels);
  const int64_t sample = data.c * data.h * data.w;
  // A random range.
  std::uniform_int_distribution<int64_t> index(0, data.n - 1);
  int64_t begin = index(rng), end = index(rng);
  if (begin > end) std::swap(begin, end);
  std::vector<uint8_t> range(size_t((end + 1 - begin) * sample), 0xAB);
  reader.read_images(begin, end + 1 - begin, range.data());
  EXPECT_TRUE(std::equal(range.begin(), range.end(), data.images.begin() + begin * sample));
  // Random indices with repeats and a consecutive run.
  std::vector<int64_t> indices;
  for (int i = 0; i < 17; ++i) indices.push_back(index(rng));
  indices.push_back(0);
  indices.push_back(1);
  indices.push_back(2);
  std::vector<uint8_t> gathered(indices.size() * size_t(sample), 0xAB);
  reader.read_images(indices, gathered.data());
  for (size_t i = 0; i < indices.size(); ++i)
    EXPECT_TRUE(std::equal(gathered.begin() + i * sample, gathered.begin() + (i + 1) * sample,
                           data.images.begin() + indices[i] * sample))
        << "sample " << indices[i];
  expect_error([&] { reader.read_images(std::vector<int64_t>{data.n}, gathered.data()); },
               {path, "outside [0, " + std::to_string(data.n)});
}

TEST(Dataset, TokensReadBackInEveryStorageType) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  TempDir dir;
  struct Case {
    hid_t type;
    io::TokenType expected;
    int64_t vocab;
  };
  for (const Case& c : {Case{H5T_STD_U8LE, io::TokenType::u8, 256}, Case{H5T_STD_U16LE, io::TokenType::u16, 50257},
                        Case{H5T_STD_I32LE, io::TokenType::i32, 100000}}) {
    SCOPED_TRACE(io::token_type_name(c.expected));
    const std::string path = dir.file(std::string("tokens_") + io::token_type_name(c.expected) + ".h5");
    std::uniform_int_distribution<int32_t> id(0, int32_t(c.vocab - 1));
    std::vector<int32_t> tokens(size_t(std::uniform_int_distribution<int>(2, 3000)(rng)));
    for (auto& t : tokens) t = id(rng);
    write_tokens(path, tokens, c.type, c.vocab);

    TokenData reader(path);
    EXPECT_EQ(reader.info().kind, DatasetKind::tokens);
    EXPECT_EQ(reader.info().token_type, c.expected);
    EXPECT_EQ(reader.info().vocab_size, c.vocab);
    ASSERT_EQ(reader.size(), int64_t(tokens.size()));
    std::uniform_int_distribution<int64_t> position(0, reader.size() - 1);
    int64_t begin = position(rng), end = position(rng);
    if (begin > end) std::swap(begin, end);
    std::vector<int32_t> out(size_t(end + 1 - begin), -7);
    reader.read(begin, end + 1 - begin, out.data());
    EXPECT_TRUE(std::equal(out.begin(), out.end(), tokens.begin() + begin));
    expect_error([&] { reader.read(reader.size() - 1, 2, out.data()); }, {path, "outside the dataset"});
  }
}

TEST(Dataset, MissingFileSaysSo) {
  TempDir dir;
  const std::string path = dir.file("nothing_here.h5");
  expect_refused(path, {"does not exist"});
  expect_error([&] { ClassificationData reader(path); }, {path, "does not exist"});
}

TEST(Dataset, TruncatedOrForeignFileGivesHdf5sErrorAndPath) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  TempDir dir;
  const std::string path = dir.file("truncated.h5");
  write_classification(path, random_classification(rng, 200, 1, 8, 8, 10));
  std::filesystem::resize_file(path, std::filesystem::file_size(path) / 3);
  try {
    io::inspect_dataset(path);
    ADD_FAILURE() << "a truncated file was accepted";
  } catch (const Error& error) {
    const std::string what = error.what();
    EXPECT_EQ(error.library(), "HDF5") << what;
    EXPECT_NE(what.find(path), std::string::npos) << what;
    EXPECT_NE(what.find("truncated"), std::string::npos) << what;
  }
  const std::string text = dir.file("text.h5");
  { std::ofstream(text) << "this is not an HDF5 file\n"; }
  expect_refused(text, {"cannot be opened as an HDF5 file"});
}

TEST(Dataset, SchemaVersionAndKindAreChecked) {
  TempDir dir;
  const std::vector<uint8_t> images(4 * 3, 1);
  const std::vector<int64_t> labels(4, 0);
  auto write = [&](const std::string& path, const std::function<void(RawH5Writer&)>& attributes) {
    RawH5Writer file(path);
    attributes(file);
    file.int_attribute("num_classes", 2);
    file.dataset("images", H5T_STD_U8LE, H5T_NATIVE_UINT8, {4, 1, 3, 1}, images.data());
    file.dataset("labels", H5T_STD_I64LE, H5T_NATIVE_INT64, {4}, labels.data());
  };
  const std::string no_version = dir.file("no_version.h5");
  write(no_version, [](RawH5Writer& f) { f.string_attribute("kind", "classification"); });
  expect_refused(no_version, {"'tessera_schema' is missing", "tessera prepare"});

  const std::string future = dir.file("future.h5");
  write(future, [](RawH5Writer& f) {
    f.int_attribute("tessera_schema", 2);
    f.string_attribute("kind", "classification");
  });
  expect_refused(future, {"schema version 2", "tessera prepare"});

  const std::string string_version = dir.file("string_version.h5");
  write(string_version, [](RawH5Writer& f) {
    f.string_attribute("tessera_schema", "1");
    f.string_attribute("kind", "classification");
  });
  expect_refused(string_version, {"'tessera_schema' must be an integer"});

  const std::string no_kind = dir.file("no_kind.h5");
  write(no_kind, [](RawH5Writer& f) { f.int_attribute("tessera_schema", 1); });
  expect_refused(no_kind, {"'kind' is missing"});

  const std::string odd_kind = dir.file("odd_kind.h5");
  write(odd_kind, [](RawH5Writer& f) {
    f.int_attribute("tessera_schema", 1);
    f.string_attribute("kind", "segmentation");
  });
  expect_refused(odd_kind, {"'kind' is \"segmentation\""});

  const std::string good = dir.file("good.h5");
  write(good, [](RawH5Writer& f) {
    f.int_attribute("tessera_schema", 1, H5T_STD_U8LE);  // any integer type holds the version
    f.string_attribute("kind", "classification");
  });
  EXPECT_EQ(io::inspect_dataset(good).num_samples, 4);
}

// Writes a classification file with the given parts; the caller breaks one.
struct ClassificationParts {
  bool images = true, labels = true, num_classes = true;
  hid_t image_type = H5T_STD_U8LE, label_type = H5T_STD_I64LE;
  std::vector<hsize_t> image_dims = {6, 1, 2, 3};
  hsize_t label_count = 6;
  int64_t classes = 4;
};

void write_parts(const std::string& path, const ClassificationParts& parts, const std::vector<int64_t>& labels) {
  RawH5Writer file(path);
  file.int_attribute("tessera_schema", 1);
  file.string_attribute("kind", "classification");
  if (parts.num_classes) file.int_attribute("num_classes", parts.classes);
  hsize_t count = 1;
  for (hsize_t d : parts.image_dims) count *= d;
  const std::vector<double> pixels(count, 1.0);  // HDF5 converts to the file type
  if (parts.images) file.dataset("images", parts.image_type, H5T_NATIVE_DOUBLE, parts.image_dims, pixels.data());
  if (parts.labels) file.dataset("labels", parts.label_type, H5T_NATIVE_INT64, {parts.label_count}, labels.data());
}

TEST(Dataset, ClassificationSchemaErrorsNameTheDatasetAndTheFix) {
  TempDir dir;
  const std::vector<int64_t> labels = {0, 1, 2, 3, 0, 1, 2};
  int file_number = 0;
  auto check = [&](ClassificationParts parts, const std::vector<std::string>& expected) {
    const std::string path = dir.file("broken" + std::to_string(file_number++) + ".h5");
    write_parts(path, parts, labels);
    expect_refused(path, expected);
  };
  ClassificationParts parts;
  parts.images = false;
  check(parts, {"dataset '/images' is missing", "tessera prepare idx"});
  parts = {};
  parts.labels = false;
  check(parts, {"dataset '/labels' is missing"});
  parts = {};
  parts.image_type = H5T_IEEE_F32LE;
  check(parts, {"'/images' holds float32", "uint8 [N, C, H, W]"});
  parts = {};
  parts.image_type = H5T_STD_U16LE;
  check(parts, {"'/images' holds uint16"});
  parts = {};
  parts.image_dims = {6, 2, 3};
  check(parts, {"'/images' has shape [6, 2, 3]", "4-D"});
  parts = {};
  parts.label_type = H5T_STD_I32LE;
  check(parts, {"'/labels' holds int32", "int64"});
  parts = {};
  parts.label_count = 7;
  check(parts, {"'/labels' has 7 entries but '/images' has 6 samples"});
  parts = {};
  parts.num_classes = false;
  check(parts, {"attribute 'num_classes' is missing"});
  parts = {};
  parts.classes = 3;  // label 3 at index 3 is out of range
  check(parts, {"'/labels'[3] = 3", "num_classes = 3"});
}

TEST(Dataset, LabelOutOfRangeIsFoundAnywhere) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  TempDir dir;
  for (const int64_t bad_value : {int64_t(10), int64_t(-1)}) {
    ClassificationFile data = random_classification(rng, 500, 1, 2, 2, 10);
    const auto bad = std::uniform_int_distribution<int64_t>(0, data.n - 1)(rng);
    data.labels[size_t(bad)] = bad_value;
    const std::string path = dir.file("labels" + std::to_string(bad_value) + ".h5");
    write_classification(path, data);
    expect_refused(path, {"'/labels'[" + std::to_string(bad) + "] = " + std::to_string(bad_value), "num_classes = 10"});
  }
}

TEST(Dataset, TokenSchemaErrors) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  TempDir dir;
  // An id >= vocab_size past the first validation chunk (2^20 tokens).
  std::vector<int32_t> tokens(size_t(1) << 21);
  std::uniform_int_distribution<int32_t> id(0, 999);
  for (auto& t : tokens) t = id(rng);
  const auto bad = std::uniform_int_distribution<size_t>(size_t(1) << 20, tokens.size() - 1)(rng);
  tokens[bad] = 1000;
  const std::string big = dir.file("big.h5");
  write_tokens(big, tokens, H5T_STD_U16LE, 1000);
  expect_refused(big, {"'/tokens'[" + std::to_string(bad) + "] = 1000", "vocab_size = 1000"});

  const std::string negative = dir.file("negative.h5");
  write_tokens(negative, {5, 3, -2, 1}, H5T_STD_I32LE, 10);
  expect_refused(negative, {"'/tokens'[2] = -2"});

  const std::string wide = dir.file("wide.h5");
  write_tokens(wide, {1, 2, 3}, H5T_STD_I64LE, 10);
  expect_refused(wide, {"'/tokens' holds int64", "uint8, uint16 or int32", "tessera prepare text"});

  const std::string single = dir.file("single.h5");
  write_tokens(single, {1}, H5T_STD_U8LE, 256);
  expect_refused(single, {"holds 1 token(s)"});

  const std::string no_vocab = dir.file("no_vocab.h5");
  {
    RawH5Writer file(no_vocab);
    file.int_attribute("tessera_schema", 1);
    file.string_attribute("kind", "tokens");
    const std::vector<int32_t> ids = {1, 2, 3};
    file.dataset("tokens", H5T_STD_U8LE, H5T_NATIVE_INT32, {3}, ids.data());
  }
  expect_refused(no_vocab, {"attribute 'vocab_size' is missing"});

  const std::string no_tokens = dir.file("no_tokens.h5");
  {
    RawH5Writer file(no_tokens);
    file.int_attribute("tessera_schema", 1);
    file.string_attribute("kind", "tokens");
    file.int_attribute("vocab_size", 256);
  }
  expect_refused(no_tokens, {"dataset '/tokens' is missing", "tessera prepare text"});
}

TEST(Dataset, ReaderOfTheWrongKindSaysWhichToUse) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  TempDir dir;
  const std::string tokens = dir.file("tokens.h5");
  write_tokens(tokens, {1, 2, 3}, H5T_STD_U8LE, 256);
  expect_error([&] { ClassificationData reader(tokens); }, {tokens, "not a classification set"});
  const std::string images = dir.file("images.h5");
  write_classification(images, random_classification(rng, 3, 1, 2, 2, 2));
  expect_error([&] { TokenData reader(images); }, {images, "not a token stream"});
  EXPECT_EQ(io::peek_dataset_kind(images), DatasetKind::classification);
  EXPECT_EQ(io::peek_dataset_kind(tokens), DatasetKind::tokens);
}

// The digest ranks compare (apps/rank_agreement.h): two files of the same
// shape and vocabulary that differ in one value differ; the same values
// stored as another type (or chunked otherwise) agree; past `whole_below`
// bytes it samples blocks, the first and last included.
TEST(Dataset, DigestTellsContentsApartButNotStorage) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  TempDir dir;
  std::uniform_int_distribution<int32_t> id(0, 199);
  std::vector<int32_t> tokens(5000);
  for (auto& t : tokens) t = id(rng);
  write_tokens(dir.file("a.h5"), tokens, H5T_STD_U8LE, 200);
  write_tokens(dir.file("a32.h5"), tokens, H5T_STD_I32LE, 200);
  std::vector<int32_t> changed = tokens;
  const size_t at = std::uniform_int_distribution<size_t>(0, tokens.size() - 1)(rng);
  changed[at] = (changed[at] + 1) % 200;
  write_tokens(dir.file("b.h5"), changed, H5T_STD_U8LE, 200);
  const std::string a = io::dataset_digest(dir.file("a.h5"));
  EXPECT_NE(a.find("of all 5000 tokens"), std::string::npos) << a;
  EXPECT_EQ(io::dataset_digest(dir.file("a32.h5")), a);
  EXPECT_NE(io::dataset_digest(dir.file("b.h5")), a) << "one token differs at " << at;
  // Sampled: 5000 int32 tokens = 20000 bytes over 2048 → 64 blocks of 8 tokens; the last token is always in.
  const std::string sampled = io::dataset_digest(dir.file("a.h5"), 2048);
  EXPECT_NE(sampled.find("of 64 blocks spread over 5000 tokens"), std::string::npos) << sampled;
  std::vector<int32_t> last_changed = tokens;
  last_changed.back() = (last_changed.back() + 1) % 200;
  write_tokens(dir.file("c.h5"), last_changed, H5T_STD_U8LE, 200);
  EXPECT_NE(io::dataset_digest(dir.file("c.h5"), 2048), sampled);

  ClassificationFile images = random_classification(rng, 40, 1, 4, 4, 5);
  write_classification(dir.file("i.h5"), images);
  write_classification(dir.file("i_chunked.h5"), images, 7);
  const std::string digest = io::dataset_digest(dir.file("i.h5"));
  EXPECT_NE(digest.find("of all 40 samples"), std::string::npos) << digest;
  EXPECT_EQ(io::dataset_digest(dir.file("i_chunked.h5")), digest);
  ClassificationFile relabelled = images;
  relabelled.labels[3] = (relabelled.labels[3] + 1) % 5;
  write_classification(dir.file("j.h5"), relabelled);
  EXPECT_NE(io::dataset_digest(dir.file("j.h5")), digest);
  ClassificationFile repainted = images;
  repainted.images[100] ^= 1;
  write_classification(dir.file("k.h5"), repainted);
  EXPECT_NE(io::dataset_digest(dir.file("k.h5")), digest);
}

}  // namespace
}  // namespace tessera::testing

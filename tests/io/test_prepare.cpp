// io/prepare.h: IDX files written here (plain, and gzip by a hand-written
// stored-block encoder, independent of zlib) prepare into files whose bytes
// match what was written; broken IDX files are refused and leave nothing
// behind; text files concatenate in order and split at the documented byte;
// Debian's Fashion-MNIST (if installed) prepares and matches `gzip -dc`.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>

#include "core/error.h"
#include "io/dataset.h"
#include "io/prepare.h"
#include "io/tokenizer.h"
#include "tests/io/io_test_files.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

using Bytes = std::vector<uint8_t>;

// An IDX file: magic 00 00 08 <rank>, big-endian sizes, then the payload.
Bytes idx_bytes(const std::vector<uint32_t>& dims, const Bytes& payload, uint8_t type = 0x08) {
  Bytes out = {0, 0, type, uint8_t(dims.size())};
  for (uint32_t d : dims)
    for (int shift = 24; shift >= 0; shift -= 8) out.push_back(uint8_t(d >> shift));
  out.insert(out.end(), payload.begin(), payload.end());
  return out;
}

uint32_t crc32(const Bytes& data) {
  uint32_t crc = 0xFFFFFFFFu;
  for (uint8_t byte : data) {
    crc ^= byte;
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
  }
  return ~crc;
}

// gzip (RFC 1952) around deflate stored blocks (RFC 1951, BTYPE 00).
Bytes gzip_stored(const Bytes& data) {
  Bytes out = {0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0xff};
  size_t position = 0;
  do {
    const size_t length = std::min<size_t>(65535, data.size() - position);
    const bool last = position + length == data.size();
    out.push_back(last ? 1 : 0);
    out.push_back(uint8_t(length));
    out.push_back(uint8_t(length >> 8));
    out.push_back(uint8_t(~length));
    out.push_back(uint8_t(~length >> 8));
    out.insert(out.end(), data.begin() + position, data.begin() + position + length);
    position += length;
  } while (position < data.size());
  const uint32_t crc = crc32(data), size = uint32_t(data.size());
  for (int shift = 0; shift < 32; shift += 8) out.push_back(uint8_t(crc >> shift));
  for (int shift = 0; shift < 32; shift += 8) out.push_back(uint8_t(size >> shift));
  return out;
}

void write_bytes(const std::string& path, const Bytes& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
}

Bytes random_bytes(std::mt19937_64& rng, size_t count, int high = 255) {
  std::uniform_int_distribution<int> byte(0, high);
  Bytes out(count);
  for (auto& b : out) b = uint8_t(byte(rng));
  return out;
}

void expect_error(const std::function<void()>& run, const std::vector<std::string>& parts) {
  try {
    run();
    ADD_FAILURE() << "no error thrown; expected one mentioning " << ::testing::PrintToString(parts);
  } catch (const Error& error) {
    const std::string what = error.what();
    for (const std::string& part : parts)
      EXPECT_NE(what.find(part), std::string::npos) << "missing '" << part << "' in: " << what;
  }
}

struct IdxSet {
  int64_t n, h, w;
  Bytes images, labels;  // payloads
};

IdxSet random_idx(std::mt19937_64& rng) {
  std::uniform_int_distribution<int64_t> count(1, 300), side(1, 12);
  IdxSet set{count(rng), side(rng), side(rng), {}, {}};
  set.images = random_bytes(rng, size_t(set.n * set.h * set.w));
  set.labels = random_bytes(rng, size_t(set.n), 9);
  return set;
}

TEST(PrepareIdx, RoundTripPlainAndGzip) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  TempDir dir;
  for (const bool gzip_images : {false, true})
    for (const bool gzip_labels : {false, true}) {
      SCOPED_TRACE(std::string("images ") + (gzip_images ? "gzip" : "plain") + ", labels " +
                   (gzip_labels ? "gzip" : "plain"));
      const IdxSet set = random_idx(rng);
      const Bytes images = idx_bytes({uint32_t(set.n), uint32_t(set.h), uint32_t(set.w)}, set.images);
      const Bytes labels = idx_bytes({uint32_t(set.n)}, set.labels);
      const std::string image_path = dir.file("images.idx"), label_path = dir.file("labels.idx");
      write_bytes(image_path, gzip_images ? gzip_stored(images) : images);
      write_bytes(label_path, gzip_labels ? gzip_stored(labels) : labels);
      const std::string out = dir.file("out.h5");

      int64_t last_images_done = -1;
      bool monotonic = true;
      const io::DatasetInfo info =
          io::prepare_idx(image_path, label_path, out, [&](std::string_view stage, int64_t done, int64_t total) {
            EXPECT_EQ(total, set.n);
            if (stage == "images") {
              monotonic = monotonic && done >= last_images_done;
              last_images_done = done;
            }
          });
      EXPECT_TRUE(monotonic);
      EXPECT_EQ(last_images_done, set.n);
      EXPECT_EQ(info.kind, io::DatasetKind::classification);
      EXPECT_EQ(info.num_samples, set.n);
      EXPECT_EQ(info.channels, 1);
      EXPECT_EQ(info.height, set.h);
      EXPECT_EQ(info.width, set.w);
      EXPECT_EQ(info.num_classes, *std::max_element(set.labels.begin(), set.labels.end()) + 1);
      EXPECT_EQ(read_whole_dataset<uint8_t>(out, "images", H5T_NATIVE_UINT8), set.images);
      const std::vector<int64_t> stored = read_whole_dataset<int64_t>(out, "labels", H5T_NATIVE_INT64);
      EXPECT_EQ(stored, std::vector<int64_t>(set.labels.begin(), set.labels.end()));
      EXPECT_FALSE(std::filesystem::exists(out + ".partial"));

      // An explicit class count is kept.
      EXPECT_EQ(io::prepare_idx(image_path, label_path, out, {}, 12).num_classes, 12);
    }
}

TEST(PrepareIdx, BrokenInputsAreRefusedAndLeaveNothing) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  TempDir dir;
  IdxSet set = random_idx(rng);
  set.labels[0] = 7;  // at least one label >= 5
  const Bytes images = idx_bytes({uint32_t(set.n), uint32_t(set.h), uint32_t(set.w)}, set.images);
  const Bytes labels = idx_bytes({uint32_t(set.n)}, set.labels);
  const std::string image_path = dir.file("images.idx"), label_path = dir.file("labels.idx");
  write_bytes(image_path, images);
  write_bytes(label_path, labels);
  const std::string out = dir.file("out.h5");
  auto expect_refused = [&](const std::string& images_file, const std::string& labels_file,
                            const std::vector<std::string>& parts, int64_t num_classes = 0) {
    expect_error([&] { io::prepare_idx(images_file, labels_file, out, {}, num_classes); }, parts);
    EXPECT_FALSE(std::filesystem::exists(out));
    EXPECT_FALSE(std::filesystem::exists(out + ".partial"));
  };

  expect_refused(label_path, image_path, {"--images", label_path, "swapped"});
  expect_refused(dir.file("missing.idx"), label_path, {"missing.idx", "does not exist"});

  const std::string fewer_labels = dir.file("fewer_labels.idx");
  write_bytes(fewer_labels, idx_bytes({uint32_t(set.n + 1)}, Bytes(size_t(set.n + 1), 0)));
  expect_refused(image_path, fewer_labels,
                 {"holds " + std::to_string(set.n) + " images", "holds " + std::to_string(set.n + 1) + " labels"});

  const std::string truncated = dir.file("truncated.idx");
  write_bytes(truncated, Bytes(images.begin(), images.end() - 1));
  expect_refused(truncated, label_path, {truncated, "truncated"});

  const std::string truncated_gzip = dir.file("truncated.idx.gz");
  const Bytes compressed = gzip_stored(images);
  write_bytes(truncated_gzip, Bytes(compressed.begin(), compressed.begin() + std::ptrdiff_t(compressed.size() / 2)));
  expect_refused(truncated_gzip, label_path, {truncated_gzip, "truncated"});

  const std::string trailing = dir.file("trailing.idx");
  Bytes longer = images;
  longer.push_back(0);
  write_bytes(trailing, longer);
  expect_refused(trailing, label_path, {trailing, "has data after"});

  const std::string floats = dir.file("floats.idx");
  write_bytes(floats, idx_bytes({uint32_t(set.n), uint32_t(set.h), uint32_t(set.w)}, set.images, 0x0d));
  expect_refused(floats, label_path, {floats, "IDX magic number is 0x00000d03"});

  expect_refused(image_path, label_path, {"holds label", "raise --num-classes"}, 5);

  const std::string nowhere = dir.file("no_such_dir/out.h5");
  expect_error([&] { io::prepare_idx(image_path, label_path, nowhere); }, {"no_such_dir/out.h5", "cannot create"});
}

TEST(PrepareText, ConcatenatesInOrderAndHoldsOutTheTail) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  TempDir dir;
  std::uniform_int_distribution<size_t> size(0, 5000);
  std::vector<std::string> files;
  Bytes all;
  for (int i = 0; i < 4; ++i) {
    // One file spans several 1 MiB read chunks; one is empty.
    const size_t bytes = i == 1 ? (size_t(5) << 19) + size(rng) : i == 2 ? 0 : size(rng) + 1;
    const Bytes content = random_bytes(rng, bytes);
    files.push_back(dir.file("text" + std::to_string(i) + ".txt"));
    write_bytes(files.back(), content);
    all.insert(all.end(), content.begin(), content.end());
  }
  const double fraction = std::uniform_real_distribution<double>(0.01, 0.6)(rng);
  const auto eval_count = size_t(std::floor(double(all.size()) * fraction));
  const std::string train = dir.file("train.h5"), eval = dir.file("eval.h5");
  int64_t last_done = -1;
  const io::TextPrepareResult result =
      io::prepare_text(files, train, eval, fraction, [&](std::string_view stage, int64_t done, int64_t total) {
        EXPECT_EQ(stage, "text");
        EXPECT_EQ(total, int64_t(all.size()));
        EXPECT_GE(done, last_done);
        last_done = done;
      });
  EXPECT_EQ(last_done, int64_t(all.size()));
  EXPECT_EQ(result.train.num_tokens, int64_t(all.size() - eval_count));
  EXPECT_EQ(result.eval.num_tokens, int64_t(eval_count));
  EXPECT_EQ(result.train.vocab_size, 256);
  EXPECT_EQ(result.train.token_type, io::TokenType::u8);
  EXPECT_EQ(result.eval.path, eval);
  const Bytes train_tokens = read_whole_dataset<uint8_t>(train, "tokens", H5T_NATIVE_UINT8);
  const Bytes eval_tokens = read_whole_dataset<uint8_t>(eval, "tokens", H5T_NATIVE_UINT8);
  EXPECT_TRUE(train_tokens == Bytes(all.begin(), all.end() - std::ptrdiff_t(eval_count)));
  EXPECT_TRUE(eval_tokens == Bytes(all.end() - std::ptrdiff_t(eval_count), all.end()));

  // Without an eval file everything is training text.
  const io::TextPrepareResult whole = io::prepare_text(files, train, "", 0.0);
  EXPECT_TRUE(whole.eval.path.empty());
  EXPECT_TRUE(read_whole_dataset<uint8_t>(train, "tokens", H5T_NATIVE_UINT8) == all);
}

// Each prepared file records the bytes of text its tokens encode (root
// attribute 'text_bytes', read back as DatasetInfo::text_bytes, what bits
// per byte divide by): for BPE, the size of the text its tokens decode to
// (decoded here with the file's own tokenizer), the two files together the
// input whole; for bytes, one per token. Token files of other tools (no
// attribute, no byte ids) have none.
TEST(PrepareText, RecordsTheBytesOfTextEachFileHolds) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  TempDir dir;
  std::string all;
  std::vector<std::string> files;
  const char* words[] = {"the ", "cat ", "sat ", "on ", "mat ", "\xc3\xa9t\xc3\xa9 ", "\n", "zebra, "};
  std::uniform_int_distribution<int> pick(0, 7);
  for (int f = 0; f < 2; ++f) {
    std::string text;
    for (int i = 0; i < 3000; ++i) text += words[pick(rng)];
    files.push_back(dir.file("text" + std::to_string(f) + ".txt"));
    write_bytes(files.back(), Bytes(text.begin(), text.end()));
    all += text;
  }
  const std::string train = dir.file("train.h5"), eval = dir.file("eval.h5");
  io::TextTokenizerOptions bpe;
  bpe.tokenizer = "bpe";
  bpe.vocab_size = 300;
  const io::TextPrepareResult result = io::prepare_text(files, train, eval, 0.1, {}, bpe);
  const auto decoded = [](const std::string& path) {
    const std::vector<int32_t> ids = read_whole_dataset<int32_t>(path, "tokens", H5T_NATIVE_INT32);
    return io::Tokenizer::load(path)->decode(ids);
  };
  const std::string train_text = decoded(train), eval_text = decoded(eval);
  EXPECT_EQ(train_text + eval_text, all);
  ASSERT_TRUE(result.train.text_bytes.has_value());
  ASSERT_TRUE(result.eval.text_bytes.has_value());
  EXPECT_EQ(*result.train.text_bytes, int64_t(train_text.size()));
  EXPECT_EQ(*result.eval.text_bytes, int64_t(eval_text.size()));
  EXPECT_LT(result.eval.num_tokens, *result.eval.text_bytes) << "BPE tokens hold several bytes each";
  EXPECT_EQ(io::inspect_dataset(eval).text_bytes, result.eval.text_bytes);

  const io::TextPrepareResult bytes = io::prepare_text(files, train, eval, 0.1);
  EXPECT_EQ(bytes.train.text_bytes, std::optional<int64_t>(bytes.train.num_tokens));
  EXPECT_EQ(bytes.eval.text_bytes, std::optional<int64_t>(bytes.eval.num_tokens));
  EXPECT_EQ(*bytes.train.text_bytes + *bytes.eval.text_bytes, int64_t(all.size()));

  const std::string foreign = dir.file("foreign.h5");  // another tool's tokens: the bytes are unknown
  write_tokens(foreign, {1, 2, 3, 299, 4}, H5T_STD_U16LE, 300);
  EXPECT_FALSE(io::inspect_dataset(foreign).text_bytes.has_value());
}

TEST(PrepareText, RefusesWhatCannotWork) {
  TempDir dir;
  const std::string text = dir.file("a.txt");
  write_bytes(text, Bytes{'h', 'e', 'l', 'l', 'o', '\n'});
  const std::string out = dir.file("out.h5");
  expect_error([&] { io::prepare_text({text}, out, "", 0.1); }, {"--eval-output"});
  expect_error([&] { io::prepare_text({text}, out, out, 0.5); }, {"same file"});
  expect_error([&] { io::prepare_text({text}, out, dir.file("eval.h5"), 0.1); }, {"holds out 0", "at least 2"});
  expect_error([&] { io::prepare_text({text}, out, dir.file("eval.h5"), 1.0); }, {"--eval-fraction", "[0, 1)"});
  expect_error([&] { io::prepare_text({dir.file("gone.txt")}, out, "", 0.0); }, {"gone.txt", "does not exist"});
  expect_error([&] { io::prepare_text({}, out, "", 0.0); }, {"no input files"});
  EXPECT_FALSE(std::filesystem::exists(out));
}

// The bytes `gzip -dc` gives for a file: an independent decoder.
Bytes gunzip(const std::string& path) {
  const std::string command = "gzip -dc '" + path + "'";
  FILE* pipe = popen(command.c_str(), "r");
  EXPECT_NE(pipe, nullptr) << command;
  Bytes out;
  if (!pipe) return out;
  char buffer[1 << 16];
  size_t got;
  while ((got = std::fread(buffer, 1, sizeof buffer, pipe)) > 0) out.insert(out.end(), buffer, buffer + got);
  EXPECT_EQ(pclose(pipe), 0) << command;
  return out;
}

TEST(PrepareIdx, FashionMnistTestSet) {
  const std::string root = "/usr/share/datasets/fashion-mnist";
  if (!std::filesystem::exists(root + "/t10k-images-idx3-ubyte.gz"))
    GTEST_SKIP() << root << " is missing: install Debian's dataset-fashion-mnist (scripts/install-deps.sh does)";
  TempDir dir;
  const std::string images = root + "/t10k-images-idx3-ubyte.gz", labels = root + "/t10k-labels-idx1-ubyte.gz";
  const std::string out = dir.file("fashion_test.h5");
  const io::DatasetInfo info = io::prepare_idx(images, labels, out);
  EXPECT_EQ(info.num_samples, 10000);
  EXPECT_EQ(info.num_classes, 10);
  EXPECT_EQ(info.channels, 1);
  EXPECT_EQ(info.height, 28);
  EXPECT_EQ(info.width, 28);
  const Bytes raw_images = gunzip(images), raw_labels = gunzip(labels);
  ASSERT_EQ(raw_images.size(), 16u + 10000u * 28u * 28u);
  ASSERT_EQ(raw_labels.size(), 8u + 10000u);
  EXPECT_TRUE(read_whole_dataset<uint8_t>(out, "images", H5T_NATIVE_UINT8) ==
              Bytes(raw_images.begin() + 16, raw_images.end()));
  EXPECT_EQ(read_whole_dataset<int64_t>(out, "labels", H5T_NATIVE_INT64),
            std::vector<int64_t>(raw_labels.begin() + 8, raw_labels.end()));
}

TEST(PrepareText, FortunesCorpus) {
  const std::string root = "/usr/share/games/fortunes";
  std::vector<std::string> files;
  for (const char* name : {"computers", "science", "linux"})
    if (std::filesystem::is_regular_file(root + "/" + name)) files.push_back(root + "/" + name);
  if (files.empty()) GTEST_SKIP() << root << " is missing: install Debian's fortunes (scripts/install-deps.sh does)";
  TempDir dir;
  int64_t total = 0;
  for (const auto& file : files) total += int64_t(std::filesystem::file_size(file));
  const io::TextPrepareResult result = io::prepare_text(files, dir.file("train.h5"), dir.file("eval.h5"), 0.05);
  EXPECT_EQ(result.train.num_tokens + result.eval.num_tokens, total);
  EXPECT_EQ(result.eval.num_tokens, int64_t(std::floor(double(total) * 0.05)));
}

}  // namespace
}  // namespace tessera::testing

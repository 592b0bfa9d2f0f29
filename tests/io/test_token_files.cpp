// io/token_files.h and prepare_token_files: Megatron indexed datasets and
// llm.c token shards written here field by field from their documented
// layouts (random tokens, empty sequences, gaps between sequences, both
// token widths, multimodal modes) prepare into token datasets holding the
// same stream, split at the documented token; every malformed header field is
// refused naming the file and the field, an id past --vocab-size naming the
// file and the position, and nothing is left behind.
#include <gtest/gtest.h>
#include <hdf5.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/prepare.h"
#include "io/token_files.h"
#include "tests/io/io_test_files.h"
#include "tests/support/error_text.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<uint8_t>;

template <typename T>
void put(Bytes& out, T value) {
  const auto* at = reinterpret_cast<const uint8_t*>(&value);
  out.insert(out.end(), at, at + sizeof value);  // little-endian on this machine, as the formats are
}

void write_bytes(const std::string& path, const Bytes& bytes) {
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
}

// A Megatron dataset's fields, to write as they are (or broken).
struct Megatron {
  Bytes magic = {'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0};
  uint64_t version = 1;
  uint8_t dtype = 8;  // uint16
  std::vector<int32_t> sizes;
  std::vector<int64_t> pointers;
  std::vector<int64_t> documents;
  bool modes = false;           // multimodal: int8 per sequence after the document indices
  int64_t sequence_count = -1;  // the header's count; -1: sizes.size()
  Bytes bin;

  void write(const std::string& prefix) const {
    Bytes idx = magic;
    put(idx, version);
    put(idx, dtype);
    put(idx, uint64_t(sequence_count >= 0 ? uint64_t(sequence_count) : sizes.size()));
    put(idx, uint64_t(documents.size()));
    for (int32_t size : sizes) put(idx, size);
    for (int64_t pointer : pointers) put(idx, pointer);
    for (int64_t document : documents) put(idx, document);
    if (modes)
      for (size_t i = 0; i < sizes.size(); ++i) put(idx, int8_t(0));
    write_bytes(prefix + ".idx", idx);
    write_bytes(prefix + ".bin", bin);
  }
};

// Sequences of random tokens below `vocab` (some empty), `width` bytes each,
// with `gap` junk bytes between sequences in .bin; `stream` gets the tokens in order.
Megatron megatron_of(int width, uint8_t dtype, int64_t vocab, int sequences, int gap, std::mt19937_64& rng,
                     std::vector<int64_t>& stream) {
  Megatron m;
  m.dtype = dtype;
  std::uniform_int_distribution<int64_t> id(0, vocab - 1);
  std::uniform_int_distribution<int32_t> length(0, 40);
  m.documents.push_back(0);
  for (int s = 0; s < sequences; ++s) {
    for (int g = 0; g < gap; ++g) m.bin.push_back(0xAB);
    m.pointers.push_back(int64_t(m.bin.size()));
    const int32_t size = s == 1 ? 0 : length(rng);
    m.sizes.push_back(size);
    for (int32_t i = 0; i < size; ++i) {
      const int64_t token = id(rng);
      stream.push_back(token);
      const auto* at = reinterpret_cast<const uint8_t*>(&token);
      m.bin.insert(m.bin.end(), at, at + width);
    }
    if (s % 3 == 2) m.documents.push_back(s + 1);
  }
  if (m.documents.back() != sequences) m.documents.push_back(sequences);
  return m;
}

// An llm.c shard: the 256-int32 header and the tokens.
Bytes llmc_bytes(int32_t magic, int32_t version, int32_t count, const std::vector<int64_t>& tokens, int width) {
  Bytes out;
  std::vector<int32_t> header(256, 0);
  header[0] = magic;
  header[1] = version;
  header[2] = count;
  for (int32_t field : header) put(out, field);
  for (int64_t token : tokens) {
    const auto* at = reinterpret_cast<const uint8_t*>(&token);
    out.insert(out.end(), at, at + width);
  }
  return out;
}

// The /tokens of a prepared file as int64, read with the raw C API, and its vocab_size.
std::vector<int64_t> stored_tokens(const std::string& path, int64_t* vocab_size, H5T_class_t* type_class = nullptr,
                                   size_t* type_size = nullptr) {
  const hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  EXPECT_GE(file, 0) << path;
  const hid_t dataset = H5Dopen2(file, "tokens", H5P_DEFAULT);
  const hid_t space = H5Dget_space(dataset);
  const hsize_t n = hsize_t(H5Sget_simple_extent_npoints(space));
  std::vector<int64_t> tokens(n);
  H5Dread(dataset, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, tokens.data());
  const hid_t type = H5Dget_type(dataset);
  if (type_class) *type_class = H5Tget_class(type);
  if (type_size) *type_size = H5Tget_size(type);
  const hid_t attribute = H5Aopen(file, "vocab_size", H5P_DEFAULT);
  H5Aread(attribute, H5T_NATIVE_INT64, vocab_size);
  H5Aclose(attribute);
  H5Tclose(type);
  H5Sclose(space);
  H5Dclose(dataset);
  H5Fclose(file);
  return tokens;
}

// The prepared train + eval files hold `stream`, split at the documented token.
void expect_prepared(const io::TextPrepareResult& result, const std::vector<int64_t>& stream, double eval_fraction,
                     int64_t vocab, size_t type_size) {
  const int64_t eval = io::text_eval_tokens(int64_t(stream.size()), eval_fraction);
  int64_t train_vocab = 0, eval_vocab = 0;
  H5T_class_t type_class;
  size_t size = 0;
  const std::vector<int64_t> train = stored_tokens(result.train.path, &train_vocab, &type_class, &size);
  const std::vector<int64_t> held = stored_tokens(result.eval.path, &eval_vocab);
  EXPECT_EQ(train, std::vector<int64_t>(stream.begin(), stream.end() - eval));
  EXPECT_EQ(held, std::vector<int64_t>(stream.end() - eval, stream.end()));
  EXPECT_EQ(train_vocab, vocab);
  EXPECT_EQ(eval_vocab, vocab);
  EXPECT_EQ(type_class, H5T_INTEGER);
  EXPECT_EQ(size, type_size);
}

TEST(TokenFiles, MegatronDatasetsPrepareIntoTheSameStream) {
  TESSERA_SEED_TRACE();
  std::mt19937_64 rng = make_rng();
  TempDir dir;
  struct Case {
    int width;
    uint8_t dtype;
    int64_t vocab;
    int gap;
    bool modes;
  };
  for (const Case& c : {Case{2, 8, 50257, 0, false}, Case{4, 4, 100000, 3, true}, Case{1, 1, 200, 0, false},
                        Case{8, 5, 70000, 1, false}}) {
    SCOPED_TRACE("dtype code " + std::to_string(c.dtype));
    std::vector<int64_t> stream;
    const std::string first = dir.file("first_" + std::to_string(c.dtype));
    const std::string second = dir.file("second_" + std::to_string(c.dtype));
    Megatron a = megatron_of(c.width, c.dtype, c.vocab, 9, c.gap, rng, stream);
    a.modes = c.modes;
    a.write(first);
    megatron_of(c.width, c.dtype, c.vocab, 5, c.gap, rng, stream).write(second);
    const io::TokenSource source = io::open_megatron_dataset(first + ".idx");  // any of the three names
    EXPECT_EQ(source.path, first + ".bin");
    EXPECT_EQ(source.documents, int64_t(a.documents.size()) - 1);
    const std::string out = dir.file("out_" + std::to_string(c.dtype) + ".h5");
    const io::TextPrepareResult result =
        io::prepare_token_files({source, io::open_megatron_dataset(second)}, out,
                                dir.file("eval_" + std::to_string(c.dtype) + ".h5"), 0.1, c.vocab);
    expect_prepared(result, stream, 0.1, c.vocab, c.vocab <= 65536 ? 2 : 4);
    EXPECT_EQ(result.train.vocab_size, c.vocab);
  }
}

TEST(TokenFiles, LlmcShardsPrepareIntoTheSameStream) {
  TESSERA_SEED_TRACE();
  std::mt19937_64 rng = make_rng();
  TempDir dir;
  for (const int version : {1, 2}) {
    SCOPED_TRACE("version " + std::to_string(version));
    const int width = version == 1 ? 2 : 4;
    const int64_t vocab = version == 1 ? 50257 : 128256;
    std::uniform_int_distribution<int64_t> id(0, vocab - 1);
    std::vector<int64_t> stream, first(3000), second(1234);
    for (int64_t& t : first) t = id(rng);
    for (int64_t& t : second) t = id(rng);
    stream.insert(stream.end(), first.begin(), first.end());
    stream.insert(stream.end(), second.begin(), second.end());
    const std::string a = dir.file("a" + std::to_string(version) + ".bin");
    const std::string b = dir.file("b" + std::to_string(version) + ".bin");
    write_bytes(a, llmc_bytes(20240520, version, int32_t(first.size()), first, width));
    write_bytes(b, llmc_bytes(20240520, version, int32_t(second.size()), second, width));
    // --vocab-size 0: the largest id + 1.
    int64_t largest = 0;
    for (int64_t t : stream) largest = std::max(largest, t);
    const io::TextPrepareResult result = io::prepare_token_files({io::open_llmc_shard(a), io::open_llmc_shard(b)},
                                                                 dir.file("out.h5"), dir.file("out.eval.h5"), 0.05, 0);
    expect_prepared(result, stream, 0.05, largest + 1, largest + 1 <= 65536 ? 2 : 4);
  }
}

TEST(TokenFiles, MalformedFilesAreRefusedNamingTheFileAndTheField) {
  TESSERA_SEED_TRACE();
  std::mt19937_64 rng = make_rng();
  TempDir dir;
  std::vector<int64_t> stream;
  const Megatron good = megatron_of(2, 8, 1000, 6, 0, rng, stream);
  struct Broken {
    const char* name;
    std::function<void(Megatron&)> damage;
    std::string field;
  };
  const std::vector<Broken> cases = {
      {"magic", [](Megatron& m) { m.magic[3] = 'X'; }, "field 'magic'"},
      {"version", [](Megatron& m) { m.version = 2; }, "field 'version' is 2"},
      {"float", [](Megatron& m) { m.dtype = 7; }, "field 'dtype' is 7 (float32)"},
      {"dtype", [](Megatron& m) { m.dtype = 9; }, "field 'dtype' is 9, not one of"},
      {"count", [](Megatron& m) { m.sequence_count = 7; }, "fields 'sequence count' 7 and 'document count' 3 need"},
      {"size", [](Megatron& m) { m.sizes[2] = -4; }, "field 'sizes' of sequence 2 is -4"},
      {"pointer",
       [](Megatron& m) {
         m.sizes[4] = 5;
         m.pointers[4] = int64_t(m.bin.size()) - 1;
       },
       "field 'pointers' puts sequence 4 (5 uint16 tokens) at byte"},
      {"documents", [](Megatron& m) { m.documents[1] = 99; }, "field 'document indices' entry 1 is 99"},
  };
  for (const Broken& c : cases) {
    SCOPED_TRACE(c.name);
    Megatron m = good;
    c.damage(m);
    const std::string prefix = dir.file(std::string("broken_") + c.name);
    m.write(prefix);
    const std::string message = error_of([&] { io::open_megatron_dataset(prefix); });
    EXPECT_CONTAINS(message, prefix + ".idx");
    EXPECT_CONTAINS(message, c.field);
  }
  {
    const std::string prefix = dir.file("short");
    write_bytes(prefix + ".idx", Bytes{'M', 'M', 'I', 'D'});
    write_bytes(prefix + ".bin", Bytes{});
    EXPECT_CONTAINS(error_of([&] { io::open_megatron_dataset(prefix); }), "fewer than the 34 of the MMIDIDX header");
    fs::remove(prefix + ".bin");
    EXPECT_CONTAINS(error_of([&] { io::open_megatron_dataset(prefix); }), prefix + ".bin does not exist");
  }

  const std::vector<int64_t> tokens = {1, 2, 70000, 4};
  const std::string shard = dir.file("shard.bin");
  const auto llmc_error = [&](const Bytes& bytes) {
    write_bytes(shard, bytes);
    return error_of([&] { io::open_llmc_shard(shard); });
  };
  EXPECT_CONTAINS(llmc_error(Bytes(100, 0)), "fewer than the 1024 of an llm.c shard's header");
  EXPECT_CONTAINS(llmc_error(llmc_bytes(1234, 1, 4, tokens, 2)), shard + ": header[0] (magic) is 1234");
  EXPECT_CONTAINS(llmc_error(llmc_bytes(20240520, 3, 4, tokens, 2)), shard + ": header[1] (version) is 3");
  EXPECT_CONTAINS(llmc_error(llmc_bytes(20240520, 1, 5, tokens, 2)),
                  shard + ": header[2] (token count) is 5 (10 bytes of tokens) but the file holds 8 bytes");

  // An id past --vocab-size: named with its file and position; nothing written.
  write_bytes(shard, llmc_bytes(20240520, 2, 4, tokens, 4));
  const std::string out = dir.file("refused.h5");
  EXPECT_CONTAINS(error_of([&] { io::prepare_token_files({io::open_llmc_shard(shard)}, out, "", 0.0, 50257); }),
                  "llm.c token shard: token 2 of " + shard + " is 70000, not below the vocabulary size 50257");
  EXPECT_FALSE(fs::exists(out));
  EXPECT_FALSE(fs::exists(out + ".partial"));
}

}  // namespace
}  // namespace tessera::testing

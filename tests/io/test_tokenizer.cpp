// io/tokenizer.h against references written here, independently of it: a
// naive trainer that recounts every pair before each merge, GPT-2's bpe()
// loop on strings (O(n^2) per chunk), and GPT-2's bytes_to_unicode() for
// hand-made vocab.json / merges.txt files. Also: lossless round trips on the
// fortunes corpus and on random bytes that are not UTF-8, GPT-2's
// pre-tokenization on hand-checked strings, malformed GPT-2 files and
// damaged /tokenizer groups (written with the raw HDF5 API) refused naming
// the file and the line, entry or dataset, and `prepare text --tokenizer bpe`
// end to end.
#include <gtest/gtest.h>
#include <hdf5.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/dataset.h"
#include "io/prepare.h"
#include "io/tokenizer.h"
#include "tests/io/io_test_files.h"
#include "tests/support/error_text.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

using io::Tokenizer;

void write_text(const std::string& path, std::string_view text) {
  std::ofstream(path, std::ios::binary).write(text.data(), std::streamsize(text.size()));
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// All of Debian's fortunes (as README.md prepares them), or "" when not installed.
std::string fortunes_corpus() {
  const std::filesystem::path root = "/usr/share/games/fortunes";
  if (!std::filesystem::is_directory(root)) return "";
  std::vector<std::string> files;
  for (const auto& entry : std::filesystem::directory_iterator(root)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_regular_file() && !entry.is_symlink() && !name.ends_with(".dat") && !name.ends_with(".u8"))
      files.push_back(entry.path().string());
  }
  std::sort(files.begin(), files.end());
  std::string text;
  for (const std::string& file : files) text += read_text(file);
  return text;
}

std::string random_bytes(std::mt19937_64& rng, size_t count) {
  std::uniform_int_distribution<int> byte(0, 255);
  std::string out(count, '\0');
  for (char& c : out) c = char(byte(rng));
  return out;
}

// ---- references ---------------------------------------------------------------

// BPE training by recounting all pairs of every chunk occurrence before each
// merge: the most frequent pair, ties to the smallest (left, right) ids,
// until `merges` merges or no pair occurs twice.
std::vector<Tokenizer::Merge> reference_training(const std::vector<std::string_view>& chunks, int merges) {
  std::vector<std::vector<int32_t>> words;
  for (std::string_view chunk : chunks) {
    std::vector<int32_t> ids;
    for (char c : chunk) ids.push_back(uint8_t(c));
    words.push_back(ids);
  }
  std::vector<Tokenizer::Merge> learnt;
  for (int32_t next_id = 256; int(learnt.size()) < merges; ++next_id) {
    std::map<std::pair<int32_t, int32_t>, int64_t> counts;  // ordered: the first maximum is the smallest pair
    for (const auto& ids : words)
      for (size_t i = 0; i + 1 < ids.size(); ++i) ++counts[{ids[i], ids[i + 1]}];
    std::pair<int32_t, int32_t> best{-1, -1};
    int64_t best_count = 1;
    for (const auto& [pair, count] : counts)
      if (count > best_count) best = pair, best_count = count;
    if (best.first < 0) break;
    learnt.push_back({best.first, best.second});
    for (auto& ids : words) {
      std::vector<int32_t> merged;
      for (size_t i = 0; i < ids.size(); ++i) {
        if (i + 1 < ids.size() && ids[i] == best.first && ids[i + 1] == best.second) {
          merged.push_back(next_id);
          ++i;
        } else {
          merged.push_back(ids[i]);
        }
      }
      ids = merged;
    }
  }
  return learnt;
}

// GPT-2's bpe() on strings: while some adjacent pair has a rank, merge every
// occurrence of the lowest-ranked one, left to right; then look the parts up.
struct ReferenceBpe {
  std::map<std::pair<std::string, std::string>, int> ranks;
  std::map<std::string, int32_t> ids;

  explicit ReferenceBpe(const Tokenizer& tokenizer) {
    for (int32_t id = 0; id < tokenizer.vocab_size(); ++id) ids[tokenizer.token_text(id)] = id;
    for (size_t rank = 0; rank < tokenizer.merges().size(); ++rank) {
      const Tokenizer::Merge merge = tokenizer.merges()[rank];
      ranks.emplace(std::make_pair(tokenizer.token_text(merge.left), tokenizer.token_text(merge.right)), int(rank));
    }
  }

  std::vector<int32_t> chunk(std::string_view text) const {
    std::vector<std::string> parts;
    for (char c : text) parts.emplace_back(1, c);
    while (parts.size() > 1) {
      int best = INT_MAX;
      std::pair<std::string, std::string> pair;
      for (size_t i = 0; i + 1 < parts.size(); ++i) {
        const auto found = ranks.find({parts[i], parts[i + 1]});
        if (found != ranks.end() && found->second < best) best = found->second, pair = found->first;
      }
      if (best == INT_MAX) break;
      std::vector<std::string> merged;
      for (size_t i = 0; i < parts.size(); ++i) {
        if (i + 1 < parts.size() && parts[i] == pair.first && parts[i + 1] == pair.second) {
          merged.push_back(parts[i] + parts[i + 1]);
          ++i;
        } else {
          merged.push_back(parts[i]);
        }
      }
      parts = merged;
    }
    std::vector<int32_t> out;
    for (const std::string& part : parts) out.push_back(ids.at(part));
    return out;
  }

  std::vector<int32_t> encode(const Tokenizer& tokenizer, std::string_view text) const {
    std::vector<int32_t> out;
    for (std::string_view piece : tokenizer.pretokenize(text)) {
      const std::vector<int32_t> ids_of_piece = chunk(piece);
      out.insert(out.end(), ids_of_piece.begin(), ids_of_piece.end());
    }
    return out;
  }
};

// GPT-2's bytes_to_unicode(), written out: the printable bytes in its order,
// then the others, each with its character as UTF-8.
struct Gpt2Bytes {
  std::vector<int> order;                // bytes in the order GPT-2's encoder.json numbers them
  std::map<int, std::string> character;  // byte -> its character, UTF-8

  Gpt2Bytes() {
    std::vector<int> printable;
    for (int b = 33; b <= 126; ++b) printable.push_back(b);
    for (int b = 161; b <= 172; ++b) printable.push_back(b);
    for (int b = 174; b <= 255; ++b) printable.push_back(b);
    order = printable;
    int extra = 0;
    for (int b = 0; b < 256; ++b)
      if (std::find(printable.begin(), printable.end(), b) == printable.end()) {
        order.push_back(b);
        character[b] = utf8(256 + extra++);
      }
    for (int b : printable) character[b] = utf8(b);
  }
  static std::string utf8(int code) {
    if (code < 0x80) return std::string(1, char(code));
    return {char(0xC0 | (code >> 6)), char(0x80 | (code & 0x3F))};
  }
  std::string spell(std::string_view bytes) const {
    std::string out;
    for (char c : bytes) out += character.at(uint8_t(c));
    return out;
  }
};

std::string json_string(const std::string& text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

// A small GPT-2 tokenizer as files' contents: the 256 bytes in GPT-2's order,
// `extra` tokens (spelled in bytes), <|endoftext|> last; merges of byte
// strings, spelled by GPT-2's characters.
struct Gpt2Files {
  std::string vocab, merges;
};
Gpt2Files gpt2_files(const std::vector<std::string>& extra,
                     const std::vector<std::pair<std::string, std::string>>& merges) {
  const Gpt2Bytes gpt2;
  std::string vocab = "{";
  int id = 0;
  for (int b : gpt2.order) {
    vocab += (id ? ", " : "") + json_string(gpt2.character.at(b)) + ": " + std::to_string(id);
    ++id;
  }
  for (const std::string& token : extra) {
    vocab += ", " + json_string(gpt2.spell(token)) + ": " + std::to_string(id);
    ++id;
  }
  vocab += ", \"<|endoftext|>\": " + std::to_string(id) + "}";
  std::string lines = "#version: 0.2\n";
  for (const auto& [left, right] : merges) lines += gpt2.spell(left) + " " + gpt2.spell(right) + "\n";
  return {vocab, lines};
}

// Merges listed out of training order on purpose: " the" + "r" ranks before
// the merges that make " the", so encoding must wait for its round.
const std::vector<std::pair<std::string, std::string>> kHandMerges = {
    {" the", "r"},  {" ", "t"}, {"h", "e"},  {" t", "he"}, {"i", "n"},       {" ", "a"},   {"e", "r"},
    {" ther", "e"}, {"c", "c"}, {"cc", "c"}, {"\n", "\n"}, {"\xc3", "\xa9"}, {" th", "e"}, {" ", "th"}};
const std::vector<std::string> kHandTokens = {" ther",  " t", "he",  " the", "in",       " a",  "er",
                                              " there", "cc", "ccc", "\n\n", "\xc3\xa9", " th", "th"};

// ---- tests ----------------------------------------------------------------------

TEST(Tokenizer, BytesAreTheIdentity) {
  const Tokenizer bytes = Tokenizer::bytes();
  EXPECT_TRUE(bytes.is_bytes());
  EXPECT_EQ(bytes.vocab_size(), 256);
  const std::string text("a\xff\0 b", 5);
  EXPECT_EQ(bytes.encode(text), (std::vector<int32_t>{'a', 0xff, 0, ' ', 'b'}));
  EXPECT_EQ(bytes.decode(bytes.encode(text)), text);
  EXPECT_CONTAINS(error_of([&] { bytes.decode(std::vector<int32_t>{1, 256}); }), "token id 256");
  EXPECT_CONTAINS(error_of([&] { bytes.decode(std::vector<int32_t>{-1}); }), "[0, 256)");
}

TEST(Tokenizer, PretokenizesWithGpt2sPattern) {
  const Tokenizer bytes = Tokenizer::bytes();
  using Chunks = std::vector<std::string_view>;
  EXPECT_EQ(bytes.pretokenize("Hello world's  123 !!\n\n  x I'M we'll"),
            (Chunks{"Hello", " world", "'s", " ", " 123", " !!", "\n\n ", " x", " I", "'", "M", " we", "'ll"}));
  EXPECT_EQ(bytes.pretokenize("caf\xc3\xa9 \xe4\xb8\xad\xe6\x96\x87 \xd9\xa3\xd9\xa4 x  "),
            (Chunks{"caf\xc3\xa9", " \xe4\xb8\xad\xe6\x96\x87", " \xd9\xa3\xd9\xa4", " x", "  "}));
  // Bytes that are not UTF-8 are chunks of their own; valid text around them is split as usual.
  EXPECT_EQ(bytes.pretokenize("a\xff"
                              "b \xe2\x82 x\xc3"),
            (Chunks{"a", "\xff", "b", " ", "\xe2\x82", " x", "\xc3"}));
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  for (int trial = 0; trial < 20; ++trial) {  // every byte in exactly one chunk, in order
    const std::string text = random_bytes(rng, 3000);
    std::string joined;
    for (std::string_view chunk : bytes.pretokenize(text)) {
      EXPECT_FALSE(chunk.empty());
      joined += chunk;
    }
    ASSERT_EQ(joined, text);
  }
}

TEST(Tokenizer, TrainingMatchesANaiveRecount) {
  std::string text = read_text("/usr/share/games/fortunes/fortunes");
  if (text.empty()) text = "the cat sat on the mat; the rat ate the oat. " + std::string(40, '=') + " that's all\n";
  const Tokenizer bytes = Tokenizer::bytes();
  const io::BpeTraining trained = Tokenizer::train_bpe(text, 512);
  const auto expected = reference_training(bytes.pretokenize(text), 512 - 256);
  ASSERT_EQ(trained.tokenizer.merges().size(), expected.size()) << trained.note;
  for (size_t i = 0; i < expected.size(); ++i) ASSERT_EQ(trained.tokenizer.merges()[i], expected[i]) << "merge " << i;
  for (size_t i = 0; i < expected.size(); ++i) {  // merge i makes token 256 + i, spelled by the pair
    const Tokenizer::Merge merge = expected[i];
    EXPECT_EQ(trained.tokenizer.token_text(int32_t(256 + i)),
              trained.tokenizer.token_text(merge.left) + trained.tokenizer.token_text(merge.right));
  }
}

TEST(Tokenizer, TrainingStopsWhenNoPairRepeats) {
  int64_t last = 0;
  const io::BpeTraining trained = Tokenizer::train_bpe("abab abab xyz", 1000, [&](int64_t done, int64_t total) {
    EXPECT_EQ(done, last + 1);
    EXPECT_EQ(total, 1000 - 256);
    last = done;
  });
  EXPECT_LT(trained.tokenizer.vocab_size(), 1000);
  EXPECT_EQ(last, int64_t(trained.tokenizer.merges().size()));
  EXPECT_CONTAINS(trained.note, "no pair of adjacent tokens occurs twice");
  EXPECT_EQ(trained.tokenizer.encode(" abab"), (std::vector<int32_t>{' ', 257}));  // ab = 256, abab = 257
  EXPECT_CONTAINS(error_of([] { Tokenizer::train_bpe("abc", 255); }), "[256, 2^20]");
}

TEST(Tokenizer, FortunesRoundTripCompressionAndDeterminism) {
  const std::string text = fortunes_corpus();
  if (text.empty()) GTEST_SKIP() << "/usr/share/games/fortunes is missing: install Debian's fortunes";
  const io::BpeTraining first = Tokenizer::train_bpe(text, 1024);
  const io::BpeTraining second = Tokenizer::train_bpe(text, 1024);
  EXPECT_TRUE(first.note.empty()) << first.note;
  EXPECT_EQ(first.tokenizer.vocab_size(), 1024);
  EXPECT_EQ(first.tokenizer.merges(), second.tokenizer.merges());
  const std::vector<int32_t> ids = first.tokenizer.encode(text);
  EXPECT_EQ(first.tokenizer.decode(ids), text);
  EXPECT_LT(double(ids.size()), 0.5 * double(text.size())) << "a 1024-token BPE should halve English text";
  // The encoder's merge order against GPT-2's loop, on a slice of the corpus.
  const ReferenceBpe reference(first.tokenizer);
  const std::string_view slice = std::string_view(text).substr(text.size() / 3, 60000);
  EXPECT_EQ(first.tokenizer.encode(slice), reference.encode(first.tokenizer, slice));
}

TEST(Tokenizer, AnyBytesRoundTrip) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  // Trained on random bytes too, so merges span invalid UTF-8 chunks.
  const std::string corpus = random_bytes(rng, 20000) + "the there then other\n" + std::string(300, ' ');
  const Tokenizer tokenizer = Tokenizer::train_bpe(corpus, 600).tokenizer;
  const ReferenceBpe reference(tokenizer);
  for (int trial = 0; trial < 30; ++trial) {
    std::string text = random_bytes(rng, std::uniform_int_distribution<size_t>(0, 2000)(rng));
    if (trial % 3 == 0) text += corpus.substr(trial * 100, 500);
    const std::vector<int32_t> ids = tokenizer.encode(text);
    ASSERT_EQ(tokenizer.decode(ids), text);
    ASSERT_EQ(ids, reference.encode(tokenizer, text));
  }
}

TEST(Tokenizer, LoadsGpt2FilesAndEncodesAsGpt2Does) {
  TempDir dir;
  const Gpt2Files files = gpt2_files(kHandTokens, kHandMerges);
  write_text(dir.file("vocab.json"), files.vocab);
  write_text(dir.file("merges.txt"), files.merges);
  const Tokenizer tokenizer = Tokenizer::from_gpt2_files(dir.file("vocab.json"), dir.file("merges.txt"));
  EXPECT_EQ(tokenizer.vocab_size(), 256 + int64_t(kHandTokens.size()) + 1);
  EXPECT_EQ(tokenizer.merges().size(), kHandMerges.size());
  const auto id_of = [&](const std::string& token) {
    for (int32_t id = 0; id < tokenizer.vocab_size(); ++id)
      if (tokenizer.token_text(id) == token) return id;
    return -1;
  };
  EXPECT_EQ(id_of("!"), 0);  // GPT-2 numbers the printable bytes first
  EXPECT_EQ(id_of(" "), 188 + 32);
  EXPECT_EQ(tokenizer.encode(" there"), (std::vector<int32_t>{id_of(" there")}));
  EXPECT_EQ(tokenizer.encode("ccccc"), (std::vector<int32_t>{id_of("cc"), id_of("ccc")}));  // (c, c) first, everywhere
  EXPECT_EQ(tokenizer.decode(std::vector<int32_t>{int32_t(tokenizer.vocab_size() - 1)}), "<|endoftext|>");
  const ReferenceBpe reference(tokenizer);
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  const std::string alphabet = "therica \n\xc3\xa9";
  for (int trial = 0; trial < 200; ++trial) {
    std::string text;
    const size_t length = std::uniform_int_distribution<size_t>(0, 40)(rng);
    for (size_t i = 0; i < length; ++i)
      text += alphabet[std::uniform_int_distribution<size_t>(0, alphabet.size() - 1)(rng)];
    ASSERT_EQ(tokenizer.encode(text), reference.encode(tokenizer, text)) << text;
    ASSERT_EQ(tokenizer.decode(tokenizer.encode(text)), text);
  }
  // A pair a round creates with a lower rank waits for the next round: GPT-2
  // merges both "a b" of "abab" before "ab a" (which would leave "aba" "b").
  const Gpt2Files rounds = gpt2_files({"ab", "aba"}, {{"ab", "a"}, {"a", "b"}});
  const Tokenizer waits = Tokenizer::from_gpt2_text(rounds.vocab, rounds.merges);
  EXPECT_EQ(waits.encode("abab"), (std::vector<int32_t>{256, 256}));
  EXPECT_EQ(waits.encode("abab"), ReferenceBpe(waits).encode(waits, "abab"));
  // No "#version" line and Windows line ends read the same.
  std::string crlf;
  for (const auto& [left, right] : kHandMerges)
    crlf += Gpt2Bytes().spell(left) + " " + Gpt2Bytes().spell(right) + "\r\n";
  EXPECT_EQ(Tokenizer::from_gpt2_text(files.vocab, crlf).merges(), tokenizer.merges());
}

TEST(Tokenizer, Gpt2FilesRoundTrip) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  TempDir dir;
  std::string text = fortunes_corpus().substr(0, 400000);
  text += random_bytes(rng, 5000);
  const Tokenizer trained = Tokenizer::train_bpe(text, 2000).tokenizer;
  trained.write_gpt2_files(dir.file("vocab.json"), dir.file("merges.txt"));
  const std::string merges = read_text(dir.file("merges.txt"));
  EXPECT_TRUE(merges.starts_with("#version: 0.2\n"));
  EXPECT_NE(read_text(dir.file("vocab.json")).find("\"\xc4\xa0\":32"), std::string::npos) << "space is U+0120";
  const Tokenizer loaded = Tokenizer::from_gpt2_files(dir.file("vocab.json"), dir.file("merges.txt"));
  EXPECT_EQ(loaded.merges(), trained.merges());
  ASSERT_EQ(loaded.vocab_size(), trained.vocab_size());
  for (int32_t id = 0; id < trained.vocab_size(); ++id) ASSERT_EQ(loaded.token_text(id), trained.token_text(id));
  EXPECT_EQ(loaded.encode(text), trained.encode(text));
}

TEST(Tokenizer, MalformedGpt2FilesAreRefusedNamingTheLineOrEntry) {
  const Gpt2Files good = gpt2_files(kHandTokens, kHandMerges);
  const Gpt2Bytes gpt2;
  const auto refused = [](const std::string& vocab, const std::string& merges) {
    return error_of([&] { Tokenizer::from_gpt2_text(vocab, merges, "my/vocab.json", "my/merges.txt"); });
  };
  EXPECT_CONTAINS(refused("{\"a\": 1,", good.merges), "my/vocab.json is not valid JSON");
  EXPECT_CONTAINS(refused("[1, 2]", good.merges), "object of token -> id");
  EXPECT_CONTAINS(refused("{\"a\": 0}", good.merges), "has 1 entries");
  std::string vocab = good.vocab;
  vocab.replace(vocab.find("\"<|endoftext|>\": 270"), 20, "\"<|endoftext|>\": 3");
  EXPECT_CONTAINS(refused(vocab, good.merges), "id 3 is given to two entries");
  vocab = good.vocab;
  vocab.replace(vocab.find("\"<|endoftext|>\": 270"), 20, "\"<|endoftext|>\": 9000");
  EXPECT_CONTAINS(refused(vocab, good.merges), "entry \"<|endoftext|>\" has id 9000");
  vocab = good.vocab;
  vocab.replace(vocab.find("\"<|endoftext|>\": 270"), 20, "\"<|endoftext|>\": 2.5");
  EXPECT_CONTAINS(refused(vocab, good.merges), "has id 2.5");
  vocab = good.vocab;
  vocab.replace(vocab.find("\"<|endoftext|>\""), 15, "\"a b\"");  // a raw space is not a GPT-2 byte character
  EXPECT_CONTAINS(refused(vocab, good.merges), "entry \"a b\" (id 270) has a character at byte 1");
  vocab = good.vocab;
  const std::string space = json_string(gpt2.character.at(' '));
  vocab.replace(vocab.find(space + ":"), space.size(), "\"xyz\"");
  EXPECT_CONTAINS(refused(vocab, ""), "my/vocab.json has no token for the byte 0x20");
  EXPECT_CONTAINS(refused(vocab, good.merges), "my/merges.txt line 3: token \"\xc4\xa0\" is not in the vocabulary");

  EXPECT_CONTAINS(refused(good.vocab, "#version: 0.2\nh e\nhe\n"), "my/merges.txt line 3: \"he\" is not two tokens");
  EXPECT_CONTAINS(refused(good.vocab, "h e\nh  e\n"), "line 2");
  EXPECT_CONTAINS(refused(good.vocab, "h e\nq xq\n"), "my/merges.txt line 2: token \"xq\" is not in the vocabulary");
  EXPECT_CONTAINS(refused(good.vocab, "h e\nq z\n"), "my/merges.txt line 2: merge");
  EXPECT_CONTAINS(refused(good.vocab, "h e\nq z\n"), "\"qz\", which is not in the vocabulary");
  EXPECT_CONTAINS(refused(good.vocab, "h e\ni n\nh e\n"), "my/merges.txt line 3: merge");
  EXPECT_CONTAINS(refused(good.vocab, "h e\ni n\nh e\n"), "repeats merge 0");
  EXPECT_CONTAINS(refused(good.vocab, "h e\n\xff n\n"), "line 2: \"\xff\" has a character at byte 0");

  TempDir dir;
  EXPECT_CONTAINS(error_of([&] { Tokenizer::from_gpt2_files(dir.file("none.json"), dir.file("m.txt")); }),
                  "none.json does not exist");
}

// ---- the /tokenizer group ---------------------------------------------------------------------

// A /tokenizer group written with the raw HDF5 API, as given (valid or not).
struct RawTokenizer {
  std::string kind = "bpe";
  std::vector<uint8_t> bytes;
  std::vector<int64_t> offsets;
  std::vector<int32_t> merges;  // [M, 2] flattened
  int merge_columns = 2;
  bool with_offsets = true;

  explicit RawTokenizer(const Tokenizer& tokenizer) {
    offsets.push_back(0);
    for (int32_t id = 0; id < tokenizer.vocab_size(); ++id) {
      const std::string& token = tokenizer.token_text(id);
      bytes.insert(bytes.end(), token.begin(), token.end());
      offsets.push_back(int64_t(bytes.size()));
    }
    for (const Tokenizer::Merge& merge : tokenizer.merges()) merges.insert(merges.end(), {merge.left, merge.right});
  }

  void write(const std::string& path) const {
    RawH5Writer file(path);
    const hid_t group = H5Gcreate2(file.id(), "tokenizer", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    const hid_t space = H5Screate(H5S_SCALAR);
    const hid_t type = H5Tcopy(H5T_C_S1);
    H5Tset_size(type, H5T_VARIABLE);
    const hid_t attribute = H5Acreate2(group, "kind", type, space, H5P_DEFAULT, H5P_DEFAULT);
    const char* text = kind.c_str();
    H5Awrite(attribute, type, &text);
    H5Aclose(attribute);
    H5Tclose(type);
    H5Sclose(space);
    H5Gclose(group);
    file.dataset("tokenizer/token_bytes", H5T_STD_U8LE, H5T_NATIVE_UINT8, {bytes.size()}, bytes.data());
    if (with_offsets)
      file.dataset("tokenizer/token_offsets", H5T_STD_I64LE, H5T_NATIVE_INT64, {offsets.size()}, offsets.data());
    file.dataset("tokenizer/merges", H5T_STD_I32LE, H5T_NATIVE_INT32,
                 {merges.size() / size_t(merge_columns), hsize_t(merge_columns)}, merges.data());
  }
};

TEST(Tokenizer, SavedWithTheDatasetAndLoadedBack) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  TempDir dir;
  const std::string text = "the other there then thin " + random_bytes(rng, 3000);
  const Tokenizer trained = Tokenizer::train_bpe(text, 400).tokenizer;
  const std::string path = dir.file("tokens.h5");
  write_tokens(path, {1, 2, 3}, H5T_STD_U16LE, trained.vocab_size());
  EXPECT_FALSE(Tokenizer::load(path).has_value());
  trained.save(path);
  const std::optional<Tokenizer> loaded = Tokenizer::load(path);
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(loaded->merges(), trained.merges());
  EXPECT_EQ(loaded->encode(text), trained.encode(text));
  const io::DatasetInfo info = io::inspect_dataset(path);
  EXPECT_EQ(info.tokenizer, trained.describe());
  EXPECT_CONTAINS(info.describe(), "tokenizer BPE (" + std::to_string(trained.merges().size()) + " merges)");

  // A vocab_size attribute that disagrees with the tokenizer is refused.
  const std::string wrong = dir.file("wrong.h5");
  write_tokens(wrong, {1, 2, 3}, H5T_STD_U16LE, trained.vocab_size() + 1);
  trained.save(wrong);
  EXPECT_CONTAINS(error_of([&] { io::inspect_dataset(wrong); }),
                  "has " + std::to_string(trained.vocab_size()) + " tokens");
}

TEST(Tokenizer, DamagedGroupIsRefusedNamingFileAndDataset) {
  TempDir dir;
  const Tokenizer trained = Tokenizer::train_bpe("the other there then thin the thee", 270).tokenizer;
  const int64_t vocab = trained.vocab_size();
  struct Case {
    const char* what;
    std::function<void(RawTokenizer&)> damage;
    std::vector<std::string> expected;
  };
  const std::vector<Case> cases = {
      {"offset past the bytes",
       [](RawTokenizer& t) { t.offsets[5] = 1 << 20; },
       {"'/tokenizer/token_offsets'", "entries 4 and 5"}},
      {"offsets falling",
       [](RawTokenizer& t) { std::swap(t.offsets[7], t.offsets[8]); },
       {"'/tokenizer/token_offsets'", "do not rise"}},
      {"offsets not ending at the bytes",
       [](RawTokenizer& t) { t.offsets.back() -= 1; },
       {"'/tokenizer/token_offsets'", "from 0 to the"}},
      {"too few offsets",
       [](RawTokenizer& t) { t.offsets.resize(100); },
       {"'/tokenizer/token_offsets'", "100 offsets"}},
      {"no offsets", [](RawTokenizer& t) { t.with_offsets = false; }, {"'/tokenizer/token_offsets' is missing"}},
      {"merge of an unknown id",
       [vocab](RawTokenizer& t) { t.merges[3] = int32_t(vocab); },
       {"'/tokenizer/merges' row 1", "outside [0, " + std::to_string(vocab) + ")"}},
      {"merge that makes no token",
       [](RawTokenizer& t) { t.merges[0] = 'q'; },
       {"'/tokenizer/merges' row 0", "not in the vocabulary"}},
      {"merge repeated",
       [](RawTokenizer& t) { t.merges[2] = t.merges[0], t.merges[3] = t.merges[1]; },
       {"'/tokenizer/merges' row 1", "repeats merge 0"}},
      {"merges of three columns",
       [](RawTokenizer& t) { t.merges.resize(6), t.merge_columns = 3; },
       {"'/tokenizer/merges'", "int32 [M, 2]"}},
      {"byte token changed",
       [](RawTokenizer& t) { t.bytes[' '] = 'x'; },
       {"'/tokenizer/token_offsets'", "token 120 spells the same bytes as token 32"}},
      {"unknown kind", [](RawTokenizer& t) { t.kind = "wordpiece"; }, {"group '/tokenizer'", "\"wordpiece\""}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    RawTokenizer raw(trained);
    c.damage(raw);
    const std::string path = dir.file("damaged.h5");
    raw.write(path);
    const std::string message = error_of([&] { Tokenizer::load(path); });
    EXPECT_CONTAINS(message, path);
    for (const std::string& part : c.expected) EXPECT_CONTAINS(message, part);
  }
  RawTokenizer intact(trained);
  intact.write(dir.file("intact.h5"));
  EXPECT_EQ(Tokenizer::load(dir.file("intact.h5"))->merges(), trained.merges());
}

// ---- prepare text --tokenizer bpe ---------------------------------------------------------------

std::vector<int32_t> stored_ids(const std::string& path) {
  const io::TokenData data(path);
  std::vector<int32_t> ids(size_t(data.size()));
  data.read(0, data.size(), ids.data());
  return ids;
}

TEST(PrepareTextBpe, TrainsEncodesSplitsAndStoresTheTokenizer) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  TempDir dir;
  std::string text;
  std::vector<std::string> files;
  for (int i = 0; i < 3; ++i) {
    std::string content;
    for (int line = 0; line < 80; ++line)
      content += "Line " + std::to_string(line * (i + 1)) + ": the quick brown fox jumps over the lazy dog.\n";
    if (i == 1) content += random_bytes(rng, 500);
    files.push_back(dir.file("part" + std::to_string(i) + ".txt"));
    write_text(files.back(), content);
    text += content;
  }
  io::TextTokenizerOptions options;
  options.tokenizer = "bpe";
  options.vocab_size = 300;
  std::map<std::string, int64_t> last_done;
  const std::string train = dir.file("train.h5"), eval = dir.file("eval.h5");
  const io::TextPrepareResult result = io::prepare_text(
      files, train, eval, 0.25,
      [&](std::string_view stage, int64_t done, int64_t) { last_done[std::string(stage)] = done; }, options);
  EXPECT_EQ(last_done["merges"], 300 - 256);
  EXPECT_EQ(last_done["encode"], int64_t(text.size()));
  EXPECT_EQ(last_done["text"], int64_t(text.size()));
  const std::optional<Tokenizer> from_train = Tokenizer::load(train), from_eval = Tokenizer::load(eval);
  ASSERT_TRUE(from_train && from_eval);
  EXPECT_EQ(from_train->merges(), from_eval->merges());
  EXPECT_EQ(from_train->merges(), Tokenizer::train_bpe(text, 300).tokenizer.merges());
  EXPECT_EQ(result.train.vocab_size, 300);
  EXPECT_EQ(result.train.token_type, io::TokenType::u16);
  std::vector<int32_t> ids = stored_ids(train);
  const std::vector<int32_t> held_out = stored_ids(eval);
  const int64_t total = int64_t(ids.size() + held_out.size());
  EXPECT_LT(total, int64_t(text.size()));
  EXPECT_EQ(int64_t(held_out.size()), int64_t(std::floor(double(total) * 0.25)));
  ids.insert(ids.end(), held_out.begin(), held_out.end());
  EXPECT_EQ(from_train->decode(ids), text);

  // GPT-2 files instead of training; the default stays bytes, with no group.
  const Gpt2Files gpt2 = gpt2_files(kHandTokens, kHandMerges);
  write_text(dir.file("vocab.json"), gpt2.vocab);
  write_text(dir.file("merges.txt"), gpt2.merges);
  io::TextTokenizerOptions loaded;
  loaded.vocab_json = dir.file("vocab.json");
  loaded.merges_txt = dir.file("merges.txt");
  const io::TextPrepareResult with_files = io::prepare_text(files, train, "", 0.0, {}, loaded);
  EXPECT_EQ(with_files.train.vocab_size, 256 + int64_t(kHandTokens.size()) + 1);
  EXPECT_EQ(Tokenizer::load(train)->decode(stored_ids(train)), text);
  io::prepare_text(files, train, "", 0.0);
  EXPECT_FALSE(Tokenizer::load(train).has_value());
  EXPECT_EQ(io::inspect_dataset(train).token_type, io::TokenType::u8);
}

TEST(PrepareTextBpe, RefusesConflictingFlags) {
  TempDir dir;
  const std::string text = dir.file("a.txt"), out = dir.file("out.h5");
  write_text(text, "hello hello hello\n");
  const auto refused = [&](const std::string& kind, int64_t vocab_size, const std::string& vocab,
                           const std::string& merges) {
    io::TextTokenizerOptions options{kind, vocab_size, vocab, merges};
    return error_of([&] { io::prepare_text({text}, out, "", 0.0, {}, options); });
  };
  EXPECT_CONTAINS(refused("bytes", 1000, "", ""), "add --tokenizer bpe or drop --vocab-size");
  EXPECT_CONTAINS(refused("", 1000, "", ""), "--vocab-size 1000 is for BPE training");
  EXPECT_CONTAINS(refused("bpe", 0, "", ""), "needs --vocab-size N");
  EXPECT_CONTAINS(refused("bpe", 256, "", ""), "[257, 2^20]");
  EXPECT_CONTAINS(refused("bpe", (1 << 20) + 1, "", ""), "[257, 2^20]");
  EXPECT_CONTAINS(refused("", 0, "v.json", ""), "--vocab needs --merges");
  EXPECT_CONTAINS(refused("", 0, "", "m.txt"), "--merges needs --vocab");
  EXPECT_CONTAINS(refused("bytes", 0, "v.json", "m.txt"), "drop --tokenizer bytes");
  EXPECT_CONTAINS(refused("bpe", 500, "v.json", "m.txt"), "drop --vocab-size");
  EXPECT_CONTAINS(refused("wordpiece", 0, "", ""), "--tokenizer wordpiece is not known");
  EXPECT_CONTAINS(refused("", 0, dir.file("v.json"), dir.file("m.txt")), "v.json does not exist");
  EXPECT_FALSE(std::filesystem::exists(out));
}

}  // namespace
}  // namespace tessera::testing

// A byte-level BPE tokenizer (GPT-2's scheme), trained on a corpus or loaded
// from Hugging Face GPT-2 files, and stored with the token datasets it made
// so that their ids can be turned back into text (io/README.md, "/tokenizer").
//
// A vocabulary is a list of byte strings indexed by token id; all 256 single
// bytes are in it, so every byte string encodes losslessly. A merge (left,
// right) joins two adjacent tokens into the token spelled by their
// concatenation; merges are ranked by their order. Encoding splits text into
// chunks with GPT-2's pattern
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// (PCRE2, Unicode properties; bytes that are not valid UTF-8 form chunks of
// their own), then in each chunk repeatedly merges every occurrence of the
// adjacent pair of lowest rank, left to right, as GPT-2's encoder.py does.
// Merges never cross chunks.
//
// Hugging Face's vocab.json / merges.txt spell bytes as GPT-2's
// bytes_to_unicode() characters: the printable bytes '!'..'~', 0xA1..0xAC and
// 0xAE..0xFF as the code points of the same value, the 68 others as U+0100
// upward in byte order (space is U+0120, "Ġ").
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace tessera::io {

// Vocabularies this build trains, loads and stores: at most 2^20 tokens.
inline constexpr int64_t kMaxVocabSize = int64_t(1) << 20;

// Called as work proceeds: `done` of `total` (merges learnt, or bytes encoded).
using TokenizerProgress = std::function<void(int64_t done, int64_t total)>;

struct BpeTraining;
class ChunkPattern;  // the compiled pre-tokenization pattern (io/tokenizer.cpp)

class Tokenizer {
 public:
  struct Merge {
    int32_t left = 0, right = 0;
    friend bool operator==(const Merge&, const Merge&) = default;
  };

  // The identity on bytes: id b is byte b, no merges (what `prepare text`
  // writes by default; such files carry no /tokenizer group).
  static Tokenizer bytes();

  // Learns merges on `text` until the vocabulary holds `vocab_size` tokens
  // (ids 0..255 the bytes, then one per merge in the order learnt). Each step
  // merges the pair of adjacent tokens that occurs most often in the text's
  // chunks (ties: the smallest (left, right) ids); training stops early, with
  // a note saying so, when no pair occurs twice. `vocab_size` in [256, 2^20].
  static BpeTraining train_bpe(std::string_view text, int64_t vocab_size, const TokenizerProgress& progress = {});

  // Hugging Face GPT-2 files: vocab.json (an object of token string -> id,
  // ids 0..N-1 each once) and merges.txt (an optional "#version" line, then
  // one "left right" pair per line). Every entry and line is checked; errors
  // name the file and the entry or line.
  static Tokenizer from_gpt2_files(const std::string& vocab_json, const std::string& merges_txt);
  // The same from the files' contents; the names are used in messages.
  static Tokenizer from_gpt2_text(std::string_view vocab_json, std::string_view merges_txt,
                                  const std::string& vocab_name = "vocab.json",
                                  const std::string& merges_name = "merges.txt");
  // Writes the two files (merges.txt with a "#version: 0.2" line), for
  // transformers' GPT2Tokenizer(vocab_file, merges_file).
  void write_gpt2_files(const std::string& vocab_json, const std::string& merges_txt) const;

  // Token ids of `text` (any bytes); decode(encode(s)) == s.
  std::vector<int32_t> encode(std::string_view text, const TokenizerProgress& progress = {}) const;
  // The chunks encode() merges within, in order (views into `text`).
  std::vector<std::string_view> pretokenize(std::string_view text) const;
  // The bytes the ids stand for; an id outside [0, vocab_size) throws naming it.
  std::string decode(std::span<const int32_t> ids) const;
  const std::string& token_text(int32_t id) const;  // the bytes of one token

  int64_t vocab_size() const { return int64_t(tokens_.size()); }
  const std::vector<Merge>& merges() const { return merges_; }
  bool is_bytes() const;         // the identity on bytes
  std::string describe() const;  // "BPE (768 merges)", "bytes"

  // Adds the group /tokenizer to the existing HDF5 file `h5_path`: attribute
  // kind = "bpe", token_bytes uint8 [all tokens' bytes concatenated],
  // token_offsets int64 [V + 1] (token i is bytes [offsets[i],
  // offsets[i+1])), merges int32 [M, 2] (left, right ids, in rank order).
  void save(const std::string& h5_path) const;
  // The tokenizer stored in `h5_path`, or nothing when it has no /tokenizer
  // group (its ids are bytes). Everything is validated; errors name the file
  // and the dataset.
  static std::optional<Tokenizer> load(const std::string& h5_path);
  // What decodes the ids of a model trained on the dataset `h5_path` with a
  // vocabulary of `vocab_size`: the stored tokenizer, or bytes when there is
  // none and the vocabulary is 256 (`prepare text`'s default); nothing when
  // the ids came from another tool (Megatron, llm.c files). A stored
  // tokenizer larger than the vocabulary is refused naming both.
  static std::optional<Tokenizer> for_model_data(const std::string& h5_path, int64_t vocab_size);
  // for_model_data of a dataset a user named with `flag` ("generate:
  // --tokenizer"): a path that is missing, a directory, a checkpoint, not
  // HDF5, or a dataset that gives no tokenizer is refused naming the flag,
  // what the path is, and what to give instead.
  static Tokenizer of_dataset(const std::string& h5_path, int64_t vocab_size, const std::string& flag);

 private:
  // Where a token or merge came from, for messages ("merges.txt line 7").
  using Site = std::function<std::string(int64_t index)>;
  Tokenizer(std::vector<std::string> tokens, std::vector<Merge> merges, const Site& token_site, const Site& merge_site);

  struct MergeRule {
    int32_t rank = 0, result = 0;
  };
  void encode_chunk(std::string_view chunk, std::vector<int32_t>& out) const;

  std::vector<std::string> tokens_;                // the bytes of each id
  std::vector<Merge> merges_;                      // by rank
  std::unordered_map<uint64_t, MergeRule> rules_;  // (left << 32 | right) -> rank and merged id
  int32_t byte_ids_[256] = {};
  std::shared_ptr<const ChunkPattern> pattern_;
};

struct BpeTraining {
  Tokenizer tokenizer;
  std::string note;  // empty, or why training stopped before the vocabulary size asked for
};

}  // namespace tessera::io

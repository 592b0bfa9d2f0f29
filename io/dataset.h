// Tessera's HDF5 datasets (schema in io/README.md): a classification set
// (/images uint8 [N, C, H, W], /labels int64 [N]) or a token stream (/tokens
// 1-D uint8, uint16 or int32; /tokenizer, the tokenizer that made it, when
// stored: io/tokenizer.h). inspect_dataset() reads and validates a file's
// schema; ClassificationData and TokenData open a file, validate it the same
// way, and read ranges of samples or tokens into host buffers.
//
// A file that changes while it is open (truncated, rewritten in place, or
// replaced at its path: size, modification time, device and inode compared
// after every read with what they were at the open) makes the read throw,
// naming the file and what changed: what was read cannot be trusted.
//
// Every open validates everything a training run would trip over later:
// schema version, kind, datasets present with the right dtype and rank,
// images and labels agreeing on N, labels in [0, num_classes), token ids in
// [0, vocab_size), a stored tokenizer valid and of vocab_size tokens. Errors
// name the file, the dataset or attribute, and what to do about it.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <optional>
#include <string>
#include <vector>

namespace tessera::io {

inline constexpr int64_t kSchemaVersion = 1;  // the `tessera_schema` attribute this build reads and writes

enum class DatasetKind { classification, tokens };
enum class TokenType { u8, u16, i32 };  // how /tokens is stored in the file

const char* dataset_kind_name(DatasetKind kind);  // "classification", "tokens"
const char* token_type_name(TokenType type);      // "uint8", "uint16", "int32"

struct DatasetInfo {
  std::string path;
  int64_t schema_version = 0;
  DatasetKind kind = DatasetKind::classification;
  // classification
  int64_t num_samples = 0;
  int64_t channels = 0, height = 0, width = 0;
  int64_t num_classes = 0;
  // tokens
  int64_t num_tokens = 0;
  int64_t vocab_size = 0;
  TokenType token_type = TokenType::u8;
  // The stored tokenizer (group /tokenizer, io/tokenizer.h) described, e.g.
  // "BPE (768 merges)"; empty when the file has none (its
  // ids are bytes when vocab_size is 256, else another tool's).
  std::string tokenizer;
  // How many bytes of text the tokens encode (root attribute 'text_bytes',
  // written by `tessera prepare text`; for older byte files, the token
  // count); nothing when unknown (token files of other tools).
  std::optional<int64_t> text_bytes;

  int64_t sample_bytes() const { return channels * height * width; }  // one image
  std::string describe() const;  // "classification: 10000 samples of 1x28x28, 10 classes"
};

// Opens `path`, validates its schema (including every label and token id) and
// returns what it holds.
DatasetInfo inspect_dataset(const std::string& path);
// Only the root attributes (schema version, kind), validated: a cheap way to
// learn which reader a file needs.
DatasetKind peek_dataset_kind(const std::string& path);

struct Hdf5Objects;  // the open file and datasets (io/dataset.cpp)

// A validated classification file. Labels are held in memory (they were all
// read for validation); images are read on demand.
class ClassificationData {
 public:
  explicit ClassificationData(const std::string& path);
  ~ClassificationData();
  ClassificationData(ClassificationData&&) noexcept;
  ClassificationData& operator=(ClassificationData&&) noexcept;

  const DatasetInfo& info() const { return info_; }
  int64_t size() const { return info_.num_samples; }
  std::span<const int64_t> labels() const { return labels_; }  // [N], each in [0, num_classes)

  // Images [begin, begin + count) into `out` [count, C, H, W].
  void read_images(int64_t begin, int64_t count, uint8_t* out) const;
  // Images of samples `indices` (any order, repeats allowed) into `out`
  // [indices.size(), C, H, W], in the order given. Runs of consecutive
  // indices are read with one call.
  void read_images(std::span<const int64_t> indices, uint8_t* out) const;

 private:
  DatasetInfo info_;
  std::vector<int64_t> labels_;
  std::unique_ptr<Hdf5Objects> objects_;
};

// A validated token stream.
class TokenData {
 public:
  explicit TokenData(const std::string& path);
  ~TokenData();
  TokenData(TokenData&&) noexcept;
  TokenData& operator=(TokenData&&) noexcept;

  const DatasetInfo& info() const { return info_; }
  int64_t size() const { return info_.num_tokens; }

  // Tokens [begin, begin + count) into `out`, converted to int32.
  void read(int64_t begin, int64_t count, int32_t* out) const;

 private:
  DatasetInfo info_;
  std::unique_ptr<Hdf5Objects> objects_;
};

// A digest of what `path` holds, for checking that ranks read the same data
// (apps/rank_agreement.h): a CRC-32 of the values (labels and image bytes, or
// tokens as int32, so the storage type and chunking do not matter) of the
// whole file when its data is at most `whole_below` bytes, else of 64 blocks
// spread evenly over it, the first and last included, with the labels whole.
// "crc32 0x1a2b3c4d of all 1245580 tokens" or "... of 64 sampled blocks".
std::string dataset_digest(const std::string& path, int64_t whole_below = int64_t(64) << 20);

}  // namespace tessera::io

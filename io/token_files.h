// Token files that other tools write, opened and checked so `tessera prepare
// megatron|llmc` can turn them into Tessera's token datasets (io/prepare.h).
// Both are little-endian:
//
//   Megatron-LM indexed dataset (megatron/core/datasets/indexed_dataset.py,
//   the "mmap" format): PREFIX.idx and PREFIX.bin.
//     .idx  "MMIDIDX\0\0" (9 bytes), version u64 = 1, dtype code u8 (1 uint8,
//           2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32,
//           8 uint16), sequence count u64 N, document count u64 D, then
//           sizes int32[N] (tokens of each sequence), pointers int64[N] (byte
//           offset of each sequence in .bin), document indices int64[D]
//           (sequence ranges of the documents: 0, ..., N) and, in multimodal
//           datasets, modes int8[N].
//     .bin  the sequences' tokens in the dtype.
//   llm.c token shard (.bin, as its data scripts write them): int32[256]
//     header, [0] magic 20240520, [1] version (1: uint16 tokens, 2: uint32),
//     [2] token count; then the tokens.
//
// Opening checks every header field against the files' sizes and throws
// naming the file and the field; reading checks each token id.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tessera::io {

// Where a file's tokens are: byte ranges of one data file, in stream order.
struct TokenSource {
  struct Range {
    int64_t offset = 0;  // bytes into `path`
    int64_t tokens = 0;
  };
  std::string path;      // the file holding the tokens
  std::string format;    // "Megatron indexed dataset PREFIX", "llm.c token shard"
  int element_size = 2;  // bytes per token id: 1, 2, 4 or 8
  bool is_signed = false;
  std::vector<Range> ranges;  // the sequences (merged where consecutive)
  int64_t tokens = 0;
  int64_t documents = 0;  // Megatron: D - 1 (the document count); llm.c: 0
};

// PREFIX, PREFIX.idx or PREFIX.bin of a Megatron indexed dataset.
TokenSource open_megatron_dataset(const std::string& prefix);
// An llm.c token shard.
TokenSource open_llmc_shard(const std::string& path);

// Tokens [first, first + count) of the source's stream into `out`; a token
// id that is negative, or not below `vocab_size` (when > 0), throws naming
// the file, the token's position and the limit.
void read_source_tokens(const TokenSource& source, int64_t first, int64_t count, int64_t* out, int64_t vocab_size = 0);

}  // namespace tessera::io

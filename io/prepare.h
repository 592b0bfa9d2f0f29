// Turning raw data into Tessera's HDF5 datasets (schema in io/README.md):
//   prepare_idx   MNIST-style IDX image and label files (plain or gzip) into a
//                 classification file;
//   prepare_text  text files into a token stream, with the last
//                 `eval_fraction` of the tokens held out in a second file:
//                 byte-level (uint8, vocabulary 256), or through a BPE
//                 tokenizer (io/tokenizer.h) trained on the text or loaded
//                 from GPT-2 files and stored in both files;
//   prepare_token_files  token files other tools wrote (Megatron indexed
//                 datasets, llm.c shards: io/token_files.h) into a token
//                 stream (uint16, or int32 past 65536 ids), split the same way.
// Both write to "<out>.partial" and rename it into place when complete, so a
// failed or interrupted run never leaves a file that looks valid; both
// re-open the result through inspect_dataset() and return what it holds.
// The `tessera prepare` command line (apps/prepare_command.cpp) calls these.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "io/dataset.h"
#include "io/token_files.h"

namespace tessera::io {

// Called as work proceeds: `stage` names the step ("labels", "images",
// "text"); `done` of `total` items (samples or bytes) are written.
using PrepareProgress = std::function<void(std::string_view stage, int64_t done, int64_t total)>;

// IDX files: images magic 0x00000803 (uint8, [N, H, W]) and labels magic
// 0x00000801 (uint8, [N]), gzip-compressed or plain (detected from the bytes).
// Writes /images uint8 [N, 1, H, W] and /labels int64 [N]. num_classes = 0
// takes the largest label + 1; otherwise every label must be below it.
DatasetInfo prepare_idx(const std::string& images_idx, const std::string& labels_idx, const std::string& out_h5,
                        const PrepareProgress& progress = {}, int64_t num_classes = 0);

struct TextPrepareResult {
  DatasetInfo train;
  DatasetInfo eval;  // eval.path is empty when no eval file was written
  std::string note;  // empty, or why BPE training stopped short of --vocab-size
};

// How prepare_text turns text into token ids (the flags of `prepare text`).
struct TextTokenizerOptions {
  // "bytes": each byte is its id (uint8, vocabulary 256; no /tokenizer
  // group). "bpe": a byte-level BPE tokenizer, trained on the text or
  // loaded from vocab_json + merges_txt. Empty: "bpe" when the files are
  // given, else "bytes".
  std::string tokenizer;
  int64_t vocab_size = 0;              // bpe training: the vocabulary to learn, in [257, 2^20]
  std::string vocab_json, merges_txt;  // Hugging Face GPT-2 files (both or neither)
};

// The number of bytes of an `total`-byte stream held out for evaluation:
// floor(total * eval_fraction).
int64_t text_eval_tokens(int64_t total, double eval_fraction);

// Concatenates `files` byte for byte in the order given (no separators) and
// tokenizes the text as `tokenizer` says. Of the n tokens (bytes, or BPE
// ids), the first n - e go to `out_h5` and the last e =
// text_eval_tokens(n, eval_fraction) to `eval_out_h5`. With no eval file,
// eval_fraction must be 0. BPE reads the whole text into memory, stores
// uint16 ids (int32 past 65536 tokens) and the tokenizer in both files, and
// reports the stages "text", "merges" (training), "encode" and "tokens".
TextPrepareResult prepare_text(const std::vector<std::string>& files, const std::string& out_h5,
                               const std::string& eval_out_h5, double eval_fraction,
                               const PrepareProgress& progress = {}, const TextTokenizerOptions& tokenizer = {});

// The sources' tokens concatenated in the order given, the last
// text_eval_tokens(n, eval_fraction) held out as for text. `vocab_size` 0
// takes the largest id + 1; otherwise every id must be below it (the first
// that is not is named with its file and position). Stored as uint16 when the
// vocabulary fits, else int32.
TextPrepareResult prepare_token_files(const std::vector<TokenSource>& sources, const std::string& out_h5,
                                      const std::string& eval_out_h5, double eval_fraction, int64_t vocab_size,
                                      const PrepareProgress& progress = {});

}  // namespace tessera::io

// Turning raw data into Tessera's HDF5 datasets (schema in io/README.md):
//   prepare_idx   MNIST-style IDX image and label files (plain or gzip) into a
//                 classification file;
//   prepare_text  text files into a byte-level token stream (uint8, vocabulary
//                 256), with the last `eval_fraction` of the bytes held out in
//                 a second file;
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
};

// The number of bytes of an `total`-byte stream held out for evaluation:
// floor(total * eval_fraction).
int64_t text_eval_tokens(int64_t total, double eval_fraction);

// Concatenates `files` byte for byte in the order given (no separators). Of
// the n bytes, the first n - e go to `out_h5` and the last e =
// text_eval_tokens(n, eval_fraction) to `eval_out_h5`. With no eval file,
// eval_fraction must be 0.
TextPrepareResult prepare_text(const std::vector<std::string>& files, const std::string& out_h5,
                               const std::string& eval_out_h5, double eval_fraction,
                               const PrepareProgress& progress = {});

// The sources' tokens concatenated in the order given, the last
// text_eval_tokens(n, eval_fraction) held out as for text. `vocab_size` 0
// takes the largest id + 1; otherwise every id must be below it (the first
// that is not is named with its file and position). Stored as uint16 when the
// vocabulary fits, else int32.
TextPrepareResult prepare_token_files(const std::vector<TokenSource>& sources, const std::string& out_h5,
                                      const std::string& eval_out_h5, double eval_fraction, int64_t vocab_size,
                                      const PrepareProgress& progress = {});

}  // namespace tessera::io

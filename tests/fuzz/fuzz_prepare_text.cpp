// libFuzzer harness: `tessera prepare text` (io::prepare_text) on fuzzed
// text files and settings: one to four files (empty ones included), an
// --eval-fraction anywhere in and out of [0, 1), with or without an eval
// file, that file's name possibly the output's own. Bad settings must be
// tessera::Error; a successful preparation must split the n bytes into
// n - e training and e = floor(n * fraction) eval tokens of vocabulary 256
// whose bytes are the input's, in order.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "fuzz_support.h"
#include "io/dataset.h"
#include "io/prepare.h"

namespace {

using namespace tessera;
using namespace tessera::fuzz;

double eval_fraction(uint8_t code) {
  switch (code) {
    case 255:
      return 1.0;
    case 254:
      return -0.25;
    case 253:
      return 0.0;
    default:
      return code / 256.0;
  }
}

// The tokens of a prepared file, as bytes.
std::string tokens_of(const std::string& path) {
  io::TokenData data(path);
  std::vector<int32_t> ids(size_t(data.size()));
  data.read(0, data.size(), ids.data());
  return std::string(ids.begin(), ids.end());
}

}  // namespace

// The input: a flags byte (bits 0-1: files - 1; 4: write an eval file; 8:
// name it like the output), the --eval-fraction code (eval_fraction()),
// each file's length but the last's (16-bit little-endian), then the files.
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  if (size < 2) return 0;
  const uint8_t flags = bytes[0];
  const double fraction = eval_fraction(bytes[1]);
  const size_t files = (flags & 3) + 1;
  size_t at = std::min(size, 2 + 2 * (files - 1));  // the first file's first byte
  std::vector<size_t> lengths;
  size_t left = size - at;
  for (size_t i = 0; i + 1 < files; ++i) {
    const size_t field = 2 + 2 * i;
    const size_t length = field + 2 <= size ? size_t(bytes[field]) | size_t(bytes[field + 1]) << 8 : 0;
    lengths.push_back(std::min(length, left));
    left -= lengths.back();
  }
  lengths.push_back(left);

  const fs::path dir = fresh_scratch_dir();
  std::vector<std::string> paths;
  std::string all;
  for (size_t i = 0; i < files; ++i) {
    const std::string text(reinterpret_cast<const char*>(bytes) + at, lengths[i]);
    at += lengths[i];
    paths.push_back((dir / ("text" + std::to_string(i) + ".txt")).string());
    write_file(paths.back(), text);
    all += text;
  }
  const std::string out = (dir / "text.h5").string();
  const std::string eval = flags & 8 ? out : flags & 4 ? (dir / "text.eval.h5").string() : "";
  expect_clean_errors([&] {
    const io::TextPrepareResult result = io::prepare_text(paths, out, eval, fraction);
    const size_t held_out = eval.empty() ? 0 : size_t(io::text_eval_tokens(int64_t(all.size()), fraction));
    const bool right = result.train.vocab_size == 256 && tokens_of(out) == all.substr(0, all.size() - held_out) &&
                       (eval.empty() || tokens_of(eval) == all.substr(all.size() - held_out));
    if (!right) std::abort();
  });
  check_hdf5_ids_closed();
  return 0;
}

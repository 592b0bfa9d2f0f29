// libFuzzer harness: the BPE tokenizer (io/tokenizer.h) on fuzzed input.
// Hugging Face GPT-2 files (vocab.json, merges.txt) must load or be refused
// with tessera::Error, never a crash, a huge allocation, a leak or undefined
// behaviour; any tokenizer that loads, or that training on fuzzed text
// makes, must encode any bytes losslessly (decode(encode(s)) == s), and
// survive writing to GPT-2 files or to an HDF5 /tokenizer group and reading
// back with the same vocabulary and merges.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_support.h"
#include "io/hdf5_file.h"
#include "io/tokenizer.h"

namespace {

using namespace tessera;
using namespace tessera::fuzz;

bool same_tokenizer(const io::Tokenizer& a, const io::Tokenizer& b) {
  if (a.vocab_size() != b.vocab_size() || a.merges() != b.merges()) return false;
  for (int32_t id = 0; id < a.vocab_size(); ++id)
    if (a.token_text(id) != b.token_text(id)) return false;
  return true;
}

// Encoding `text` must give ids in range that decode to `text`.
void check_round_trip(const io::Tokenizer& tokenizer, std::string_view text) {
  const std::vector<int32_t> ids = tokenizer.encode(text);
  for (const int32_t id : ids)
    if (id < 0 || id >= tokenizer.vocab_size()) std::abort();
  if (tokenizer.decode(ids) != text) std::abort();
}

// The next piece of `input` up to a NUL (or its end), removed from `input`.
std::string_view take_until_nul(std::string_view& input) {
  const size_t end = std::min(input.find('\0'), input.size());
  const std::string_view piece = input.substr(0, end);
  input.remove_prefix(std::min(end + 1, input.size()));
  return piece;
}

}  // namespace

// The input: a flags byte, then
//   flags bit 0 clear: vocab.json, NUL, merges.txt, NUL, text to encode
//     (bit 1: write the loaded tokenizer to GPT-2 files and read them back);
//   flags bit 0 set: a vocabulary size byte (256 + its value), then text to
//     train on and encode (bit 1: save the tokenizer to HDF5 and load it back).
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  if (size < 2) return 0;
  const uint8_t flags = bytes[0];
  std::string_view input(reinterpret_cast<const char*>(bytes) + 1, size - 1);
  const fs::path dir = fresh_scratch_dir();
  expect_clean_errors([&] {
    if (!(flags & 1)) {
      const std::string_view vocab = take_until_nul(input);
      const std::string_view merges = take_until_nul(input);
      const io::Tokenizer tokenizer = io::Tokenizer::from_gpt2_text(vocab, merges);
      check_round_trip(tokenizer, input);
      if (flags & 2) {
        const std::string vocab_path = (dir / "vocab.json").string(), merges_path = (dir / "merges.txt").string();
        tokenizer.write_gpt2_files(vocab_path, merges_path);
        if (!same_tokenizer(tokenizer, io::Tokenizer::from_gpt2_files(vocab_path, merges_path))) std::abort();
      }
      return;
    }
    const int64_t vocab_size = 256 + int64_t(uint8_t(input[0]));
    input.remove_prefix(1);
    const io::Tokenizer tokenizer = io::Tokenizer::train_bpe(input, vocab_size).tokenizer;
    check_round_trip(tokenizer, input);
    check_round_trip(tokenizer, std::string(input.rbegin(), input.rend()));
    if (flags & 2) {
      const std::string path = (dir / "tokenizer.h5").string();
      io::create_hdf5_file(path);  // closed again at once: save() adds to an existing file
      tokenizer.save(path);
      const std::optional<io::Tokenizer> loaded = io::Tokenizer::load(path);
      if (!loaded || !same_tokenizer(tokenizer, *loaded)) std::abort();
    }
  });
  check_hdf5_ids_closed();
  return 0;
}
